"""`EngineConfig`, the engine's settings and their checks, and `kv_store_dtype`, the KV store's
dtype that its `kv_cache_dtype` maps to.

Why a module of its own: the settings are plain data with their validation, no engine state,
and are read by code that never runs a step (the CLI's flags in engine/command.py, the
benchmark in engine/bench.py, the eval's experiment cells), so they need not come with the
loop in engine/engine.py, which was past the package's ~600-line rule with them. engine.py
re-exports all three names (`EngineConfig`, `KV_CACHE_DTYPES`, `kv_store_dtype`), so their old
path `sparse_framework.engine.engine` still works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.errors import ConfigError
from ..common.flashmla_format import LATENT_DIM, NOPE_DIM
from .models import ModelConfig
from .prefill_attention import CHOICES as PREFILL_CHOICES


@dataclass(frozen=True)
class EngineConfig:
    """How many requests and tokens one engine serves at once.

    max_num_seqs: requests running at once (the coordinator's request rows);
    max_num_batched_tokens: tokens per step (decode rows + prefill chunk tokens);
    max_prefill_chunk: the longest chunk of one prompt in a step (None: the token budget);
    max_model_len: prompt + generated tokens of one request (None: the model's
    max_position_embeddings); staging_tokens: prompt tokens staged at once during prefill
    (None: max_model_len, one longest prompt); device/host_capacity_tokens: the store's pools
    (None: the coordinator's sizing); decode_graphs: the coordinator's per-layer decode graphs
    (CUDA); cuda_graphs: whole decode-only steps replayed from CUDA graphs (CUDA;
    step_graphs.py); fused_ops: the model's fused projections and layer kernels
    (DecoderModel.use_fused_ops; None: on for a CUDA device when the model has them — Gemma's
    have none, `supports_fused_ops`); prefill_attention: "auto"
    (flash-attn's varlen kernel where installed, else SDPA), "flash_attn" (required) or "sdpa"
    (engine/prefill_attention.py); async_scheduling: the next step is built while the GPU runs
    this one (engine/engine.py's docstring; None: on for a CUDA device, off with tensor_parallel_size > 1); seed: the sampler's generator
    for requests without a seed of their own. kv_cache_dtype: "auto" (the KV store in the
    model's dtype) or "fp8" (MLA models with a 512 + 64 latent only: the store keeps FlashMLA's
    656-byte FP8 rows, quantising the model's latents as it writes them, on the device and the
    host; `kv_store_dtype` maps it). enable_prefix_caching: reuse the K/V of cached prompt
    prefixes from the store's host pool (engine/prefix_cache.py; outputs are those of the cache
    off, `Engine.prefix_cache.stats` counts the prefill tokens saved). warm_up: whether the
    engine's owner (LLM, `serve`, generate, bench) runs `Engine.warm_up` before the first
    request — every batch bucket's decode step compiled and captured (engine/warm_up.py);
    None: on for a CUDA device with cuda_graphs or decode_graphs; True also forces it on the
    CPU (eager steps only). The engine itself never runs it unasked.

    Memory (engine/memory.py, docs/engine.md "Memory"): gpu_memory_utilization (0 < u <= 1)
    sizes the pools from that fraction of the device's memory less the weights, one step's
    activations and the prefill staging, as vLLM does; max_num_seqs is then an upper bound and
    the engine takes as many request rows of max_model_len as fit on the device and in the host
    budget, host_memory_bytes (None: a fraction of MemAvailable). device_memory_bytes: the
    device memory the plan takes the fraction of (None: the CUDA device's; required on a CPU
    device, which has none of its own). None (the default): max_num_seqs x max_model_len.

    tensor_parallel_size: ranks the model is split over (engine/parallel.py; docs/engine.md,
    "Tensor parallelism"): the Llama family only, N dividing num_heads, num_kv_heads and
    intermediate_size; every rank builds its Engine with the same settings inside a process
    group (`parallel.init_tp`) over a model sharded for it (`random_model`/`load_model` with
    `tp=ctx.shard`). host_memory_bytes is then the whole host's budget, each rank taking 1/N."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None
    max_model_len: int | None = None
    staging_tokens: int | None = None
    device_capacity_tokens: int | None = None
    host_capacity_tokens: int | None = None
    decode_graphs: bool = False
    cuda_graphs: bool = False
    fused_ops: bool | None = None
    prefill_attention: str = "auto"
    async_scheduling: bool | None = None
    seed: int | None = 0
    enable_prefix_caching: bool = False
    gpu_memory_utilization: float | None = None
    host_memory_bytes: int | None = None
    device_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    warm_up: bool | None = None

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"EngineConfig.tensor_parallel_size must be an int >= 1, got {tp!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prefill_chunk", "max_model_len", "staging_tokens", "device_capacity_tokens", "host_capacity_tokens",
                     "host_memory_bytes", "device_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"EngineConfig.{name} must be None or >= 1, got {value}")
        if self.warm_up not in (None, True, False):
            raise ConfigError(f"EngineConfig.warm_up must be None, True or False, got {self.warm_up!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.prefill_attention not in PREFILL_CHOICES:
            raise ConfigError(f"EngineConfig.prefill_attention must be one of {', '.join(PREFILL_CHOICES)}, "
                              f"got {self.prefill_attention!r}")
        u = self.gpu_memory_utilization
        if u is None:
            for name in ("host_memory_bytes", "device_memory_bytes"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"EngineConfig.{name} is a budget of the memory plan: set gpu_memory_utilization "
                                      "(0 < u <= 1) too")
            return
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"EngineConfig.gpu_memory_utilization must be None or in (0, 1] (a fraction of the "
                              f"device's memory), got {u!r}")
        for name in ("device_capacity_tokens", "host_capacity_tokens"):
            if getattr(self, name) is not None:
                raise ConfigError(f"EngineConfig.{name} and gpu_memory_utilization both size the pools: give one "
                                  "(with gpu_memory_utilization the pools follow from the memory plan)")


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_store_dtype(kv_cache_dtype: str, model_config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV store's dtype for EngineConfig.kv_cache_dtype: the model's `dtype` ("auto"), or
    float8_e4m3fn ("fp8"), which the store keeps in FlashMLA's 656-byte latent rows: an MLA
    model with kv_lora_rank 512 and qk_rope_head_dim 64 only (ConfigError otherwise)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype != "fp8":
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    mla = model_config.mla
    if mla is None or (mla.kv_lora_rank, mla.qk_rope_head_dim) != (NOPE_DIM, LATENT_DIM - NOPE_DIM):
        shape = "not an MLA model" if mla is None else f"latent {mla.kv_lora_rank} + {mla.qk_rope_head_dim}"
        raise ConfigError(f"kv_cache_dtype 'fp8' stores FlashMLA's 656-byte FP8 rows: it needs an MLA model with "
                          f"kv_lora_rank {NOPE_DIM} and qk_rope_head_dim {LATENT_DIM - NOPE_DIM} ({model_config.architecture}: "
                          f"{shape}); use kv_cache_dtype 'auto'")
    return torch.float8_e4m3fn
