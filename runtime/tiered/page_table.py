"""PageTable: every page record of a tiered cache, its columns declared once.

A *record* is one logical page of KV, in every layer: record r holds the tokens
``[index[r] * P, index[r] * P + tokens[r])`` of each sequence that lists it. A sequence lists
its records in logical order (``seq_pages``). A record is listed by one sequence, or — a full
page of a shared prefix (a fork, the prefix index) — by several: ``refs[r]`` counts the
sequences listing it, plus one while the prefix index holds it (``cached``), and the record
is freed when the last of them lets it go. A page that is still being written (the partial
last page of a sequence) is never shared. A *paused* sequence (preempted by demotion) keeps
its records but pins none of them: it has no hot window until it resumes.

Per record: ``refs``, ``cached``, ``index``, ``tokens`` and ``t0`` (in the hot window of a
running sequence that lists it). Per (layer, record), [L, R] tensors: the slot of each tier holding a copy
(``device_slot``, ``warm_slot``, ``host_slot``, ``disk_slot``; -1 where the tier holds none),
the statistics the replacement policy and the migration thresholds read, and the key
summaries the scorer reads (element-wise key min / max per kv head, summed saliency).

Invariants (:meth:`check`, run by the tiered cache's property tests after every step):
  * ``refs[r]`` equals the number of times r is listed over all sequences plus ``cached[r]``;
    records with ``refs == 0`` are exactly the free list, without duplicates; a cached record
    is a full page;
  * a sequence of ``seq_len`` tokens lists ``ceil(seq_len / P)`` records with indices
    0, 1, ... in order; a sequence's partial last page is listed by that sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Sequence

import torch

from tieredkv.runtime.tiered.masks import longs

INF = float("inf")
#: decode steps of access history kept per (layer, record) in ``hist`` (bit i: needed i steps ago)
HIST_BITS = 62
HIST_MASK = (1 << HIST_BITS) - 1


def column(dtype: torch.dtype, fill: Any, *, per_layer: bool = True, new: Any = None, summary: bool = False,
           scorer: bool = False) -> Any:
    """A column of the table: [R] (``per_layer=False``) or [L, R] (+ [KVH, D] for a key
    ``summary``) of ``dtype``; a free record holds ``fill``, a record just handed out ``new``
    (default: ``fill``). ``scorer``: what the scorer reads inside a step, kept where the device
    tier lives (``summary_device``); every other column lives on the host."""
    return field(default=None, metadata={"dtype": dtype, "fill": fill, "new": fill if new is None else new,
                                         "per_layer": per_layer, "summary": summary, "scorer": scorer})


def _hot_bounds(seq_len: int, page_size: int, sink_tokens: int, recent_tokens: int) -> tuple[int, int, int]:
    """(pages, sink pages, first page of the recent window) of a sequence at length ``seq_len``."""
    n = -(-seq_len // page_size)
    first_recent = max(0, seq_len - recent_tokens) // page_size
    return n, -(-sink_tokens // page_size), min(first_recent, n - 1)


def hot_pages(seq_len: int, page_size: int, sink_tokens: int, recent_tokens: int) -> torch.Tensor:
    """[ceil(seq_len / P)] bool: a sequence's T0 pages at length ``seq_len`` — its sink pages,
    the pages of its recent window and the page being written."""
    n, sink, first_recent = _hot_bounds(seq_len, page_size, sink_tokens, recent_tokens)
    idx = torch.arange(n)
    return (idx < sink) | (idx >= first_recent)


def hot_page_count(seq_len: int, page_size: int, sink_tokens: int, recent_tokens: int) -> int:
    """How many pages :func:`hot_pages` marks (without building the mask)."""
    n, sink, first_recent = _hot_bounds(seq_len, page_size, sink_tokens, recent_tokens)
    if n == 0:
        return 0
    sink = min(sink, n)
    return sink + n - max(first_recent, sink)


def hot_records(pages: list[int], seq_len: int, page_size: int, sink_tokens: int, recent_tokens: int) -> list[int]:
    """Of a sequence's records ``pages`` (in logical order; the first ones when it has fewer than
    its length needs), those :func:`hot_pages` marks at length ``seq_len`` — in Python, no tensor."""
    n, sink, first_recent = _hot_bounds(seq_len, page_size, sink_tokens, recent_tokens)
    return pages[: min(sink, n)] + pages[max(first_recent, sink) : n]


@dataclass(eq=False)
class PageTableState:
    """A copy of a :class:`PageTable` (:meth:`PageTable.snapshot`)."""

    columns: dict[str, torch.Tensor]
    seq_pages: dict[int, list[int]]
    seq_len: dict[int, int]
    free: list[int]
    paused: set[int]


@dataclass(eq=False)
class PageTable:
    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    #: where the columns the scorer reads live (the device tier's device)
    summary_device: str | torch.device = "cpu"
    # per record [R]
    refs: torch.Tensor = column(torch.long, 0, per_layer=False)  # sequences listing the record (+1 if cached)
    cached: torch.Tensor = column(torch.bool, False, per_layer=False)  # held by the prefix index
    index: torch.Tensor = column(torch.long, 0, per_layer=False)  # logical page index in its sequence(s)
    tokens: torch.Tensor = column(torch.long, 0, per_layer=False)  # tokens written
    t0: torch.Tensor = column(torch.bool, False, per_layer=False, new=True)  # in a hot window (never evicted)
    # per (layer, record) [L, R]: the slot of each tier that holds a copy, -1 where none
    device_slot: torch.Tensor = column(torch.long, -1)  # full precision, on the device (T0, T1, T2)
    warm_slot: torch.Tensor = column(torch.long, -1)  # encoded with the warm codec, on the device (T2w)
    host_slot: torch.Tensor = column(torch.long, -1)  # host memory (T3)
    disk_slot: torch.Tensor = column(torch.long, -1)  # the memory-mapped file (T4)
    # statistics (decode steps are the clock)
    last_access: torch.Tensor = column(torch.long, 0)  # step of the last access (creation step before one)
    frequency: torch.Tensor = column(torch.long, 0)  # decode steps that needed the page
    win_access: torch.Tensor = column(torch.long, 0)  # ... in the current migration window
    idle_windows: torch.Tensor = column(torch.long, 0)  # windows in a row without an access
    t1: torch.Tensor = column(torch.bool, False)  # labelled a hot key (T1)
    importance: torch.Tensor = column(torch.float32, 0.0, new=1.0)  # the latest importance score
    acc_mass: torch.Tensor = column(torch.float32, 0.0)  # accumulated attention mass (H2O's signal)
    last_relevance: torch.Tensor = column(torch.float32, 0.0)  # relevance at the last step that listed the page
    hist: torch.Tensor = column(torch.long, 0)  # access history: bit i = needed by the decode step i steps ago
    prefetched: torch.Tensor = column(torch.bool, False)  # brought in by the prefetcher, not needed since
    staged: torch.Tensor = column(torch.bool, False)  # prefetched into the staging area for the next decode step
    # key summaries the scorer reads
    kmin: torch.Tensor = column(torch.float32, INF, summary=True, scorer=True)
    kmax: torch.Tensor = column(torch.float32, -INF, summary=True, scorer=True)
    sal_sum: torch.Tensor = column(torch.float32, 0.0, scorer=True)  # summed saliency of the page's tokens
    # sequences
    seq_pages: dict[int, list[int]] = field(default_factory=dict)
    seq_len: dict[int, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    paused: set[int] = field(default_factory=set)  # sequences without a hot window (preempted)

    def __post_init__(self) -> None:
        for name, meta in self.columns():
            setattr(self, name, self._filled(meta, 0))
        self.grow(64)

    # ------------------------------------------------------------------ columns
    @classmethod
    def columns(cls) -> Iterator[tuple[str, dict]]:
        """(name, declaration) of every tensor column."""
        for f in fields(cls):
            if "dtype" in f.metadata:
                yield f.name, f.metadata

    def _filled(self, meta: dict, n: int, value: Any = None) -> torch.Tensor:
        shape = (self.num_layers, n) if meta["per_layer"] else (n,)
        if meta["summary"]:
            shape += (self.kv_heads, self.head_dim)
        device = self.summary_device if meta["scorer"] else "cpu"
        return torch.full(shape, meta["fill"] if value is None else value, dtype=meta["dtype"], device=device)

    @property
    def capacity(self) -> int:
        """Records allocated (live and free): R."""
        return self.refs.shape[0]

    @property
    def alive(self) -> torch.Tensor:
        """[R] bool: listed by at least one sequence."""
        return self.refs > 0

    def grow(self, n: int) -> None:
        """``n`` more free records (handed out lowest index first)."""
        old = self.capacity
        for name, meta in self.columns():
            setattr(self, name, torch.cat([getattr(self, name), self._filled(meta, n)], dim=1 if meta["per_layer"] else 0))
        self.free.extend(range(old + n - 1, old - 1, -1))

    def reserve(self, n: int) -> None:
        """At least ``n`` free records: grows by what is missing, and by at least an eighth of the
        capacity (amortized growth that leaves at most ~1/9 of the records unused — every per-step
        column op runs over all of them, so doubling would cost up to 2x the work)."""
        if n > len(self.free):
            self.grow(max(n - len(self.free), self.capacity // 8, 64))

    def new_record(self, index: int, step: int) -> int:
        """A free record, reset to every column's ``new`` value, as logical page ``index`` of one
        sequence (refs 1); ``step`` is its creation step (its first ``last_access``)."""
        self.reserve(1)
        r = self.free.pop()
        for name, meta in self.columns():
            if meta["per_layer"]:
                getattr(self, name)[:, r] = meta["new"]
            else:
                getattr(self, name)[r] = meta["new"]
        self.refs[r], self.index[r], self.last_access[:, r] = 1, index, step
        return r

    # ------------------------------------------------------------------ sequences
    def records_of(self, seq: int) -> torch.Tensor:
        return longs(self.seq_pages[seq])

    def add_sequence(self, seq: int, shared: Sequence[int] = ()) -> None:
        """A new sequence; ``shared``: full pages of other sequences it starts with (its first
        ``len(shared)`` pages, in order)."""
        shared = list(shared)
        if shared:
            recs = torch.tensor(shared, dtype=torch.long)
            if not (self.alive[recs].all() and (self.tokens[recs] == self.page_size).all()
                    and torch.equal(self.index[recs], torch.arange(len(shared)))):
                raise ValueError("shared pages must be live full pages, the first pages of a sequence, in order")
            self.refs.index_add_(0, recs, torch.ones_like(recs))
        self.seq_pages[seq] = shared
        self.seq_len[seq] = len(shared) * self.page_size

    def unref(self, recs: torch.Tensor) -> torch.Tensor:
        """A sequence lets ``recs`` go: their reference counts drop; returns the records no
        sequence lists any more (the caller releases their slots, then :meth:`release`)."""
        if len(recs) == 0:
            return recs
        self.refs.index_add_(0, recs, torch.full_like(recs, -1))
        return recs[self.refs[recs] == 0]

    def release(self, recs: torch.Tensor) -> None:
        """Records nobody lists go back to the free list (their slots already released)."""
        self.t1[:, recs] = False
        self.free.extend(recs.tolist())

    def update_t0(self, sink_tokens: int, recent_tokens: int) -> None:
        """T0 of every running (not paused) sequence: its sink pages, the pages of its recent
        window and the page being written; a shared page is T0 when it is in the hot window of
        any running sequence listing it."""
        self.t0.zero_()
        hot: list[int] = []  # every running sequence's hot records, gathered in Python: one write
        for seq, pages in self.seq_pages.items():
            if pages and seq not in self.paused:
                hot += hot_records(pages, self.seq_len[seq], self.page_size, sink_tokens, recent_tokens)
        if hot:
            self.t0[longs(hot)] = True

    def hold(self, recs: torch.Tensor) -> None:
        """The prefix index takes one reference on each of ``recs`` (live full pages, not yet cached)."""
        if len(recs) == 0:
            return
        if not (self.alive[recs].all() and (self.tokens[recs] == self.page_size).all() and not self.cached[recs].any()):
            raise ValueError("the prefix index holds live full pages, once each")
        self.cached[recs] = True
        self.refs.index_add_(0, recs, torch.ones_like(recs))

    def let_go(self, recs: torch.Tensor) -> torch.Tensor:
        """The prefix index drops its reference on ``recs``; returns those nobody holds any more."""
        if not bool(self.cached[recs].all()):
            raise ValueError("the prefix index lets go only of records it holds")
        self.cached[recs] = False
        return self.unref(recs)

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> PageTableState:
        return PageTableState({name: getattr(self, name).clone() for name, _ in self.columns()},
                              {s: list(p) for s, p in self.seq_pages.items()}, dict(self.seq_len), list(self.free),
                              set(self.paused))

    def restore(self, state: PageTableState) -> None:
        for name, value in state.columns.items():
            setattr(self, name, value.clone())
        self.seq_pages = {s: list(p) for s, p in state.seq_pages.items()}
        self.seq_len = dict(state.seq_len)
        self.free = list(state.free)
        self.paused = set(state.paused)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise AssertionError when an invariant (module docstring) does not hold."""
        listed = torch.zeros(self.capacity, dtype=torch.long)
        for seq, pages in self.seq_pages.items():
            recs = torch.tensor(pages, dtype=torch.long)
            listed.index_add_(0, recs, torch.ones_like(recs))
            assert len(pages) == -(-self.seq_len[seq] // self.page_size), f"sequence {seq}: pages and length disagree"
            assert torch.equal(self.index[recs], torch.arange(len(pages))), f"sequence {seq}: pages out of order"
            if pages and self.seq_len[seq] % self.page_size:
                assert int(self.refs[pages[-1]]) == 1, f"sequence {seq}: the page being written is shared"
        assert torch.equal(listed + self.cached.long(), self.refs), \
            "reference counts disagree with the sequences' page lists and the prefix index"
        assert (self.tokens[self.cached] == self.page_size).all(), "a cached record is not a full page"
        assert self.paused <= set(self.seq_pages), "a paused sequence that does not exist"
        free = sorted(self.free)
        assert len(set(free)) == len(free), "a record is on the free list twice"
        assert free == (self.refs == 0).nonzero().flatten().tolist(), "the free list is not the unlisted records"
