"""The predictor interface: given the cache's state after decode step t, which pages will
steps t+1 ... t+d select?

Every predictor reads one :class:`PredictorInput` — the same columns the live runtime and
the replay of a recorded access log (``trace.replay``) hold — and returns a score per
(layer, record): > 0 means predicted, higher first. The prefetcher brings in the highest
scored non-resident pages within its budget. ``lead`` says when a predictor can run:
``"step"`` between decode steps, ``"layer"`` inside a step, for layer l once layer l-1's
query exists (its copies overlap one layer's compute, not a step's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tieredkv.runtime.tiered.page_table import HIST_BITS


@dataclass
class PredictorInput:
    """The state after a decode step, over the manager's [L, R] columns."""

    hist: torch.Tensor  # [L, R] long: bit i = needed by the decode step i steps ago
    alive: torch.Tensor  # [R] bool
    t0: torch.Tensor  # [R] bool: in T0 (always resident and attended)
    index: torch.Tensor  # [R] page index in its sequence
    seq_pages: torch.Tensor  # [R] pages of the record's sequence (0 for dead records)
    select_pages: torch.Tensor  # [R] pages beyond T0 a decode step of the record's sequence selects
    importance: torch.Tensor  # [L, R] the importance kept between steps
    acc_mass: torch.Tensor  # [L, R] accumulated attention mass
    step: int  # decode steps so far
    horizon: int  # predict the pages of the next ``horizon`` decode steps
    spec: torch.Tensor | None = None  # [L, R] relevance under the previous layer's query (lead "layer")
    groups: tuple[torch.Tensor, ...] = ()  # each sequence's records (logical order)

    @classmethod
    def from_manager(cls, mgr, horizon: int, spec: torch.Tensor | None = None) -> "PredictorInput":
        t = mgr.table
        R = t.capacity
        seq_pages = torch.zeros(R, dtype=torch.long)
        select = torch.zeros(R, dtype=torch.long)
        attend = mgr.budgets.attention_pages
        groups = []
        for seq in t.seq_pages:
            recs = t.records_of(seq)
            groups.append(recs)
            seq_pages[recs] = len(recs)
            beyond_t0 = len(recs) - int(t.t0[recs].sum())
            select[recs] = beyond_t0 if attend is None else max(0, min(beyond_t0, attend - int(t.t0[recs].sum())))
        return cls(t.hist, t.alive, t.t0, t.index, seq_pages, select, t.importance, t.acc_mass, mgr.step_no, horizon,
                   spec, tuple(groups))

    def bits(self, n: int) -> torch.Tensor:
        """[n, L, R] float: the last ``n`` steps' needed flags, oldest first."""
        n = min(n, HIST_BITS)
        shifts = torch.arange(n - 1, -1, -1).view(-1, 1, 1)
        return ((self.hist.unsqueeze(0) >> shifts) & 1).float()

    def top_per_sequence(self, score: torch.Tensor) -> torch.Tensor:
        """[L, R] bool: per layer and sequence, its ``select_pages`` highest-``score`` non-T0 pages."""
        out = torch.zeros(score.shape, dtype=torch.bool)
        for recs in self.groups:
            k = int(self.select_pages[recs[0]]) if len(recs) else 0
            cand = recs[~self.t0[recs]]
            if k <= 0 or len(cand) == 0:
                continue
            top = torch.topk(score[:, cand], min(k, len(cand)), dim=1).indices
            out[torch.arange(score.shape[0]).unsqueeze(1), cand[top]] = True
        return out


class Predictor:
    """A page-access predictor (module docstring). ``offline``: needs the recorded future
    (replay only); ``needs_spec``: reads ``PredictorInput.spec``."""

    name: ClassVar[str] = ""
    lead: ClassVar[str] = "step"
    offline: ClassVar[bool] = False
    needs_spec: ClassVar[bool] = False

    def scores(self, x: PredictorInput) -> torch.Tensor:
        raise NotImplementedError
