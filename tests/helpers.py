"""Shared test fixtures-as-constants."""

# A Quest config small enough for CPU tests: 8 pages of 4 tokens per selection, plus one sink
# page and the recent window, in a 256-token device buffer; every prompt decodes sparsely.
SMALL_QUEST = {
    "algorithm": "quest",
    "top_k": 32,
    "page_size": 4,
    "sink_tokens": 4,
    "recent_tokens": 8,
    "min_sparse_prompt_len": 0,
    "device_buffer_tokens": 256,
}
