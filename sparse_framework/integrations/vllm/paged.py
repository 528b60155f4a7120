"""The vLLM plugin's core over a paged KV cache, in plain torch (no vLLM import).

vLLM keeps every layer's K/V in physical blocks of `block_size` tokens; request i's logical
block j is physical block `block_table[i, j]`. Here a selection page is one vLLM block, so
an algorithm's representation lives per physical block (a side tensor indexed by block id)
and is written whenever vLLM writes K into a block. Blocks that vLLM's prefix cache shares
between requests share their representation too, at no cost.

    write(state, slot_mapping, keys)            every K write (prefill and decode), no host sync
    decode_rows(query_start_loc, seq_lens, ...) once per step: which rows decode sparsely
    select(state, q, block_table, seq_lens)     decode: a Selection of logical tokens, whole
                                                blocks, per request and KV head
    folded_page_table(selection, block_table)   the Selection as a block table over the KV
                                                cache folded to one KV head per page (the
                                                FlashAttention adaptor's page-table rewrite)
    attend_reference(q, k_cache, v_cache, md)   attention over that table in torch (the
                                                project's torch_ref backend): the reference
                                                the vLLM kernel path is tested against

The config comes from `SPARSE_FRAMEWORK_VLLM_CONFIG` (`load_vllm_config`): the same JSON
object as everywhere else, with defaults for what vLLM decides (page = block, resident).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ...adaptors.flash_attention import FlashAttentionAdaptor, FlashAttentionMetadata
from ...backends.torch_ref import TorchRefBackend
from ...common.batch import Selection
from ...common.errors import ConfigError
from ...common.layout import resolve_impl
from ...config import MAX_CONTEXT_TOKENS, SparseConfig, dense_layer_set, load_config, read_json_object
from ...kernels.reference.scores import quest_paged_scores_torch
# the twins' base, below this module (paged_base.py); `paged.PagedAlgorithm` is that class
from .paged_base import CONFIG_ENV, PagedAlgorithm, PagedState, _block_rows, representation_dtype

IGNORED_FIELDS = ("backend", "adaptor", "device_buffer_tokens")
"""Fields of the shared config that vLLM decides instead: attention runs in vLLM's own kernel
over a rewritten block table, and every token stays resident (no device buffer)."""


def config_source(environ: dict[str, str] | None = None) -> str | None:
    """The plugin's config text from the environment (None when unset or blank)."""
    value = (os.environ if environ is None else environ).get(CONFIG_ENV, "")
    return value if value.strip() else None


def load_vllm_config(source: str | dict[str, Any], block_size: int | None = None) -> SparseConfig:
    """Parse the plugin's config (a JSON object, a JSON file path or a dict) with vLLM's
    defaults, or raise ConfigError naming `SPARSE_FRAMEWORK_VLLM_CONFIG`, the field and the
    values it may take.

    Inside vLLM: `store` is "resident" (every token stays in vLLM's paged cache; the host tier
    would need vLLM's KV-cache manager patched, so "hierarchical" is refused when named);
    `page_size` defaults to vLLM's block size and must equal it when given (block_size None:
    not known yet, any power of two is accepted), and `top_k` is at least one block;
    `device_buffer_tokens` is not used (set large so that a top_k up to the context passes the
    shared validation); `backend` and `adaptor` are not used (vLLM's own kernel attends).

    The checks against the block size run twice: in vLLM's front-end process as soon as its
    engine config is made, before any worker starts or weights load (`check_engine_config`,
    hooked in by `register()`), and in each worker when the attention layers are built."""
    try:
        data = dict(read_json_object(source, "config")) if isinstance(source, str) else dict(source)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{CONFIG_ENV}: {exc}") from None
    if data.get("store", "resident") != "resident":
        raise ConfigError(
            f"{CONFIG_ENV}: `store` = {data['store']!r} is not supported inside vLLM: vLLM's KV-cache manager keeps "
            "every token in its paged cache, and a host tier would need that manager patched; use \"resident\" "
            "(or leave `store` out)"
        )
    data["store"] = "resident"
    if block_size is not None:
        given = data.setdefault("page_size", block_size)
        if given != block_size:
            raise ConfigError(page_size_error(given, block_size))
        top_k = data.get("top_k")
        if isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k < block_size:
            raise ConfigError(top_k_error(top_k, block_size))
    data.setdefault("device_buffer_tokens", MAX_CONTEXT_TOKENS)
    try:
        config = load_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{CONFIG_ENV}: {exc}") from None
    if block_size is not None and config.top_k < block_size:  # the default top_k, a token-granular algorithm's
        raise ConfigError(top_k_error(config.top_k, block_size))
    _, reason = _twin(config)
    if reason is not None:
        raise ConfigError(
            f"{CONFIG_ENV}: {reason}. Algorithms with a twin (entry-point group sparse_framework.vllm): "
            f"{', '.join(paged_names())}; any other ScoringAlgorithm that needs no prompt queries runs through the "
            "rebuild bridge (paged_bridge.py)"
        )
    return config


def page_size_error(given: Any, block_size: int) -> str:
    """`page_size` differs from vLLM's KV block size: what may be set instead."""
    restart = ""
    if isinstance(given, int) and not isinstance(given, bool) and given > 0 and given & (given - 1) == 0:
        restart = (f", or keep {given} and start vLLM with --block-size {given} (`LLM(block_size={given})`; "
                   "vLLM's CPU kernel takes multiples of 32, FlashAttention multiples of 16)")
    return (f"{CONFIG_ENV}: `page_size` = {given!r} differs from vLLM's KV block size ({block_size}); inside vLLM a "
            f"page is one block. Allowed: \"page_size\": {block_size}, or leave `page_size` out (it defaults to the "
            f"block size){restart}")


def top_k_error(top_k: int, block_size: int) -> str:
    """`top_k` below one KV block: what may be set instead."""
    return (f"{CONFIG_ENV}: `top_k` = {top_k} is less than one KV block ({block_size} tokens): inside vLLM a "
            f"selection is whole blocks, top_k // {block_size} of them besides the sink, recent and newest ones. "
            f"Allowed: `top_k` >= {block_size} (vLLM's block size), or a smaller --block-size")


def engine_block_size(vllm_config: Any, platform_is_cpu: bool) -> int | None:
    """The KV block size vLLM's workers will use, read from its engine config in the front-end
    process (`VllmConfig`, after the platform's `check_and_update_config`), or None where that
    process cannot know it yet. The CPU platform settles it there (the user's --block-size, or
    its default of 128); on CUDA a block size the user did not give is chosen in the worker by
    the attention backend (`update_block_size_for_backend`), and a hybrid (attention + mamba)
    model's is aligned there on any platform. Duck-typed: reads `cache_config.block_size`,
    `cache_config.user_specified_block_size` and `model_config.is_hybrid` only."""
    cache = getattr(vllm_config, "cache_config", None)
    block_size = getattr(cache, "block_size", None)
    if not isinstance(block_size, int) or block_size < 1:
        return None
    model = getattr(vllm_config, "model_config", None)
    if model is not None and bool(getattr(model, "is_hybrid", False)):
        return None
    if not platform_is_cpu and not getattr(cache, "user_specified_block_size", False):
        return None
    return block_size


@dataclass
class BlockBounds(PagedState):
    """Quest's page bounds per physical block: the element-wise min and max key of the tokens
    written to each block, [num_blocks + 1, num_kv_heads, head_dim] in the key dtype (+inf /
    -inf for blocks never written)."""

    page_min: torch.Tensor
    page_max: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.page_min.shape[0] - 1

    @property
    def dtype(self) -> torch.dtype:
        return self.page_min.dtype


class PagedQuest(PagedAlgorithm):
    """Quest (algorithms/quest.py) with page = vLLM block and its bounds kept per physical block.

    The selection equals `Quest`'s over the same logical sequence: the same bounds (min and max
    are exact, whichever order the keys come in), the same scoring kernel and options
    (`gqa_reduce`, `range_weight`, `min_pages`, `newest_in_top_k`, `impl`) and the same
    top-k with the sink, recent and newest pages forced in (`topk_selection`)."""

    @classmethod
    def blocks_of_budget(cls, config: SparseConfig) -> int:
        return config.algorithm_class.budget_units(config)  # Quest's (min_pages)

    def new_state(
        self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> BlockBounds:
        """Empty bounds for a KV cache of `num_blocks` blocks."""
        dtype = representation_dtype(dtype)
        shape = (num_blocks + 1, num_kv_heads, head_dim)  # + the sink row
        return BlockBounds(
            block_size=self.unit,
            page_min=torch.full(shape, float("inf"), dtype=dtype, device=device),
            page_max=torch.full(shape, float("-inf"), dtype=dtype, device=device),
        )

    def write(self, state: BlockBounds, slot_mapping: torch.Tensor, keys: torch.Tensor) -> None:
        """Fold keys [T, Hkv, D] written at physical slots `slot_mapping` (int [>= T'], slot =
        block * block_size + offset; negative = padding, skipped; rows past T' ignored) into
        their blocks' bounds. A write at offset 0 starts the block afresh: vLLM fills a block
        from offset 0, so a reused block id forgets what it held before.

        No host sync (it runs for every layer of every step): padding slots and blocks that
        are not restarted are routed to the sink row instead of being filtered out."""
        n = min(slot_mapping.shape[0], keys.shape[0])
        if n == 0:
            return
        sink = state.num_blocks
        blocks, offsets, keep = _block_rows(slot_mapping, n, state.block_size, sink, state.page_min.device)
        restart = torch.where(keep & (offsets == 0), blocks, sink)
        state.page_min.index_fill_(0, restart, float("inf"))
        state.page_max.index_fill_(0, restart, float("-inf"))
        index = blocks.view(-1, 1, 1).expand(n, *keys.shape[1:])
        rows = keys[:n].to(state.page_min.dtype)
        state.page_min.scatter_reduce_(0, index, rows, "amin", include_self=True)
        state.page_max.scatter_reduce_(0, index, rows, "amax", include_self=True)

    def score(
        self, state: BlockBounds, q: torch.Tensor, block_table: torch.Tensor, n_blocks: int,
        seq_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 [B, Hkv, n_blocks]: Quest's bound of each logical block of each request
        (the bounds need no lengths).
        q [B, Hq, D]; block_table int [B, >= n_blocks] (entries past a request's blocks are
        read, clamped into range, and ignored by the top-k). On CUDA one Triton kernel reads
        the bounds through the table (`kernels/paged_scores.py`), no gathered copy."""
        args = (q, state.page_min, state.page_max, block_table, n_blocks, self.options.gqa_reduce,
                self.options.range_weight)
        if resolve_impl(self.impl, q.device) == "triton":
            from ...kernels.paged_scores import quest_paged_scores_triton

            return quest_paged_scores_triton(*args)
        return quest_paged_scores_torch(*args)


def _twin(config: SparseConfig) -> tuple[type[PagedAlgorithm] | None, str | None]:
    """(the twin, None), or (None, why not). A twin registered under the algorithm's name
    decides alone (it wins over the bridge, and its refusal stands); without one the rebuild
    bridge (`paged_bridge.PagedBridge`) runs the algorithm itself unless it refuses."""
    from ... import registry
    from ...common.errors import PluginError
    from .paged_bridge import PagedBridge

    try:
        cls = registry.load("vllm", config.algorithm)
    except PluginError as exc:
        if config.algorithm.rpartition(":")[2] in registry.names("vllm"):  # registered, but broken
            return None, f"`algorithm` = {config.algorithm!r}: its twin inside vLLM does not load ({exc})"
        reason = PagedBridge.refuses(config)
        if reason:
            return None, (f"`algorithm` = {config.algorithm!r} has no twin inside vLLM, and the rebuild bridge cannot "
                          f"run it: {reason}")
        return PagedBridge, None
    reason = cls.refuses(config)
    return (None, reason) if reason else (cls, None)


def paged_algorithm_class(config: SparseConfig) -> type[PagedAlgorithm] | None:
    """The config's algorithm's twin inside vLLM, registered under the algorithm's name in the
    `sparse_framework.vllm` entry-point group (`registry`: a third party registers its own
    beside its algorithm), if it takes this config (`PagedAlgorithm.refuses`); without one, the
    rebuild bridge (`paged_bridge.PagedBridge`: the unchanged algorithm over every key, rebuilt
    each step) if it takes the config; None otherwise. Built in: Quest's bounds (`PagedQuest`)
    and DSA over the real keys (`paged_keys.PagedKeyMass`)."""
    return _twin(config)[0]


def paged_names() -> list[str]:
    """The algorithms that have a registered twin inside vLLM (for error messages; any other
    `ScoringAlgorithm` that needs no prompt queries runs through the rebuild bridge)."""
    from ... import registry

    return registry.names("vllm")


def graph_safe(config: SparseConfig) -> bool:
    """Whether the config's twin may be captured in a full CUDA graph (`PagedAlgorithm.graph_safe`)."""
    cls = paged_algorithm_class(config)
    return cls is not None and cls.graph_safe


def paged_algorithm(config: SparseConfig) -> PagedAlgorithm:
    """The paged implementation of the config's algorithm (checked by `load_vllm_config`)."""
    cls = paged_algorithm_class(config)
    assert cls is not None, config.algorithm
    return cls(config)


def sparse_layers(config: SparseConfig, num_layers: int) -> frozenset[int]:
    """Model layers that decode sparsely: all but `dense_layers` and the algorithm's own
    (Quest: `dense_first_layers`)."""
    return frozenset(range(num_layers)) - dense_layer_set(config, num_layers)


@dataclass
class DecodeRows:
    """One step's rows that may decode sparsely, planned once per step on the host.

    rows: int64 [n] request rows (one query token, context >= `min_sparse_prompt_len`) and
    tokens: int64 [n] their query tokens, both on the device; count n; decode_rows: every
    row with one query token; max_seq_len: an upper bound of those rows' contexts (sizes
    the scores without a host sync).

    static: a uniform decode batch (one query token per row) whose rows are all taken, in
    order, with shapes from the metadata alone (`PagedAlgorithm.select_static`): what a full CUDA
    graph can capture and replay. rows and tokens are then None, count = decode_rows = the
    batch's rows and max_seq_len unused (0)."""

    rows: torch.Tensor | None
    tokens: torch.Tensor | None
    count: int
    decode_rows: int
    max_seq_len: int
    static: bool = False

    @classmethod
    def uniform(cls, num_reqs: int) -> "DecodeRows":
        """Every row of a uniform single-token decode batch, for the static path."""
        return cls(rows=None, tokens=None, count=num_reqs, decode_rows=num_reqs, max_seq_len=0, static=True)


def decode_rows(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor | None,
    min_len: int,
    device: torch.device | str,
    max_seq_len: int | None = None,
) -> DecodeRows:
    """Plan which rows decode sparsely from host tensors: query_start_loc int [R + 1] (CPU),
    seq_lens int [>= R] (CPU; None when not known on the host: every one-token row is
    taken, which needs min_len <= 1, and max_seq_len bounds them). The row and token indices
    are copied to `device` once per step, not per layer."""
    starts = query_start_loc.to("cpu", torch.long)
    num_reqs = starts.shape[0] - 1
    one_token = starts[1:] - starts[:-1] == 1
    decode = int(one_token.sum())
    if seq_lens is None:
        if min_len > 1 or max_seq_len is None:
            raise ValueError("decode_rows: without seq_lens on the host, min_len must be <= 1 and max_seq_len given")
        take = one_token
        bound = max_seq_len
    else:
        lens = seq_lens[:num_reqs].to("cpu", torch.long)
        take = one_token & (lens >= max(min_len, 1))
        bound = int(lens[take].max()) if bool(take.any()) else 0
    rows = take.nonzero().view(-1)
    tokens = starts[:-1][rows]
    if torch.device(device).type == "cuda":  # pinned, so that the copies do not wait for the device
        rows, tokens = rows.pin_memory(), tokens.pin_memory()
    return DecodeRows(
        rows=rows.to(device, non_blocking=True),
        tokens=tokens.to(device, non_blocking=True),
        count=int(rows.numel()),
        decode_rows=decode,
        max_seq_len=bound,
    )


def folded_page_table(
    selection: Selection, block_table: torch.Tensor, num_kv_heads: int, block_size: int
) -> FlashAttentionMetadata:
    """A selection of logical tokens (whole blocks) as FlashAttention metadata over the KV
    cache [num_blocks, Hkv, block_size, ...] folded to pages of one KV head,
    [num_blocks * Hkv, block_size, 1, ...], in which block b of head h is page b * Hkv + h.

    Sequence b * Hkv + h is request b's selection for KV head h: page_table int32
    [B * Hkv, W / block_size], cache_seqlens int32 [B * Hkv]. A per-request selection
    (one row) is broadcast to every KV head. Built by the FlashAttention adaptor: the physical
    slot of a selected token is (block * Hkv) * block_size + offset, and with
    num_slots = block_size the adaptor's head-major numbering adds h."""
    idx = selection.indices.long()
    b, h, width = idx.shape
    if h not in (1, num_kv_heads):
        raise ValueError(f"a selection has 1 or num_kv_heads ({num_kv_heads}) rows per request, got {h}")
    lengths = selection.lengths
    if h == 1 and num_kv_heads > 1:
        idx = idx.expand(b, num_kv_heads, width)
        lengths = lengths.expand(b, num_kv_heads)
    valid = idx >= 0
    blocks = block_table.long().gather(1, (idx.clamp(min=0) // block_size).reshape(b, -1)).view(idx.shape)
    slots = torch.where(valid, blocks * num_kv_heads * block_size + idx % block_size, -1).to(torch.int32)
    return FlashAttentionAdaptor().plan(slots, lengths.contiguous(), page_size=block_size, num_slots=block_size)


def attend_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: FlashAttentionMetadata,
    *,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] over `folded_page_table` metadata and a plain paged cache
    k_cache/v_cache [num_blocks, Hkv, block_size, D] (token t of block b and head h at
    [b, h, t]), with the project's `torch_ref` backend (float32 accumulate): [B, Hq, D] in
    q's dtype. vLLM's CPU cache keeps K in an ISA-specific order inside a block, so inside
    vLLM its own kernel reads it (backend.py); this is the reference for plain tensors."""
    nb, hk, bs, d = k_cache.shape
    k = k_cache.reshape(nb * hk, bs, 1, d)
    v = v_cache.reshape(nb * hk, bs, 1, v_cache.shape[-1])
    kwargs = {} if softcap is None else {"softcap": softcap}
    return TorchRefBackend().run(q, k, v, metadata, scale=scale, **kwargs)


@dataclass
class VllmStats:
    """What the plugin did in this process (vLLM's worker: run the engine in-process,
    VLLM_ENABLE_V1_MULTIPROCESSING=0, to read it from the caller).

    forward_calls: attention forwards through the plugin's backend, any layer;
    sparse_calls: those that attended some rows sparsely; dense_calls: the others;
    mixed_calls: sparse calls whose step had other rows too (prefill chunks, dense rows), which
    vLLM's forward attended first;
    sparse_rows / dense_rows: decode rows attended sparsely / densely (prefill rows are not
    counted); selected_tokens / context_tokens: over sparse rows and KV heads, the tokens
    attended and the tokens in context; kv_writes: tokens folded into representations (slots
    passed to the write, padding included).

    sparse_rows, dense_rows, selected_tokens, context_tokens and kv_writes are summed on the
    device (`add_device`), in place, and read when the counters are (`as_dict`): counting
    them per layer would be a host sync each, and a full CUDA graph that captured the
    additions repeats them at every replay. The call counters (forward_calls, sparse_calls,
    dense_calls, mixed_calls) are counted on the host: Python calls, which a graph's replay
    does not make (they count eager calls and captures only)."""

    forward_calls: int = 0
    sparse_calls: int = 0
    dense_calls: int = 0
    mixed_calls: int = 0
    sparse_rows: int = 0
    dense_rows: int = 0
    selected_tokens: int = 0
    context_tokens: int = 0
    kv_writes: int = 0
    _device: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def add_device(self, name: str, value: torch.Tensor | int, device: torch.device | str) -> None:
        """Add a 0-d integer tensor (or an int) to counter `name` on `device`, in place,
        without reading it back. The counter's tensor lives as long as the process (`reset`
        zeroes it), so that a CUDA graph that captured the addition keeps counting."""
        total = self._device.get(name)
        if total is None:
            total = self._device[name] = torch.zeros((), dtype=torch.long, device=device)
        total.add_(value)

    def as_dict(self) -> dict[str, int]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        for name, total in self._device.items():
            out[name] += int(total)
        return out

    def reset(self) -> None:
        for f in fields(self):
            if not f.name.startswith("_"):
                setattr(self, f.name, 0)
        with torch.inference_mode():  # the counters were made inside vLLM's forward: inference tensors
            for total in self._device.values():
                total.zero_()


STATS = VllmStats()
"""This process's counters."""

DIAGNOSTICS: dict[str, Any] = {}
"""What the backend found at its first sparse decode in this process (backend and impl class,
KV-cache shape, strides and dtype, how the cache was folded, the kernel): for a first run on a
new platform, where a wrong assumption shows here before it shows in the tokens."""
