"""Run the cells of an experiment and measure each against dense decoding.

RULER workloads generate through the engine instead (ruler_runner.py). Model workloads (the
reference model, a user's Hugging Face model) decode teacher-forced: the
prompt is prefilled densely, then the known continuation is fed one token per step, so dense
and sparse runs see the same tokens and their logits compare position by position. Sparse
runs go through the transformers integration (`SparseHandle`); its observer hands every
layer's query, new K/V, output and selection to `AttentionProbe`, which keeps the full K/V and
measures the layer against exact dense attention. The synthetic workload uses the engine's
decode loop, which measures the same attention metrics itself.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .loop import run_experiment
from .metrics import attention_recall, dense_attention, needle_hits, relative_error, selected_mask
from .workload import DTYPES, WorkloadConfig
from ..common.errors import ConfigError
from .experiment import Cell, HFWorkload, ReferenceWorkload, RulerWorkload, SyntheticWorkload

# What a cell reports (None where a workload cannot measure it), with how tables show it.
METRICS: dict[str, str] = {
    "accuracy": "task accuracy: answers entirely right (reference), argmax agreement with dense (hf), or "
    "RULER's string-match-all, the share of the expected strings in the greedy answer (ruler)",
    "recall": "attention mass on the selected tokens / mass of the exact top-k of the same size",
    "rel_error": "attention output error vs dense attention, ‖o − o_dense‖ / ‖o_dense‖",
    "kl": "KL(dense ‖ sparse) of the next-token distributions, nats per scored position",
    "needle_hit_rate": "share of the asked fact's tokens (reference) or needles (synthetic) selected",
    "device_kv_fraction": "device KV bytes held / dense device KV bytes",
    "hit_rate": "share of the selected tokens already in the device buffer at decode (hierarchical store; ruler)",
    "moved_kib_per_token": "host→device KiB copied per decode step, all layers: of the batch (teacher-forced, "
    "synthetic), of one request, i.e. per output token (ruler)",
    "sparse_fraction": "share of the decode layer-steps (request x layer x step) that attended sparsely; "
    "the rest fell back to dense: prompts below min_sparse_prompt_len, dense layers. 'never': the "
    "cell measured dense attention only",
    "ms_per_token": "wall time per decode step of the batch (first step excluded; ruler: per output token over the "
    "engine's decode-only steps; Python and kernels, with any first-use compilation of a new shape: benchmarks/, "
    "not this, measure speed)",
}


# what the dense baseline holds and moves, relative to itself
DENSE_STORE: dict[str, float] = {"device_kv_fraction": 1.0, "moved_kib_per_token": 0.0}


@dataclass
class Decoded:
    """One teacher-forced decode: logits [rows, steps, vocab] predicting tokens[:, p + 1] for
    p = prompt_len .. T - 2, and the time per step."""

    logits: torch.Tensor
    ms_per_token: float


class AttentionProbe:
    """Observer of a SparseHandle: keeps every request's full K/V per layer and compares each
    decode layer with exact dense attention (float64) over it."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.needles: list[torch.Tensor] | None = None  # per row, set by the caller per step
        self.sums = {"recall": 0.0, "rel_error": 0.0}
        self.n = 0
        self.hits = self.needle_total = 0
        self.seconds = 0.0  # time spent measuring, taken out of the decode time

    def __call__(self, event: Any) -> None:
        start = time.perf_counter()
        try:
            self._observe(event)
        finally:
            self.seconds += time.perf_counter() - start

    def _observe(self, event: Any) -> None:
        layer, batch = event.layer, event.batch
        if event.selection is None:  # prefill: the packed prompt, row after row
            lens = [r.prompt_len for r in batch.requests]
            self.keys[layer] = [k.float() for k in event.k.split(lens)]
            self.values[layer] = [v.float() for v in event.v.split(lens)]
            return
        sel = event.selection
        for i, request in enumerate(batch.requests):
            self.keys[layer][i] = torch.cat([self.keys[layer][i], event.k[i : i + 1].float()])
            self.values[layer][i] = torch.cat([self.values[layer][i], event.v[i : i + 1].float()])
            q = event.q[i].float()
            ref, probs = dense_attention(q, self.keys[layer][i], self.values[layer][i])
            mask = selected_mask(sel.indices[i], request.seq_len, q.shape[0])
            self.sums["recall"] += attention_recall(probs, mask)
            self.sums["rel_error"] += relative_error(event.out[i], ref)
            self.n += 1
            if self.needles is not None and self.needles[i].numel():
                hit, total = needle_hits(self.needles[i].to(mask.device), mask)
                self.hits += hit
                self.needle_total += total

    def result(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {k: v / self.n if self.n else None for k, v in self.sums.items()}
        out["needle_hit_rate"] = self.hits / self.needle_total if self.needle_total else None
        return out


def teacher_forced(
    model: Any, tokens: torch.Tensor, prompt_len: int, cache: Any, before_step: Any = None, probe: Any = None
) -> Decoded:
    """Prefill tokens[:, :prompt_len] into `cache`, then feed the rest one token per step. The
    time of each step excludes what the `probe` (an AttentionProbe) spent measuring."""
    from ..integrations.transformers import cache_kwarg

    steps = tokens.shape[1] - 1 - prompt_len
    name = cache_kwarg(model)  # "cache" from transformers 5.24, "past_key_values" before
    with torch.no_grad():
        model(input_ids=tokens[:, :prompt_len], **{name: cache}, use_cache=True)
        logits, seconds = [], 0.0
        for j in range(steps):
            p = prompt_len + j
            if before_step is not None:
                before_step(p)
            start, measuring = time.perf_counter(), probe.seconds if probe is not None else 0.0
            out = model(input_ids=tokens[:, p : p + 1], **{name: cache}, use_cache=True)
            step_logits = out.logits[:, -1].float()
            if tokens.device.type == "cuda":
                torch.cuda.synchronize()
            if j > 0 or steps == 1:
                seconds += time.perf_counter() - start
                seconds -= (probe.seconds - measuring) if probe is not None else 0.0
            logits.append(step_logits)
    timed = max(1, steps - 1)
    return Decoded(torch.stack(logits, 1), 1000 * seconds / timed)


def kl_per_position(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """KL(dense ‖ sparse) per position, in nats (float64)."""
    p = dense.double().log_softmax(-1)
    q = sparse.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


class Runner:
    """Runs cells; keeps loaded models, drawn sequences and dense baselines between cells."""

    def __init__(self, device: str, dtype: str, seed: int, dense_backend: str = "torch_ref") -> None:
        self.device, self.dtype, self.seed = device, DTYPES[dtype], seed
        self.dense_backend = dense_backend  # the engine's dense baseline (ruler) runs through it
        self._ruler: Any = None  # a RulerRunner, made by the first ruler cell
        self._models: dict[str, Any] = {}
        self._dense: dict[str, tuple[Decoded, Any]] = {}  # per (workload, context): dense decode, inputs

    # -- models and inputs --------------------------------------------------------------------
    def model(self, workload: ReferenceWorkload | HFWorkload) -> Any:
        key = "reference" if isinstance(workload, ReferenceWorkload) else workload.model
        if key not in self._models:
            if isinstance(workload, ReferenceWorkload):
                from ..toy_model.model import load_reference_model

                self._models[key] = load_reference_model(self.dtype, self.device)
            else:
                self._models[key] = _load_hf_model(workload.model, self.dtype, self.device)
        return self._models[key]

    def reference_inputs(self, workload: ReferenceWorkload, context: int) -> Any:
        from ..toy_model.tasks import TASKS, TaskConfig, draw

        cfg = TaskConfig(context=context, **TASKS[workload.task])
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + context)
        return [draw(cfg, gen) for _ in range(workload.sequences)]

    def hf_inputs(self, workload: HFWorkload, context: int) -> list[tuple[torch.Tensor, int]]:
        """Per prompt: (its last `context` tokens and the dense model's greedy continuation
        [1, T], the prompt's length)."""
        model = self.model(workload)
        tokenizer = _load_tokenizer(workload.model)
        rows = []
        for prompt in _read_prompts(Path(workload.prompts), workload.limit):
            ids = tokenizer(prompt, return_tensors="pt").input_ids[:, -context:].to(self.device)
            with torch.no_grad():
                full = model.generate(
                    ids, max_new_tokens=workload.max_new_tokens, do_sample=False,
                    attention_mask=torch.ones_like(ids), pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
            if full.shape[1] - ids.shape[1] < 2:
                raise ConfigError(f"the model stopped after {full.shape[1] - ids.shape[1]} new tokens on prompt {prompt[:40]!r}: nothing to decode")
            rows.append((full, ids.shape[1]))
        return rows

    # -- cells --------------------------------------------------------------------------------
    def run(self, cell: Cell) -> dict[str, Any]:
        """The metrics of one cell (raises on failure; the caller records the error)."""
        if isinstance(cell.workload, SyntheticWorkload):
            return self._synthetic(cell)
        if isinstance(cell.workload, RulerWorkload):
            if self._ruler is None:
                from .ruler_runner import RulerRunner

                self._ruler = RulerRunner(self.device, self.dtype, self.seed, self.dense_backend)
            return self._ruler.run(cell)
        if isinstance(cell.workload, ReferenceWorkload):
            return self._reference(cell)
        return self._hf(cell)

    def _baseline(self, cell: Cell, compute: Callable[[], tuple[Decoded, Any]]) -> tuple[Decoded, Any]:
        """(dense decode, its inputs) of the cell's workload and context: computed by the
        first cell that needs it (the dense cell comes first), then shared by the others."""
        key = json.dumps([cell.workload.model_dump(), cell.context], sort_keys=True)
        if key not in self._dense:
            self._dense[key] = compute()
        return self._dense[key]

    def _reference(self, cell: Cell) -> dict[str, Any]:
        wl = cell.workload
        assert isinstance(wl, ReferenceWorkload)
        model = self.model(wl)

        def compute() -> tuple[Decoded, Any]:
            seqs = self.reference_inputs(wl, cell.context)
            tokens = torch.stack([s.tokens for s in seqs]).to(self.device)
            return self._decode_dense(model, tokens, seqs[0].prompt_len), (seqs, tokens)

        dense, (seqs, tokens) = self._baseline(cell, compute)
        prompt_len = seqs[0].prompt_len
        targets = torch.stack([s.targets for s in seqs])[:, prompt_len:-1]
        query_of = torch.stack([s.query_of for s in seqs])[:, prompt_len:-1]
        scored = targets >= 0

        def needles_at(p: int) -> list[torch.Tensor]:
            empty = torch.empty(0, dtype=torch.long)
            return [s.needles[int(s.query_of[p])] if s.targets[p] >= 0 else empty for s in seqs]

        if cell.config is None:
            decoded, attention, store = dense, {}, DENSE_STORE
        else:
            decoded, attention, store = self._decode_sparse(model, cell, tokens, prompt_len, needles_at)
        pred = decoded.logits.argmax(-1).cpu()
        right = (pred == targets) | ~scored
        # a query counts when every one of its scored tokens is right
        queries = [(r, int(q)) for r in range(len(seqs)) for q in query_of[r][scored[r]].unique()]
        correct = sum(bool(right[r][query_of[r] == q].all()) for r, q in queries)
        kl = kl_per_position(dense.logits.cpu(), decoded.logits.cpu())[scored]
        return {
            "accuracy": correct / len(queries),
            "token_accuracy": float((pred == targets)[scored].float().mean()),
            "kl": float(kl.mean()),
            **attention, **store,
            "ms_per_token": decoded.ms_per_token,
            "rows": len(seqs), "decode_steps": decoded.logits.shape[1],
        }

    def _hf(self, cell: Cell) -> dict[str, Any]:
        wl = cell.workload
        assert isinstance(wl, HFWorkload)
        model = self.model(wl)

        def compute() -> tuple[Decoded, Any]:
            rows = self.hf_inputs(wl, cell.context)
            return _concat([self._decode_dense(model, r, n) for r, n in rows]), rows

        dense, rows = self._baseline(cell, compute)
        if cell.config is None:
            decoded, attention, store = dense, {}, DENSE_STORE
        else:
            parts = [self._decode_sparse(model, cell, r, n, None) for r, n in rows]
            decoded = _concat([p[0] for p in parts])
            attention = _mean_dicts([p[1] for p in parts])
            store = _mean_dicts([p[2] for p in parts])
        agree = decoded.logits.argmax(-1) == dense.logits.argmax(-1)
        return {
            "accuracy": float(agree.float().mean()),
            "kl": float(kl_per_position(dense.logits.cpu(), decoded.logits.cpu()).mean()),
            **attention, **store, "ms_per_token": decoded.ms_per_token, "rows": len(rows),
        }

    def _decode_dense(self, model: Any, tokens: torch.Tensor, prompt_len: int) -> Decoded:
        from transformers import DynamicCache

        return teacher_forced(model, tokens, prompt_len, DynamicCache())

    def _decode_sparse(
        self, model: Any, cell: Cell, tokens: torch.Tensor, prompt_len: int, needles_at: Any
    ) -> tuple[Decoded, dict[str, float | None], dict[str, float]]:
        from ..integrations.transformers import enable

        assert cell.config is not None
        probe = AttentionProbe(model.config.num_hidden_layers)
        with enable(model, cell.config, max_requests=tokens.shape[0], max_seq_len=tokens.shape[1] + 1) as handle:
            handle.observer = probe
            store = handle.coordinator.store
            before = _bytes_in(store)
            cache = handle.new_cache()
            try:
                def before_step(p: int) -> None:
                    probe.needles = needles_at(p) if needles_at is not None else None

                decoded = teacher_forced(model, tokens, prompt_len, cache, before_step, probe)
                fractions = [store.device_tokens(r) / r.seq_len for r in cache.requests]
            finally:
                cache.close()
            moved = (_bytes_in(store) - before) / 1024 / max(1, decoded.logits.shape[1])
            sparse_fraction = handle.dense_tally().sparse_fraction
        stats = {"device_kv_fraction": sum(fractions) / len(fractions), "moved_kib_per_token": moved,
                 "sparse_fraction": sparse_fraction}
        return decoded, probe.result(), stats

    def _synthetic(self, cell: Cell) -> dict[str, Any]:
        wl = cell.workload
        assert isinstance(wl, SyntheticWorkload)
        options = {**wl.options, "contexts": [cell.context], "device": self.device, "seed": self.seed}
        options["dtype"] = next(name for name, dt in DTYPES.items() if dt == self.dtype)
        workload = WorkloadConfig(**options)
        config = cell.config
        if config is None:  # dense: every prompt below min_sparse_prompt_len decodes densely
            from ..config import load_config

            config = load_config({"algorithm": "quest", "min_sparse_prompt_len": cell.context + 1})
        (r,) = run_experiment(config, workload)
        return {
            "recall": r.recall, "rel_error": r.rel_error, "needle_hit_rate": r.needle_hit_rate,
            "device_kv_fraction": r.device_kv_fraction,
            "moved_kib_per_token": r.swap_in_kib_per_step, "ms_per_token": r.ms_per_step,
            "sparse_fraction": r.sparse_fraction if cell.config is not None else None,
            "rows": 1, "decode_steps": workload.decode_steps,
        }


def _bytes_in(store: Any) -> int:
    stats = getattr(store, "stats", None)
    return sum(int(s["bytes_in"]) for s in stats()) if stats is not None else 0


def _concat(parts: list[Decoded]) -> Decoded:
    """Rows of several decodes (each one prompt) side by side; steps may differ, so logits are
    flattened to [1, total steps, vocab]."""
    logits = torch.cat([p.logits.reshape(-1, p.logits.shape[-1]) for p in parts])[None]
    return Decoded(logits, sum(p.ms_per_token for p in parts) / len(parts))


def _mean_dicts(items: list[dict[str, Any]]) -> dict[str, Any]:
    keys = items[0].keys()
    out = {}
    for k in keys:
        vals = [d[k] for d in items if d[k] is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def _load_hf_model(name: str, dtype: torch.dtype, device: str) -> Any:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(name, torch_dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:  # (huggingface_hub < 1 raises a ValueError for bad ids)
        raise ConfigError(f"workload model {name!r} cannot be loaded without the network: {exc}") from None
    return model.to(device).eval()


def _load_tokenizer(name: str) -> Any:
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"workload model {name!r} has no tokenizer that loads offline: {exc}") from None


def _read_prompts(path: Path, limit: int | None) -> list[str]:
    if not path.is_file():
        raise ConfigError(f"prompts file {str(path)!r} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{path}:{n}: a JSON line needs a 'prompt' key") from None
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"prompts file {str(path)!r} has no prompts")
    return prompts[:limit]


def finite(x: float | None) -> float | None:
    """JSON-safe: NaN/inf become None."""
    return x if x is None or math.isfinite(x) else None


@dataclass
class CellRecord:
    """One line of the results file."""

    id: str
    experiment: str
    workload: str
    context: int
    algorithm: str
    backend: str
    budget: str
    top_k: int | None
    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    config: dict[str, Any] | None = None
