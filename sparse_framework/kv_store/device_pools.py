"""The store's device pools: one per layer kind, each sized from what its layers must hold.

Why per kind: a dense layer keeps every token of every request on the device, a sparse
layer only a fixed buffer per sparse request. Were every layer's pool the same size, one
dense layer (Quest keeps its first two dense) would force full-context pools on all others,
and the "hierarchical" store would take as much device memory as a dense cache.

The kinds and their default sizes (pages of `page_size` tokens per layer; `max_pages` =
cdiv(max_seq_len, page_size)):

  dense_layers   `dense_layers` of the hierarchical store: max_requests × max_pages. Every
                 token of every request stays here, so this is the exact worst case and the
                 pool can never overflow.
  sparse_layers  the other layers of the hierarchical store: max_requests × share, with
                 share = max(buffer, min(cdiv(min_sparse_prompt_len, page_size), max_pages)),
                 buffer = min(cdiv(device_buffer_tokens, page_size), max_pages). A sparse
                 request holds its buffer; a request that decodes densely (its prompt is
                 shorter than `min_sparse_prompt_len`) holds every token, and its prompt
                 plus a first decoded token always fits in one share. Pages are shared by
                 the rows of a layer: a dense-mode request that grows past its share takes
                 free pages, and a CapacityError naming the settings to change says when
                 there are none. `device_capacity_tokens` replaces the default.
  resident       the resident store (`"store": "resident"`), every layer: max_requests ×
                 max_pages (every token on the device), or `device_capacity_tokens`.

The hybrid store (`"store": "hybrid"`) has the hierarchical store's two kinds, but its sparse
layers' pool defaults to max_requests × max_pages, as the resident store's: requests stay
whole on the device while they fit, and only under pressure shrink to their buffer (spills.py).

`size_device_pools` is plain arithmetic, shared by the store and `plan_capacity`, so that
`sparse-framework plan` counts exactly what the store allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.arith import cdiv
from ..common.layout import KVLayout
from .copy import put_rows
from .pages import PageAllocator, allocate_pool, paged_slots_rows

SPARSE_LAYERS, DENSE_LAYERS, RESIDENT = "sparse_layers", "dense_layers", "resident"


@dataclass(frozen=True)
class PoolSizing:
    """One device pool: its layers, its pages per layer and the rule that chose them."""

    kind: str
    layers: tuple[int, ...]
    pages: int  # per layer
    page_size: int
    rule: str  # how `pages` was chosen, in words (stats, logs)

    @property
    def tokens(self) -> int:
        """Token slots per layer (and per KV head)."""
        return self.pages * self.page_size

    def bytes(self, layout: KVLayout) -> int:
        """Device bytes of the pool over its layers, as stored (K and V, or the latent)."""
        return self.tokens * len(self.layers) * layout.bytes_per_token_per_layer


def buffer_pages(device_buffer_tokens: int, page_size: int, max_seq_len: int) -> int:
    """Pages of a sparse request's buffer in one layer: `device_buffer_tokens` in whole pages,
    never more than a whole sequence (a larger buffer would never be filled)."""
    return min(cdiv(device_buffer_tokens, page_size), cdiv(max_seq_len, page_size))


def row_share_pages(
    *, device_buffer_tokens: int, min_sparse_prompt_len: int, page_size: int, max_seq_len: int
) -> int:
    """Default pages per request row in a sparse layer's pool: a sparse request's buffer, or
    the longest prompt that decodes densely plus its first decoded token, whichever is more."""
    max_pages = cdiv(max_seq_len, page_size)
    dense_room = min(cdiv(min_sparse_prompt_len, page_size), max_pages)
    return max(buffer_pages(device_buffer_tokens, page_size, max_seq_len), dense_room)


def size_device_pools(
    *,
    num_layers: int,
    dense_layers: frozenset[int] | set[int] | tuple[int, ...],
    page_size: int,
    device_buffer_tokens: int,
    min_sparse_prompt_len: int,
    max_requests: int,
    max_seq_len: int,
    resident_only: bool = False,
    capacity_tokens: int | None = None,
    hybrid: bool = False,
) -> list[PoolSizing]:
    """The pools a store with these settings allocates (see the module docstring); kinds
    without layers are left out. `capacity_tokens` (device_capacity_tokens) replaces the
    default size of the sparse layers' pool, or of the resident store's. `hybrid`: the
    hybrid store's (the sparse layers' pool holds every request whole by default)."""
    max_pages = cdiv(max_seq_len, page_size)
    full = f"max_requests {max_requests} x max_seq_len {max_seq_len}"
    given = None if capacity_tokens is None else (cdiv(capacity_tokens, page_size), f"device_capacity_tokens {capacity_tokens}")
    if resident_only:
        pages, rule = given or (max_requests * max_pages, f"{full}: every token on the device (resident store)")
        return [PoolSizing(RESIDENT, tuple(range(num_layers)), pages, page_size, rule)]
    dense = tuple(sorted(layer for layer in dense_layers if layer < num_layers))
    sparse = tuple(layer for layer in range(num_layers) if layer not in dense)
    pools = []
    if sparse:
        share = row_share_pages(
            device_buffer_tokens=device_buffer_tokens, min_sparse_prompt_len=min_sparse_prompt_len,
            page_size=page_size, max_seq_len=max_seq_len,
        )
        default = (
            max_requests * share,
            f"max_requests {max_requests} x {share * page_size} tokens (the larger of device_buffer_tokens "
            f"{device_buffer_tokens} and min_sparse_prompt_len {min_sparse_prompt_len}, in pages, at most max_seq_len)",
        )
        if hybrid:
            default = (max_requests * max_pages, f"{full}: every request whole while it fits (hybrid store)")
        pages, rule = given or default
        pools.append(PoolSizing(SPARSE_LAYERS, sparse, pages, page_size, rule))
    if dense:
        rule = f"{full}: a dense layer keeps every token of every request"
        pools.append(PoolSizing(DENSE_LAYERS, dense, max_requests * max_pages, page_size, rule))
    return pools


class DevicePool:
    """The tensors and page allocators of one pool: per stored tensor (K and V, or the latent)
    [layers, slots, kv_heads, dim], or head-major [layers, kv_heads, slots, dim]; pages are
    handed out per layer (one allocator per layer, all of the same size)."""

    def __init__(self, sizing: PoolSizing, layout: KVLayout, *, head_major: bool, knob: str) -> None:
        self.sizing = sizing
        self.kind = sizing.kind
        self.layers = sizing.layers
        self.slots = sizing.tokens
        self.head_major = head_major
        self.layout = layout
        hk, d = layout.num_kv_heads, layout.stored_head_dim
        n = len(sizing.layers)
        shape = (n, hk, self.slots, d) if head_major else (n, self.slots, hk, d)
        what = f"device KV pool of the {sizing.kind.replace('_', ' ')}"
        dev = torch.device(layout.device)
        self.tensors = [allocate_pool(shape, layout.storage_dtype, dev, what, knob) for _ in range(layout.tensors_per_token)]
        self.index = {layer: i for i, layer in enumerate(sizing.layers)}
        self.alloc = {layer: PageAllocator(sizing.pages, f"{what} (layer {layer})") for layer in sizing.layers}

    def buffers(self, layer: int) -> list[torch.Tensor]:
        """The layer's part of every stored tensor: [slots, kv_heads, dim] (or head-major)."""
        i = self.index[layer]
        return [t[i] for t in self.tensors]

    def offsets(self, layer: int, slots: torch.Tensor, head: torch.Tensor | int = 0) -> torch.Tensor:
        """Flat element offsets, into this pool's tensors, of a stream's row at device slots
        of a layer (-1 kept)."""
        hk, d = self.layout.num_kv_heads, self.layout.stored_head_dim
        i = self.index[layer]
        if self.head_major:
            off = ((i * hk + head) * self.slots + slots) * d
        else:
            off = (i * self.slots + slots) * hk * d
        return torch.where(slots >= 0, off, -1)

    def layer_offset(self, layer: int) -> int:
        """Element offset of the layer's part of a stored tensor."""
        return self.index[layer] * self.slots * self.layout.stored_row_elems

    @property
    def bytes(self) -> int:
        return self.sizing.bytes(self.layout)

    @property
    def used_pages(self) -> int:
        return sum(a.used for a in self.alloc.values())

    def stats(self) -> dict[str, object]:
        """How the pool was sized and what it holds now (pages summed over its layers)."""
        per_page = self.sizing.page_size * self.layout.bytes_per_token_per_layer
        return {
            "kind": self.kind,
            "layers": len(self.layers),
            "tokens_per_layer": self.slots,
            "bytes": self.bytes,
            "used_tokens": self.used_pages * self.sizing.page_size,
            "used_bytes": self.used_pages * per_page,
            "rule": self.sizing.rule,
        }


class DeviceRows:
    """Where a stream's rows sit on the device: each layer's pool and the device page table.

    `pools` are the store's pools and `pool_of` the pool of each layer (fixed at construction);
    `table` [layers, max_requests, pages] int32 is the device page table, shared: its one owner
    (`DevicePages`, device_pages.py) maps and unmaps pages in it at admission, growth, retract,
    release and spills; the swap-in and the decode writes only read it."""

    def __init__(
        self, pools: list[DevicePool], pool_of: list[DevicePool], table: torch.Tensor, *, page_size: int, head_major: bool
    ) -> None:
        self.pools, self.pool_of, self.table = pools, pool_of, table
        self.page_size, self.head_major = page_size, head_major

    def slots(self, layer: int, slot_ids: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Device slots of positions (logical tokens of a resident layer, or buffer positions
        of a buffered one). slot_ids: [B]; pos: [B, ...] int, -1 kept. Returns `dtype`."""
        return paged_slots_rows(self.table[layer], slot_ids, pos, self.page_size, dtype)

    def offsets(self, layer: int, slots: torch.Tensor, head: torch.Tensor | int = 0) -> torch.Tensor:
        """Flat element offsets, into the tensors of the layer's pool, of a stream's row at
        device slots (-1 kept)."""
        return self.pool_of[layer].offsets(layer, slots, head)

    def buffers(self, layer: int) -> list[torch.Tensor]:
        """The layer's device rows per stored tensor: [slots, kv_heads, dim], or head-major."""
        return self.pool_of[layer].buffers(layer)

    def put(self, layer: int, slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """rows[i]: [n, kv_heads, dim] to device slots [n] (all heads), or, in the head-major
        layout, slots [n, kv_heads] (one slot per head)."""
        put_rows(self.buffers(layer), slots, rows, self.head_major)

    def paged_view(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_pages, page_size, heads, dim] views of a layer's device pool (no copy). An fp8
        MLA latent comes as FlashMLA's uint8 rows [.., 1, 656] for both K and V (the same
        tensor: V is part of the packed NoPE bytes); consumers unpack (`unpack_flashmla_fp8`)."""
        layout = self.pool_of[layer].layout
        heads = 1 if self.head_major else layout.num_kv_heads
        shape = (-1, page_size, heads, layout.stored_head_dim)
        bufs = self.buffers(layer)
        k = bufs[0].reshape(shape)
        if layout.is_flashmla_fp8:
            return k, k
        v = k[..., : layout.v_head_dim] if layout.is_mla else bufs[1].reshape(shape)
        if layout.is_fp8:
            return k.view(layout.dtype), v.view(layout.dtype)
        return k, v
