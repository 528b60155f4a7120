"""Quest's page bounds scored through a block table: the vLLM plugin's scoring pass.

Inside vLLM a page is one KV block and the bounds live per physical block
([num_blocks + 1, Hkv, D], `integrations/vllm/paged.py`), so request b's logical page p is
block `block_table[b, p]`. Gathering the bounds into [B, Hkv, n_pages, D] first (what the
torch twin does) writes and reads them again, twice the bytes of the scoring itself, and
under a full CUDA graph that gather's buffer spans every block of the table at every captured
batch size. The Triton kernel reads each bound once, through the table: one program per
(request, KV head, run of pages), the scores of `quest_scores` (same formula, reductions and
`range_weight`), float32 [B, Hkv, n_pages]. The torch twin, `quest_paged_scores_torch`, is
in `reference/scores.py` (it runs without Triton).

Table entries are clamped into [0, num_blocks) (a table row past a request's blocks holds
whatever vLLM left there; the top-k ignores those pages by length).
"""

from __future__ import annotations

import torch
import triton

from .dot_modes import _launchable, _pow2
from .reference.scores import REDUCTIONS, _check_paged, _check_quest, quest_paged_scores_torch
from .scoring import QUEST_TILE, QUEST_WARPS
from .triton.paged_scores import quest_paged_scores_kernel

__all__ = ["quest_paged_scores_torch", "quest_paged_scores_triton"]


def quest_paged_scores_triton(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, block_table: torch.Tensor,
    n_pages: int, reduce: str = "max", range_weight: float = 1.0,
) -> torch.Tensor:
    """Triton version of `quest_paged_scores_torch` (same arguments and result)."""
    _check_paged(q, page_min, page_max, block_table, n_pages)
    # the shared checks of quest_scores, on a view with the paged bounds' head and dim
    view = page_min.unsqueeze(2)
    b, hkv, g, d = _check_quest(q, view, view, torch.arange(q.shape[0], device=q.device), min(n_pages, 1),
                                reduce, range_weight)
    _launchable(q, page_min, page_max, block_table)
    if page_min.stride() != page_max.stride():
        raise ValueError("quest_paged_scores: page_min and page_max must have the same strides")
    out = torch.empty(b, hkv, n_pages, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_d = _pow2(d)
    block_p = max(1, min(_pow2(n_pages), QUEST_TILE // block_d))
    grid = (b, hkv, triton.cdiv(n_pages, block_p))
    quest_paged_scores_kernel[grid](
        q, page_min, page_max, block_table, out, n_pages, page_min.shape[0], d, (1.0 - range_weight) / 2,
        *q.stride(), *block_table.stride(), *page_min.stride(),
        HKV=hkv, G=g, REDUCE=REDUCTIONS[reduce], SHRINK=range_weight != 1.0, BLOCK_P=block_p, BLOCK_D=block_d,
        num_warps=QUEST_WARPS,
    )
    return out
