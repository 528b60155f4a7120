"""Conversations as the text a model continues: a tokenizer's chat template, applied once for the
CLI's chat path, the server's /v1/chat/completions and RULER's chat prompts alike."""

from __future__ import annotations

from typing import Any


def chat_text(tokenizer: Any, turns: list[dict[str, str]]) -> str:
    """The templated conversation with the generation prompt, as text that the engine's encoding
    (special tokens added) turns into the tokens `apply_chat_template(tokenize=True)` gives."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return without_doubled_bos(tokenizer, text)


def without_doubled_bos(tokenizer: Any, text: str) -> str:
    """A templated text less its leading BOS where encoding adds one: templates that open with
    {{ bos_token }} (Gemma 3's, Llama 3's) are meant for encoding without special tokens, the
    engine encodes text with them, and a doubled BOS changes a Gemma's answers."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not isinstance(text, str) or not text.startswith(bos):
        return text
    adds_bos = list(tokenizer.encode("")) == [tokenizer.bos_token_id]
    return text[len(bos):] if adds_bos else text
