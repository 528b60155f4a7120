"""`SparseConfig`: the one JSON object that configures an experiment, and its parsing.

    {"algorithm": "quest", "backend": "auto", "top_k": 2048, "page_size": 16,
     "extra": {...the algorithm's own options, validated by its pydantic Config...}}

It comes from a JSON string, a JSON file path, a dict, or Python. Parsing resolves the named
plugins through the registry, so an unknown algorithm or backend, an option the algorithm
does not declare, or a combination a kernel cannot serve is rejected here, with one message
naming the field, the bad value and what is allowed — never later, at step time.
"""

from __future__ import annotations

import json
import warnings
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from . import registry
from .common.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from .adaptors.base import BackendAdaptor
    from .algorithms.base import SparseAlgorithm
    from .backends.base import AttentionBackend
    from .common.layout import KVLayout

DENSE_CONFIG: dict[str, Any] = {"algorithm": "quest", "store": "resident", "sparse_policy": "always",
                                "min_sparse_prompt_len": 10**9}
"""A config under which every request decodes densely, every token resident on the device: the
dense baseline of evaluations and benchmarks. Every request is "short" under the static rule;
sparse_policy "always" is what makes min_sparse_prompt_len count (the default cost policy does
not consult it, so `{"min_sparse_prompt_len": 10**9}` alone still decodes long contexts sparsely)."""

AUTO_BACKENDS = {"cuda": ("triton", "flashmla", "torch_ref"), "cpu": ("torch_ref",)}
"""backend "auto": the first of these that is installed and serves the layout, per device type
(the Triton split-K kernel on CUDA: measured faster than flash-attn's paged decode over a page
table, docs/backends.md; FlashMLA for the fp8 MLA rows Triton does not read)."""


class SparseConfig(BaseModel):
    """Framework-level options; algorithm-specific ones live in `extra`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: str = Field("quest", description="registered algorithm name (`sparse-framework plugins`)")
    backend: str = Field(
        "auto", description="registered attention backend name, or auto: the fastest installed one for the "
        "device (triton on CUDA, torch_ref on the CPU), resolved when the layout is known and reported"
    )
    store: Literal["hierarchical", "resident", "hybrid"] = Field(
        "resident",
        description="resident: every token on the device (the fastest while everything fits); hybrid: the "
        "resident store until the device pool runs short, then running requests spill to the host tier "
        "(pressure only); hierarchical: full KV on the host, a fixed device buffer per request (more long "
        "requests per GPU, slower per step), docs/kv_store.md",
    )
    adaptor: str | None = Field(
        None, description="metadata adaptor; default: the one the backend consumes"
    )
    top_k: int = Field(2048, ge=1, description="retrieved tokens per selection (pages: top_k // page_size)")
    page_size: int = Field(
        16, ge=1, description="tokens per page (page-granular algorithms, paged KV); a power of two"
    )
    device_buffer_tokens: int = Field(
        4096, ge=1, description="device slots per request and layer in hierarchical mode "
        "(rounded up to whole pages)"
    )
    sink_tokens: int = Field(16, ge=0, description="first tokens of every sequence, always selected")
    recent_tokens: int = Field(64, ge=0, description="last tokens of every sequence, always selected")
    min_sparse_prompt_len: int = Field(
        2048, ge=0, description="prompts shorter than this decode densely (sparse_policy 'always')"
    )
    sparse_policy: Literal["always", "cost"] = Field(
        "cost",
        description="always: sparse wherever min_sparse_prompt_len allows; cost: sparse only where the cost "
        "model says it reads less than dense, min_sparse_prompt_len not consulted: per request at admission "
        "(hierarchical store: a dense one stays whole on the device), per decode step for the resident "
        "store (docs/engine.md, 'Sparse only when it pays')",
    )
    policy_hbm_tb_s: float | None = Field(
        None, gt=0, description="cost policy: HBM bandwidth, TB/s, at which a step's K/V and "
        "representation bytes are read; default: the GPU's measured ceiling (common/hardware.py)",
    )
    policy_overhead_us: float | None = Field(
        None, ge=0, description="cost policy: fixed µs of one sparse layer-step at batch 1 (scoring, "
        "top-k, residency, launches); default: the GPU's fit (benchmarks/sparse_policy_fit.py)",
    )
    policy_overhead_growth_us: float | None = Field(
        None, ge=0, description="cost policy: µs the sparse layer-step's overhead grows "
        "per further request selecting in the same step; default: the GPU's fit",
    )
    dense_layers: list[int] = Field(
        default_factory=list, description="layer indices that always attend densely"
    )
    host_kv_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="dtype of the hierarchical store's host tier. auto: the layout's (the device buffer's); "
        "fp8_e4m3: K and V rows as float8_e4m3fn with a power-of-two scale per token and KV head "
        "(absmax / 448, one exponent byte), dequantised to the layout's dtype when copied into the device "
        "buffer: about half the host bytes of bf16 (head_dim 128: 0.504x), so about twice the requests the "
        "host bounds; attention reads the fp8 round trip of every token that came back from the host. MHA/GQA "
        "layouts in a non-fp8 dtype only (refused: the resident store, MLA and fp8 layouts)",
    )
    prefetch: Literal["off", "early_query"] = Field(
        "off",
        description="hierarchical store: early_query predicts each sparse layer's selection one layer ahead "
        "(the next layer's query computed from the residual stream entering this layer, scored against the next "
        "layer's representations) and swaps its missing rows in on a side stream while this layer computes; the "
        "layer's own selection is unchanged and copies what the prediction missed (docs/engine.md, 'Prefetch'). "
        "Llama-family models of this engine; algorithms without decode inputs",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="the algorithm's own options (see its schema)"
    )

    _extra_model: BaseModel | None = PrivateAttr(default=None)

    @field_validator("dense_layers")
    @classmethod
    def _unique_layers(cls, layers: list[int]) -> list[int]:
        if any(layer < 0 for layer in layers):
            raise ValueError(f"layer indices must be >= 0, got {layers}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layer indices must be unique, got {layers}")
        return sorted(layers)

    @field_validator("host_kv_dtype")
    @classmethod
    def _host_tier(cls, host_kv_dtype: str, info: Any) -> str:
        # the resident store has no host tier to shrink (the layout's checks are the store's)
        if host_kv_dtype != "auto" and info.data.get("store") == "resident":
            raise ValueError("the resident store keeps no host tier; use store 'hierarchical' or host_kv_dtype 'auto'")
        return host_kv_dtype

    @field_validator("prefetch")
    @classmethod
    def _prefetch_needs_a_host_tier(cls, prefetch: str, info: Any) -> str:
        if prefetch != "off" and info.data.get("store") == "resident":
            raise ValueError("the resident store has every token on the device, nothing to prefetch; use store "
                             "'hierarchical' or prefetch 'off'")
        return prefetch

    @field_validator("page_size")
    @classmethod
    def _power_of_two(cls, page_size: int) -> int:
        # the kernels, adaptors and backends are tested with power-of-two pages only (FlashMLA
        # and FlashAttention page sizes are powers of two); other sizes are refused here rather
        # than half supported
        if page_size >= 1 and page_size & (page_size - 1):
            low = 1 << (page_size.bit_length() - 1)
            raise ValueError(f"page_size must be a power of two (1, 2, 4, 8, 16, ...), e.g. {low} or {2 * low}")
        return page_size

    @field_validator("algorithm", "backend", "adaptor")
    @classmethod
    def _registered(cls, name: str | None, info: Any) -> str | None:
        if name is None or (info.field_name == "backend" and name == "auto"):
            return name
        try:
            registry.load(info.field_name, name)
        except PluginError as exc:
            raise ValueError(str(exc)) from None
        return name

    def _warn_unconsulted_threshold(self) -> None:
        """A min_sparse_prompt_len set to anything but 0 or its default under the cost policy is
        not consulted: say so, since a config such as {"min_sparse_prompt_len": 10**9} reads as
        "dense" but decodes long contexts sparsely (a dense baseline went sparse that way)."""
        default = type(self).model_fields["min_sparse_prompt_len"].default
        if self.sparse_policy == "cost" and self.min_sparse_prompt_len not in (0, default):
            warnings.warn(
                f"min_sparse_prompt_len ({self.min_sparse_prompt_len}) is not consulted under sparse_policy "
                "'cost' (the default), which decides dense or sparse by its cost model; set sparse_policy "
                "'always' for the static rule (sparse_framework.config.DENSE_CONFIG decodes everything densely)",
                UserWarning, stacklevel=2)

    @model_validator(mode="after")
    def _check_plugins(self) -> SparseConfig:
        algo = self.algorithm_class
        try:
            self._extra_model = algo.Config.model_validate(self.extra)
        except ValidationError as exc:
            raise ValueError(
                f"invalid extra-config for algorithm {self.algorithm!r}: "
                + "; ".join(describe_errors(exc, algo.Config, prefix="extra"))
            ) from None
        self._check_top_k(algo)
        algo.check_config(self)
        self.adaptor_class.check_config(self)
        self._warn_unconsulted_threshold()
        if self.backend == "auto":
            return self  # the adaptor is checked against the backend `resolved` picks
        backend = self.backend_class
        if self.adaptor_name not in backend.metadata_formats:
            allowed = ", ".join(repr(f) for f in backend.metadata_formats)
            raise ValueError(
                f"backend {self.backend!r} consumes {allowed} metadata, "
                f"but adaptor {self.adaptor_name!r} was chosen; leave `adaptor` unset or "
                f"set it to one of {allowed}"
            )
        return self

    def _check_top_k(self, algo: type[SparseAlgorithm]) -> None:
        """top_k refused in its own terms: above MAX_CONTEXT_TOKENS it can never be used;
        otherwise when its selection (sink + top_k + recent, as the base class counts it)
        does not fit the device buffer, with the largest top_k that does — the algorithm's own
        check named only the buffer ("raise device_buffer_tokens to at least 1000000000096"
        for a top_k of 1e12). What an algorithm adds on top (SnapKV's tail) is left to its own
        check. A selection never holds more tokens than the context, so a top_k above
        max_model_len buys nothing."""
        from .algorithms.base import SparseAlgorithm

        buffer = self.device_buffer_tokens
        need = algo.max_selected_tokens(self)
        base_need = SparseAlgorithm.max_selected_tokens.__func__(algo, self)  # type: ignore[attr-defined]
        too_wide = need > buffer and base_need > buffer
        fits = _largest_fitting_top_k(self, algo) if too_wide else None
        lower = (f"lower top_k to at most {fits} (what device_buffer_tokens ({buffer}) holds)" if fits
                 else f"lower sink_tokens and recent_tokens (they alone fill device_buffer_tokens ({buffer}))")
        if self.top_k > MAX_CONTEXT_TOKENS:
            raise ValueError(
                f"`top_k` = {self.top_k} can never be used: a selection never holds more tokens than the context, "
                f"and no context is longer than {MAX_CONTEXT_TOKENS} tokens (int32 positions); give a top_k below "
                "your max_model_len" + (f": {lower}" if too_wide else ""))
        if too_wide:
            raise ValueError(
                f"`top_k` = {self.top_k} (with sink_tokens {self.sink_tokens} and recent_tokens {self.recent_tokens}: "
                f"up to {need} tokens per request and layer) does not fit the device buffer: {lower}, or raise "
                f"device_buffer_tokens to at least {need} (a top_k above your "
                "max_model_len buys nothing: a selection never holds more tokens than the context)"
            )

    # -- resolved plugins --------------------------------------------------------------
    def resolved(self, where: KVLayout | str | torch.device) -> SparseConfig:
        """This config with `backend` "auto" replaced by the backend it picks for a layout (or
        a device): the first of AUTO_BACKENDS[device type] that is installed, consumes the
        adaptor's metadata and serves the layout. Raises ConfigError saying why none did."""
        if self.backend != "auto":
            return self
        from .common.layout import KVLayout

        layout = where if isinstance(where, KVLayout) else None
        device_type = torch.device(layout.device if layout is not None else where).type
        why = []
        for name in AUTO_BACKENDS.get(device_type, AUTO_BACKENDS["cpu"]):
            try:
                cls = registry.load("backend", name)
                if self.adaptor is not None and self.adaptor not in cls.metadata_formats:
                    raise ConfigError(f"does not consume adaptor {self.adaptor!r}'s metadata")
                if layout is not None:
                    cls.check_layout(layout)
            except (ConfigError, PluginError) as exc:
                why.append(f"{name!r} {exc}")
                continue
            return self.model_copy(update={"backend": name})
        raise ConfigError(f"backend 'auto' found no backend for device {device_type!r}: " + "; ".join(why))

    def key(self) -> dict[str, Any]:
        """Every option spelt out, the algorithm's extra-config with its defaults filled in:
        what stored results are keyed by, so that a default changed later never changes what
        a stored cell means (resolve "auto" first: `resolved`)."""
        return {**self.model_dump(), "extra": self.extra_config.model_dump()}

    @property
    def algorithm_class(self) -> type[SparseAlgorithm]:
        return registry.load("algorithm", self.algorithm)

    @property
    def backend_class(self) -> type[AttentionBackend]:
        if self.backend == "auto":
            # a report or check before a layout is known: the choice on this machine
            return self.resolved("cuda" if torch.cuda.is_available() else "cpu").backend_class
        return registry.load("backend", self.backend)

    @property
    def adaptor_name(self) -> str:
        return self.adaptor or self.backend_class.metadata_formats[0]

    @property
    def adaptor_class(self) -> type[BackendAdaptor]:
        return registry.load("adaptor", self.adaptor_name)

    @property
    def extra_config(self) -> BaseModel:
        """`extra` parsed by the algorithm's Config model (defaults filled in)."""
        assert self._extra_model is not None  # set by the validator; never None after construction
        return self._extra_model


MAX_CONTEXT_TOKENS = 2**31 - 1  # positions and selections are int32: no context is longer


def _largest_fitting_top_k(config: SparseConfig, algo: type[SparseAlgorithm]) -> int | None:
    """The largest top_k whose selection fits config's device buffer (None: not even 1)."""
    def fits(top_k: int) -> bool:
        return algo.max_selected_tokens(config.model_copy(update={"top_k": top_k})) <= config.device_buffer_tokens

    lo, hi = 0, config.top_k  # fits(lo) (or lo == 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    unit = config.page_size if algo.granularity == "page" else 1
    return (lo - lo % unit) or None  # whole pages: 4000, not the equivalent 4015


def describe_errors(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> list[str]:
    """One readable line per pydantic error: field, bad value, what is allowed."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        field = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(model.model_fields) or "none"
            lines.append(f"`{field}`: unknown option; allowed options: {allowed}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if field:
            lines.append(f"`{field}` = {err['input']!r}: {msg}")
        else:
            lines.append(msg)
    return lines


def load_config(source: SparseConfig | dict[str, Any] | str | PathLike[str]) -> SparseConfig:
    """Parse a config from a SparseConfig, a dict, a JSON string, or a JSON file path.

    Raises ConfigError with one line per problem.
    """
    if isinstance(source, SparseConfig):
        return source
    data = read_json_object(source, "config") if isinstance(source, (str, PathLike)) else source
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
    return validate(SparseConfig, data, "sparse config")


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], data: Any, what: str) -> M:
    """`model.model_validate(data)`, with every problem in one ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid {what}:\n  " + "\n  ".join(describe_errors(exc, model))) from None


def read_json_object(source: str | PathLike[str], what: str) -> Any:
    """The JSON value of a string that holds an object, or of a file path."""
    text = str(source)
    where = f"{what} JSON string"
    if text.lstrip()[:1] in ("[", '"') or text.strip().lstrip("-").isdigit():
        raise ConfigError(f"{what} must be a JSON object ({{...}}), got {text.strip()[:40]!r}")
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if path.is_dir():
            raise ConfigError(f"{what} {text!r} is a directory; give a JSON file or a JSON object ({{...}})")
        if not path.is_file():
            raise ConfigError(f"{what} {text!r} is neither a JSON object nor an existing file")
        where = f"{what} file {str(path)!r}"
        text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc}") from None


def _loads(kind: str, name: str) -> bool:
    try:
        registry.load(kind, name)
    except PluginError:
        return False
    return True


def config_schema(distribution: str | None = None) -> dict[str, Any]:
    """JSON Schema of SparseConfig with each loadable algorithm's extra-config under `$defs`,
    tied to its algorithm name by if/then.

    `distribution` limits the algorithms and backends to those one distribution registers
    ("sparse-decode-framework": the built-ins; see `registry.names`)."""
    schema = SparseConfig.model_json_schema()
    defs = schema.setdefault("$defs", {})
    rules = []
    usable = []
    for name in registry.names("algorithm", distribution):
        try:
            algo = registry.load("algorithm", name)
        except PluginError:
            continue  # listed with its error by `sparse-framework plugins`
        usable.append(name)
        key = f"extra_{name}"
        defs[key] = algo.Config.model_json_schema(ref_template="#/$defs/" + key + "_{model}")
        for sub, sub_schema in defs[key].pop("$defs", {}).items():
            defs[f"{key}_{sub}"] = sub_schema
        rules.append(
            {
                "if": {"properties": {"algorithm": {"const": name}}},
                "then": {"properties": {"extra": {"$ref": f"#/$defs/{key}"}}},
            }
        )
    if rules:
        schema["allOf"] = rules
    schema["properties"]["algorithm"]["enum"] = usable
    schema["properties"]["backend"]["enum"] = ["auto"] + [
        n for n in registry.names("backend", distribution) if _loads("backend", n)]
    return schema


def dense_layer_set(config: SparseConfig, layers: int | KVLayout) -> frozenset[int]:
    """Every store layer that attends densely: `config.dense_layers` (store layers) and the
    algorithm's own rule, which speaks of the network's layers (Quest's first N). `layers`: a
    layer count (store layers are the model's), or the store's layout, whose `model_layers`
    (store layer i is model layer model_layers[i]) maps the rule, so on Gemma 3 (full layers 5,
    11, 17) Quest's first two layers are sliding ones and every full layer is sparse."""
    num_layers = layers if isinstance(layers, int) else layers.num_layers
    model_layers = None if isinstance(layers, int) else layers.model_layers
    ids = tuple(range(num_layers)) if model_layers is None else model_layers
    named = config.algorithm_class.own_dense_layers(config, max(ids, default=-1) + 1)
    own = {i for i, layer in enumerate(ids) if layer in named}
    return frozenset(layer for layer in {*config.dense_layers, *own} if layer < num_layers)
