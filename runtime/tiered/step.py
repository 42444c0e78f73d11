"""What crosses the boundary between the tiered cache and its TierManager during a step:
the open step's plan (:class:`StepPlan`, a :class:`SeqStep` per sequence) and its access
record (:class:`StepAccess`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepAccess:
    """What one step did, per (layer, record): pages it needed (selected, T0 excluded),
    which of those were not resident, the pages streamed to the staging area, the attention
    mass each page received, its relevance and the importance kept for it."""

    needed: torch.Tensor  # [L, R] bool
    missing: torch.Tensor  # [L, R] bool
    streamed: torch.Tensor  # [L, R] bool: copied to staging this step (exact misses, prefill)
    mass: torch.Tensor  # [L, R] float
    importance: torch.Tensor  # [L, R] float
    scored: torch.Tensor  # [L, R] bool: importance was computed
    relevance: torch.Tensor  # [L, R] float: observed attention share where attended, the scorer's estimate elsewhere
    tier: torch.Tensor | None = None  # [L, R] int8: where each page was when the step began (TIER_CODES)
    spec: torch.Tensor | None = None  # [L, R] float: relevance under the previous layer's query (NaN: none)

    @classmethod
    def empty(cls, num_layers: int, num_records: int) -> "StepAccess":
        flags = lambda: torch.zeros(num_layers, num_records, dtype=torch.bool)  # noqa: E731
        zeros = lambda: torch.zeros(num_layers, num_records)  # noqa: E731
        return cls(flags(), flags(), flags(), zeros(), zeros(), flags(), zeros())

    def columns(self, rows) -> "StepAccess":
        """The record of columns ``rows`` (e.g. one sequence's records)."""
        return StepAccess(*(None if v is None else v[:, rows] for v in vars(self).values()))


#: the ``tier`` codes of an access record: full precision on the device, warm (encoded) on the
#: device, host (T3), disk (T4)
TIER_CODES = {"device": 0, "warm": 1, "host": 2, "disk": 3}


@dataclass(frozen=True)
class SeqStep:
    """One sequence's part of the open step: its records in logical order and where the
    step's new tokens go."""

    seq: int
    recs: torch.Tensor  # [M] the sequence's records, logical order
    rows: slice | torch.Tensor  # the same records as an index of [L, R] columns (a slice when consecutive)
    t0: torch.Tensor  # [M] bool: in T0 (attended whatever its score)
    index: torch.Tensor  # [M] logical page index
    tokens: torch.Tensor  # [M] tokens written in each page, the step's included
    distance: torch.Tensor  # [M] from the last new token to each page's last token
    write_recs: torch.Tensor  # [T] the record of each new token
    write_offsets: torch.Tensor  # [T] its slot in that page
    seq_len: int  # tokens after the step
    past: int  # tokens before the step


@dataclass(frozen=True)
class StepPlan:
    """The open step: every sequence's :class:`SeqStep`, and the new tokens' places in
    (sequence, token) order."""

    seqs: tuple[SeqStep, ...]
    num_new: int
    write_recs: torch.Tensor  # [B * T]
    write_offsets: torch.Tensor  # [B * T]

    @property
    def decode(self) -> bool:
        return self.num_new == 1
