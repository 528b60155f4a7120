"""The figures of a `bench-serve` report and the tables and lines that print them.

`summarize` turns one point's `RequestResult`s and duration into the report's run figures (mean,
p50, p99 of TTFT, TPOT, ITL and latency; throughput; goodput under SLOs; failures by kind) and
`request_row` each request's row; `report_tables` (a rate sweep), `curve_tables` (a concurrency
sweep) and `error_lines` read a finished report (the JSON-ready dict) back for the console.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .serve_client import RequestResult
from .stats import percentile

if TYPE_CHECKING:
    from rich.table import Table

PERCENTILES = (50, 99)


def distribution_ms(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 of seconds, in milliseconds (None when there are none)."""
    out: dict[str, float | None] = {"mean": 1000 * sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        p = percentile(values, q)
        out[f"p{q}"] = None if p is None else 1000 * p
    return out


def summarize(results: Sequence[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """One rate's figures from its requests and its duration (s); goodput is None without SLOs."""
    done = [r for r in results if r.ok]
    errors: dict[str, dict[str, Any]] = {}
    for r in results:
        if not r.ok:
            e = errors.setdefault(str(r.error), {"count": 0, "message": r.message})
            e["count"] += 1
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)  # noqa: E731
    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(1 for r in done if meets_slo(r, slo_ttft_ms, slo_tpot_ms))
    inputs, outputs = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    return {
        "sent": len(results), "completed": len(done), "failed": len(results) - len(done), "errors": errors,
        "duration_s": duration, "input_tokens": inputs, "output_tokens": outputs,
        "request_throughput": per_s(len(done)), "output_throughput": per_s(outputs),
        "total_token_throughput": per_s(inputs + outputs),
        "good_requests": good, "goodput": None if good is None else per_s(good),
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms([g for r in done for g in r.itl]),
        "latency_ms": distribution_ms([r.latency for r in done if r.latency is not None]),
    }


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A completed request within both SLOs (one not given holds; a single-token answer has no TPOT)."""
    if not r.ok or r.ttft is None:
        return False
    if slo_ttft_ms is not None and 1000 * r.ttft > slo_ttft_ms:
        return False
    tpot = r.tpot
    return slo_tpot_ms is None or tpot is None or 1000 * tpot <= slo_tpot_ms


def request_row(r: RequestResult) -> dict[str, Any]:
    ms = (lambda s: None if s is None else 1000 * s)  # noqa: E731
    return {"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft),
            "tpot_ms": ms(r.tpot), "latency_ms": ms(r.latency), "error": r.error, "message": r.message or None}


def rate_text(rate: float | str) -> str:
    """A rate for tables: "inf" or the number as short as it goes."""
    return str(rate) if isinstance(rate, str) else "inf" if math.isinf(rate) else f"{rate:g}"


def report_tables(report: dict[str, Any]) -> list[Table]:
    """Two tables of one row per rate, each within 80 columns: throughput, then latency (ms)."""
    from ..common.tables import new_table

    slo = " and ".join(f"{what} <= {report[key]:g} ms" for what, key in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
                       if report[key] is not None)
    first = new_table(f"bench-serve: {report['model']}, {report['num_prompts']} requests per rate", (
        "ok: completed / sent; req/s and out tok/s over the rate's duration (first send to last answer); "
        + (f"goodput: requests with {slo} per second" if slo else "goodput: give --slo-ttft-ms / --slo-tpot-ms")),
        tight=True)
    for col in ("rate", "ok", "failed", "time s", "req/s", "out tok/s", "in tok", "out tok", "goodput"):
        first.add_column(col, justify="right", no_wrap=True)
    second = new_table("latency (ms)", "TTFT: to the first token; TPOT: per output token after it; ITL: between "
                       "tokens; E2E: the whole request", tight=True)
    for col in ("rate", "TTFT p50", "p99", "TPOT p50", "p99", "ITL p50", "p99", "E2E p50", "p99"):
        second.add_column(col, justify="right", no_wrap=True)
    for run in report["runs"]:
        rate = rate_text(run["request_rate"])
        first.add_row(rate, f"{run['completed']}/{run['sent']}", str(run["failed"]), f"{run['duration_s']:.1f}",
                      _num(run["request_throughput"], ".2f"), _num(run["output_throughput"], ",.1f"),
                      f"{run['input_tokens']:,}", f"{run['output_tokens']:,}", _num(run["goodput"], ".2f"))
        second.add_row(rate, *(_ms(run[k][f"p{q}"]) for k in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms")
                               for q in PERCENTILES))
    return [first, second]


def curve_tables(report: dict[str, Any]) -> list[Table]:
    """A concurrency sweep in one table of one row per N, within 80 columns: throughput, then
    TTFT and TPOT p50/p99 (ms)."""
    from ..common.tables import new_table

    k, floor = report.get("prompts_per_concurrency"), report.get("min_prompts")
    table = new_table(f"bench-serve: {report['label']}, concurrency sweep",
                      f"N: at most N in flight, {k} x N requests (at least {floor}) offered at once; out tok/s over "
                      "the point's duration (first send to last answer); TTFT to the first token, TPOT per output "
                      "token after it (ms)", tight=True, drop=("time s",))
    for col in ("N", "ok", "failed", "time s", "out tok/s", "TTFT p50", "p99", "TPOT p50", "p99"):
        table.add_column(col, justify="right", no_wrap=True)
    for run in report["runs"]:
        table.add_row(str(run["max_concurrency"]), f"{run['completed']}/{run['sent']}", str(run["failed"]),
                      f"{run['duration_s']:.1f}", _num(run["output_throughput"], ",.1f"),
                      *(_ms(run[key][f"p{q}"]) for key in ("ttft_ms", "tpot_ms") for q in PERCENTILES))
    return [table]


def run_name(report: dict[str, Any], run: dict[str, Any]) -> str:
    """A run as the error lines name it: "concurrency N" in a concurrency sweep, else "rate R"."""
    if report.get("mode") == "concurrency":
        return f"concurrency {run['max_concurrency']}"
    return f"rate {rate_text(run['request_rate'])}"


def error_lines(report: dict[str, Any]) -> list[str]:
    """One line per run and kind of failure: how many, and the first reason."""
    return [f"{run_name(report, run)}: {e['count']} x {kind}: {e['message']}"
            for run in report["runs"] for kind, e in run["errors"].items()]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ms(value: float | None) -> str:
    """Milliseconds in at most 7 characters (eight columns of them fit 80): 3 significant
    figures below 100 ms, whole milliseconds above."""
    if value is None:
        return "-"
    return format(value, ".2f" if value < 10 else ".1f" if value < 100 else ",.0f")
