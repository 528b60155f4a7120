"""The base of every algorithm's twin inside vLLM (`PagedAlgorithm`), below the modules that
find twins (`paged.py`) and define them (`paged.PagedQuest`, `paged_keys.py`,
`paged_bridge.py`), so that finding one never imports a module that imports the finder.
`paged.py` re-exports every name here: `paged.PagedAlgorithm` is this class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...algorithms.base import _max_units, topk_selection
from ...common.batch import Selection
from ...config import SparseConfig

CONFIG_ENV = "SPARSE_FRAMEWORK_VLLM_CONFIG"
"""The environment variable that enables the plugin and holds its config: a JSON object or
the path of a JSON file. Unset or empty: the plugin registers nothing and vLLM is unchanged."""


@dataclass
class PagedState:
    """One layer's per-block representation. Every tensor has num_blocks + 1 rows: the extra
    last row is a sink for padding slots (and, for Quest, blocks not restarted by a write), so
    that `write` needs no boolean indexing (a host sync per layer on the GPU); no block table
    points at it."""

    block_size: int

    @property
    def num_blocks(self) -> int:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError


def representation_dtype(key_dtype: torch.dtype) -> torch.dtype:
    """The dtype a representation keeps keys in: the key dtype, bfloat16 for an fp8 cache."""
    return key_dtype if key_dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) else torch.bfloat16


def _block_rows(slot_mapping: torch.Tensor, n: int, block_size: int, sink: int, device: torch.device) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, offsets, kept) of the first n physical slots: padding slots (< 0) go to block
    `sink`, offset 0, without a host sync."""
    slots = slot_mapping[:n].to(device=device, dtype=torch.long)
    keep = slots >= 0
    blocks = torch.where(keep, slots.div(block_size, rounding_mode="floor"), sink)
    offsets = torch.where(keep, slots % block_size, 0)
    return blocks, offsets, keep


class PagedAlgorithm:
    """An algorithm inside vLLM: a representation per physical KV block (`new_state`, filled by
    `write` at every K write), scores per logical block of each request (`score`), and the
    framework's top-k over them with the sink, recent and newest blocks forced in (`select`;
    `select_static` for full CUDA graphs). A selection page is one vLLM block, whatever the
    algorithm's own granularity."""

    granularity: ClassVar[str] = "page"
    per_kv_head: ClassVar[bool] = True
    graph_safe: ClassVar[bool] = True
    """Whether `select_static` can be captured in a full CUDA graph (no host sync, shapes from
    the block table alone). False: the CUDA backend declares no full-graph support for it, so
    vLLM lowers its graph mode to PIECEWISE (attention eager: `backend_cuda.py`)."""

    def __init__(self, config: SparseConfig) -> None:
        self.config = config
        self.options = config.extra_config
        self.unit = config.page_size
        self.budget_units = self.blocks_of_budget(config)
        self.width_units = _max_units(config, self.unit, self.budget_units)
        # as Quest.__init__ and ScoringAlgorithm.top_units set them; an algorithm without the
        # options gets ScoringAlgorithm's defaults (the newest block on top, the kernel "auto")
        self.newest_forced = (not getattr(self.options, "newest_in_top_k", False)) or config.recent_tokens >= 1
        self.impl: str = getattr(self.options, "impl", "auto")

    @classmethod
    def refuses(cls, config: SparseConfig) -> str | None:
        """Why this twin cannot run this config of its algorithm (naming the field), or None."""
        return None

    @classmethod
    def blocks_of_budget(cls, config: SparseConfig) -> int:
        """Blocks the top-k keeps besides the forced ones: top_k // block."""
        return config.top_k // config.page_size

    def new_state(
        self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> PagedState:
        raise NotImplementedError

    def write(self, state: Any, slot_mapping: torch.Tensor, keys: torch.Tensor) -> None:
        """Fold keys [T, Hkv, D] written at physical slots `slot_mapping` into `state`."""
        raise NotImplementedError

    def score(
        self, state: Any, q: torch.Tensor, block_table: torch.Tensor, n_blocks: int, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """float32 [B, Hkv or 1, n_blocks]: each logical block's score for each request
        (seq_lens int [B], for twins whose scores depend on the lengths)."""
        raise NotImplementedError

    def select(
        self,
        state: Any,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int | None = None,
    ) -> Selection:
        """Logical tokens to attend to: int32 indices [B, Hkv, W] in whole blocks, ascending,
        -1 padded, with lengths [B, Hkv]. seq_lens int [B] counts the new token (already
        written). max_seq_len: an upper bound of seq_lens known on the host (a larger one only
        scores more blocks, the selection is the same); None reads it from seq_lens, a host
        sync."""
        max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        n_blocks = min(-(-max_len // self.unit), block_table.shape[1])
        scores = self.score(state, q, block_table, n_blocks, seq_lens)
        return self._top(scores, seq_lens, self.width_units, None)

    def select_static(
        self, state: Any, q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, min_len: int
    ) -> Selection:
        """`select` for every row of a uniform decode batch with shapes fixed by the block
        table alone, as a full CUDA graph needs (no host bound of the lengths, no host-planned
        rows): every block of the table is scored (a wider score leaves the selection
        unchanged) and a row shorter than `min_len` (`min_sparse_prompt_len`) keeps all its
        blocks, the dense answer, which the selection width makes room for. Rows of length 0
        (a graph's padding) select nothing."""
        n_blocks = block_table.shape[1]
        scores = self.score(state, q, block_table, n_blocks, seq_lens)
        width = self.width_units
        tail_start = None
        if min_len > 1:
            width = min(max(width, -(-min_len // self.unit)), n_blocks)
            lens = seq_lens.long()
            tail_start = torch.where(lens < min_len, torch.zeros_like(lens), lens)
        return self._top(scores, seq_lens, width, tail_start)

    def _top(
        self, scores: torch.Tensor, seq_lens: torch.Tensor, width_units: int, tail_start: torch.Tensor | None
    ) -> Selection:
        return topk_selection(
            scores,
            seq_lens,
            unit=self.unit,
            budget_units=self.budget_units,
            sink_tokens=self.config.sink_tokens,
            recent_tokens=self.config.recent_tokens,
            width_units=width_units,
            impl="torch" if scores.device.type == "cpu" else self.impl,
            newest_forced=self.newest_forced,
            tail_start=tail_start,
        )
