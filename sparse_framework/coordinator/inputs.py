"""What `SparseCoordinator.attention_begin` checks before it touches the store: the shapes,
devices and dtypes of q/k/v and of an algorithm's extra model inputs.

Kept apart from the coordinator so that its hooks read as the lifecycle they are; every check
here is a shape, device or dtype compare (no work on the tensors), and every refusal names
what was expected and what came, since a wrong tensor handed to an engine's attention layer is
the first mistake an integrator makes.
"""

from __future__ import annotations

import torch

from ..algorithms.base import Inputs, SparseAlgorithm
from ..common.batch import Batch
from ..common.layout import KVLayout


def check_model_inputs(algo: SparseAlgorithm, name: str, tokens: int, inputs: Inputs | None, prefill: bool,
                       layout: KVLayout) -> Inputs:
    """The algorithm's declared extra inputs of this phase, each [tokens, *shape]; inputs it
    declares for the other phase only are accepted (and checked) too. `name`: the config's
    algorithm name, for the messages."""
    want = algo.prefill_inputs if prefill else algo.decode_inputs
    known = {**algo.prefill_inputs, **algo.decode_inputs}
    given = dict(inputs or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        allowed = ", ".join(known) or "none"
        raise ValueError(f"algorithm {name!r} takes no input(s) {unknown}; it takes: {allowed}")
    missing = [n for n in want if n not in given]
    if missing:
        shapes = ", ".join(f"{n} [tokens, {', '.join(map(str, want[n]))}]" for n in missing)
        raise ValueError(f"algorithm {name!r} needs the model input(s) {shapes}; pass them as inputs={{...}}")
    device_type = torch.device(layout.device).type
    for n, t in given.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (tokens, *known[n]):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            shape = ", ".join(map(str, (tokens, *known[n])))
            raise ValueError(f"input {n!r} of algorithm {name!r} must be [{shape}], got {got}")
        if t.device.type != device_type:
            raise ValueError(f"input {n!r} is on {t.device}, the KV layout on {layout.device}")
    return given


def input_dtypes(layout: KVLayout) -> frozenset[torch.dtype] | None:
    """The q/k/v dtypes attention_begin takes: the layout's own, and float32 (a model computing
    in float32 over a narrower cache: cast down as it is stored). None: any (an fp8 layout's
    store quantises whatever it is given)."""
    return None if layout.is_fp8 else frozenset((layout.dtype, torch.float32))


def check_qkv(layout: KVLayout, layer: int, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None,
              batch: Batch, dtypes: frozenset[torch.dtype] | None, prefill_query_rows: int | None) -> None:
    """q [rows, num_q_heads, head_dim], k and v [tokens, num_kv_heads, head_dim] (MLA: the
    latent as k, v None), in `dtypes`. Anything else — bfloat16 rows into a float32 layout
    (KVLayout's default dtype, not the model's), float16 into bfloat16 — would be cast
    silently: a layout built for another model dtype. q None (store_prompt for an algorithm
    that reads no queries): k and v only."""
    tokens = sum(batch.query_lens)  # the layer and the step were checked by the coordinator's step order
    want_kv = (tokens, layout.num_kv_heads, layout.head_dim)
    if layout.is_mla:
        if tuple(k.shape) != want_kv or v is not None:
            raise ValueError(
                f"an MLA layout takes the latent as k {list(want_kv)} and v=None "
                f"(V is its first {layout.v_head_dim} dims), got k {list(k.shape)}"
            )
    elif v is None or tuple(k.shape) != want_kv or tuple(v.shape) != want_kv:
        got = "None" if v is None else list(v.shape)
        raise ValueError(f"k and v must be {list(want_kv)}, got {list(k.shape)} and {got}")
    if dtypes is not None and not ((q is None or q.dtype in dtypes) and k.dtype in dtypes
                                   and (v is None or v.dtype in dtypes)):
        got = ("" if q is None else f"q {q.dtype}, ") + f"k {k.dtype}" + ("" if v is None else f", v {v.dtype}")
        raise ValueError(
            f"layer {layer}: the KV layout's dtype is {layout.dtype} but got {got}; q, k and v must be in the "
            f"layout's dtype (or float32, cast down as stored): build the layout with the model's dtype "
            f"(KVLayout(dtype=...), ModelConfig.kv_layout(dtype, ...)) or cast q, k and v to {layout.dtype}")
    if q is None:
        return
    tail = query_tail_rows(batch, prefill_query_rows)
    rows_ok = q.dim() == 3 and (q.shape[0] == tokens or (tail is not None and q.shape[0] == sum(tail)))
    if not rows_ok or q.shape[2] != layout.head_dim or q.shape[1] % layout.num_kv_heads:
        also = "" if tail is None else (
            f" (or, at prefill, only each prompt's last {prefill_query_rows} queries: "
            f"{sum(tail)} rows, all that the algorithm's build reads)")
        raise ValueError(
            f"q must be [{tokens}, num_q_heads, {layout.head_dim}]{also} with num_q_heads a multiple of "
            f"{layout.num_kv_heads} KV heads, got {list(q.shape)}"
        )


def query_tail_rows(batch: Batch, prefill_query_rows: int | None) -> list[int] | None:
    """At prefill, the rows per request of q's tail form: the last `prefill_query_rows` queries
    of each prompt, all an algorithm that declares it reads (None: no tail form)."""
    if not batch.is_prefill or prefill_query_rows is None or prefill_query_rows == 0:
        return None
    return [min(prefill_query_rows, n) for n in batch.query_lens]
