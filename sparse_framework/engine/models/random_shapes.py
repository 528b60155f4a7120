"""Random-weight model shapes by name (`bench --random`, `serve --random`, the benchmarks): a
real model's size and layout with no checkpoint at hand, and the sparse config a shape needs of
its own (DeepSeek-V3.2: DSA fed by its indexer)."""

from __future__ import annotations

from typing import Any

import torch

RANDOM_MODELS = {
    "llama-3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
    "llama-3-70b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
                    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
    "tiny": {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    # DeepSeek-V3.2 cut down to one H100 (issue 22): every layer has the real attention shape
    # (128 heads, query LoRA 1536, latent 512 + RoPE 64, nope 128 / v 128, indexer 64 heads x
    # 128, top-2048, YaRN as released) and the real vocabulary and dense MLP, but only 6 layers
    # (first_k_dense_replace 1) and a SHRUNK MoE: 8 routed experts of the real size (2048), top-2,
    # 4 groups of 2 with the best 2 groups kept, instead of 256 experts top-8 in 8 groups of 32.
    # The real MoE would not fit (~660B parameters); the routed experts only add weight bytes to a
    # decode step, which the floor counts as they are here. Random weights only: a checkpoint
    # always loads with the experts its config names. ~5.5e9 parameters, ~10.2 GiB in bf16.
    "deepseek-v3.2-mini": {
        "architectures": ["DeepseekV32ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 6,
        "first_k_dense_replace": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                               "mscale_all_dim": 1.0, "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    },
    # the same family at CPU-test scale (tests/test_engine_bench.py): index_topk 16 below the
    # prompts, 2 layers (one dense, one MoE of 4 experts top-2 in 2 groups)
    "deepseek-v3.2-tiny": {
        "architectures": ["DeepseekV32ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "index_n_heads": 4, "index_head_dim": 32,
        "index_topk": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
}



def random_model_config(name: str, device: str, kv_cache_dtype: str = "auto") -> dict[str, Any] | None:
    """The sparse config `bench --random NAME` runs without --config, where the model needs its
    own: the DeepSeek-V3.2 presets decode with DSA fed by the model's lightning indexer as the
    model selects (the integration's findings: top_k = index_topk, no sink or recent tokens
    forced in, the newest token competing by its own index score, sparse at any length
    ("always" from `min_sparse_prompt_len` 0) as the model applies its top-k at any length), indexer keys in FP8 (V3.2's deployment; use
    key_dtype "bfloat16" to match transformers' bf16 run), over the hierarchical store
    (HiSparse's case: full latents on the host, 4096 rows per request and layer on the device).
    Backend: on CUDA `triton` for a bf16 cache, `flashmla` (FlashMLA built: benchmarks/
    build_flashmla.sh) for kv_cache_dtype "fp8", whose rows the Triton kernel does not read;
    `torch_ref` on the CPU. None: the demo's Quest config."""
    raw = RANDOM_MODELS[name]
    if raw["architectures"] != ["DeepseekV32ForCausalLM"]:
        return None
    cuda = torch.device(device).type == "cuda"
    backend = ("flashmla" if kv_cache_dtype == "fp8" else "triton") if cuda else "torch_ref"
    buffer = 4096 if raw["index_topk"] >= 1024 else 4 * raw["index_topk"]
    return {"algorithm": "dsa", "backend": backend, "store": "hierarchical", "top_k": raw["index_topk"],
            "page_size": min(64, raw["index_topk"] // 4), "device_buffer_tokens": buffer,
            "sink_tokens": 0, "recent_tokens": 0, "sparse_policy": "always", "min_sparse_prompt_len": 0,
            "extra": {"index_heads": raw["index_n_heads"], "index_dim": raw["index_head_dim"],
                      "key_dtype": "fp8_e4m3" if raw["index_head_dim"] % 128 == 0 else "bfloat16",
                      "score_newest": True}}
