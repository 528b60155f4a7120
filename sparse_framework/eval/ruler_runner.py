"""RULER cells: a real model answers lm-eval's RULER prompts through the engine.

Unlike the teacher-forced workloads (runner.py), a RULER cell generates: every sample is one
greedy request, all submitted at once to a fresh `LLM` built over the model loaded once per
(model, dtype, device), and the answers are scored as RULER scores them (string-match-all).
That is the figure a user of the engine gets, so it is the one that decides between
algorithms and options. The dense baseline is the same engine with every request below
`min_sparse_prompt_len` and a resident store (as benchmarks/engine_sweep.py runs dense), so
the two differ only in the attention the decode steps read.

Besides accuracy a cell reports what the hierarchical store did (device-buffer hit rate and
host→device bytes per output token, from the coordinator store's per-layer counters), the
share of decode layer-steps that attended sparsely, and the decode time per output token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..common.errors import ConfigError
from ..config import DENSE_CONFIG, SparseConfig, load_config
from .experiment import Cell, RulerWorkload
from .ruler import RulerSample, prompt_ids, ruler_samples, score


EXAMPLE_CHARS = 120  # a kept prediction is cut to this many characters


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class RulerRunner:
    """Runs ruler cells; keeps loaded engine models, tokenizers and samples between cells."""

    def __init__(self, device: str, dtype: torch.dtype, seed: int, dense_backend: str = "torch_ref") -> None:
        self.device, self.dtype, self.seed, self.dense_backend = device, dtype, seed, dense_backend
        self._dirs: dict[str, Path] = {}
        self._models: dict[Path, Any] = {}
        self._tokenizers: dict[Path, Any] = {}
        self._prompts: dict[tuple[str, ...], tuple[list[RulerSample], list[list[int]]]] = {}

    # -- model, tokenizer, prompts --------------------------------------------------------------
    def model_dir(self, workload: RulerWorkload) -> Path:
        """The checkpoint directory (a catalog model converted on first use; not installed: a
        ConfigError with the install command)."""
        from ..engine.models.catalog import resolve_model

        if workload.model not in self._dirs:
            self._dirs[workload.model] = resolve_model(workload.model)
        return self._dirs[workload.model]

    def model(self, root: Path) -> Any:
        """The engine model, loaded once per checkpoint (this runner has one dtype and device)."""
        if root not in self._models:
            from ..engine.models import load_model

            self._models[root] = load_model(root, self.dtype, self.device)
        return self._models[root]

    def tokenizer(self, root: Path) -> Any:
        if root not in self._tokenizers:
            from ..engine.llm import load_tokenizer

            tok = load_tokenizer(root)
            if tok is None:
                raise ConfigError(f"ruler workload: model directory {str(root)!r} has no tokenizer files (RULER "
                                  "prompts are text)")
            self._tokenizers[root] = tok
        return self._tokenizers[root]

    def prompts(self, workload: RulerWorkload, context: int) -> tuple[list[RulerSample], list[list[int]]]:
        """The cell's samples and their prompt token ids (chat template applied or not), the
        same for every cell of (workload, context)."""
        key = (workload.model, workload.task, str(context), str(workload.samples), str(workload.chat_template))
        if key not in self._prompts:
            root = self.model_dir(workload)
            tok = self.tokenizer(root)
            samples = ruler_samples(root, workload.task, context, workload.samples, self.seed, tokenizer=tok)
            ids = [prompt_ids(s, tok, workload.chat_template) for s in samples]
            self._prompts[key] = (samples, ids)
        return self._prompts[key]

    def max_model_len(self, workload: RulerWorkload, context: int, ids: list[list[int]]) -> int:
        """Room for the longest prompt (the generator sizes `input` to the context; the chat
        template and gen_prefix add a few dozen tokens) and the answer, in whole pages; the
        same for the dense and every sparse cell of (workload, context)."""
        return _round_up(max(context, max(len(i) for i in ids)) + workload.new_tokens, 64)

    # -- one cell -------------------------------------------------------------------------------
    def run(self, cell: Cell) -> dict[str, Any]:
        from ..engine.llm import LLM
        from ..engine.sampling import SamplingParams

        wl = cell.workload
        assert isinstance(wl, RulerWorkload)
        samples, ids = self.prompts(wl, cell.context)
        root = self.model_dir(wl)
        config = cell.config if cell.config is not None else self.dense_config()
        options = {
            **wl.engine, "max_num_seqs": min(wl.max_num_seqs, len(ids)), "max_model_len": self.max_model_len(wl, cell.context, ids),
            "max_num_batched_tokens": wl.max_num_batched_tokens, "seed": self.seed,
        }
        llm = LLM.from_model(self.model(root), config, tokenizer=self.tokenizer(root), **options)
        outputs = llm.generate(ids, SamplingParams(max_tokens=wl.new_tokens, temperature=0))
        failed = [o for o in outputs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed in the engine: {failed[0].error}")
        sparse_share = llm.engine.runner.coord.dense_tally.sparse_fraction
        if cell.config is None and sparse_share:
            raise RuntimeError(f"the dense baseline decoded {sparse_share:.1%} of its layer-steps sparsely: "
                               f"its config {config.key()} is not dense")
        texts = [o.text or "" for o in outputs]
        scores = [score(t, s.outputs) for t, s in zip(texts, samples)]
        metrics: dict[str, Any] = {
            "accuracy": sum(scores) / len(scores),
            **self._engine_stats(llm, cell.config is not None),
            "rows": len(samples),
            "output_tokens": sum(len(o.token_ids) for o in outputs),
            "prompt_tokens": sum(len(i) for i in ids) / len(ids),
            "examples": [
                {"index": s.index, "answer": list(s.outputs), "prediction": _cut(t), "score": sc}
                for s, t, sc in list(zip(samples, texts, scores))[: wl.examples]
            ],
        }
        return metrics

    def dense_config(self) -> SparseConfig:
        return load_config({**DENSE_CONFIG, "backend": self.dense_backend})

    @staticmethod
    def _engine_stats(llm: Any, sparse: bool) -> dict[str, Any]:
        """What the engine's store and coordinator counted in the cell: device-buffer hit rate
        and host→device KiB per output token (store counters; None where the store keeps
        none or saw no lookup), sparse share of the decode layer-steps (sparse cells only),
        and ms per output token over the decode-only steps (steps that also prefilled are
        left out: their time is the prompt's)."""
        engine = llm.engine
        coord = engine.runner.coord
        per_layer = coord.store.stats() if callable(getattr(coord.store, "stats", None)) else []
        hits = sum(int(s.get("hits", 0)) for s in per_layer)
        misses = sum(int(s.get("misses", 0)) for s in per_layer)
        bytes_in = sum(int(s.get("bytes_in", 0)) for s in per_layer)
        decode = [(rows, seconds) for rows, prefill, _, seconds in engine.step_log if rows and not prefill]
        decode_rows = sum(rows for rows, *_ in engine.step_log)  # every decode row swaps in (mixed steps too)
        out: dict[str, Any] = {
            "hit_rate": hits / (hits + misses) if per_layer and hits + misses else None,
            "moved_kib_per_token": bytes_in / 1024 / decode_rows if per_layer and decode_rows else None,
            "sparse_fraction": coord.dense_tally.sparse_fraction if sparse else None,
            "ms_per_token": 1000 * sum(s for _, s in decode) / sum(r for r, _ in decode) if decode else None,
        }
        if not sparse:  # dense: nothing is fetched, every token is on the device
            out["moved_kib_per_token"] = 0.0
        return out


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 1] + "…"
