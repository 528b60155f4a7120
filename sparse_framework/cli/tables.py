"""The tables the CLI prints (`run`, `plan`, `plugins`), built with common/tables.py's
`new_table` (as `bench`, `generate` and `eval` build theirs), readable from 80 columns up.

Each table holds only columns that have something to say, batch-level figures (time per step,
bytes moved, buffer hit rate) appear once per batch in the table's caption rather than on
every request's row, and every row says what it is.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from .. import registry
from ..coordinator.dense_tally import COST_POLICY, DENSE_LAYER, DENSE_REQUEST
from ..eval.loop import RequestResult
from ..coordinator.capacity import CapacityPlan
from ..common.tables import new_table


def mode_label(r: RequestResult) -> str:
    """How a request decoded: "sparse", "sparse, 2/32 layers dense", "dense: prompt < 2048",
    "dense: cost policy" (sparse_policy "cost" judged dense cheaper at admission), or "dense:
    every layer dense"."""
    if r.dense_reason is not None:
        if _cost_policy(r):
            return "dense: cost policy"
        return f"dense: prompt < {r.config.get('min_sparse_prompt_len', '?')}"
    dense = len(r.dense_layers)
    if r.num_layers and dense >= r.num_layers:
        return "dense: every layer dense"
    return f"sparse, {dense}/{r.num_layers} layers dense" if dense else "sparse"


def _cost_policy(r: RequestResult) -> bool:
    """Whether the run's config decides dense by the cost model (min_sparse_prompt_len unused)."""
    return r.config.get("sparse_policy") == "cost"


def run_table(results: list[RequestResult]) -> Table:
    """One experiment (one config, one batch): a row per request, the batch's figures below."""
    first = results[0]
    cfg = first.config
    title = (f"{first.algorithm} top_k={first.top_k} on {first.backend} "
             f"(page {cfg.get('page_size')}, buffer {cfg.get('device_buffer_tokens')} tokens)")
    table = new_table(title, _batch_caption(results), drop=("dev KV", "needles", "selected"))
    headings = ("context", "mode", "selected", "rel err", "recall", "needles", "KV read", "dev KV")
    for name in headings:  # the mode is words (it may wrap), the rest are figures
        table.add_column(name, justify="left" if name == "mode" else "right", no_wrap=name != "mode")
    for r in results:
        needles = "-" if r.needle_hit_rate is None else f"{r.needle_hit_rate:.1%}"
        mode = Text(mode_label(r), style="yellow" if r.sparse_fraction < 1 else "")
        table.add_row(
            str(r.context), mode, f"{r.selected_tokens:.0f}", f"{r.rel_error:.2e}", f"{r.recall:.3f}",
            needles, f"{r.kv_read_fraction:.1%}", f"{r.device_kv_fraction:.1%}",
        )
    return table


def _batch_caption(results: list[RequestResult]) -> str:
    """The batch's time, traffic and hit rate, and how much of it went dense and why."""
    r = results[0]
    hits = [x.hit_rate for x in results if x.hit_rate is not None]
    hit = f"{hits[0]:.1%}" if hits else "- (no sparse request)"
    steps = sum(x.layer_steps for x in results)
    by_reason: dict[str, int] = {}
    for x in results:
        for reason, n in x.dense_layer_steps.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    dense = sum(by_reason.values())
    lines = [
        f"batch of {len(results)}: {r.ms_per_step:.1f} ms/step, {r.swap_in_kib_per_step:.0f} KiB/step host->device, "
        f"buffer hit rate {hit}",
        f"dense decode layer-steps: {dense} of {steps}"
        + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) + ")" if by_reason else ""),
    ]
    if by_reason.get(DENSE_REQUEST) and _cost_policy(r):
        lines.append(f"  {DENSE_REQUEST}: the cost policy (sparse_policy \"cost\") found dense cheaper at "
                     "admission: decoded densely")
    elif by_reason.get(DENSE_REQUEST):
        lines.append(f"  {DENSE_REQUEST}: prompt shorter than min_sparse_prompt_len "
                     f"({r.config.get('min_sparse_prompt_len')}): decoded densely")
    if by_reason.get(COST_POLICY):
        lines.append(f"  {COST_POLICY}: requests or decode steps the cost model found cheaper dense "
                     "(docs/engine.md, 'Sparse only when it pays')")
    if by_reason.get(DENSE_LAYER):
        lines.append(f"  {DENSE_LAYER}: layers {r.dense_layers} attend densely (config dense_layers "
                     "and the algorithm's own, e.g. Quest's extra.dense_first_layers)")
    return "\n".join(lines)


def plan_table(title: str, rows: list[tuple[CapacityPlan, str]]) -> Table:
    """Per context: the resident store, then the hierarchical store at each buffer size
    (`rows`: the plan and what its buffer is: "config" or "min")."""
    table = new_table(title, (
        "resident: every token on the device. buffer N: the hierarchical store, a device buffer of N tokens "
        "per request and sparse layer (config: device_buffer_tokens; min: the smallest that holds the "
        "largest selection), full KV on the host. gain: concurrent requests over resident; KV-only gain: "
        "device KV bytes per request, resident over hierarchical."
    ), drop=("KV-only gain", "host/req"))
    for col in ("context", "store", "device/req", "host/req", "requests", "limited by", "gain", "KV-only\ngain"):
        words = col in ("store", "limited by")  # these may wrap at their spaces; figures never
        table.add_column(col, justify="left" if col == "store" else "right", no_wrap=not words)
    last_context = None
    for plan, which in rows:
        if plan.context_len != last_context:
            if last_context is not None:
                table.add_section()
            fits = plan.resident_requests > 0
            table.add_row(f"{plan.context_len:,}", "resident", size_text(plan.resident_device_bytes), "-",
                          str(plan.resident_requests), "device", "1.00x" if fits else "-", "1.00x")
            last_context = plan.context_len
        table.add_row("", f"buffer {plan.device_buffer_tokens:,} ({which})",
                      size_text(plan.hierarchical_device_bytes), size_text(plan.hierarchical_host_bytes),
                      str(plan.hierarchical_requests), plan.limited_by,
                      f"{plan.gain:.2f}x" if plan.resident_requests else "-", f"{plan.kv_only_gain:.2f}x")
    return table


def plugins_table() -> Table:
    """Every registered plugin: its distribution, whether it loads, and for backends whether
    it can run on this machine (and why not). Load errors name the plugin's module."""
    table = new_table("registered plugins")
    for name in ("kind", "name", "distribution", "status"):
        table.add_column(name)
    for kind in registry.GROUPS:
        for info in registry.describe(kind):
            dist = "built-in" if info.distribution == registry.BUILTIN else info.distribution
            if info.error is not None:
                status = Text("error: " + info.error, style="red")
            elif kind == "backend":
                ok, reason = registry.load(kind, info.name).availability()
                status = Text("runs here" if ok else f"cannot run here: {reason}", style="green" if ok else "yellow")
            else:
                status = Text("ok", style="green")
            table.add_row(kind, info.name, dist, status)
    return table


def size_text(n: int) -> str:
    """Bytes for a person: MiB below 10 GiB, GiB above."""
    return f"{n / 2**20:,.0f} MiB" if n < 10 * 2**30 else f"{n / 2**30:,.1f} GiB"
