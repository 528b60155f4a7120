"""The vLLM plugin's core over a paged KV cache, in plain torch (no vLLM import).

vLLM keeps every layer's K/V in physical blocks of `block_size` tokens; request i's logical
block j is physical block `block_table[i, j]`. Here a selection page is one vLLM block, so
an algorithm's representation lives per physical block (a side tensor indexed by block id)
and is written whenever vLLM writes K into a block. Blocks that vLLM's prefix cache shares
between requests share their representation too, at no cost.

    write(state, slot_mapping, keys)            every K write (prefill and decode)
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
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from ...adaptors.flash_attention import FlashAttentionAdaptor, FlashAttentionMetadata
from ...algorithms.base import _max_units, scoring_kernel, topk_selection
from ...backends.torch_ref import TorchRefBackend
from ...common.batch import Selection
from ...common.errors import ConfigError
from ...config import MAX_CONTEXT_TOKENS, SparseConfig, dense_layer_set, load_config, read_json_object

CONFIG_ENV = "SPARSE_FRAMEWORK_VLLM_CONFIG"
"""The environment variable that enables the plugin and holds its config: a JSON object or
the path of a JSON file. Unset or empty: the plugin registers nothing and vLLM is unchanged."""

IGNORED_FIELDS = ("backend", "adaptor", "device_buffer_tokens")
"""Fields of the shared config that vLLM decides instead: attention runs in vLLM's own kernel
over a rewritten block table, and every token stays resident (no device buffer)."""


def config_source(environ: dict[str, str] | None = None) -> str | None:
    """The plugin's config text from the environment (None when unset or blank)."""
    value = (os.environ if environ is None else environ).get(CONFIG_ENV, "")
    return value if value.strip() else None


def load_vllm_config(source: str | dict[str, Any], block_size: int | None = None) -> SparseConfig:
    """Parse the plugin's config (a JSON object, a JSON file path or a dict) with vLLM's
    defaults, or raise ConfigError naming `SPARSE_FRAMEWORK_VLLM_CONFIG` and the field.

    Inside vLLM: `store` is "resident" (every token stays in vLLM's paged cache; the host tier
    would need vLLM's KV-cache manager patched, so "hierarchical" is refused when named);
    `page_size` defaults to vLLM's block size and must equal it when given (block_size None:
    not known yet, any power of two is accepted); `device_buffer_tokens` is not used (set large
    so that a top_k up to the context passes the shared validation); `backend` and `adaptor`
    are not used (vLLM's own kernel attends)."""
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
            raise ConfigError(
                f"{CONFIG_ENV}: `page_size` = {given!r} differs from vLLM's KV block size ({block_size}): inside vLLM a "
                f"page is one block; set \"page_size\": {block_size}, leave it out, or start vLLM with "
                f"--block-size {given} (the CPU kernel takes multiples of 32)"
            )
    data.setdefault("device_buffer_tokens", MAX_CONTEXT_TOKENS)
    try:
        config = load_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{CONFIG_ENV}: {exc}") from None
    if config.algorithm_class not in PAGED_ALGORITHMS:
        raise ConfigError(
            f"{CONFIG_ENV}: `algorithm` = {config.algorithm!r} has no per-block (paged) representation for vLLM yet; "
            f"supported inside vLLM: {', '.join(sorted(PAGED_NAMES))}"
        )
    return config


@dataclass
class BlockBounds:
    """Quest's page bounds per physical block of one layer: the element-wise min and max key
    of the tokens written to each block, [num_blocks, num_kv_heads, head_dim] in the key dtype
    (+inf / -inf for blocks never written)."""

    page_min: torch.Tensor
    page_max: torch.Tensor
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.page_min.shape[0]


class PagedQuest:
    """Quest (algorithms/quest.py) with page = vLLM block and its bounds kept per physical block.

    The selection equals `Quest`'s over the same logical sequence: the same bounds (min and max
    are exact, whichever order the keys come in), the same scoring kernel and options
    (`gqa_reduce`, `range_weight`, `min_pages`, `newest_in_top_k`, `impl`) and the same
    top-k with the sink, recent and newest pages forced in (`topk_selection`)."""

    granularity: ClassVar[str] = "page"
    per_kv_head: ClassVar[bool] = True

    def __init__(self, config: SparseConfig) -> None:
        self.config = config
        self.options = config.extra_config
        algo = config.algorithm_class
        self.unit = config.page_size
        self.budget_units = algo.budget_units(config)
        self.width_units = _max_units(config, self.unit, self.budget_units)
        # as Quest.__init__ and ScoringAlgorithm.top_units set them
        self.newest_forced = (not self.options.newest_in_top_k) or config.recent_tokens >= 1
        self.impl = self.options.impl

    def new_state(
        self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> BlockBounds:
        """Empty bounds for a KV cache of `num_blocks` blocks (fp8 caches: bounds in bfloat16)."""
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            dtype = torch.bfloat16
        shape = (num_blocks, num_kv_heads, head_dim)
        return BlockBounds(
            page_min=torch.full(shape, float("inf"), dtype=dtype, device=device),
            page_max=torch.full(shape, float("-inf"), dtype=dtype, device=device),
            block_size=self.unit,
        )

    def write(self, state: BlockBounds, slot_mapping: torch.Tensor, keys: torch.Tensor) -> None:
        """Fold keys [T, Hkv, D] written at physical slots `slot_mapping` (int [>= T'], slot =
        block * block_size + offset; negative = padding, skipped; rows past T' ignored) into
        their blocks' bounds. A write at offset 0 starts the block afresh: vLLM fills a block
        from offset 0, so a reused block id forgets what it held before."""
        n = min(slot_mapping.shape[0], keys.shape[0])
        slots = slot_mapping[:n].to(device=state.page_min.device, dtype=torch.long)
        keep = slots >= 0
        slots, keys = slots[keep], keys[:n][keep].to(state.page_min.dtype)
        if slots.numel() == 0:
            return
        blocks = slots // state.block_size
        fresh = blocks[slots % state.block_size == 0]
        state.page_min[fresh] = float("inf")
        state.page_max[fresh] = float("-inf")
        index = blocks.view(-1, 1, 1).expand_as(keys)
        state.page_min.scatter_reduce_(0, index, keys, "amin", include_self=True)
        state.page_max.scatter_reduce_(0, index, keys, "amax", include_self=True)

    def score(
        self, state: BlockBounds, q: torch.Tensor, block_table: torch.Tensor, n_blocks: int
    ) -> torch.Tensor:
        """float32 [B, Hkv, n_blocks]: Quest's bound of each logical block of each request.
        q [B, Hq, D]; block_table int [B, >= n_blocks] (entries past a request's blocks are
        read, clamped into range, and ignored by the top-k)."""
        table = block_table[:, :n_blocks].long().clamp(0, state.num_blocks - 1)
        lo = state.page_min[table].transpose(1, 2)  # [B, Hkv, n, D]
        hi = state.page_max[table].transpose(1, 2)
        rows = torch.arange(q.shape[0], device=q.device)
        scores = scoring_kernel("quest_scores", self.impl, q.device)
        return scores(q, lo, hi, rows, n_blocks, self.options.gqa_reduce, self.options.range_weight)

    def select(
        self, state: BlockBounds, q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
    ) -> Selection:
        """Logical tokens to attend to: int32 indices [B, Hkv, W] in whole blocks, ascending,
        -1 padded, with lengths [B, Hkv]. seq_lens int [B] counts the new token (already
        written). Host sync: the longest sequence sizes the scores."""
        max_len = int(seq_lens.max())
        n_blocks = -(-max_len // self.unit)
        scores = self.score(state, q, block_table, n_blocks)
        return topk_selection(
            scores,
            seq_lens,
            unit=self.unit,
            budget_units=self.budget_units,
            sink_tokens=self.config.sink_tokens,
            recent_tokens=self.config.recent_tokens,
            width_units=self.width_units,
            impl="torch" if q.device.type == "cpu" else self.impl,
            newest_forced=self.newest_forced,
        )


def _paged_algorithms() -> dict[type, type[PagedQuest]]:
    from ...algorithms.quest import Quest

    return {Quest: PagedQuest}


PAGED_ALGORITHMS = _paged_algorithms()
PAGED_NAMES = ("quest",)


def paged_algorithm(config: SparseConfig) -> PagedQuest:
    """The paged implementation of the config's algorithm (checked by `load_vllm_config`)."""
    return PAGED_ALGORITHMS[config.algorithm_class](config)


def sparse_layers(config: SparseConfig, num_layers: int) -> frozenset[int]:
    """Model layers that decode sparsely: all but `dense_layers` and the algorithm's own
    (Quest: `dense_first_layers`)."""
    return frozenset(range(num_layers)) - dense_layer_set(config, num_layers)


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
    attended and the tokens in context; kv_writes: tokens folded into representations."""

    forward_calls: int = 0
    sparse_calls: int = 0
    dense_calls: int = 0
    mixed_calls: int = 0
    sparse_rows: int = 0
    dense_rows: int = 0
    selected_tokens: int = 0
    context_tokens: int = 0
    kv_writes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def reset(self) -> None:
        for name in self.as_dict():
            setattr(self, name, 0)


STATS = VllmStats()
