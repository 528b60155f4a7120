"""The engine's offline benchmark: drawn workloads, one run, and the figures of issue 20's table.

`run_benchmark(llm, spec)` queues `spec.num_prompts` random prompts (lengths drawn from a
fixed, uniform or normal distribution, seeded), all at once or arriving as a Poisson process,
runs the engine to completion and returns a flat dict of what it measured:

- output tokens/s, TTFT and TPOT percentiles (TTFT from each request's arrival);
- admitted concurrency (the most requests running at once, read from the scheduler after each
  plan) beside the memory-bound maximum: `max_requests` of the engine's own memory plan
  (engine/memory.py, the one `sparse-framework plan --engine` prints) for the run's model,
  sparse config, max_model_len and step size, and whether the device or the host bounds it;
- the median decode step with the most requests decoding and no prefill, beside its HBM floor
  (`floors.decode_floor_bytes` of each such step ÷ the GPU's HBM ceiling, common/hardware.py);
- prefill TFLOP/s (`prefill_flops` over the wall time of the steps that contained prefill);
- the device-buffer hit rate and PCIe host→device bytes of the hierarchical store (summed over
  layers of `HierarchicalKVStore.stats()`; None for the resident store);
- peak GPU memory (CUDA), the pools' bytes, preemptions.

Every figure is computed from this run; nothing is carried over from elsewhere.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.table import Table

from ..common.tables import new_table
from .floors import decode_floor_bytes, decode_weight_bytes, moe_modules, prefill_flops
from .stats import percentile
from ..common import hardware
from ..common.errors import ConfigError
from ..common.hardware import gpu_figures
from ..config import SparseConfig
from ..engine.engine_config import kv_store_dtype
from ..engine.llm import LLM
from ..engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, EngineMemoryPlan, plan_for
from ..engine.sampling import SamplingParams

LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "normal")


@dataclass(frozen=True)
class BenchSpec:
    """What one benchmark run queues.

    input_len/output_len: the mean lengths; *_dist: "fixed", "uniform" (in
    [L(1-R), L(1+R)]) or "normal" (σ = L·R/2, clipped to the same range), R = range_ratio;
    request_rate: Poisson arrivals per second (None: every request queued at once);
    concurrency: requests running at once (the engine's max_num_seqs; None: num_prompts);
    seed: the lengths, arrivals and prompt tokens."""

    num_prompts: int = 8
    input_len: int = 2048
    output_len: int = 32
    input_len_dist: str = "fixed"
    output_len_dist: str = "fixed"
    range_ratio: float = 0.0
    request_rate: float | None = None
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("input_len_dist", "output_len_dist"):
            if getattr(self, name) not in LENGTH_DISTRIBUTIONS:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, "
                                  f"got {getattr(self, name)!r}")
        if not 0 <= self.range_ratio < 1:
            raise ConfigError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ConfigError(f"--request-rate must be > 0 requests per second, got {self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1, got {self.concurrency}")

    @property
    def running(self) -> int:
        return self.concurrency or self.num_prompts


@dataclass(frozen=True)
class Workload:
    """The drawn requests: prompt and output lengths, arrival offsets in seconds (all 0 when
    queued at once), and the prompts' token ids."""

    input_lens: list[int]
    output_lens: list[int]
    arrivals: list[float]
    prompts: list[list[int]] = field(repr=False)

    @property
    def max_model_len(self) -> int:
        return max(i + o for i, o in zip(self.input_lens, self.output_lens))


def draw_lengths(dist: str, mean: int, ratio: float, n: int, generator: torch.Generator) -> list[int]:
    """`n` lengths around `mean` (see `BenchSpec`), each in [max(1, ⌊L(1-R)⌋), ⌈L(1+R)⌉]."""
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    if dist == "fixed" or lo == hi:
        return [mean] * n
    if dist == "uniform":
        return torch.randint(lo, hi + 1, (n,), generator=generator).tolist()
    if dist == "normal":
        drawn = torch.randn(n, generator=generator, dtype=torch.float64) * (mean * ratio / 2) + mean
        return drawn.round().clamp(lo, hi).long().tolist()
    raise ConfigError(f"length distribution must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, got {dist!r}")


def draw_workload(spec: BenchSpec, vocab_size: int) -> Workload:
    """The requests of `spec`, reproducible from its seed (one generator per quantity, so
    changing the output distribution does not change the prompts)."""
    gens = [torch.Generator().manual_seed(spec.seed * 4 + i) for i in range(4)]
    n = spec.num_prompts
    inputs = draw_lengths(spec.input_len_dist, spec.input_len, spec.range_ratio, n, gens[0])
    outputs = draw_lengths(spec.output_len_dist, spec.output_len, spec.range_ratio, n, gens[1])
    if spec.request_rate is None:
        arrivals = [0.0] * n
    else:
        gaps = torch.empty(n, dtype=torch.float64).exponential_(spec.request_rate, generator=gens[2])
        arrivals = (gaps.cumsum(0) - gaps[0]).tolist()  # the first request arrives at 0
    prompts = [torch.randint(0, vocab_size, (length,), generator=gens[3]).tolist() for length in inputs]
    return Workload(inputs, outputs, arrivals, prompts)


def memory_plan(model: torch.nn.Module, sparse_config: SparseConfig, device: str | torch.device, *,
                max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                gpu_memory_utilization: float | None = None, device_memory_bytes: int | None = None,
                host_memory_bytes: int | None = None, kv_cache_dtype: str = "auto", cuda_graphs: bool = False,
                decode_graphs: bool = False) -> EngineMemoryPlan | None:
    """The engine's memory plan (`memory.plan_for`) for an engine of these settings built with
    `gpu_memory_utilization` (None: DEFAULT_GPU_MEMORY_UTILIZATION): the memory-bound maximum of
    a run whose own engine was sized without one. Call it before building that engine (on CUDA
    the plan measures the free memory, which the engine's pools would take). None on a device
    with no memory of its own to measure and no `device_memory_bytes` (the CPU): no bound.
    kv_cache_dtype: the engine's (EngineConfig.kv_cache_dtype: "fp8" plans FlashMLA's rows);
    cuda_graphs / decode_graphs: the engine's, whose captured graphs the plan reserves."""
    device = torch.device(device)
    if device.type != "cuda" and device_memory_bytes is None:
        return None
    params = list(model.parameters())
    dtype = params[0].dtype
    store_dtype = kv_store_dtype(kv_cache_dtype, model.config, dtype)  # type: ignore[arg-type]
    layout = model.config.kv_layout(store_dtype, device, max_model_len)  # type: ignore[union-attr]
    return plan_for(params, model.config, layout, sparse_config, device=device,  # type: ignore[arg-type]
                    max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                    max_num_seqs=max_num_seqs, dtype=dtype,
                    gpu_memory_utilization=gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
                    device_memory_bytes=device_memory_bytes, host_memory_bytes=host_memory_bytes,
                    cuda_graphs=cuda_graphs, decode_graphs=decode_graphs)


# -- a run -------------------------------------------------------------------------------------
@dataclass
class _StepRecord:
    running: int  # requests running after the plan was made (admissions and preemptions applied)
    decode: list[tuple[int, int]]  # per decode row: (context tokens, prompt tokens)
    experts_hit: list[int | None] | None = None  # per MoE block: distinct experts the step ran (None: not seen)


def _observe_experts(llm: LLM, records: list[_StepRecord]) -> None:
    """After each step the runner executes, note how many routed experts each MoE block ran
    (the gathered dispatch's count; None for a step replayed from a CUDA graph or run densely)
    on the step's record (the runner executes once per non-empty plan, in order)."""
    moes = moe_modules(llm.model)
    if not moes:
        return
    runner = llm.engine.runner
    inner = runner.execute

    def execute(*args, **kwargs):  # type: ignore[no-untyped-def]
        for m in moes:
            m.experts_hit = None
        out = inner(*args, **kwargs)
        if records:
            records[-1].experts_hit = [m.experts_hit for m in moes]
        return out

    runner.execute = execute  # type: ignore[method-assign]


def _observe_plans(llm: LLM) -> list[_StepRecord]:
    """Record each non-empty plan the scheduler makes (the engine logs one step per such plan,
    in the same order as its step_log)."""
    scheduler = llm.engine.scheduler
    inner = scheduler.schedule
    records: list[_StepRecord] = []

    def schedule():  # type: ignore[no-untyped-def]
        plan = inner()
        if not plan.is_empty:
            decode = [(s.num_computed_tokens + 1, s.num_prompt_tokens) for s in plan.decode]
            records.append(_StepRecord(len(scheduler.running), decode))
        return plan

    scheduler.schedule = schedule  # type: ignore[method-assign]
    return records


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def store_traffic(llm: LLM) -> dict[str, float | int | None]:
    """Hits, misses, hit rate and host->device bytes of the hierarchical store over the run,
    and the rows its prefetch copied ahead (`SparseConfig.prefetch`; counted in h2d_bytes too,
    not in the hits and misses). None for the resident store, which never swaps in."""
    coord = llm.engine.runner.coord
    if coord.config.store == "resident":
        return {"buffer_hits": None, "buffer_misses": None, "hit_rate": None, "h2d_bytes": None, "prefetch_rows": None}
    stats = coord.store.stats()
    hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
    return {"buffer_hits": hits, "buffer_misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else None,
            "h2d_bytes": sum(s["bytes_in"] for s in stats), "prefetch_rows": sum(s["prefetch_rows"] for s in stats)}


class TokenProgress:
    """The work an engine has done since this was made, in tokens: prompt tokens prefilled
    plus rows decoded, read from its step log (each call adds the steps run since the last).
    A bar of finished requests stands at 0/N through a long prefill; this one moves with every
    chunk. `total(prompt_lens, output_lens)`: the same count for requests run to the end (the
    last prefill chunk samples the first output token, so a request decodes max_tokens - 1)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seen = engine.steps
        self.done = 0

    def __call__(self) -> int:
        new, self.seen = self.engine.steps - self.seen, self.engine.steps
        log = self.engine.step_log
        self.done += sum(rows + prefill for rows, prefill, *_ in itertools.islice(reversed(log), min(new, len(log))))
        return self.done

    @staticmethod
    def total(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
        return sum(prompt_lens) + sum(max(0, n - 1) for n in output_lens)


def run_benchmark(llm: LLM, spec: BenchSpec, plan: EngineMemoryPlan | None = None, *,
                  work: Workload | None = None, on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Run `spec` through `llm`'s engine (built with max_num_seqs = the concurrency) and return
    the figures (module docstring). The memory-bound maximum is the engine's own plan when it
    was built with gpu_memory_utilization, else `plan` (`memory_plan`, made before the engine;
    None: no bound). `work`: spec's requests when the caller has drawn them already (None:
    drawn here). `on_step(done, total)` after each step, in tokens (`TokenProgress`: prompt
    tokens prefilled + tokens decoded), for a progress bar that moves during a long prefill.
    Raises ConfigError if any request failed."""
    engine = llm.engine
    plan = engine.memory_plan or plan
    device = engine.device
    work = work or draw_workload(spec, llm.model.config.vocab_size)
    if work.max_model_len > engine.max_model_len:
        raise ConfigError(f"the drawn requests need {work.max_model_len} tokens (prompt + output) but the engine's "
                          f"max_model_len is {engine.max_model_len}; raise --max-model-len")
    records = _observe_plans(llm)
    _observe_experts(llm, records)
    progress, total = TokenProgress(engine), TokenProgress.total(work.input_lens, work.output_lens)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in work.output_lens]
    arrival_of: dict[str, float] = {}
    outs = []
    pending = list(range(spec.num_prompts))
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and work.arrivals[pending[0]] <= now:
            i = pending.pop(0)
            rid = f"req-{i}"
            arrival_of[rid] = start + work.arrivals[i]
            engine.add_request(rid, work.prompts[i], params[i])
        if not engine.has_unfinished():
            time.sleep(max(0.0, work.arrivals[pending[0]] - now))
            continue
        outs.extend(engine.step())
        if on_step is not None:
            on_step(min(progress(), total), total)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise ConfigError(f"{len(failed)} request(s) failed, e.g. {failed[0].request_id}: {failed[0].error}")
    log = engine.step_log
    if len(log) != len(records):
        raise RuntimeError(f"the engine logged {len(log)} steps for {len(records)} plans")

    # decode: the steps with the most rows decoding and no prefill chunk
    decode_only = [(entry, rec) for entry, rec in zip(log, records) if entry[0] and not entry[1]]
    most = max((entry[0] for entry, _ in decode_only), default=0)
    full = [(entry[3], rec) for entry, rec in decode_only if entry[0] == most]
    step_s = statistics.median(sec for sec, _ in full) if full else None
    floors = [decode_floor_bytes(llm, rec.decode, rec.experts_hit) for _, rec in full]
    gpu = gpu_figures(device) or hardware.DEFAULT  # the CPU's rows print "n/a" (bench_tables)
    floor_s = statistics.median(floors) / gpu.hbm_bytes_per_s if full else None
    weights_floor = statistics.median(decode_weight_bytes(llm.model, len(rec.decode), rec.experts_hit)
                                      for _, rec in full) if full else None

    prefill_s = sum(entry[3] for entry in log if entry[1])
    flops = prefill_flops(llm.model.config, work.input_lens)
    decode_s = sum(entry[3] for entry in log if entry[0])
    decode_steps = sum(1 for entry in log if entry[0])
    traffic = store_traffic(llm)

    ttft = [o.first_token_time - arrival_of[o.request_id] for o in outs if o.first_token_time is not None]
    tpot = [o.tpot for o in outs if o.tpot is not None]
    tokens = sum(len(o.token_ids) for o in outs)
    coord = engine.runner.coord
    pools = coord.memory_stats()
    return {
        "requests": len(outs), "input_len": spec.input_len, "output_len": spec.output_len,
        "input_len_dist": spec.input_len_dist, "output_len_dist": spec.output_len_dist, "range_ratio": spec.range_ratio,
        "request_rate": spec.request_rate, "seed": spec.seed,
        "input_lens": work.input_lens, "output_lens": work.output_lens, "arrivals_s": work.arrivals,
        "concurrency": spec.running, "max_model_len": engine.max_model_len,
        "admitted_concurrency": max((r.running for r in records), default=0),
        "memory_bound_max": None if plan is None else plan.max_requests,
        "memory_bound": "no device memory to plan for" if plan is None else plan.limited_by,
        "memory_plan": None if plan is None else plan.as_dict(),
        "elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "steps": engine.steps, "preemptions": engine.scheduler.num_preemptions,
        "decode_step_ms": _ms(step_s), "decode_step_floor_ms": _ms(floor_s), "decode_step_rows": most,
        "decode_step_floor_bytes": statistics.median(floors) if full else None,
        "decode_step_weight_bytes": weights_floor, "kv_cache_dtype": engine.config.kv_cache_dtype,
        "kv_row_bytes": coord.layout.row_bytes,
        "full_decode_steps": len(full),
        "prefill_tokens": sum(work.input_lens), "prefill_tokens_computed": sum(entry[1] for entry in log),
        "prefill_flops": flops, "prefill_seconds": prefill_s,
        "prefill_tflops": flops / prefill_s / 1e12 if prefill_s else None, "peak_tflops": gpu.matmul_flops / 1e12 if gpu.matmul_flops else None,
        "gpu": gpu.name, "hbm_tb_s": gpu.hbm_tb_s,
        **traffic, "decode_seconds": decode_s,
        "h2d_gb_per_s": traffic["h2d_bytes"] / decode_s / 1e9 if traffic["h2d_bytes"] is not None and decode_s else None,
        # the swap-in's own floor: the bytes the misses moved per decode step over PCIe
        "decode_step_pcie_floor_ms": (_ms(traffic["h2d_bytes"] / decode_steps / gpu.pcie_bytes_per_s)
                                      if traffic["h2d_bytes"] is not None and decode_steps and gpu.pcie_bytes_per_s
                                      else None),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "device_pool_bytes": sum(p["bytes"] for p in pools if p["kind"] != "host"),
        "host_pool_bytes": sum(p["bytes"] for p in pools if p["kind"] == "host"),
        "config": coord.config.model_dump(mode="json"), "device": str(device),
        "decode_graphs": engine.config.decode_graphs, "cuda_graphs": engine.config.cuda_graphs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "prefill_attention": engine.runner.prefill_attention_label,
        "fused_ops": bool(getattr(engine.runner.model, "fused_ops", False)),
        "async_scheduling": engine.async_scheduling,
        # prompt tokens taken from the prefix cache (None: the cache is off); prefill_tokens_computed excludes them
        "prefix_cache": None if engine.prefix_cache is None else engine.prefix_cache.stats.as_dict(),
    }


# -- tables ------------------------------------------------------------------------------------
def fmt_or_dash(value: float | None, spec: str = ",.1f") -> str:
    """A figure for a table, '-' where there is none (also the sweep page's)."""
    return "-" if value is None else format(value, spec)


def gib_or_dash(n: int | None) -> str:
    """Bytes in GiB for a table, '-' where there are none."""
    return "-" if n is None else f"{n / 2**30:,.2f}"


def on_gpu(result: dict[str, Any]) -> bool:
    """Whether a run's device is a GPU, the only kind the HBM floor and the matmul peak (an
    H100's) describe: a CPU run is never compared with them."""
    return str(result.get("device", "cpu")).startswith("cuda")


def bench_tables(results: Sequence[dict[str, Any]], title: str) -> list[Table]:
    """Two tables of one row per run, readable from 80 columns up (`FitTable`: the least
    important columns go first): throughput and latency, then prefill, the store's traffic and
    memory. The decode floor and the % of peak are the run's GPU's figures (common/hardware.py):
    "n/a" for a run on the CPU, whose caption says so."""
    gpu = all(on_gpu(r) for r in results)
    names = sorted({f"{r.get('gpu', 'H100')} {r.get('hbm_tb_s', 3.0):.2f} TB/s" for r in results})
    floor = (f"floor: its HBM floor (weights + the K/V and representations it reads, at {', '.join(names)})" if gpu
             else "floor: n/a on the CPU (the floors are for a GPU's HBM)")
    first = new_table(title, (
        "conc: admitted (most running at once) / asked; max: the memory-bound maximum (the engine's memory "
        "plan at this max_model_len; bound by the device or the host). tok/s: output tokens per second; TTFT, TPOT "
        f"in ms; step: median decode step (ms) with the most requests decoding and no prefill, {floor}"),
        tight=True, drop=("TTFT p99", "TPOT p99", "preempt", "floor"))
    for col in ("in", "conc", "max", "tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "step", "floor",
                "preempt"):
        first.add_column(col, justify="right", no_wrap=col != "max")
    peak = ("% of the GPU's bf16 matmul peak (common/hardware.py)" if gpu else
            "% peak: n/a on the CPU (the peak is a GPU's)")
    second = new_table("prefill, store traffic and memory", (
        f"prefill: FLOPs of the prompts over the wall time of the steps with prefill, {peak}; hit: device-buffer "
        "hit rate; H2D: host->device bytes (GB) and their rate over the decode steps; memory in GiB: peak GPU "
        "allocated, device pools, host pool ('-': none or not CUDA)"),
        tight=True, drop=("H2D GB/s", "host", "dev pools", "% peak"))
    for col in ("in", "conc", "prefill TF/s", "% peak", "hit", "H2D GB", "H2D GB/s", "GPU peak", "dev pools", "host"):
        second.add_column(col, justify="right", no_wrap=True)
    for r in results:
        length = f"{r['input_len']:,}"
        conc = f"{r['admitted_concurrency']}/{r['concurrency']}"
        bound = "-" if r["memory_bound_max"] is None else f"{r['memory_bound_max']} {r['memory_bound']}"
        here = on_gpu(r)
        first.add_row(length, conc, bound, fmt_or_dash(r["output_tokens_per_s"]), fmt_or_dash(r["ttft_p50_ms"], ",.0f"),
                      fmt_or_dash(r["ttft_p99_ms"], ",.0f"), fmt_or_dash(r["tpot_p50_ms"]), fmt_or_dash(r["tpot_p99_ms"]),
                      fmt_or_dash(r["decode_step_ms"]),
                      fmt_or_dash(r["decode_step_floor_ms"]) if here else "n/a", str(r["preemptions"]))
        tf = r["prefill_tflops"]
        share = (fmt_or_dash(None if tf is None or not r["peak_tflops"] else 100 * tf / r["peak_tflops"]) if here
                 else "n/a")
        second.add_row(length, conc, fmt_or_dash(tf, ",.3g"), share,
                       fmt_or_dash(r["hit_rate"], ".1%"), fmt_or_dash(None if r["h2d_bytes"] is None else r["h2d_bytes"] / 1e9, ",.2f"),
                       fmt_or_dash(r["h2d_gb_per_s"], ",.2f"), gib_or_dash(r["peak_gpu_bytes"]), gib_or_dash(r["device_pool_bytes"]),
                       gib_or_dash(r["host_pool_bytes"]))
    return [first, second]


def reset_peak_memory(device: str | torch.device) -> None:
    """Start the peak GPU memory of a run afresh (call before building its engine)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(torch.device(device))
