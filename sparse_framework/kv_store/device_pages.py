"""Which device pages each (request, layer) holds, and the device page table that maps them.

`DevicePages` owns two things that must change together: the page ids each (layer, request
row) holds (`owned`, host-side) and the device page table (`table`, [layers, max_requests,
pages] int32, -1 unmapped) that the swap-in, the decode writes and the kernels read through
`DeviceRows`. Allocation is all or nothing over layers, and a pool without room raises a
CapacityError that names what is full, why the request needs the room and the settings that
make room. The pools themselves (their tensors and page allocators) are device_pools.py's; the
store decides how many tokens a (request, layer) needs (its mode), this module only places them.
"""

from __future__ import annotations

import torch

from ..common.arith import cdiv
from ..common.batch import Request
from ..common.errors import CapacityError
from ..common.transfer import tensor_to_device
from .device_pools import DENSE_LAYERS, RESIDENT, DevicePool


class DevicePages:
    """The device pages of every (layer, request row) and the device page table.

    `pool_of`: each layer's pool (its allocator hands out the layer's pages). `table_pages`:
    columns of the page table. max_requests, max_pages, buffer_tokens and
    min_sparse_prompt_len: the store's geometry, for the table's shape and the errors' words.
    """

    def __init__(
        self,
        pool_of: list[DevicePool],
        *,
        page_size: int,
        max_requests: int,
        max_pages: int,
        table_pages: int,
        buffer_tokens: int,
        min_sparse_prompt_len: int,
        device: torch.device,
    ) -> None:
        self.pool_of = pool_of
        num_layers = len(pool_of)
        self.allocs = [pool_of[layer].alloc[layer] for layer in range(num_layers)]
        self.page_size, self.device = page_size, device
        self.max_requests, self.max_pages = max_requests, max_pages
        self.buffer_tokens, self.min_sparse_prompt_len = buffer_tokens, min_sparse_prompt_len
        self.table = torch.full((num_layers, max_requests, table_pages), -1, dtype=torch.int32, device=device)
        self.owned: dict[tuple[int, int], torch.Tensor] = {}  # (layer, row) -> page ids in logical order

    def alloc(self, request: Request, tokens: dict[int, int]) -> None:
        """All-or-nothing: pages for `tokens[layer]` tokens of the request in each given layer
        (beyond those it holds), or a CapacityError with nothing changed."""
        needs = {}
        for layer, want_tokens in tokens.items():
            have = self.owned.get((layer, request.slot))
            n = cdiv(want_tokens, self.page_size) - (0 if have is None else have.numel())
            if n > 0:
                needs[layer] = n
        for layer, n in needs.items():
            if n > self.allocs[layer].free:
                raise self.no_room(layer, n, f"request {request.rid!r}", request.dense)
        if not needs:
            return
        # the page-table entries of every layer in one host->device copy: a copy per layer
        # synchronises with the device each time (32 per request at every page boundary)
        layer_ids, cols, values = [], [], []
        for layer, n in needs.items():
            ids = self.allocs[layer].alloc(n, self.page_size, f"request {request.rid!r}")
            have = self.owned.get((layer, request.slot), ids[:0])
            layer_ids.append(torch.full((n,), layer))
            cols.append(torch.arange(have.numel(), have.numel() + n))
            values.append(ids)
            self.owned[(layer, request.slot)] = torch.cat([have, ids])
        index = tensor_to_device(torch.stack([torch.cat(layer_ids), torch.cat(cols)]), self.device)
        self.table[index[0], request.slot, index[1]] = tensor_to_device(torch.cat(values).to(torch.int32), self.device)

    def release(self, slot: int, layers: list[int]) -> None:
        """Give back the pages row `slot` holds in `layers` (it holds some in each) and unmap them."""
        for layer in layers:
            self.allocs[layer].release(self.owned.pop((layer, slot)))
        self.table[layers, slot] = -1

    def free(self, slot: int) -> None:
        """Give back every page row `slot` holds, in every layer, and unmap them."""
        for layer in range(len(self.allocs)):
            ids = self.owned.pop((layer, slot), None)
            if ids is not None:
                self.allocs[layer].release(ids)
        self.table[:, slot] = -1

    def held(self, slot: int, layer: int | None = None) -> int:
        """Pages row `slot` holds in `layer` (None: summed over every layer)."""
        if layer is not None:
            ids = self.owned.get((layer, slot))
            return 0 if ids is None else ids.numel()
        return sum(ids.numel() for (_, s), ids in self.owned.items() if s == slot)

    def free_pages(self, layers: list[int]) -> int:
        """Free pages in every one of `layers` (the fewest of any)."""
        return min(self.allocs[layer].free for layer in layers)

    @property
    def used_pages(self) -> int:
        """Pages held now, summed over layers."""
        return sum(a.used for a in self.allocs)

    def no_room(self, layer: int, pages: int, who: str, dense_request: bool) -> CapacityError:
        """The CapacityError for a layer's pool without `pages` free pages: what is full, why the
        request(s) need the room, and the settings that make room."""
        pool, alloc, p = self.pool_of[layer], self.allocs[layer], self.page_size
        full = f"max_requests x max_seq_len = {self.max_requests * self.max_pages * p}"
        head = (
            f"device KV pool of the {pool.kind.replace('_', ' ')} full in layer {layer}: {who} needs {pages} more "
            f"pages of {p} tokens ({pages * p} tokens), {alloc.free} of {alloc.num_pages} pages are free"
        )
        if pool.kind == RESIDENT:
            why = "the resident store keeps every token of every request on the device"
            fix = (f"raise device_capacity_tokens (now {pool.slots} tokens per layer; {full} fits any mix), "
                   "lower max_requests / max_seq_len, or use the hierarchical store")
        elif pool.kind == DENSE_LAYERS:
            why = f"dense layers ({sorted(pool.layers)}, dense_layers) keep every token of every request"
            fix = "lower max_requests / max_seq_len or remove the layer from dense_layers"
        elif dense_request:
            why = (f"a request whose prompt is shorter than min_sparse_prompt_len ({self.min_sparse_prompt_len}) "
                   "decodes densely and keeps every token in every layer")
            fix = (f"raise device_capacity_tokens (now {pool.slots} tokens per layer; {full} fits any mix), "
                   "lower min_sparse_prompt_len so that it decodes sparsely, or generate fewer tokens")
        else:
            why = f"a sparse request holds a buffer of device_buffer_tokens ({self.buffer_tokens}) in every sparse layer"
            fix = (f"raise device_capacity_tokens (now {pool.slots} tokens per layer) or lower device_buffer_tokens; "
                   "requests that decode densely (prompts shorter than min_sparse_prompt_len) may hold the rest")
        return CapacityError(f"{head}: {why}; {fix}")
