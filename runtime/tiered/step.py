"""What crosses the boundary between the tiered cache and its TierManager during a step.

A step is planned once for every sequence and layer (:class:`StepPlan`: [B, M] tensors of the
listed pages), runs its layers as tensor ops, and is accounted once (:class:`StepRecord`:
[L, B, M] tensors of what each layer selected, attended and observed), which the manager
folds into its [L, R] access record (:class:`StepAccess`) and statistics.

Dimensions: L layers, B sequences in the step, M listed pages (the longest sequence's; a
shorter sequence's row is padded: ``valid`` is False there), R page records.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

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

    @classmethod
    def reuse(cls, spare: "StepAccess | None", num_layers: int, num_records: int) -> "StepAccess":
        """:meth:`empty`, in ``spare``'s tensors (a finished step's record, zeroed in place: no
        [L, R] allocation per step) where their shape still fits."""
        if spare is None or spare.needed.shape != (num_layers, num_records):
            return cls.empty(num_layers, num_records)
        for f in fields(cls):  # the columns zeroed, the optional logs (a default: None) dropped
            if f.default is MISSING:
                getattr(spare, f.name).zero_()
            else:
                setattr(spare, f.name, f.default)
        return spare

    def columns(self, rows) -> "StepAccess":
        """The record of columns ``rows`` (e.g. one sequence's records)."""
        return StepAccess(*(None if v is None else v[:, rows] for v in vars(self).values()))


#: the ``tier`` codes of an access record: full precision on the device, warm (encoded) on the
#: device, host (T3), disk (T4)
TIER_CODES = {"device": 0, "warm": 1, "host": 2, "disk": 3}


@dataclass(frozen=True)
class StepPlan:
    """The open step, for all its sequences at once (host tensors; the cache copies what its
    layers read to the model's device once per step).

    Row b is sequence ``seq_ids[b]``; its ``lengths[b]`` records are listed in logical order in
    columns ``0 .. lengths[b] - 1``; the other columns are padding (``valid`` False, ``recs``
    repeating the row's first record so every gather stays in range, ``index``
    ``PAD_PAGE_INDEX``, ``tokens``, ``t0`` and ``distance`` 0)."""

    seq_ids: tuple[int, ...]
    num_new: int
    lengths: tuple[int, ...]  # pages listed per sequence
    recs: torch.Tensor  # [B, M] records
    valid: torch.Tensor  # [B, M] bool
    index: torch.Tensor  # [B, M] logical page index
    tokens: torch.Tensor  # [B, M] tokens written in each page, the step's included
    t0: torch.Tensor  # [B, M] bool: in T0 (attended whatever its score)
    distance: torch.Tensor  # [B, M] from the last new token to each page's last token
    seq_len: torch.Tensor  # [B] tokens after the step
    past: torch.Tensor  # [B] tokens before the step
    write_recs: torch.Tensor  # [B * T] the record of each new token, (sequence, token) order
    write_offsets: torch.Tensor  # [B * T] its slot in that page

    @property
    def decode(self) -> bool:
        return self.num_new == 1

    @property
    def batch(self) -> int:
        return len(self.seq_ids)

    @property
    def width(self) -> int:
        """M: the listed columns of every row."""
        return self.recs.shape[1]

    @property
    def candidates(self) -> torch.Tensor:
        """[B, M] the pages that compete for the attention budget: the valid pages outside T0
        (all valid pages of a row whose pages are all T0)."""
        free = self.valid & ~self.t0
        return torch.where(free.any(1, keepdim=True), free, self.valid)

    def row(self, b: int) -> torch.Tensor:
        """The records of row b, in logical order [lengths[b]]."""
        return self.recs[b, : self.lengths[b]]


@dataclass
class StepRecord:
    """What a step's layers did with the listed pages, [L, B, M] (the plan's columns), handed
    to the manager once per step (``TierManager.record_step``).

    ``relevance``: the scorer's estimate where a layer scored its pages (0 elsewhere); the
    cache replaces it with the observed attention share where the page was attended before
    mixing ``importance``. ``exact``: warm pages read from their exact copy (``warm.exact_reads``),
    None when there were none. ``resident`` / ``staged``: residency when each layer attended
    (None: as the table holds it at the step's end — nothing moved during the step).
    ``mass`` None: the step did not measure attention mass (the budgets held the work and the
    device had room: the layers ran the paged cache's attention), so the pages' mass, relevance
    and importance are left as they were."""

    selected: torch.Tensor  # bool
    attended: torch.Tensor  # bool
    relevance: torch.Tensor | None  # float (None: the mass stands for it)
    mass: torch.Tensor | None  # float: attention mass per page (mean over query heads, sum over queries)
    importance: torch.Tensor | None = None  # float: what the manager keeps between steps
    exact: torch.Tensor | None = None  # bool
    full: torch.Tensor | None = None  # bool
    warm: torch.Tensor | None = None  # bool
    staged: torch.Tensor | None = None  # bool

    @classmethod
    def empty(cls, num_layers: int, plan: StepPlan) -> "StepRecord":
        shape = (num_layers, *plan.recs.shape)
        return cls(torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool), torch.zeros(shape),
                   torch.zeros(shape))
