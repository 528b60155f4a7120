"""Issue 21's prefix-cache benchmark: shared system prompts and multi-turn chat, cache on and off.

Workloads (random token ids, seeded; greedy decoding, `ignore_eos`):

  shared-prefix  --num-requests requests, each one shared system prompt of --system-len tokens
                 followed by a distinct --question-len-token question, each generating
                 --output-len tokens. --arrival: "burst" (all queued at once: requests admitted
                 before the first one's prompt is prefilled find nothing cached), "after-first"
                 (the first alone, then the rest at once: the system prompt is cached when they
                 arrive, the common serving case) or "sequential" (each queued when the one before
                 finished).
  chat           --conversations independent conversations of --turns turns, run side by side;
                 turn t's prompt is turn t-1's prompt + its generated output + a new
                 --turn-len-token user message, queued when turn t-1 finished, so the cache can
                 serve everything but the new message (and the last partial page).

Configs (--configs):

  dense          Quest in its dense mode (min_sparse_prompt_len 1e9) over the resident store, with a
                 host pool of --cache-tokens for the cache (prefix_cache.check_supported: the
                 resident store sizes none); every token read, the baseline
  quest-hier     Quest over the hierarchical store (full K/V on the host, a --device-buffer-tokens
                 buffer per request on the device), top_k --top-k

Each workload x config runs twice on fresh engines of identical sizes, the prefix cache off and
on (`EngineConfig.enable_prefix_caching`), after an untimed warm-up of the config (Triton
compiles, the allocator). Per cell: TTFT p50/p99 (from each request's queueing), prompt
tokens, prefill tokens computed (the engine's step log) and served from the cache
(`prefix_cache.stats`: hit tokens, hit rate = hit tokens / prompt tokens admitted), output
tokens/s over the whole run, the run's time; and per pair whether every output with the cache
on equals its output with the cache off, token for token, and how many differ.

In bfloat16 (CUDA) a greedy output is not a function of the prompt alone: how the prompt is
cut into prefill chunks and which requests share a step change the matmuls' shapes and so
their rounding, and a random-weight model's near-flat logits turn such differences into other
tokens within a few steps. A cache hit changes the schedule, so differing outputs there do not
by themselves show a fault in the cache. --schedule-control adds a third run per pair that
isolates this: the cache off with half the tokens per step ("off/2" in the table), a changed
schedule and nothing else, compared with the first cache-off run the same way. Exact equality
of the cache is checked in float32 with TF32 off (tests/test_engine_prefix_cache*.py, on the CPU
and on CUDA). A table (100 columns) is printed and
{"meta", "results"} JSON written to --out after every on/off pair (--resume skips the pairs
already there; --time-limit-s stops starting new ones).

    python benchmarks/prefix_cache_bench.py --random llama-3-8b --device cuda --cuda-graphs \\
        --out benchmarks/results/prefix_cache_h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import write_results  # noqa: E402

from sparse_framework.common.tables import new_table  # noqa: E402
from sparse_framework.common.errors import ConfigError  # noqa: E402
from sparse_framework.config import DENSE_CONFIG  # noqa: E402
from sparse_framework.bench.offline import fmt_or_dash, reset_peak_memory  # noqa: E402
from sparse_framework.bench.stats import percentile  # noqa: E402
from sparse_framework.engine.models.random_shapes import RANDOM_MODELS  # noqa: E402
from sparse_framework.engine.engine import Engine  # noqa: E402
from sparse_framework.engine.request_output import RequestOutput  # noqa: E402
from sparse_framework.engine.engine_config import EngineConfig  # noqa: E402
from sparse_framework.engine.models import ModelConfig, random_model  # noqa: E402
from sparse_framework.engine.sampling import SamplingParams  # noqa: E402

WORKLOADS = ("shared-prefix", "chat")
CONFIG_NAMES = ("dense", "quest-hier")
ARRIVALS = ("burst", "after-first", "sequential")


def bench_configs(backend: str, top_k: int, device_buffer_tokens: int, min_sparse_prompt_len: int,
                  quest_dense_first_layers: int) -> dict[str, dict[str, Any]]:
    """The sparse configs by name (module docstring)."""
    return {
        "dense": {**DENSE_CONFIG, "backend": backend},
        "quest-hier": {"algorithm": "quest", "backend": backend, "store": "hierarchical", "sparse_policy": "always",
                       "top_k": top_k,
                       "device_buffer_tokens": device_buffer_tokens, "min_sparse_prompt_len": min_sparse_prompt_len,
                       "extra": {"dense_first_layers": quest_dense_first_layers}},
    }


# -- workloads ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """The workloads' sizes (the flags of the same names)."""

    system_len: int
    question_len: int
    num_requests: int
    arrival: str
    turns: int
    turn_len: int
    conversations: int
    output_len: int
    seed: int

    def max_model_len(self, workload: str) -> int:
        if workload == "shared-prefix":
            return self.system_len + self.question_len + self.output_len
        return self.turns * (self.turn_len + self.output_len)

    def rows(self, workload: str, max_num_seqs: int | None) -> int:
        """Requests running at once: --max-num-seqs (shared-prefix; default min(requests, 16)),
        one per conversation (chat)."""
        if workload == "chat":
            return self.conversations
        return max_num_seqs or min(self.num_requests, 16)

    def unique_tokens(self, workload: str) -> int:
        """Distinct tokens the workload's prompts and outputs hold: what a cache keeping all of
        it needs (the default host pool of the cache)."""
        if workload == "shared-prefix":
            return self.system_len + self.num_requests * (self.question_len + self.output_len)
        return self.conversations * self.max_model_len("chat")


def _tokens(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def run_shared_prefix(engine: Engine, sizes: Sizes, vocab: int) -> list[RequestOutput]:
    """The shared-prefix workload through `engine`; outputs in request order."""
    g = torch.Generator().manual_seed(sizes.seed)
    system = _tokens(sizes.system_len, vocab, g)
    prompts = [system + _tokens(sizes.question_len, vocab, g) for _ in range(sizes.num_requests)]
    params = SamplingParams(max_tokens=sizes.output_len, temperature=0.0, ignore_eos=True)
    done: dict[str, RequestOutput] = {}
    waves = {"burst": [list(range(len(prompts)))],
             "after-first": [[0], list(range(1, len(prompts)))],
             "sequential": [[i] for i in range(len(prompts))]}[sizes.arrival]
    for wave in waves:
        for i in wave:
            engine.add_request(f"q{i}", prompts[i], params)
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step())
    return [done[f"q{i}"] for i in range(len(prompts))]


def run_chat(engine: Engine, sizes: Sizes, vocab: int) -> list[RequestOutput]:
    """The chat workload through `engine`: each conversation's next turn is queued as its last
    one finishes; outputs in (conversation, turn) order."""
    g = torch.Generator().manual_seed(sizes.seed + 1)
    messages = [[_tokens(sizes.turn_len, vocab, g) for _ in range(sizes.turns)] for _ in range(sizes.conversations)]
    params = SamplingParams(max_tokens=sizes.output_len, temperature=0.0, ignore_eos=True)
    done: dict[str, RequestOutput] = {}
    for c in range(sizes.conversations):
        engine.add_request(f"c{c}t0", messages[c][0], params)
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
            c, t = (int(x) for x in out.request_id[1:].split("t"))
            if t + 1 < sizes.turns and out.finish_reason != "error":
                prompt = list(out.prompt_token_ids) + list(out.token_ids) + messages[c][t + 1]
                engine.add_request(f"c{c}t{t + 1}", prompt, params)
    return [done[k] for k in sorted(done, key=lambda r: tuple(int(x) for x in r[1:].split("t")))]


RUNS = {"shared-prefix": run_shared_prefix, "chat": run_chat}


# -- one cell -------------------------------------------------------------------------------------
def build_engine(model: torch.nn.Module, config: dict[str, Any], args: argparse.Namespace, workload: str,
                 cache: bool, sizes: Sizes) -> Engine:
    """A fresh engine for one cell; the same sizes with the cache on and off. The host pool:
    every row's max_model_len plus --cache-tokens (default: the workload's distinct tokens)
    for the cache, for both stores: the hierarchical store's requests keep their K/V there,
    and the budget (engine/budget.py) promises every admitted request its whole life's host
    pages even where its K/V stay on the device (the resident store, dense mode), and lets
    the cache export only into pages beyond those promises."""
    max_model_len = sizes.max_model_len(workload)
    rows = sizes.rows(workload, args.max_num_seqs)
    host = (args.cache_tokens or sizes.unique_tokens(workload)) + rows * max_model_len
    options = EngineConfig(max_num_seqs=rows, max_num_batched_tokens=max(args.max_num_batched_tokens, rows),
                           max_model_len=max_model_len, host_capacity_tokens=host, cuda_graphs=args.cuda_graphs,
                           enable_prefix_caching=cache)
    return Engine(model, model.config, config, options)  # type: ignore[arg-type]


def run_cell(model: torch.nn.Module, config: dict[str, Any], args: argparse.Namespace, workload: str,
             config_name: str, cache: bool, sizes: Sizes, control: bool = False) -> tuple[dict[str, Any], list[list[int]]]:
    """One cell's row and its outputs' token ids (an "error" row and no outputs on failure);
    `control`: the cache off with half --max-num-batched-tokens (--schedule-control)."""
    row: dict[str, Any] = {"cell": cell_key(workload, config_name, cache, control), "workload": workload,
                           "config_name": config_name, "prefix_cache": cache, "model": args.random,
                           "schedule_control": control}
    if control:
        args = argparse.Namespace(**{**vars(args), "max_num_batched_tokens": max(1, args.max_num_batched_tokens // 2)})
    try:
        reset_peak_memory(args.device)
        engine = build_engine(model, config, args, workload, cache, sizes)
        start = time.perf_counter()
        outs = RUNS[workload](engine, sizes, model.config.vocab_size)  # type: ignore[union-attr]
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        elapsed = time.perf_counter() - start
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise ConfigError(f"{len(failed)} request(s) failed, e.g. {failed[0].request_id}: {failed[0].error}")
        ttft = [o.ttft for o in outs if o.ttft is not None]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        computed = sum(entry[1] for entry in engine.step_log)
        stats = engine.prefix_cache.stats.as_dict() if engine.prefix_cache is not None else None
        tokens = sum(len(o.token_ids) for o in outs)
        row.update({
            "requests": len(outs), "rows": engine.num_seqs, "max_model_len": engine.max_model_len,
            "elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),  # type: ignore[operator]
            "ttft_ms": [1e3 * t for t in ttft],
            "prompt_tokens": prompt_tokens, "prefill_tokens_computed": computed,
            "prefill_tokens_saved": 0 if stats is None else stats["hit_tokens"],
            "hit_rate": None if stats is None else stats["hit_rate"], "cache_stats": stats,
            "preemptions": engine.scheduler.num_preemptions, "steps": engine.steps,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(engine.device) if engine.device.type == "cuda" else None,
            "host_capacity_tokens": engine.config.host_capacity_tokens, "cuda_graphs": engine.config.cuda_graphs,
            "async_scheduling": engine.async_scheduling, "config": engine.runner.coord.config.model_dump(mode="json"),
            "device": str(engine.device), "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            **step_times(engine.step_log),
        })
        token_ids = [list(o.token_ids) for o in outs]
        del engine
    except Exception as exc:  # a failing cell is its row, never the run's end  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"
        token_ids = []
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return row, token_ids


def step_times(log: list[tuple[int, int, int, float]]) -> dict[str, Any]:
    """Where the run's time went, from the engine's step log (decode rows, prefill tokens,
    context, seconds): steps with prefill tokens, decode-only steps and their median."""
    prefill = [t for _, tokens, _, t in log if tokens > 0]
    decode = [t for _, tokens, _, t in log if tokens == 0]
    return {"prefill_steps_s": sum(prefill), "decode_steps_s": sum(decode), "decode_steps": len(decode),
            "decode_step_ms_p50": None if not decode else 1e3 * percentile(decode, 50)}  # type: ignore[operator]


def compare_outputs(off: list[list[int]], on: list[list[int]]) -> dict[str, Any]:
    """Whether every output with the cache on equals its output with it off, how many differ,
    and for each that does (request index, first differing position): where to look."""
    differing = [(i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
                 for i, (a, b) in enumerate(zip(off, on)) if a != b]
    equal = len(off) == len(on) and not differing
    return {"outputs_equal_cache_off": equal, "outputs_differing": len(differing) + abs(len(off) - len(on)),
            "first_differences": differing}


def cell_key(workload: str, config_name: str, cache: bool, control: bool = False) -> str:
    """A cell's name; `control`: the cache off with half the tokens per step (--schedule-control)."""
    return f"{workload}/{config_name}/cache-{'on' if cache else 'off'}{'-half-step' if control else ''}"


def pair_keys(workload: str, config_name: str, control: bool) -> list[str]:
    """The cells one pair runs: off, on, and with --schedule-control the half-step control."""
    return [cell_key(workload, config_name, False), cell_key(workload, config_name, True)] + \
        [cell_key(workload, config_name, False, True)] * control


# -- the table ------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
    """One row per cell, within 100 columns."""
    t = new_table("prefix cache: on vs off", (
        "TTFT in ms from queueing; computed: prefill tokens the steps ran; saved: prompt tokens served from the "
        "cache; hit: saved / prompt tokens admitted; tok/s: output tokens per second over the run; differ: outputs "
        "with the cache on that differ from their output with it off (0: all equal, token for token); off/2: the "
        "cache off with half the tokens per step, compared with the off run (--schedule-control)"), tight=True)
    for col in ("workload", "config", "cache", "TTFT p50", "p99", "computed", "saved", "hit", "tok/s", "run s",
                "differ"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        name = (r["workload"], r["config_name"],
                "off/2" if r.get("schedule_control") else ("on" if r["prefix_cache"] else "off"))
        if "error" in r:
            t.add_row(*name, r["error"][:60], *[""] * 7)
            continue
        same = r.get("outputs_equal_cache_off")
        t.add_row(*name, fmt_or_dash(r["ttft_p50_ms"], ",.0f"), fmt_or_dash(r["ttft_p99_ms"], ",.0f"),
                  f"{r['prefill_tokens_computed']:,}", f"{r['prefill_tokens_saved']:,}",
                  fmt_or_dash(r["hit_rate"], ".1%"), fmt_or_dash(r["output_tokens_per_s"]),
                  fmt_or_dash(r["elapsed_s"], ",.2f"), "-" if same is None else f"{r['outputs_differing']}/{r['requests']}")
    return t


# -- arguments and main -------------------------------------------------------------------------
def _list(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{flag} needs a comma-separated list of {', '.join(allowed)}, got {text!r}")
    for item in items:
        if item not in allowed:
            raise ConfigError(f"{flag}: unknown {item!r}; choose from {', '.join(allowed)}")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random", choices=sorted(RANDOM_MODELS), default="llama-3-8b", help="model shape (random weights)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)} (default both)")
    p.add_argument("--configs", default=",".join(CONFIG_NAMES), help=f"of {', '.join(CONFIG_NAMES)} (default both)")
    p.add_argument("--system-len", type=int, default=16384, help="shared-prefix: the system prompt's tokens")
    p.add_argument("--question-len", type=int, default=512, help="shared-prefix: each question's tokens")
    p.add_argument("--num-requests", type=int, default=64, help="shared-prefix: requests (default 64)")
    p.add_argument("--arrival", choices=ARRIVALS, default="after-first", help="shared-prefix: how requests are "
                   "queued (module docstring; default after-first)")
    p.add_argument("--max-num-seqs", type=int, help="shared-prefix: requests running at once (default "
                   "min(requests, 16)); chat runs one per conversation")
    p.add_argument("--turns", type=int, default=8, help="chat: turns per conversation (default 8)")
    p.add_argument("--turn-len", type=int, default=4096, help="chat: each user message's tokens (default 4096)")
    p.add_argument("--conversations", type=int, default=1, help="chat: conversations side by side (default 1)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request / turn (default 128)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' token ids")
    p.add_argument("--cache-tokens", type=int, help="host pool tokens for the cache beyond the requests' own "
                   "(default: the workload's distinct tokens)")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default 16384 on CUDA, 2048 on the CPU)")
    p.add_argument("--top-k", type=int, default=2048, help="quest-hier's top_k (default 2048)")
    p.add_argument("--device-buffer-tokens", type=int, default=4096, help="quest-hier's buffer (default 4096)")
    p.add_argument("--min-sparse-prompt-len", type=int, default=2048, help="quest-hier's (default 2048)")
    p.add_argument("--quest-dense-first-layers", type=int, default=2, help="quest-hier's dense first layers (default 2)")
    p.add_argument("--cuda-graphs", action="store_true", help="whole decode steps replayed from CUDA graphs")
    p.add_argument("--schedule-control", action="store_true", help="per pair, a third run with the cache off "
                   "and half the tokens per step: what a changed schedule alone changes (module docstring)")
    p.add_argument("--no-warmup", action="store_true", help="skip each config's untimed warm-up run")
    p.add_argument("--resume", action="store_true", help="skip the cells already in --out (those without an error)")
    p.add_argument("--time-limit-s", type=float, help="start no new on/off pair after this many seconds (the first "
                   "always starts; rerun with --resume for the rest)")
    p.add_argument("--out", default="prefix_cache_bench.json", help="{meta, results} JSON, written after every on/off pair")
    args = p.parse_args(argv)
    args.workload_list = _list(args.workloads, "--workloads", WORKLOADS)
    args.config_list = _list(args.configs, "--configs", CONFIG_NAMES)
    for flag in ("system_len", "question_len", "num_requests", "turns", "turn_len", "conversations", "output_len"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("max_num_seqs", "cache_tokens", "max_num_batched_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 16384 if torch.device(args.device).type == "cuda" else 2048
    args.sizes = Sizes(args.system_len, args.question_len, args.num_requests, args.arrival, args.turns, args.turn_len,
                       args.conversations, args.output_len, args.seed)
    return args


def _warm_sizes(sizes: Sizes) -> Sizes:
    """A small run of the same shape, its prompts past the default min_sparse_prompt_len (2048)
    so that the sparse path's kernels compile too, a few requests, four output tokens."""
    return Sizes(system_len=min(sizes.system_len, 4096), question_len=min(sizes.question_len, 64),
                 num_requests=min(sizes.num_requests, 3), arrival="after-first", turns=min(sizes.turns, 2),
                 turn_len=min(sizes.turn_len, 2304), conversations=1, output_len=min(sizes.output_len, 4),
                 seed=sizes.seed + 99)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    previous = json.loads(out.read_text())["results"] if args.resume and out.exists() else []
    rows: list[dict[str, Any]] = list(previous)
    done = {r["cell"] for r in rows if "error" not in r}
    cuda = torch.device(args.device).type == "cuda"
    configs = bench_configs("triton" if cuda else "torch_ref", args.top_k, args.device_buffer_tokens,
                            args.min_sparse_prompt_len, args.quest_dense_first_layers)
    pairs = [(w, n) for w in args.workload_list for n in args.config_list
             if not all(key in done for key in pair_keys(w, n, args.schedule_control))]
    print(f"{len(pairs)} on/off pair(s) to run, {len(rows)} cell(s) already in {out}", flush=True)
    dtype = "bfloat16" if cuda else "float32"
    model = None if not pairs else random_model(ModelConfig.from_hf(RANDOM_MODELS[args.random]), dtype, args.device)
    meta = {"model": args.random, "dtype": dtype, "device": args.device, "sizes": vars(args.sizes),
            "gpu": torch.cuda.get_device_name(args.device) if cuda else None}
    start = time.monotonic()
    for i, (workload, name) in enumerate(pairs):
        if i and args.time_limit_s is not None and time.monotonic() - start > args.time_limit_s:
            print(f"time limit {args.time_limit_s:g} s: {len(pairs) - i} pair(s) left; rerun with --resume", flush=True)
            break
        if not args.no_warmup:
            warm, _ = run_cell(model, configs[name], args, workload, name, True, _warm_sizes(args.sizes))
            print(f"[{time.monotonic() - start:7.1f} s] warm-up {workload}/{name}: {warm.get('error') or 'done'}",
                  flush=True)
        pair = pair_keys(workload, name, args.schedule_control)
        rows = [r for r in rows if r["cell"] not in pair]
        pair_rows, outputs = [], []
        for cache, control in [(False, False), (True, False)] + [(False, True)] * args.schedule_control:
            row, ids = run_cell(model, configs[name], args, workload, name, cache, args.sizes, control)
            pair_rows.append(row)
            outputs.append(ids)
            what = row.get("error") or (f"TTFT p50 {row['ttft_p50_ms']:,.0f} ms, saved "
                                        f"{row['prefill_tokens_saved']:,} tokens, {row['elapsed_s']:,.1f} s")
            print(f"[{time.monotonic() - start:7.1f} s] {row['cell']}: {what}", flush=True)
        if "error" not in pair_rows[0]:
            for row, ids in zip(pair_rows[1:], outputs[1:]):
                if "error" not in row:
                    row.update(compare_outputs(outputs[0], ids))
        rows.extend(pair_rows)
        write_results(str(out), meta, rows, "prefix_cache_bench.py", argv)
    Console(width=100).print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
