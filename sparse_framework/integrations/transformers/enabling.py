"""`enable` (alias `sparse`): checks the model, builds the coordinator from the model's
config (its `KVLayout`, the full and sliding layers, the soft-caps and sinks) and returns the
model's SparseHandle. A model family with a module of its own (MLA: mla.py) is handed to that
module's enabler. Owns no state (the handle does)."""

from __future__ import annotations

from collections.abc import Callable
from os import PathLike
from typing import Any

from ...common.layout import KVLayout
from ...config import SparseConfig
from ...coordinator.core import SparseCoordinator
from ...kv_store.sliding_window import SlidingWindowKV
from .attention import _set_attention_options
from .compat import UnsupportedModelError, check_transformers_version
from .handle import _ENABLED, SparseHandle
from .model_info import LayerMap, _text_config, _uncompiled, is_mla


def enable(
    model: Any,
    config: SparseConfig | dict[str, Any] | str | PathLike[str],
    *,
    max_requests: int = 8,
    max_seq_len: int = 8192,
    device_capacity_tokens: int | None = None,
    host_capacity_tokens: int | None = None,
    decode_graphs: bool = False,
) -> SparseHandle:
    """Run `model`'s decode through a SparseCoordinator built from `config`.

    decode_graphs: on CUDA, replay each layer's sparse decode (store write, select, make
    resident, attend) from a CUDA graph instead of launching it from Python (see
    sparse_framework/coordinator/graphs.py); the model itself still runs eagerly.

    max_requests: the most rows one generate() may have (all caches alive at once together).
    max_seq_len: the longest prompt + generated tokens of a row (padding excluded). The
    store's device pools are sized per layer kind from both and the config: dense layers
    max_requests x max_seq_len, sparse layers max_requests x the larger of
    device_buffer_tokens and min_sparse_prompt_len (docs/kv_store.md);
    device_capacity_tokens replaces the sparse layers' tokens per layer, host_capacity_tokens
    the host pool's (`sparse-framework plan` counts the same bytes; `handle.stats()["pools"]`
    and the INFO log say what was allocated). Sliding-window layers whose window is shorter
    than max_seq_len are not in the store: each keeps a device ring of max_requests x window
    tokens (`SlidingWindowKV`; see "Hybrid sliding-window models" in the package docstring). Returns the handle; `handle.disable()` restores
    the model, and the handle is also a context manager (`with sparse(...) as handle:`).
    """
    check_transformers_version()
    model = _uncompiled(model)
    if model in _ENABLED:
        raise ValueError("sparse decode is already enabled on this model; disable its handle first")
    cfg = _text_config(model)
    family = family_enabler(cfg)
    if family is not None:
        return family(model, cfg, config, max_requests=max_requests, max_seq_len=max_seq_len,
                      device_capacity_tokens=device_capacity_tokens, host_capacity_tokens=host_capacity_tokens,
                      decode_graphs=decode_graphs)
    layers = LayerMap.of(cfg, max_seq_len)
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layout = KVLayout(
        num_layers=len(layers.full),  # the store holds the full-attention layers only (0 is fine)
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=model.dtype,
        device=model.device,
        model_layers=tuple(layers.full) if layers.sliding else None,  # Quest's first layers are the model's
    )
    coord = SparseCoordinator(
        config, layout, max_requests=max_requests, max_seq_len=max_seq_len,
        device_capacity_tokens=device_capacity_tokens, host_capacity_tokens=host_capacity_tokens,
        decode_graphs=decode_graphs,
    )
    _set_attention_options(model, cfg, layers, coord)
    algo = coord.algorithm
    if algo.prefill_inputs or algo.decode_inputs:
        needs = sorted({**algo.prefill_inputs, **algo.decode_inputs})
        raise UnsupportedModelError(
            f"algorithm {coord.config.algorithm!r} with these options needs model inputs {needs} that a "
            "transformers model does not compute (for DSA set extra.source to 'keys')"
        )
    sliding = None
    if layers.sliding:
        assert layers.window is not None
        sliding = SlidingWindowKV(len(layers.sliding), layers.window, max_requests, num_kv_heads, head_dim,
                                  dtype=model.dtype, device=model.device)
    return SparseHandle(model, coord, layers, sliding)


sparse = enable  # `with sparse(model, config) as handle: ...` reads better in a with statement


def family_enabler(cfg: Any) -> Callable[..., SparseHandle] | None:
    """The `enable` of a model family that has a module of its own, imported here when the
    first model of the family is enabled (no caller imports it first; importing the package
    does not import it): MLA models (DeepSeek-V3.2 / GLM-MoE-DSA: latent cache, indexer
    inputs, absorbed decode) -> mla.enable_mla. None for the models `enable` builds itself."""
    if is_mla(cfg):
        from .mla import enable_mla

        return enable_mla
    return None
