"""TierManager: where every page of every layer lives, and every decision that moves it.

Pages are the *records* of a :class:`~tieredkv.runtime.tiered.page_table.PageTable` (record r
is one logical page in every layer; shared prefix pages are listed by several sequences);
residency and statistics are per (layer, record): [L, R] tensors, so a decision is a handful
of vectorized ops over all layers at once — no per-page Python. The class is split by job:
page moves (``moves.py``), the warm sub-tier (``warm_tier.py``), window migration and
prefetch (``migration.py``), accounting and invariants (``accounting.py``), the step's
accounting (``step_fold.py``: a native op per fold on the CPU); this file holds the sequences and the step.

Tiers (docs/tiers.md):
  T0 hot      device; the sink pages, the recent-window pages and the page being written
              of each sequence; never evicted, always attended;
  T1 hot keys device; a label on the most-accessed resident pages (capacity
              ``hot_key_pages`` per layer). On CUDA this region is what an L2
              access-policy window would cover; here it is accounting only;
  T2 device   the other resident pages; T0 + T1 + T2 <= the device budget minus staging;
  T2w warm    (with a warm codec) pages encoded with a KV codec in a fixed share of the
              device bytes: the policy's victims and the pages demoted at window
              boundaries are written back to the host when dirty (the host keeps the exact
              copy), then compressed here instead of leaving the device; attention decodes
              them; a warm page that turns hot (migration thresholds) is re-fetched exact
              from the host into a full-precision slot; under pressure the warm tier drops
              its lowest-priority pages (no bytes move: the host copy exists);
  T3 host     every page that has been written back (inclusive: a clean resident page
              keeps its host copy, so evicting it moves no bytes);
  T4 disk     host overflow, in a memory-mapped file (optional).

What the cache asks of it, per step (one decode step, in order):
  ``begin_step``     new records and device slots for the step's tokens -> a :class:`StepPlan`
                     ([B, M] tensors of every sequence's pages, built once);
  ``write_tokens``   per layer: the new K/V into their device pages, the key summaries
                     (a decode step that scores nothing: ``append_tokens`` per layer, then
                     ``fold_summaries`` once for every layer);
  ``summaries``      per layer: what the scorer reads of the listed pages (key bounds, saliency);
  ``attended``       per layer: the selected pages the step can attend (mode);
  ``read_pages``     the one reader of pages, from whichever tier holds them;
  ``record_step``    once: what every layer needed, missed, streamed, the attention mass and
                     importance — and the one accounting of the step's reads;
  ``end_step``       statistics, migration at window boundaries, demand admission.
  (``close_step``    the two above in one call — the cache's; a decode step's end in one native
                     op over the layers where it applies, ``StepFold.close_step``.)

Invariants (the property tests check them after every step):
  * every live page has at least one copy (device, host or disk) — nothing is lost;
    a warm (compressed) page always has an exact copy on the host or disk;
  * a page is never both full-precision and warm on the device;
  * slot tables and pool owners are each other's inverse; no slot holds two pages;
  * device-owned pages per layer <= resident capacity; host pages <= host budget;
  * every live page of every layer is counted in exactly one tier, and the counted moves
    balance the pools: device slots = created + fetched + copied - evicted - released, warm
    slots = compressed - warm promotions - warm drops - released;
  * the page table's own (reference counts, free list, page lists);
  * freeing a sequence returns every slot and record no other sequence lists.
"""

from __future__ import annotations

import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tieredkv.errors import KVCacheFullError
from tieredkv.models.cache import write_pool_rows
from tieredkv.plugins.kv_append import kv_append
from tieredkv.plugins.tiered_attention import PAD_PAGE_INDEX
from tieredkv.runtime.tiered.accounting import TierAccounting
from tieredkv.runtime.tiered.budgets import ResolvedBudgets
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.masks import any_, count_, longs, pairs_
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.migration import WindowMigration
from tieredkv.runtime.tiered.moves import PageMoves
from tieredkv.runtime.tiered.page_table import PageTable, PageTableState
from tieredkv.runtime.tiered.policies import ReplacementPolicy
from tieredkv.runtime.tiered.step import StepAccess, StepPlan
from tieredkv.runtime.tiered.step_fold import StepFold
from tieredkv.runtime.tiered.store import DiskPool, TierPool, warm_pool
from tieredkv.runtime.tiered.transfers import Transfers
from tieredkv.runtime.tiered.warm_tier import WarmTier


@dataclass(eq=False)
class ManagerState:
    """A copy of a TierManager's state (its metrics excepted: they keep accumulating)."""

    table: PageTableState
    pools: dict[str, tuple]
    step_no: int


class TierManager(StepFold, PageMoves, WarmTier, WindowMigration, TierAccounting):
    """``page_bytes``: the bytes one page of one layer counts for (default: the device pool's;
    trace replay, whose pages carry one value, counts the real pages'). ``next_use(table)``:
    the step of each (layer, record)'s next access, [L, R] (Belady's oracle replays a recorded
    trace). ``keep_decoded_warm``: the warm pool keeps decoded copies (a CPU evaluation aid,
    ``WarmPool``). ``prefetcher``: called after every decode step (``between_steps(manager)``)
    to bring predicted pages in (``tieredkv.runtime.tiered.prefetch``)."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 config: TieredKVConfig, budgets: ResolvedBudgets, policy: ReplacementPolicy,
                 page_bytes: int | None = None, next_use: Callable[[PageTable], torch.Tensor] | None = None,
                 keep_decoded_warm: bool = False, prefetcher=None, device: str | torch.device = "cpu") -> None:
        self.L, self.P = num_layers, config.page_size
        self.config, self.budgets, self.policy = config, budgets, policy
        self.kv_heads, self.head_dim = kv_heads, head_dim
        unlimited = policy.unlimited or budgets.device_pages is None
        self.resident_cap = None if unlimited else budgets.resident_pages
        self.device = TierPool("device", num_layers, kv_heads, self.P, head_dim, dtype, self.resident_cap,
                               device=device)
        self.host = TierPool("host", num_layers, kv_heads, self.P, head_dim, dtype, budgets.host_pages, pin=True)
        disk_path = config.budgets.disk_path
        self.disk = DiskPool(disk_path, num_layers, kv_heads, self.P, head_dim, dtype) if disk_path else None
        self.warm = None
        if config.warm.codec is not None and not unlimited and budgets.warm_pages > 0:
            self.warm = warm_pool(num_layers, [c for c, _ in config.warm.rungs()], (kv_heads, self.P, head_dim),
                                  budgets.warm_rungs, keep_decoded=keep_decoded_warm, device=self.device.device)
        self.staging_pages = 0 if unlimited else budgets.staging_pages
        self.transfers = Transfers(device)  # batched host <-> device copies (copy streams on CUDA)
        self.page_bytes = self.device.page_bytes if page_bytes is None else page_bytes
        self.next_use = next_use
        self.prefetcher = prefetcher
        self.log_tiers = False  # record each step's tier at its start (the access log)
        self._reader: ThreadPoolExecutor | None = None  # disk (T4) -> host reads ahead of use
        self._pending: list = []  # (layers, host slots, future of the pages' data) not yet written
        self.metrics = TierMetrics()
        self.step_no = 0  # decode steps so far (the clock of recency statistics)
        self.table = PageTable(num_layers, kv_heads, head_dim, self.P, summary_device=self.device.device)
        self._access: StepAccess | None = None
        self._close_want: torch.Tensor | None = None  # close_step's buffer
        self.closed_in_one_op = 0  # decode steps closed by close_step's one op
        self._spare: StepAccess | None = None  # the last step's access record, cleared for the next one
        self._restored = False  # a rollback happened (the move counters no longer balance the pools)
        self._expected: dict[int, int] = {}  # pages each sequence expects to list (``expect``)

    def _pools(self):
        """(pool, slot column) of every tier that may hold pages."""
        t = self.table
        return ((self.device, t.device_slot), (self.warm, t.warm_slot), (self.host, t.host_slot),
                (self.disk, t.disk_slot))

    @property
    def alive(self) -> torch.Tensor:
        return self.table.alive

    def resident(self, layer: int | slice, rows) -> torch.Tensor:
        """Device-resident (full precision or warm) mask of records ``rows`` in ``layer``."""
        t = self.table
        return (t.device_slot[layer, rows] >= 0) | (t.warm_slot[layer, rows] >= 0)

    def records_of(self, seq: int) -> torch.Tensor:
        return self.table.records_of(seq)

    def length(self, seq: int) -> int:
        return self.table.seq_len[seq]

    @property
    def num_sequences(self) -> int:
        return len(self.table.seq_pages)

    def add_sequence(self, seq: int, shared: Sequence[int] = ()) -> None:
        """A new sequence; ``shared``: full pages of live sequences it starts with (reference-counted)."""
        self.table.add_sequence(seq, shared)
        if len(shared):
            try:
                self._pin_hot(seq)  # shared pages in its hot window come back onto the device
            except KVCacheFullError:
                self.free_sequence(seq)
                raise

    def free_sequence(self, seq: int) -> None:
        self._unlist(self.records_of(seq))
        del self.table.seq_pages[seq], self.table.seq_len[seq]
        self.table.paused.discard(seq)
        self._expected.pop(seq, None)

    def expect(self, seq: int, pages: int) -> None:
        """``seq`` will list up to ``pages`` pages: the page table and the device pool grow now
        to the live pages plus what every live sequence still expects (the device pool within
        its budget); where that passes the device budget, the host and warm pools too (pages
        that leave the device go there). Nothing is taken."""
        self._expected[seq] = pages
        t = self.table
        more = sum(max(0, n - len(t.seq_pages[s])) for s, n in self._expected.items())
        t.reserve(more)
        total = int(t.alive.sum()) + more
        self.device.reserve(total)
        if self.resident_cap is not None and total > self.resident_cap:
            self.host.reserve(total)
            if self.warm is not None:
                self.warm.reserve(total)

    def _unlist(self, recs: torch.Tensor) -> None:
        """A sequence lets ``recs`` go; the records no other sequence lists release every slot."""
        self._release(self.table.unref(recs))

    def hold(self, recs: torch.Tensor) -> None:
        """The prefix index keeps ``recs`` (live full pages) beyond the sequences listing them."""
        self.table.hold(recs)

    def let_go(self, recs: torch.Tensor) -> None:
        """The prefix index drops ``recs``; those no sequence lists release every slot."""
        self._release(self.table.let_go(recs))

    def pause(self, seq: int) -> None:
        """Preempt ``seq`` by demotion: it stops pinning a hot window and its pages leave the
        device (written back to the host first when dirty; warm copies dropped, the host holds
        the exact page) — except pages a running sequence pins. :meth:`resume` brings its hot
        window back; nothing is recomputed."""
        t = self.table
        t.paused.add(seq)
        t.update_t0(self.config.window.sink_tokens, self.config.window.recent_tokens)
        recs = self.records_of(seq)
        recs = recs[~t.t0[recs]]
        layers, cols = (t.device_slot[:, recs] >= 0).nonzero(as_tuple=True)
        self.evict(layers, recs[cols])
        layers = torch.arange(self.L).repeat_interleave(len(recs))
        self.metrics.warm_drops += self._drop_warm(layers, recs.repeat(self.L))
        self.metrics.paused_sequences += 1

    def resume(self, seq: int) -> None:
        """A paused sequence runs again: its hot window comes back onto the device (other pages
        demoted by policy to make room). KVCacheFullError when the device cannot take it."""
        t = self.table
        t.paused.discard(seq)
        try:
            self._pin_hot(seq)
        except KVCacheFullError:
            t.paused.add(seq)
            t.update_t0(self.config.window.sink_tokens, self.config.window.recent_tokens)
            raise
        self.metrics.resumed_sequences += 1

    def _pin_hot(self, seq: int) -> None:
        """Bring the hot window (T0) of ``seq`` onto the device, demoting other pages by policy."""
        t = self.table
        t.update_t0(self.config.window.sink_tokens, self.config.window.recent_tokens)
        recs = self.records_of(seq)
        recs = recs[t.t0[recs]]
        want = torch.zeros(self.L, t.capacity, dtype=torch.bool)
        want[:, recs] = t.device_slot[:, recs] < 0
        if not want.any():
            return
        room = self._make_room(want.sum(1), protect=want)
        if bool((room < want.sum(1)).any()):
            raise KVCacheFullError(f"the device budget ({self.resident_cap} resident pages per layer) cannot take "
                                   f"sequence {seq}'s hot window: every resident page is pinned")
        layers, cols = want.nonzero(as_tuple=True)
        self.admit(layers, cols)

    def truncate(self, seq: int, length: int) -> None:
        t = self.table
        keep = -(-length // self.P)
        pages = t.seq_pages[seq]
        self._unlist(torch.tensor(pages[keep:], dtype=torch.long))
        del pages[keep:]
        t.seq_len[seq] = min(t.seq_len[seq], length)
        if pages:
            if t.seq_len[seq] % self.P and int(t.refs[pages[-1]]) > 1:
                pages[-1] = self._copy_record(pages[-1])  # copy on write: the page will be written
            t.tokens[pages[-1]] = t.seq_len[seq] - (len(pages) - 1) * self.P
        t.update_t0(self.config.window.sink_tokens, self.config.window.recent_tokens)
        if seq in t.paused:
            return
        # the recent window moved back onto earlier pages, which may have left the device (or be warm)
        try:
            self._pin_hot(seq)
        except KVCacheFullError:
            self.pause(seq)  # consistent state: a paused sequence pins no hot window
            raise KVCacheFullError(f"sequence {seq} was truncated to {length} tokens, but the device budget "
                                   f"({self.resident_cap} resident pages per layer) cannot take its new hot window: "
                                   "every resident page is pinned; the sequence is paused (resume it when others "
                                   "finish)") from None

    def _copy_record(self, rec: int) -> int:
        """A private copy of shared record ``rec`` (statistics, summaries and K/V in every layer,
        in a new device slot); ``rec`` loses one reference."""
        t = self.table
        new = t.new_record(int(t.index[rec]), self.step_no)
        for name, meta in t.columns():
            if name not in ("refs", "cached", "device_slot", "warm_slot", "host_slot", "disk_slot"):
                column = getattr(t, name)
                if meta["per_layer"]:
                    column[:, new] = column[:, rec]
                else:
                    column[new] = column[rec]
        t.t0[new] = True
        layers = torch.arange(self.L)
        recs = torch.full_like(layers, rec)
        k, v = self.read_pages(layers, recs, self.device.dtype, exact=True)
        want = torch.zeros(self.L, t.capacity, dtype=torch.bool)
        want[:, new] = True
        self._make_room(want.sum(1), protect=want)
        slots = self.device.alloc(layers, torch.full_like(layers, new))
        if slots is None:
            raise KVCacheFullError(f"the device budget ({self.resident_cap} resident pages per layer) has no room for "
                                   "the private copy of a shared page that a truncated sequence writes into")
        self.device.write(layers, slots, k, v)
        t.device_slot[layers, new] = slots
        self.metrics.copied_pages += self.L
        t.unref(torch.tensor([rec]))
        return new

    # ------------------------------------------------------------------ step begin: new pages
    def begin_step(self, seqs: tuple[int, ...], num_new: int) -> StepPlan:
        """Create the records the step's new tokens need and give them device slots,
        evicting by policy first when the resident capacity would be exceeded."""
        t_start = time.perf_counter()
        t = self.table
        new: list[int] = []
        partial: list[int] = []  # existing pages the step writes into (a sequence's last, partial page)
        filled: list[int] = []  # the pages whose token counts change, and the counts
        counts: list[int] = []
        for seq in seqs:
            n = t.seq_len[seq] + num_new
            pages = t.seq_pages[seq]
            if t.seq_len[seq] % self.P:
                partial.append(pages[-1])
            while len(pages) * self.P < n:
                pages.append(t.new_record(len(pages), self.step_no))
                new.append(pages[-1])
            t.seq_len[seq] = n
            for i in range(max(0, len(pages) - -(-num_new // self.P) - 1), len(pages)):
                filled.append(pages[i])
                counts.append(min(self.P, n - i * self.P))
        if filled:
            t.tokens[longs(filled)] = longs(counts)
        t.update_t0(self.config.window.sink_tokens, self.config.window.recent_tokens)
        if new or partial:
            # every page written this step is resident and stays so until the step ends (a partial
            # page may have left the T0 window as the sequence grew, or left with a paused sequence)
            written = longs(new + partial)
            missing = (t.device_slot[:, written] < 0).sum(1)  # per layer (new pages are never resident)
            if bool(missing.any()):
                want = torch.zeros(self.L, t.capacity, dtype=torch.bool)
                want[:, written] = True
                if bool((self._make_room(missing, protect=want) < missing).any()):
                    raise KVCacheFullError(
                        f"the device budget ({self.resident_cap} resident pages per layer) cannot take the "
                        f"{len(new)} new page(s) of this step: every resident page is in T0 (sinks + recent window) "
                        "of a live sequence. Raise the device budget, lower recent_tokens, or run fewer sequences "
                        "at once.")
            if new:
                recs = longs(new)
                layers = torch.arange(self.L).repeat_interleave(len(recs))
                cols = recs.repeat(self.L)
                t.device_slot[layers, cols] = self.device.alloc(layers, cols)
                self.metrics.created_pages += len(layers)
            if partial:
                recs = longs(partial)
                layers, cols = (t.device_slot[:, recs] < 0).nonzero(as_tuple=True)
                self.admit(layers, recs[cols])
                self._drop_copies(recs)  # their copies off the device are stale once written
        self._access = StepAccess.reuse(self._spare, self.L, t.capacity)
        if self.log_tiers:
            self._access.tier = self.tiers()
        self.metrics.manager_seconds += time.perf_counter() - t_start
        return self._plan(seqs, num_new)

    def _plan(self, seqs: tuple[int, ...], num_new: int) -> StepPlan:
        """The open step as [B, M] tensors (module docstring of ``step``), built once per step."""
        t, P = self.table, self.P
        pages = [t.seq_pages[s] for s in seqs]
        lengths = tuple(len(p) for p in pages)
        width = max(lengths)
        rows = array("q")
        for p in pages:
            rows.fromlist(p)
            rows.fromlist(p[:1] * (width - len(p)))
        recs = longs(rows).view(len(pages), width)
        valid = torch.arange(width).unsqueeze(0) < longs(lengths).unsqueeze(1)
        index = torch.arange(width).expand_as(recs)  # a sequence lists its pages in logical order
        tokens = torch.where(valid, t.tokens[recs], 0)
        seq_len = longs([t.seq_len[s] for s in seqs])
        past = seq_len - num_new
        distance = torch.where(valid, (seq_len - 1).unsqueeze(1) - (index * P + tokens - 1), 0)
        pos = past.unsqueeze(1) + torch.arange(num_new)  # [B, T]
        return StepPlan(seq_ids=tuple(seqs), num_new=num_new, lengths=lengths, recs=recs, valid=valid,
                        index=torch.where(valid, index, PAD_PAGE_INDEX), tokens=tokens, t0=t.t0[recs] & valid,
                        distance=distance, seq_len=seq_len, past=past, write_recs=recs.gather(1, pos // P).flatten(),
                        write_offsets=(pos % P).flatten())

    # ------------------------------------------------------------------ the step's layers
    def write_tokens(self, layer: int, plan: StepPlan, k: torch.Tensor, v: torch.Tensor,
                     saliency: torch.Tensor, *, slots: torch.Tensor | None = None, rows=None) -> None:
        """The step's new K/V of one layer into their device pages (KVAppend, in place):
        ``k``, ``v`` [B * T, KVH, D] in the plan's order, with each token's ``saliency`` [B * T];
        the pages' key summaries follow. ``slots``: the new tokens' device slots in this layer,
        where the device pool lives (default: read from the page table); ``rows``: :meth:`append_tokens`'."""
        t = self.table
        recs = plan.write_recs
        if slots is None:
            slots = t.device_slot[layer, recs].to(self.device.device)
        self.append_tokens(layer, plan, k, v, slots, rows)
        self._update_summaries(layer, recs.to(t.kmin.device), k.float().to(t.kmin.device),
                               saliency.to(t.sal_sum.device, torch.float32), one_per_page=plan.decode)

    def append_tokens(self, layer: int, plan: StepPlan, k, v, slots: torch.Tensor, rows=None) -> None:
        """:meth:`write_tokens` without the summaries: the step folds them in once for every layer
        (:meth:`fold_summaries`). ``rows``: their places by ``models.cache.pool_rows`` (one copy per pool)."""
        pools = (self.device.k[layer], self.device.v[layer])
        if rows is None or not write_pool_rows(*pools, rows, k, v):
            kv_append(*pools, k, v, slots, plan.write_offsets.to(self.device.device), out=pools)  # in place

    def fold_summaries(self, plan: StepPlan, k: torch.Tensor, saliency: torch.Tensor,
                       layers: torch.Tensor | None = None) -> None:
        """A decode step's new keys k [L', B, KVH, D] of ``layers`` (default: every layer), with
        their ``saliency`` [L', B], into their pages' key min / max and summed saliency in one pass
        (each sequence writes one token into a page of its own): what :meth:`write_tokens` does
        layer by layer, with the same result."""
        t = self.table
        recs = plan.write_recs.to(t.kmin.device)
        k, saliency = k.float().to(t.kmin.device), saliency.to(t.sal_sum.device, torch.float32)
        if layers is None:  # every layer: along the record axis
            t.kmin.index_copy_(1, recs, torch.minimum(t.kmin.index_select(1, recs), k))
            t.kmax.index_copy_(1, recs, torch.maximum(t.kmax.index_select(1, recs), k))
            t.sal_sum.index_add_(1, recs, saliency)
            return
        at = (layers.to(t.kmin.device).unsqueeze(1), recs.unsqueeze(0))
        t.kmin[at] = torch.minimum(t.kmin[at], k)
        t.kmax[at] = torch.maximum(t.kmax[at], k)
        t.sal_sum[at] += saliency

    def _update_summaries(self, layer: int, recs: torch.Tensor, k: torch.Tensor, saliency: torch.Tensor, *,
                          one_per_page: bool) -> None:
        """Fold the new keys k [N, KVH, D] (with their ``saliency`` [N]) of pages ``recs`` [N] into
        the pages' key min / max and summed saliency. ``one_per_page``: each token goes to a page of
        its own (a decode step: every sequence writes its last page); else the tokens are reduced
        per page first, into a buffer of their pages only."""
        t = self.table
        pages, lo, hi = recs, k, k
        if not one_per_page:
            pages, inverse = torch.unique(recs, return_inverse=True)
            idx = inverse.view(-1, 1, 1).expand_as(k)
            lo = k.new_full((len(pages), *k.shape[1:]), float("inf")).scatter_reduce_(0, idx, k, "amin")
            hi = k.new_full((len(pages), *k.shape[1:]), float("-inf")).scatter_reduce_(0, idx, k, "amax")
        kmin, kmax = t.kmin[layer], t.kmax[layer]
        kmin.index_copy_(0, pages, torch.minimum(kmin.index_select(0, pages), lo))
        kmax.index_copy_(0, pages, torch.maximum(kmax.index_select(0, pages), hi))
        t.sal_sum[layer].index_add_(0, recs, saliency)

    def summaries(self, layer: int | slice, recs: torch.Tensor, tokens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the scorer reads of pages ``recs`` (any shape S; written ``tokens`` each, of the same
        shape) in ``layer`` (or every layer with ``slice(None)``): element-wise key min and max
        [..., S, KVH, D] and the mean saliency [..., S], where the summaries live."""
        t = self.table
        recs = recs.to(t.kmin.device)
        if isinstance(layer, int):
            flat = recs.flatten()
            kmin = t.kmin[layer].index_select(0, flat).view(*recs.shape, *t.kmin.shape[2:])
            kmax = t.kmax[layer].index_select(0, flat).view(*recs.shape, *t.kmax.shape[2:])
            sal = t.sal_sum[layer].index_select(0, flat).view(recs.shape)
        else:
            kmin, kmax, sal = t.kmin[layer, recs], t.kmax[layer, recs], t.sal_sum[layer, recs]
        return kmin, kmax, sal / tokens.to(sal.device).clamp(min=1)

    def saliency(self, layer: int | slice, recs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The mean saliency of pages ``recs`` (written ``tokens`` each) in ``layer``, where the
        summaries live: [..., *recs.shape]."""
        t = self.table
        return t.sal_sum[layer, recs.to(t.sal_sum.device)] / tokens.to(t.sal_sum.device).clamp(min=1)

    def attended(self, layer: int | slice, plan: StepPlan, selected: torch.Tensor) -> torch.Tensor:
        """The selected pages ([B, M], or [L, B, M] with ``slice(None)``) the step attends: every
        one in exact mode and in prefill (the non-resident ones streamed through the staging
        area); in masked mode's decode steps the resident ones and those the prefetcher staged
        only (the others are counted as masked)."""
        if not plan.decode or self.config.selection.mode == "exact":
            return selected
        recs = plan.recs
        return selected & (self.resident(layer, recs) | self.table.staged[layer, recs])

    def seq_access(self, seq: int) -> StepAccess:
        """The open step's access record of one sequence's pages: [L, M] columns."""
        return self._access.columns(self.records_of(seq))

    def end_step(self, *, decode: bool) -> None:
        """Close the open step: statistics from its access record, migration at window
        boundaries, demand admission of the pages it needed but did not find resident."""
        t_start = time.perf_counter()
        t, m, access = self.table, self.metrics, self._access
        prefetch = self.prefetcher is not None or any_(t.staged)  # (only a prefetch stages or marks pages)
        if decode:
            self.step_no += 1
            m.decode_steps += 1
            if prefetch:
                used = access.needed & (t.prefetched | t.staged)  # there because the prefetcher brought them in
                m.prefetch_hits += count_(used)
                t.prefetched &= ~used
        else:
            m.prefill_steps += 1
        needed, missed = self.fold_statistics(decode)
        if decode:
            m.hits += needed - missed
            m.misses += missed
        if prefetch:
            m.prefetch_wasted += count_(t.staged & ~access.needed)  # staged for this step, not used by it
        if decode and self.step_no % self.config.migration.window_steps == 0:
            self._migrate()
        if not (missed or prefetch):  # nothing missing, nothing staged: nothing to admit
            self._finish_step(decode, t_start)
            return
        want, protect, need = self.wanted()
        t.staged.zero_()  # the staging area is the step's: what it held is adopted below or gone
        if bool(need.any()):
            self._admit_wanted(want, need, self._make_room(need, protect=protect))
        self._finish_step(decode, t_start)

    def _admit_wanted(self, want: torch.Tensor, need: torch.Tensor, room: torch.Tensor) -> None:
        """The step's wanted pages ``want`` [L, R] (``need`` [L] of them) into the device slots made
        for them (``room`` [L]): all of them, by record, where every layer has room for all it wants
        (the common case: no ranking), else the ``room[l]`` most important of each layer."""
        fits = bool((room >= need).all())
        layers, recs = pairs_(want, need) if fits else self._highest(want, self.table.importance, room)
        self.admit(layers, recs, already_streamed=self._access.streamed[layers, recs])

    def _finish_step(self, decode: bool, t_start: float) -> None:
        if decode and self.prefetcher is not None:
            self.prefetcher.between_steps(self)
        self._record_residency()
        self._spare, self._access = self._access, None
        self.metrics.manager_seconds += time.perf_counter() - t_start

    # ------------------------------------------------------------------ checkpoint
    def checkpoint(self) -> ManagerState:
        """A copy of all mutable state but the metrics (which keep accumulating)."""
        self._settle()
        pools = {pool.name: pool.snapshot() for pool, _ in self._pools() if pool is not None}
        return ManagerState(self.table.snapshot(), pools, self.step_no)

    def rollback(self, state: ManagerState) -> None:
        self._settle()
        self._restored = True
        self.table.restore(state.table)
        for pool, _ in self._pools():
            if pool is not None:
                pool.restore(state.pools[pool.name])
        self.step_no = state.step_no

