"""DSA over the real keys inside vLLM: blocks ranked by the attention mass of their keys.

The framework's `dsa` with `extra.source: "keys"` (algorithms/dsa.py) is its exact-selection
oracle: a GQA group's softmax mass on each token, the top tokens kept. Inside vLLM a selection
is whole KV blocks (the block table FlashAttention reads is per block), so here a block's score
is the mass its tokens get, summed (the best block selection of that size for the group, as
Quest's bounds only estimate), and the top `top_k // block_size` blocks are kept with the
sink, recent and newest ones.

The keys are copied per physical slot at every K write ([num_blocks + 1, Hkv, block_size, D]
in the key dtype, the sink row last), since vLLM's CPU cache keeps K in an ISA-specific order
inside a block: as much memory as the K cache itself, and a decode reads every key of the
context (twice the bytes of dense attention's K). An accuracy oracle, for measuring how close
a cheaper selection comes inside vLLM, not a way to decode faster. Under full CUDA graphs
the static path gathers every key of the block table (max_model_len) per request and layer:
use it with short contexts or PIECEWISE graphs there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...algorithms.base import group_probabilities
from ...config import SparseConfig
from .paged_base import PagedAlgorithm, PagedState, _block_rows, representation_dtype


@dataclass
class BlockKeys(PagedState):
    """The K rows of every physical slot: [num_blocks + 1, Hkv, block_size, D] (zeros where
    never written; the last block is the sink of padding slots)."""

    keys: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[0] - 1

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def logical(self, blocks: torch.Tensor, n: int) -> torch.Tensor:
        """The first n keys of a request in logical order, [n, Hkv, D], through its block-table
        row `blocks` (int [>= ceil(n / block_size)])."""
        used = -(-n // self.block_size)
        k = self.keys[blocks[:used].long()]  # [used, Hkv, bs, D]
        return k.transpose(1, 2).reshape(used * self.block_size, *k.shape[1:2], k.shape[-1])[:n]


class PerSlotKeys(PagedAlgorithm):
    """A twin whose state is the K row of every physical slot (`BlockKeys`): the base of those
    that need the keys themselves, not a summary of each block (`PagedKeyMass`, and the rebuild
    bridge of `paged_bridge.py`, which rebuilds any algorithm's representation from them)."""

    def new_state(
        self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> BlockKeys:
        keys = torch.zeros(num_blocks + 1, num_kv_heads, self.unit, head_dim, dtype=representation_dtype(dtype),
                           device=device)
        return BlockKeys(block_size=self.unit, keys=keys)

    def write(self, state: BlockKeys, slot_mapping: torch.Tensor, keys: torch.Tensor) -> None:
        """Copy keys [T, Hkv, D] to their physical slots (padding to the sink block), no host
        sync."""
        n = min(slot_mapping.shape[0], keys.shape[0])
        if n == 0:
            return
        blocks, offsets, _ = _block_rows(slot_mapping, n, state.block_size, state.num_blocks, state.keys.device)
        heads = torch.arange(state.keys.shape[1], device=state.keys.device)
        state.keys[blocks.view(-1, 1), heads.view(1, -1), offsets.view(-1, 1)] = keys[:n].to(state.keys.dtype)


class PagedKeyMass(PerSlotKeys):
    """`dsa` with source "keys" at block granularity (module docstring). Per KV head when the
    layer has several (each group's own mass), as `DSA` selects per KV head then."""

    @classmethod
    def refuses(cls, config: SparseConfig) -> str | None:
        if config.extra_config.source != "keys":
            return (f"`extra.source` = {config.extra_config.source!r} needs the model's indexer keys; inside vLLM "
                    "only \"keys\" (DSA over the real keys)")
        return None

    def score(self, state: BlockKeys, q: torch.Tensor, block_table: torch.Tensor, n_blocks: int,
              seq_lens: torch.Tensor) -> torch.Tensor:
        """float32 [B, Hkv or 1, n_blocks]: the mass each group puts on each block's tokens
        (softmax of q·k / √D over the tokens before the newest, summed over the group's query
        heads and the block's tokens; padding and later tokens get none)."""
        b, hq, d = q.shape
        hk, bs = state.keys.shape[1], state.block_size
        table = block_table[:, :n_blocks].long().clamp(0, state.num_blocks - 1)
        k = state.keys[table].float()  # [B, n, Hkv, bs, D]
        k = k.permute(0, 2, 1, 3, 4).reshape(b, hk, n_blocks * bs, d)
        logits = q.float().view(b, hk, hq // hk, d) @ k.transpose(-1, -2)  # [B, Hkv, G, n * bs]
        mass = group_probabilities(logits, seq_lens, d, "sum").view(b, hk, n_blocks, bs).sum(-1)
        return mass if hk > 1 else mass.sum(1, keepdim=True)
