"""SelectPages — reference semantics: which listed pages one decode step attends to.

T0 (the pinned pages: sinks, the recent window, the page being written) always, plus the
best other pages by score up to the attention budget. The tiered cache's selection
(``TieredKVCache``), the step graph's ``tieredkv::SelectPages`` node
(``onnx_ops.select_pages_function``) and the graph's reference step (``builder.export.PoolStep``)
all call or match this.
"""

from __future__ import annotations

import torch

#: ``attend_pages`` meaning "no attention budget": every valid page is selected
ATTEND_ALL = 1 << 40


def select_pages(score: torch.Tensor, valid: torch.Tensor, pinned: torch.Tensor,
                 attend_pages: torch.Tensor) -> torch.Tensor:
    """The selected pages [B, M] bool.

    * ``score`` [B, M] float — the ranking, higher first (ImportanceScore's output);
    * ``valid`` [B, M] bool — the page is one of the sequence's (False: padding column);
    * ``pinned`` [B, M] bool — T0 pages, selected whatever their score;
    * ``attend_pages`` [B] int64 — the attention budget in pages, T0 included
      (:data:`ATTEND_ALL`: no budget).

    Every valid page when ``attend_pages`` covers them all; else the valid pinned pages plus
    the ``attend_pages - #(valid pinned)`` valid unpinned pages with the highest score, ties
    broken by the lower column (a budget below T0 selects T0 alone). Never a padding column.
    """
    m = score.shape[-1]
    candidates = valid & ~pinned
    order = torch.sort(score.float().masked_fill(~candidates, float("-inf")), dim=-1, descending=True,
                       stable=True).indices  # candidates best first, ties in column order
    take = attend_pages - (pinned & valid).sum(-1)
    top = torch.zeros_like(candidates).scatter_(-1, order, torch.arange(m, device=score.device) < take.unsqueeze(-1)) & candidates
    every = (attend_pages >= valid.sum(-1)).unsqueeze(-1)
    return valid & (pinned | every | top)
