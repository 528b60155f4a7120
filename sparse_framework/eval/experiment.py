"""Experiment files of `sparse-framework eval`: what to sweep, validated, expanded into cells.

An experiment (JSON or TOML) lists algorithms (with their extra-configs), backends, budgets,
contexts and workloads; every combination is one *cell*, and every (workload, context) also
gets a dense baseline cell. A cell's id is a hash of everything that determines its result,
so an interrupted sweep can skip the cells it already finished.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import SparseConfig, load_config, validate
from .workload import DTYPES, WorkloadConfig, check_dtype_name
from ..common.errors import ConfigError
from ..toy_model.tasks import TASKS
from .ruler import RULER_TASKS, check_task

HUGE_BUFFER = 1 << 40  # only to ask an algorithm how wide its largest selection is

# Options every cell starts from (the experiment's `base` overrides them). Prompts of every
# length take the sparse path, or the short contexts of a sweep would silently decode densely.
# every cell measures its algorithm: sparse at every context (the cost policy, the library's default,
# would decode short prompts densely); an experiment's `base` or an entry's `options` may override
DEFAULT_BASE: dict[str, Any] = {"sink_tokens": 16, "recent_tokens": 64, "page_size": 16, "min_sparse_prompt_len": 0,
                                "sparse_policy": "always"}


class AlgorithmEntry(BaseModel):
    """One algorithm setting: its name, extra-config and any other config options."""

    model_config = ConfigDict(extra="forbid")

    algorithm: str = Field(description="registered algorithm name")
    label: str | None = Field(None, description="name in tables and plots (default: the algorithm)")
    extra: dict[str, Any] = Field(default_factory=dict, description="the algorithm's extra-config")
    options: dict[str, Any] = Field(default_factory=dict, description="other SparseConfig fields for this entry")
    as_written: bool = Field(
        False, description="the config exactly as a user writes it ({algorithm, extra, options}): the library's "
        "defaults, not the experiment's base, DEFAULT_BASE or budgets; one cell per workload and context, its "
        "budget 'default' (the 'defaults' row of a table)")

    @property
    def name(self) -> str:
        return self.label or self.algorithm


class ReferenceWorkload(BaseModel):
    """A retrieval task on the shipped reference model (accuracy is measurable)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["reference"]
    task: str = Field(description="one of: " + ", ".join(TASKS))
    sequences: int = Field(2, ge=1, le=64, description="held-out sequences per cell (one batch)")

    @field_validator("task")
    @classmethod
    def _task(cls, task: str) -> str:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        return task

    @property
    def label(self) -> str:
        return f"reference/{self.task}"


class SyntheticWorkload(BaseModel):
    """The engine's synthetic attention workload (random keys with needles; no model)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["synthetic"]
    options: dict[str, Any] = Field(
        default_factory=dict, description="WorkloadConfig fields except contexts, dtype and device"
    )

    @field_validator("options")
    @classmethod
    def _options(cls, options: dict[str, Any]) -> dict[str, Any]:
        for key in ("contexts", "dtype", "device"):
            if key in options:
                raise ValueError(f"{key!r} comes from the experiment, not from the workload's options")
        WorkloadConfig(**options)  # validates the names and values
        return options

    @property
    def label(self) -> str:
        return "synthetic"


class HFWorkload(BaseModel):
    """A user's Hugging Face model (a local directory, or a hub id already in the local cache)
    and a prompts file; the dense model's greedy continuation is decoded with teacher forcing."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["hf"]
    model: str = Field(description="path or cached hub id given to from_pretrained (no download)")
    prompts: str = Field(description="text file, one prompt per line, or JSON lines with a 'prompt' key")
    max_new_tokens: int = Field(16, ge=1, description="decode steps per prompt")
    limit: int | None = Field(None, ge=1, description="use only the first prompts")

    @property
    def label(self) -> str:
        return f"hf/{Path(self.model).name}"


# EngineConfig fields a ruler workload sets through its own keys or that follow from the cell
RULER_ENGINE_OWN = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "seed")


class RulerWorkload(BaseModel):
    """A RULER task (lm-eval's offline generators) answered by a real model through the
    engine: every sample of a cell is one greedy request, scored by string-match-all."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["ruler"]
    task: str = Field(description="one of: " + ", ".join(RULER_TASKS))
    model: str = Field("smollm2-135m-instruct", description="a catalog model name or a local checkpoint directory")
    samples: int = Field(4, ge=1, description="prompts per cell (all submitted at once)")
    max_new_tokens: int | None = Field(None, ge=1, description="answer budget (default: the task's lm-eval max_gen_toks)")
    chat_template: bool = Field(True, description="wrap the prompt in the model's chat template (gen_prefix opens the "
                                "assistant's turn), as lm-eval does for instruct models")
    max_num_seqs: int = Field(16, ge=1, description="requests the engine runs at once (capped at samples)")
    max_num_batched_tokens: int = Field(4096, ge=1, description="tokens per engine step (prefill chunks + decode rows)")
    engine: dict[str, Any] = Field(default_factory=dict, description="other EngineConfig options (e.g. cuda_graphs)")
    examples: int = Field(3, ge=0, description="predictions kept (truncated) in each cell's record")

    @field_validator("task")
    @classmethod
    def _task(cls, task: str) -> str:
        check_task(task)  # a ConfigError is a ValueError: pydantic reports it under the field
        return task

    @field_validator("model")
    @classmethod
    def _model(cls, model: str) -> str:
        from ..engine.models.catalog import CATALOG

        if model not in CATALOG and not Path(model).expanduser().is_dir():
            raise ValueError(f"model must be a catalog model name ({', '.join(CATALOG)}) or a local checkpoint "
                             f"directory, got {model!r}")
        return model

    @field_validator("engine")
    @classmethod
    def _engine(cls, options: dict[str, Any]) -> dict[str, Any]:
        from ..engine.engine_config import EngineConfig

        allowed = [f for f in EngineConfig.__dataclass_fields__ if f not in RULER_ENGINE_OWN]
        for key in options:
            if key in RULER_ENGINE_OWN:
                raise ValueError(f"{key!r} is set by the workload's own key, the cell or the experiment, not in `engine`")
            if key not in allowed:
                raise ValueError(f"unknown engine option {key!r}; allowed: {', '.join(allowed)}")
        try:
            EngineConfig(**options)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return options

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens or RULER_TASKS[self.task].max_new_tokens

    @property
    def label(self) -> str:
        return f"ruler/{self.task}"


Workload = Annotated[Union[ReferenceWorkload, SyntheticWorkload, HFWorkload, RulerWorkload], Field(discriminator="kind")]


class Experiment(BaseModel):
    """The sweep: every algorithm x backend x budget x context x workload, plus dense."""

    model_config = ConfigDict(extra="forbid")

    name: str = "experiment"
    algorithms: list[str | AlgorithmEntry] = Field(min_length=1, description="names or entries")
    backends: list[str] = Field(["torch_ref"], min_length=1, description="attention backends")
    budgets: list[int | str | float] = Field(
        min_length=1, description="top_k per cell: a token count (int) or a fraction of the context ('1/16', 0.0625)"
    )
    contexts: list[int] = Field(min_length=1, description="context lengths in tokens")
    workloads: list[Workload] = Field(min_length=1)
    base: dict[str, Any] = Field(default_factory=dict, description="SparseConfig options shared by every cell")
    device: str = "cpu"
    dtype: str = Field("float32", description="model and KV dtype: " + ", ".join(DTYPES))
    seed: int = 0

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, budgets: list[int | str | float]) -> list[int | str | float]:
        for b in budgets:
            budget_fraction(b)
        return budgets

    @field_validator("contexts")
    @classmethod
    def _contexts(cls, contexts: list[int]) -> list[int]:
        if any(c < 64 for c in contexts):
            raise ValueError(f"every context must be >= 64 tokens, got {contexts}")
        return contexts

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, name: str) -> str:
        return check_dtype_name(name)

    @model_validator(mode="after")
    def _ruler_contexts(self) -> Experiment:
        """A RULER generator cannot fill every length (ruler.RulerTask.min_context): refused
        here rather than failing (or, in lm-eval, looping) in the middle of a sweep."""
        for w in self.workloads:
            if isinstance(w, RulerWorkload):
                need = RULER_TASKS[w.task].min_context
                short = [c for c in self.contexts if c < need]
                if short:
                    raise ValueError(f"contexts {short} are too short for RULER task {w.task!r} (at least {need} tokens)")
        return self

    @property
    def entries(self) -> list[AlgorithmEntry]:
        return [AlgorithmEntry(algorithm=a) if isinstance(a, str) else a for a in self.algorithms]


def budget_fraction(budget: int | str | float) -> Fraction | None:
    """None for an absolute token count, else the fraction of the context (0 < f <= 1)."""
    if isinstance(budget, bool):
        raise ValueError(f"a budget is a token count or a fraction, got {budget!r}")
    if isinstance(budget, int):
        if budget < 1:
            raise ValueError(f"a token budget must be >= 1, got {budget}")
        return None
    try:
        f = Fraction(budget).limit_denominator(1 << 16) if isinstance(budget, float) else Fraction(budget)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"budget {budget!r} is neither a token count nor a fraction like '1/16'") from None
    if not 0 < f <= 1:
        raise ValueError(f"a fractional budget must be in (0, 1], got {budget!r}")
    return f


def top_k_for(budget: int | str | float, context: int, page_size: int) -> int:
    fraction = budget_fraction(budget)
    return int(budget) if fraction is None else max(page_size, round(context * fraction))


@dataclass
class Cell:
    """One measurement. `config` is None for the dense baseline."""

    workload: ReferenceWorkload | SyntheticWorkload | HFWorkload | RulerWorkload
    context: int
    algorithm: str  # label; "dense" for the baseline
    backend: str
    budget: str
    config: SparseConfig | None
    key: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        text = json.dumps(self.key, sort_keys=True, default=str)
        return hashlib.sha1(text.encode()).hexdigest()[:16]


# file suffix -> the format it is parsed as; anything else is refused (never guessed)
EXPERIMENT_FORMATS = {".json": "JSON", ".toml": "TOML"}


def load_experiment(source: str | Path | dict[str, Any]) -> Experiment:
    """An experiment from a dict, a .json or a .toml file; errors name the key."""
    if isinstance(source, dict):
        return validate(Experiment, source, "experiment")
    path = Path(source)
    if path.is_dir():
        raise ConfigError(f"experiment file {str(path)!r} is a directory; give a .json or .toml file")
    if not path.is_file():
        raise ConfigError(f"experiment file {str(path)!r} does not exist")
    fmt = EXPERIMENT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"experiment file {str(path)!r}: unsupported file type {path.suffix or '(none)'!r}; "
            f"allowed: {', '.join(EXPERIMENT_FORMATS)} (convert YAML to JSON or TOML)"
        )
    try:
        data = tomllib.loads(path.read_text()) if fmt == "TOML" else json.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"experiment file {str(path)!r} is not valid {fmt}: {exc}") from None
    return validate(Experiment, data, f"experiment file {str(path)!r}")


def expand(exp: Experiment) -> list[Cell]:
    """Every cell of the sweep, the dense baseline of each (workload, context) first. Invalid
    algorithm settings fail here, before anything runs, naming the entry."""
    cells = []
    for workload in exp.workloads:
        for context in exp.contexts:
            common = {
                "workload": workload.model_dump(), "context": context, "dtype": exp.dtype, "seed": exp.seed,
                "device": exp.device,
            }
            cells.append(Cell(workload, context, "dense", "dense", "all", None, {**common, "dense": True}))
            for entry in exp.entries:
                if entry.as_written:
                    cfg = as_written_config(exp, entry)
                    key = {**common, "config": cfg.key(), "label": entry.name, "budget": AS_WRITTEN}
                    cells.append(Cell(workload, context, entry.name, cfg.backend, AS_WRITTEN, cfg, key))
                    continue
                for backend in exp.backends:
                    for budget in exp.budgets:
                        cfg = cell_config(exp, entry, backend, budget, context)
                        key = {**common, "config": cfg.key(), "label": entry.name, "budget": str(budget)}
                        cells.append(Cell(workload, context, entry.name, backend, str(budget), cfg, key))
    return cells


AS_WRITTEN = "default"  # the budget of an `as_written` entry's cell


def as_written_config(exp: Experiment, entry: AlgorithmEntry) -> SparseConfig:
    """An `as_written` entry's config: the library's defaults, its backend resolved for the device."""
    data: dict[str, Any] = {**entry.options, "algorithm": entry.algorithm}
    if entry.extra:
        data["extra"] = entry.extra
    try:
        return load_config(data).resolved(exp.device)
    except ConfigError as exc:
        raise ConfigError(f"algorithm {entry.name!r} (as written): {exc}") from None


def cell_config(exp: Experiment, entry: AlgorithmEntry, backend: str, budget: int | str | float, context: int) -> SparseConfig:
    """The validated config of one cell. Without an explicit device_buffer_tokens the buffer
    is just large enough for the algorithm's widest selection (whole pages)."""
    data: dict[str, Any] = {**DEFAULT_BASE, **exp.base, **entry.options, "algorithm": entry.algorithm, "backend": backend}
    if entry.extra:
        data["extra"] = entry.extra
    page = int(data.get("page_size", 16))
    data["top_k"] = top_k_for(budget, context, page)
    where = f"algorithm {entry.name!r}, backend {backend!r}, budget {budget!r}, context {context}"
    try:
        if "device_buffer_tokens" not in data:
            probe = load_config({**data, "device_buffer_tokens": HUGE_BUFFER})
            need = probe.algorithm_class.max_selected_tokens(probe)
            data["device_buffer_tokens"] = -(-need // page) * page
        return load_config(data).resolved(exp.device)  # a cell is keyed by the backend it runs
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# The embedded default: a small sweep on the shipped model that a CPU finishes in minutes.
DEFAULT_EXPERIMENT: dict[str, Any] = {
    "name": "default",
    # Quest's recipe keeps its first two layers dense; here every layer of every algorithm is
    # sparse so that the rows compare
    "algorithms": [
        {"algorithm": "quest", "extra": {"dense_first_layers": 0}}, "snapkv", "pqcache",
        {"algorithm": "dsa", "label": "dsa-keys", "extra": {"source": "keys"}},
    ],
    "backends": ["torch_ref"],
    "budgets": ["1/32", "1/8"],
    "contexts": [2048, 4096],
    "workloads": [{"kind": "reference", "task": "mqar", "sequences": 2}],
    "device": "cpu",
}
