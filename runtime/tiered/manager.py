"""TierManager: where every page of every layer lives, and every decision that moves it.

Pages are the *records* of a :class:`~tieredkv.runtime.tiered.page_table.PageTable` (record r
is one logical page in every layer; shared prefix pages are listed by several sequences);
residency and statistics are per (layer, record): [L, R] tensors, so a decision is a handful
of vectorized ops over all layers at once — no per-page Python.

Tiers (DESIGN.md, "the honest tiers"):
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

What the cache asks of it, per step (one decode step of DESIGN.md, in order):
  ``begin_step``     new records and device slots for the step's tokens -> a :class:`StepPlan`;
  ``write_tokens``   per layer: the new K/V into their device pages, the key summaries;
  ``summaries``      per layer and sequence: what the scorer reads (key bounds, saliency);
  ``attended``       per layer and sequence: the selected pages the step can attend (mode);
  ``read_pages``     the one reader of pages, from whichever tier holds them;
  ``record_access``  per layer and sequence: what the step needed, missed, streamed, the
                     attention mass and importance — and the one accounting of its reads;
  ``end_step``       statistics, migration at window boundaries, demand admission.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tieredkv.errors import KVCacheFullError
from tieredkv.plugins.kv_append import kv_append
from tieredkv.runtime.tiered.config import ResolvedBudgets, TieredKVConfig
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.page_table import HIST_MASK, PageTable, PageTableState
from tieredkv.runtime.tiered.policies import PageStats, ReplacementPolicy
from tieredkv.runtime.tiered.step import TIER_CODES, SeqStep, StepAccess, StepPlan
from tieredkv.runtime.tiered.store import DiskPool, TierPool, WarmPool, _rank_within_groups
from tieredkv.runtime.tiered.transfers import Transfers

INF = float("inf")


@dataclass(eq=False)
class ManagerState:
    """A copy of a TierManager's state (its metrics excepted: they keep accumulating)."""

    table: PageTableState
    pools: dict[str, tuple]
    step_no: int


class TierManager:
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
            from tieredkv.plugins.codec import CODECS

            self.warm = WarmPool(num_layers, CODECS[config.warm.codec], (kv_heads, self.P, head_dim),
                                 budgets.warm_pages, keep_decoded=keep_decoded_warm, device=self.device.device)
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
        self.table = PageTable(num_layers, kv_heads, head_dim, self.P)
        self._access: StepAccess | None = None
        self._restored = False  # a rollback happened (the move counters no longer balance the pools)

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

    def warm_only(self, layer: int | slice, rows) -> torch.Tensor:
        """Mask of records ``rows`` in ``layer`` held on the device only in the warm pool
        (encoded; no full-precision slot)."""
        t = self.table
        return (t.device_slot[layer, rows] < 0) & (t.warm_slot[layer, rows] >= 0)

    def exact_read_choice(self, layer: int | slice, rows, n: int) -> torch.Tensor:
        """The warm pages that a decode step reads from their exact copy off the device instead
        of decoding them (``warm.exact_reads``): of records ``rows`` in ``layer`` ([M], or [L, M]
        with ``slice(None)``), at most ``n`` per layer — the warm-only pages most relevant at the
        last step that listed them (``last_relevance``: the attention share they drew where
        attended, the scorer's estimate elsewhere; equal values: the lower column first), never
        one scored 0. Known before the step runs, so an engine's runtime stages the same pages
        the PyTorch backend reads exact."""
        warm = self.warm_only(layer, rows)
        rel = self.table.last_relevance[layer, rows]
        cand = warm & (rel > 0)
        chosen = torch.zeros_like(cand)
        if n and cand.any():
            ranked = torch.where(cand, rel, torch.full_like(rel, -1.0))
            top = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :n]
            chosen.scatter_(-1, top, True)
        return chosen & cand

    def records_of(self, seq: int) -> torch.Tensor:
        return self.table.records_of(seq)

    def length(self, seq: int) -> int:
        return self.table.seq_len[seq]

    @property
    def num_sequences(self) -> int:
        return len(self.table.seq_pages)

    # ------------------------------------------------------------------ sequences
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

    def _unlist(self, recs: torch.Tensor) -> None:
        """A sequence lets ``recs`` go; the records no other sequence lists release every slot."""
        self._release(self.table.unref(recs))

    def _release(self, freed: torch.Tensor) -> None:
        """Records nobody holds any more give back every slot of every tier."""
        if len(freed) == 0:
            return
        self._settle()
        self._unprefetch(slice(None), freed)
        for pool, slots in self._pools():
            if pool is None:
                continue
            sub = slots[:, freed]
            layers, cols = (sub >= 0).nonzero(as_tuple=True)
            pool.release(layers, sub[layers, cols])
            slots[:, freed] = -1
            if pool is self.device:
                self.metrics.released_pages += len(layers)
            elif pool is self.warm:
                self.metrics.released_warm_pages += len(layers)
        self.table.release(freed)

    def _drop_warm(self, layers: torch.Tensor, recs: torch.Tensor) -> int:
        """Release the warm copies among pages (``layers``, ``recs``); returns how many there were."""
        if self.warm is None:
            return 0
        t = self.table
        warm = t.warm_slot[layers, recs] >= 0
        layers, recs = layers[warm], recs[warm]
        if len(recs):
            self.warm.release(layers, t.warm_slot[layers, recs])
            t.warm_slot[layers, recs] = -1
        return len(recs)

    def _drop_copies(self, recs: torch.Tensor) -> None:
        """Pages about to change give up their copies in the warm, host and disk tiers."""
        self._settle()
        layers = torch.arange(self.L).repeat_interleave(len(recs))
        self.metrics.warm_drops += self._drop_warm(layers, recs.repeat(self.L))
        for pool, slots in self._pools()[2:]:  # host, disk
            if pool is None:
                continue
            sub = slots[:, recs]
            layers, cols = (sub >= 0).nonzero(as_tuple=True)
            if len(layers):
                pool.release(layers, sub[layers, cols])
                slots[layers, recs[cols]] = -1

    # ------------------------------------------------------------------ prefix index and preemption
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
                t.tokens[pages[i]] = min(self.P, n - i * self.P)
        t.update_t0(self.config.window.sink_tokens, self.config.window.recent_tokens)
        if new or partial:
            # every page written this step is resident and stays so until the step ends (a partial
            # page may have left the T0 window as the sequence grew, or left with a paused sequence)
            written = torch.tensor(new + partial, dtype=torch.long)
            want = torch.zeros(self.L, t.capacity, dtype=torch.bool)
            want[:, written] = True
            missing = want & (t.device_slot < 0)
            room = self._make_room(missing.sum(1), protect=want)
            if bool((room < missing.sum(1)).any()):
                raise KVCacheFullError(
                    f"the device budget ({self.resident_cap} resident pages per layer) cannot take the "
                    f"{len(new)} new page(s) of this step: every resident page is in T0 (sinks + recent window) of "
                    "a live sequence. Raise the device budget, lower recent_tokens, or run fewer sequences at once.")
            if new:
                recs = torch.tensor(new, dtype=torch.long)
                layers = torch.arange(self.L).repeat_interleave(len(recs))
                cols = recs.repeat(self.L)
                t.device_slot[layers, cols] = self.device.alloc(layers, cols)
                self.metrics.created_pages += len(layers)
            if partial:
                recs = torch.tensor(partial, dtype=torch.long)
                layers, cols = (t.device_slot[:, recs] < 0).nonzero(as_tuple=True)
                self.admit(layers, recs[cols])
                self._drop_copies(recs)  # their copies off the device are stale once written
        self._access = StepAccess.empty(self.L, t.capacity)
        if self.log_tiers:
            self._access.tier = self.tiers()
        self.metrics.manager_seconds += time.perf_counter() - t_start
        return self._plan(seqs, num_new)

    def _plan(self, seqs: tuple[int, ...], num_new: int) -> StepPlan:
        t, P = self.table, self.P
        steps = []
        for seq in seqs:
            recs = t.records_of(seq)
            n = t.seq_len[seq]
            pos = torch.arange(n - num_new, n)
            # a sequence's records are usually consecutive: then a slice (a view) addresses its rows
            contiguous = len(recs) > 0 and int(recs[-1]) - int(recs[0]) == len(recs) - 1 and bool((recs.diff() > 0).all())
            rows = slice(int(recs[0]), int(recs[-1]) + 1) if contiguous else recs
            tokens, index = t.tokens[rows], t.index[rows]
            steps.append(SeqStep(seq=seq, recs=recs, rows=rows, t0=t.t0[rows], index=index, tokens=tokens,
                                 distance=(n - 1) - (index * P + tokens - 1), write_recs=recs[pos // P],
                                 write_offsets=pos % P, seq_len=n, past=n - num_new))
        return StepPlan(tuple(steps), num_new, torch.cat([s.write_recs for s in steps]),
                        torch.cat([s.write_offsets for s in steps]))

    # ------------------------------------------------------------------ the step's layers
    def write_tokens(self, layer: int, plan: StepPlan, k: torch.Tensor, v: torch.Tensor,
                     saliency: torch.Tensor) -> None:
        """The step's new K/V of one layer into their device pages (KVAppend, in place):
        ``k``, ``v`` [B * T, KVH, D] in the plan's order, with each token's ``saliency`` [B * T];
        the pages' key summaries follow."""
        t = self.table
        recs = plan.write_recs
        pools = (self.device.k[layer], self.device.v[layer])
        dev = self.device.device
        kv_append(*pools, k, v, t.device_slot[layer, recs].to(dev), plan.write_offsets.to(dev), out=pools)
        kf = k.float().to(t.kmin.device)  # the summaries and every decision live on the host
        idx = recs.view(-1, 1, 1).expand_as(kf)
        t.kmin[layer].scatter_reduce_(0, idx, kf, "amin")
        t.kmax[layer].scatter_reduce_(0, idx, kf, "amax")
        t.sal_sum[layer].index_add_(0, recs, saliency)

    def summaries(self, layer: int | slice, rows, tokens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the scorer reads of pages ``rows`` (written ``tokens`` each) in ``layer`` (or every
        layer with ``slice(None)``): element-wise key min and max [..., N, KVH, D] and the mean
        saliency [..., N]."""
        t = self.table
        return t.kmin[layer, rows], t.kmax[layer, rows], t.sal_sum[layer, rows] / tokens.clamp(min=1)

    def attended(self, layer: int | slice, seq: SeqStep, selected: torch.Tensor, *, decode: bool) -> torch.Tensor:
        """The selected pages the step attends: every one in exact mode and in prefill (the
        non-resident ones streamed through the staging area); in masked mode's decode steps the
        resident ones and those the prefetcher staged only (the others are counted as masked)."""
        if not decode or self.config.selection.mode == "exact":
            return selected
        return selected & (self.resident(layer, seq.rows) | self.table.staged[layer, seq.rows])

    def read_pages(self, layers: int | torch.Tensor, recs: torch.Tensor, dtype: torch.dtype, *,
                   exact: bool | torch.Tensor = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [N, KVH, P, D] of pages (``layers``, ``recs``) in ``dtype``, from whichever tier
        holds them: the device pool, the warm pool decoded (``exact``: their host / disk copy
        instead — for every page, or [N] bool per page), else the host or disk copy. Counts
        nothing: :meth:`record_access` and :meth:`admit` account what a step reads and fetches."""
        t = self.table
        if self._pending:
            self._settle()
        dev = self.device.device  # the pages come back where the device pool lives
        if isinstance(layers, int):
            dslot = t.device_slot[layers].index_select(0, recs)
            if bool((dslot >= 0).all()):  # the common case: a view of the pool, one gather
                dslot = dslot.to(dev)
                return (self.device.k[layers].index_select(0, dslot).to(dtype),
                        self.device.v[layers].index_select(0, dslot).to(dtype))
            layers = torch.full_like(recs, layers)
        k = torch.empty((len(recs), self.kv_heads, self.P, self.head_dim), dtype=dtype, device=dev)
        v = torch.empty_like(k)
        dslot, wslot, hslot = t.device_slot[layers, recs], t.warm_slot[layers, recs], t.host_slot[layers, recs]
        full = dslot >= 0
        warm = ~full & (wslot >= 0) & ~torch.as_tensor(exact)
        on_host = ~full & ~warm & (hslot >= 0)
        on_disk = ~full & ~warm & ~on_host
        for where, read, slots, copy in ((full, self.device.read, dslot, False),
                                         (warm, self.warm and self.warm.read, wslot, False),  # decoded on the device
                                         (on_host, self.host.read, hslot, True),
                                         (on_disk, self.disk and self.disk.read, None, True)):
            idx = where.nonzero().flatten()
            if not len(idx):
                continue
            if slots is None:  # the disk tier
                slots = t.disk_slot[layers, recs]
                if bool((slots[idx] < 0).any()):
                    raise RuntimeError("internal: a page has no copy in any tier")  # the invariant tests guard this
            ks, vs = read(layers[idx], slots[idx])
            if copy:  # off the device: one batched copy per tier
                ks, vs = self.transfers.to_device(ks, vs, dtype=dtype, pages=len(idx))
            idx = idx.to(dev)
            k.index_copy_(0, idx, ks.to(dtype))
            v.index_copy_(0, idx, vs.to(dtype))
        return k, v

    def record_access(self, layer: int | slice, seq: SeqStep, *, decode: bool, selected: torch.Tensor,
                      attended: torch.Tensor, importance: torch.Tensor, mass: torch.Tensor,
                      exact: torch.Tensor | None = None, relevance: torch.Tensor | None = None) -> None:
        """What the step did with one sequence's pages in ``layer`` (a layer [M], or every layer
        at once with ``slice(None)`` and [L, M] tensors): the pages it needed and missed (decode;
        T0 excluded), masked misses, the pages streamed through the staging area, the attention
        mass (0 where not attended) and the importance kept between steps. Accounts the step's
        reads of pages that are not full-precision resident (warm decodes; streamed pages,
        staging rounds, host-to-device and disk bytes). A page shared by several sequences
        collects from each: flags or-ed, masses summed, the highest importance kept."""
        acc, t, m, rows = self._access, self.table, self.metrics, seq.rows
        resident = self.resident(layer, rows)
        staged = t.staged[layer, rows]  # on the device already: copied ahead by the prefetcher
        if decode:
            need = selected & ~seq.t0
            acc.needed[layer, rows] |= need
            acc.missing[layer, rows] |= need & ~resident & ~staged
            m.masked += int((selected & ~attended).sum())
        acc.streamed[layer, rows] |= attended & ~resident
        acc.mass[layer, rows] += mass
        first = ~acc.scored[layer, rows]
        acc.importance[layer, rows] = torch.where(first, importance, torch.maximum(acc.importance[layer, rows],
                                                                                   importance))
        relevance = (mass if relevance is None else relevance).detach()
        acc.relevance[layer, rows] = torch.where(first, relevance, torch.maximum(acc.relevance[layer, rows],
                                                                                 relevance))
        acc.scored[layer, rows] = True
        off = attended & (t.device_slot[layer, rows] < 0)
        warm = attended & self.warm_only(layer, rows)
        if exact is not None:  # warm pages read from their exact copy (warm.exact_reads) are streamed
            warm = warm & ~exact
            acc.streamed[layer, rows] |= exact
        streamed = off & ~warm & ~staged
        m.warm_reads += int(warm.sum())
        per_layer = streamed.sum(-1)
        m.streamed_pages += int(per_layer.sum())
        m.staging_rounds += int((-(-per_layer // max(1, self.staging_pages))).sum())
        self._count_h2d(int(per_layer.sum()), int((streamed & (t.host_slot[layer, rows] < 0)).sum()))

    def seq_access(self, seq: int) -> StepAccess:
        """The open step's access record of one sequence's pages: [L, M] columns."""
        return self._access.columns(self.records_of(seq))

    def tiers(self) -> torch.Tensor:
        """[L, R] int8: the tier holding each page now (``step.TIER_CODES``; dead records: disk)."""
        t = self.table
        tier = torch.full(t.device_slot.shape, TIER_CODES["disk"], dtype=torch.int8)
        tier[t.host_slot >= 0] = TIER_CODES["host"]
        tier[t.warm_slot >= 0] = TIER_CODES["warm"]
        tier[t.device_slot >= 0] = TIER_CODES["device"]
        return tier

    def _count_h2d(self, pages: int, from_disk: int) -> None:
        """Account ``pages`` pages copied host -> device, ``from_disk`` of them read from the disk tier."""
        self.metrics.bytes_h2d += pages * self.page_bytes
        self.metrics.bytes_disk_read += from_disk * self.page_bytes

    # ------------------------------------------------------------------ moves
    def _ensure_host_room(self, need: torch.Tensor, leaving: torch.Tensor) -> None:
        """Free host slots per layer [L] when the host budget is bounded: drop host copies of
        device-resident pages first (no bytes move), then spill the lowest-priority host-only
        pages to disk."""
        if self.host.max_capacity is None:
            return
        short = (need - self.host.free()).clamp(min=0)
        if not short.any():
            return
        t = self.table
        prio = self.policy.priority(self._stats())
        # 1) host copies of pages that stay resident: cheapest (they become dirty again)
        cand = (t.host_slot >= 0) & (t.device_slot >= 0) & ~leaving
        short = self._drop_host_copies(cand, prio, short, spill=False)
        if short.any():
            if self.disk is None:
                raise KVCacheFullError(
                    f"host budget ({self.host.max_capacity} pages per layer) is full and no disk tier (disk_path) "
                    "is configured; a demoted page would be lost. Raise host_budget or set disk_path.")
            cand = (t.host_slot >= 0) & (t.device_slot < 0)
            self._drop_host_copies(cand, prio, short, spill=True)

    def _spill(self, layers: torch.Tensor, recs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Pages onto the disk tier (T4)."""
        slots = self.disk.alloc(layers, recs)
        self.disk.write(layers, slots, k, v)
        self.table.disk_slot[layers, recs] = slots
        self.metrics.spilled_pages += len(recs)
        self.metrics.bytes_disk_write += len(recs) * self.page_bytes

    def _drop_host_copies(self, cand: torch.Tensor, prio: torch.Tensor, short: torch.Tensor, *, spill: bool):
        self._settle()
        t = self.table
        layers, recs = self._lowest(cand, prio, short)
        if len(recs):
            if spill:  # a page read ahead from disk still has its disk copy: nothing to write
                new = t.disk_slot[layers, recs] < 0
                sl, sr = layers[new], recs[new]
                if len(sr):
                    self._spill(sl, sr, *self.host.read(sl, t.host_slot[sl, sr]))
            self.host.release(layers, t.host_slot[layers, recs])
            t.host_slot[layers, recs] = -1
        got = torch.bincount(layers, minlength=self.L)
        return (short - got).clamp(min=0)

    def evict(self, layers: torch.Tensor, recs: torch.Tensor) -> None:
        """Full-precision pages leave the device; dirty ones (no host/disk copy) are written
        back first."""
        if len(recs) == 0:
            return
        t = self.table
        self._unprefetch(layers, recs)
        self._write_back(layers, recs)
        self.device.release(layers, t.device_slot[layers, recs])
        t.device_slot[layers, recs] = -1
        t.t1[layers, recs] = False
        self.metrics.evicted_pages += len(recs)

    def _write_back(self, layers: torch.Tensor, recs: torch.Tensor) -> None:
        """Copy the dirty ones of these full-precision device pages to the host; when more
        leave at once than a bounded host tier can take, the rest go on to the disk tier."""
        t = self.table
        dirty = (t.host_slot[layers, recs] < 0) & (t.disk_slot[layers, recs] < 0)
        if not dirty.any():
            return
        dirty_layers, dirty_recs = layers[dirty], recs[dirty]
        leaving = torch.zeros(self.L, t.capacity, dtype=torch.bool)
        leaving[layers, recs] = True
        self._ensure_host_room(torch.bincount(dirty_layers, minlength=self.L), leaving)
        k, v = self.transfers.to_host(*self.device.read(dirty_layers, t.device_slot[dirty_layers, dirty_recs]),
                                      pages=len(dirty_recs))
        to_host = torch.ones(len(dirty_recs), dtype=torch.bool)
        if self.host.max_capacity is not None:
            rank, _ = _rank_within_groups(dirty_layers, self.L)
            to_host = rank < self.host.free()[dirty_layers]
        if to_host.any():
            slots = self.host.alloc(dirty_layers[to_host], dirty_recs[to_host])
            self.host.write(dirty_layers[to_host], slots, k[to_host], v[to_host])
            t.host_slot[dirty_layers[to_host], dirty_recs[to_host]] = slots
        if not to_host.all():  # _ensure_host_room guarantees a disk tier here
            self._spill(dirty_layers[~to_host], dirty_recs[~to_host], k[~to_host], v[~to_host])
        self.metrics.writebacks += len(dirty_recs)
        self.metrics.bytes_d2h += len(dirty_recs) * self.page_bytes

    def demote(self, layers: torch.Tensor, recs: torch.Tensor, protect: torch.Tensor | None = None) -> None:
        """Full-precision device pages the policy let go: into the warm sub-tier when there is
        one (compressed; the warm tier drops its lowest-priority pages for room, never
        ``protect``-ed ones), else off the device. Pages beyond the warm capacity leave."""
        if self.warm is None or len(recs) == 0:
            self.evict(layers, recs)
            return
        t = self.table
        self._write_back(layers, recs)  # the host keeps the exact copy
        need = torch.bincount(layers, minlength=self.L)
        short = (need - self.warm.free()).clamp(min=0)
        if short.any():
            cand = t.warm_slot >= 0
            if protect is not None:
                cand &= ~protect
            drop_layers, drop_recs = self._lowest(cand, self.policy.priority(self._stats()), short)
            self.warm.release(drop_layers, t.warm_slot[drop_layers, drop_recs])
            t.warm_slot[drop_layers, drop_recs] = -1
            self.metrics.warm_drops += len(drop_recs)
        rank, _ = _rank_within_groups(layers, self.L)
        fits = rank < self.warm.free()[layers]
        if (~fits).any():
            self.evict(layers[~fits], recs[~fits])
        layers, recs = layers[fits], recs[fits]
        if len(recs) == 0:
            return
        self._unprefetch(layers, recs)
        k, v = self.device.read(layers, t.device_slot[layers, recs])
        slots = self.warm.alloc(layers, recs)
        self.warm.write(layers, slots, k, v)
        t.warm_slot[layers, recs] = slots
        self.device.release(layers, t.device_slot[layers, recs])
        t.device_slot[layers, recs] = -1
        t.t1[layers, recs] = False
        self.metrics.compressed_pages += len(recs)
        self.metrics.evicted_pages += len(recs)

    def admit(self, layers: torch.Tensor, recs: torch.Tensor, *, already_streamed: torch.Tensor | None = None) -> None:
        """Non-resident pages become resident (free slots must exist), copied exact from the
        host or disk. Pages streamed this step adopt their staging copy: no second transfer is
        counted."""
        if len(recs) == 0:
            return
        t = self.table
        self.metrics.warm_promotions += self._drop_warm(layers, recs)  # a warm copy gives way to the exact page
        slots = self.device.alloc(layers, recs)
        assert slots is not None, "admit() called without room"
        fresh = torch.ones(len(recs), dtype=torch.bool) if already_streamed is None else ~already_streamed
        from_disk = fresh & (t.host_slot[layers, recs] < 0)
        k, v = self.read_pages(layers, recs, self.device.dtype, exact=True)
        self._count_h2d(int(fresh.sum()), int(from_disk.sum()))
        self.device.write(layers, slots, k, v)
        t.device_slot[layers, recs] = slots
        self.metrics.fetched_pages += len(recs)

    def _unprefetch(self, layers, recs) -> None:
        """Pages leaving the device (or freed) that the prefetcher brought in and no step used:
        wasted prefetch."""
        t = self.table
        wasted = t.prefetched[layers, recs] | t.staged[layers, recs]
        self.metrics.prefetch_wasted += int(wasted.sum())
        t.prefetched[layers, recs] = False
        t.staged[layers, recs] = False

    def prefetch(self, scores: torch.Tensor, max_pages: int, *, layer_ahead: bool = False) -> int:
        """Bring predicted pages onto the device ahead of the steps that need them: ``scores``
        [L, R] (> 0: predicted; higher first). Per layer at most ``max_pages`` non-resident
        predicted pages are admitted (exact copies from the host or disk), into free slots or
        in place of resident pages that are neither T0 nor predicted (the policy's victims). A
        prefetch never changes what a step attends in exact mode: a page the predictor missed
        is still fetched before use. ``layer_ahead``: issued inside a step for a later layer
        (counted apart: its copy overlaps one layer's compute, not a step's). Returns the pages
        admitted."""
        t, m = self.table, self.metrics
        predicted = (scores > 0) & t.alive.unsqueeze(0)
        want = predicted & (t.device_slot < 0) & (t.warm_slot < 0) & ~t.staged
        if max_pages <= 0 or not want.any():
            return 0
        counts = want.sum(1).clamp(max=max_pages)
        room = counts if self.resident_cap is None else self._make_room(counts, protect=predicted)
        layers, recs = self._highest(want, scores, room)
        if len(recs):
            self.admit(layers, recs)
            t.prefetched[layers, recs] = True
            want[layers, recs] = False
        n = len(recs)
        # the rest, up to the budget: into the staging area, for the next step only
        stage = (counts - room).clamp(min=0).clamp(max=self.staging_pages) - t.staged.sum(1)
        if bool((stage > 0).any()):
            s_layers, s_recs = self._highest(want, scores, stage.clamp(min=0))
            t.staged[s_layers, s_recs] = True
            self._count_h2d(len(s_recs), int((t.host_slot[s_layers, s_recs] < 0).sum()))
            n += len(s_recs)
        m.prefetched_pages += n
        m.bytes_prefetch += n * self.page_bytes
        if layer_ahead:
            m.prefetch_layer_ahead_pages += n
        if self.disk is not None:  # the rest of the predicted pages that live on disk: to the host, asynchronously
            rest = want & ~t.staged & (t.host_slot < 0) & (t.disk_slot >= 0)
            if rest.any():
                self._read_ahead(*self._highest(rest, scores, torch.full((self.L,), max_pages)))
        return n

    def _read_ahead(self, layers: torch.Tensor, recs: torch.Tensor) -> int:
        """Disk (T4) -> host copies of pages predicted further ahead, read on a worker thread
        while the steps compute (the CPU backend's asynchronous copy path: host and "device"
        are the same memory here, the disk is not). Only into free host slots or those of host
        copies of resident pages (no bytes move); every reader of host or disk pages waits for
        them first (:meth:`_settle`)."""
        t = self.table
        if self.host.max_capacity is not None:  # room: host copies of resident pages go first (no bytes move)
            short = (torch.bincount(layers, minlength=self.L) - self.host.free()).clamp(min=0)
            if short.any():
                self._drop_host_copies((t.host_slot >= 0) & (t.device_slot >= 0),
                                       self.policy.priority(self._stats()), short, spill=False)
            rank, _ = _rank_within_groups(layers, self.L)
            keep = rank < self.host.free()[layers]
            layers, recs = layers[keep], recs[keep]
        if len(recs) == 0:
            return 0
        slots = self.host.alloc(layers, recs)
        t.host_slot[layers, recs] = slots
        mm, rows, cols = self.disk.mm, t.disk_slot[layers, recs].numpy().copy(), layers.numpy().copy()
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredkv-t4-read")
        self._pending.append((layers, slots, self._reader.submit(lambda: mm[rows, cols])))
        self.metrics.disk_read_ahead_pages += len(recs)
        self.metrics.bytes_disk_read += len(recs) * self.page_bytes
        return len(recs)

    def _settle(self) -> None:
        """Write the pages read ahead from disk into their host slots (waits for the reads)."""
        pending, self._pending = self._pending, []
        for layers, slots, fut in pending:
            data = fut.result()  # [N, 2, KVH, P, D]
            self.host.write(layers, slots, self.disk._to_torch(data[:, 0]), self.disk._to_torch(data[:, 1]))

    def close(self) -> None:
        """Wait for the reads in flight and stop the reader thread (no buffer or thread left)."""
        self._settle()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self.transfers.close()

    # ------------------------------------------------------------------ decisions
    def _stats(self) -> PageStats:
        t = self.table
        next_use = self.next_use(t) if self.next_use is not None else None
        return PageStats(t.last_access, t.frequency, t.importance, t.acc_mass, t.index.expand(self.L, -1), next_use)

    def _lowest(self, cand: torch.Tensor, prio: torch.Tensor, counts: torch.Tensor):
        """The ``counts[l]`` lowest-priority candidates of each layer -> (layers, records)."""
        counts = torch.minimum(counts, cand.sum(1))
        k = int(counts.max()) if len(counts) else 0
        if k == 0:
            return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
        p = prio.float().masked_fill(~cand, INF)
        order = torch.topk(p, k, dim=1, largest=False, sorted=True).indices  # [L, k]
        take = torch.arange(k).unsqueeze(0) < counts.unsqueeze(1)
        layers = torch.arange(self.L).unsqueeze(1).expand(-1, k)[take]
        return layers, order[take]

    def _highest(self, cand: torch.Tensor, prio: torch.Tensor, counts: torch.Tensor):
        return self._lowest(cand, -prio, counts)

    def _candidates(self, protect: torch.Tensor | None) -> torch.Tensor:
        """Full-precision resident pages that may leave the device: not T0, not ``protect``-ed."""
        cand = (self.table.device_slot >= 0) & ~self.table.t0.unsqueeze(0)
        return cand if protect is None else cand & ~protect

    def _make_room(self, need: torch.Tensor, protect: torch.Tensor | None) -> torch.Tensor:
        """Evict lowest-priority pages so that ``need[l]`` slots are free per layer; returns
        the slots actually available per layer."""
        if self.resident_cap is None:
            return need
        free = self.resident_cap - self.device.used()
        short = (need - free).clamp(min=0)
        if short.any():
            layers, recs = self._lowest(self._candidates(protect), self.policy.priority(self._stats()), short)
            self.demote(layers, recs, protect)
        return torch.minimum(need, self.resident_cap - self.device.used())

    def end_step(self, *, decode: bool) -> None:
        """Close the open step: statistics from its access record, migration at window
        boundaries, demand admission of the pages it needed but did not find resident."""
        t_start = time.perf_counter()
        t, m, access = self.table, self.metrics, self._access
        if decode:
            self.step_no += 1
            m.decode_steps += 1
            t.last_access[access.needed] = self.step_no
            t.frequency += access.needed.long()
            t.win_access += access.needed.long()
            m.hits += int((access.needed & ~access.missing).sum())
            m.misses += int(access.missing.sum())
            used = access.needed & (t.prefetched | t.staged)  # there because the prefetcher brought them in
            m.prefetch_hits += int(used.sum())
            t.prefetched &= ~used
            t.hist = ((t.hist << 1) & HIST_MASK) | access.needed.long()
        else:
            m.prefill_steps += 1
        m.prefetch_wasted += int((t.staged & ~access.needed).sum())  # staged for this step, not used by it
        t.acc_mass += access.mass
        t.last_relevance = torch.where(access.scored, access.relevance, t.last_relevance)
        t.importance = torch.where(access.scored, access.importance, t.importance)
        if decode and self.step_no % self.config.migration.window_steps == 0:
            self._migrate()
        want = (access.missing | (access.needed & t.staged)) & (t.device_slot < 0) & t.alive.unsqueeze(0)
        t.staged.zero_()  # the staging area is the step's: what it held is adopted below or gone
        if want.any() and self.resident_cap is not None:
            room = self._make_room(want.sum(1), protect=access.needed | want)
            layers, recs = self._highest(want, t.importance, room)
            self.admit(layers, recs, already_streamed=access.streamed[layers, recs])
        elif want.any():
            layers, recs = want.nonzero(as_tuple=True)
            self.admit(layers, recs, already_streamed=access.streamed[layers, recs])
        if decode and self.prefetcher is not None:
            self.prefetcher.between_steps(self)
        self._record_residency()
        self._access = None
        m.manager_seconds += time.perf_counter() - t_start

    def _migrate(self) -> None:
        """Window boundary: the design note's thresholds. Demote (device -> host) pages idle
        for ``demote_idle_windows`` windows or scoring below ``demote_score``; promote
        host pages accessed >= ``promote_accesses`` times this window with a score above
        ``promote_score`` into free device slots (a prefetch)."""
        c, t = self.config.migration, self.table
        t.idle_windows = torch.where(t.win_access > 0, torch.zeros_like(t.idle_windows), t.idle_windows + 1)
        if self.resident_cap is not None:
            demote = self._candidates(None) & ((t.idle_windows >= c.demote_idle_windows) |
                                               (t.importance < c.demote_score))
            layers, recs = demote.nonzero(as_tuple=True)
            self.demote(layers, recs)
            self.metrics.demotions += len(recs)
            if self.warm is not None:
                self._promote_warm()
            promote = (t.alive.unsqueeze(0) & (t.device_slot < 0) & (t.win_access >= c.promote_accesses)
                       & (t.importance > c.promote_score))
            room = (self.resident_cap - self.device.used()).clamp(min=0)
            layers, recs = self._highest(promote, t.importance, room)
            self.admit(layers, recs)
            self.metrics.promotions += len(recs)
        self._update_hot_keys()
        t.win_access.zero_()

    def _promote_warm(self) -> None:
        """Warm pages that turned hot (the promotion thresholds) get a full-precision slot
        again, re-fetched exact from the host; full-precision victims take their place."""
        c, t = self.config.migration, self.table
        hot = (t.warm_slot >= 0) & (t.win_access >= c.promote_accesses) & (t.importance > c.promote_score)
        if not hot.any():
            return
        room = self._make_room(hot.sum(1), protect=hot)
        layers, recs = self._highest(hot & (t.warm_slot >= 0), t.importance, room)
        self.admit(layers, recs)  # counts the promotions as it releases the warm copies

    def _update_hot_keys(self) -> None:
        """At a window boundary. T1: up to ``hot_key_pages`` resident non-T0 pages per layer, the most frequently
        accessed among those with >= promote_accesses accesses and score > promote_score;
        a T1 page idle too long or scoring below demote_score falls back to T2."""
        cap = self.budgets.hot_key_pages
        if cap == 0:
            return
        c, t = self.config.migration, self.table
        resident = self._candidates(None)
        keep = t.t1 & resident & (t.idle_windows < c.demote_idle_windows) & (t.importance >= c.demote_score)
        self.metrics.hot_key_demotions += int((t.t1 & resident & ~keep).sum())
        eligible = resident & ~keep & (t.frequency >= c.promote_accesses) & (t.importance > c.promote_score)
        room = (cap - keep.sum(1)).clamp(min=0)
        layers, recs = self._highest(eligible, t.frequency.float(), room)
        t.t1 = keep
        t.t1[layers, recs] = True
        self.metrics.hot_key_promotions += len(recs)

    # ------------------------------------------------------------------ accounting
    def tier_counts(self) -> dict[str, int]:
        t = self.table
        alive = t.alive.unsqueeze(0)
        dev = (t.device_slot >= 0) & alive
        t0 = dev & t.t0.unsqueeze(0)
        t1 = dev & t.t1 & ~t0
        warm = (t.warm_slot >= 0) & alive
        host_only = alive & ~dev & ~warm & (t.host_slot >= 0)
        return {"T0": int(t0.sum()), "T1": int(t1.sum()), "T2": int((dev & ~t0 & ~t1).sum()),
                "T2w": int(warm.sum()), "T3": int(host_only.sum()),
                "T4": int((alive & ~dev & ~warm & ~host_only & (t.disk_slot >= 0)).sum())}

    def tier_bytes(self, counts: dict[str, int] | None = None) -> dict[str, int]:
        """Bytes per tier now (or of the given page counts); the metrics are left as they are."""
        counts = self.tier_counts() if counts is None else counts
        return {tier: n * (self.warm_page_bytes if tier == "T2w" else self.page_bytes) for tier, n in counts.items()}

    @property
    def warm_page_bytes(self) -> int:
        return 0 if self.warm is None else self.warm.page_bytes

    def resident_bytes(self) -> int:
        """Device-owned page bytes: full-precision pages plus encoded warm pages."""
        warm = 0 if self.warm is None else int(self.warm.used().sum()) * self.warm.page_bytes
        return int(self.device.used().sum()) * self.page_bytes + warm

    def _record_residency(self) -> None:
        """Per step: the device-owned bytes (the resident-bytes-over-time series)."""
        m = self.metrics
        rb = self.resident_bytes()
        m.resident_bytes_trace.append(rb)
        m.resident_bytes_max = max(m.resident_bytes_max, rb)

    def refresh_metrics(self) -> TierMetrics:
        """Bring the point-in-time figures (pages and bytes per tier, summary bytes) up to date."""
        m = self.metrics
        counts = self.tier_counts()
        m.pages_per_tier = counts
        m.bytes_per_tier = self.tier_bytes(counts)
        m.warm_bytes_saved = counts["T2w"] * (self.page_bytes - self.warm_page_bytes)
        m.summary_bytes = int(self.table.alive.sum()) * self.L * 2 * self.kv_heads * self.head_dim * 4
        return m

    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant (module docstring) does not hold."""
        t = self.table
        t.check()
        alive = t.alive
        for pool, slots in self._pools():
            if pool is None:
                assert (slots < 0).all()
                continue
            layers, recs = (slots >= 0).nonzero(as_tuple=True)
            assert alive[recs].all(), f"{pool.name}: slot held by a dead record"
            assert (pool.owner[layers, slots[layers, recs]] == recs).all(), f"{pool.name}: owner/slot mismatch"
            assert int((pool.owner >= 0).sum()) == len(recs), f"{pool.name}: orphan slot"
            if pool.max_capacity is not None:
                assert int(pool.used().max()) <= pool.max_capacity, f"{pool.name}: over capacity"
        live = alive.unsqueeze(0).expand(self.L, -1)
        has_copy = (t.device_slot >= 0) | (t.host_slot >= 0) | (t.disk_slot >= 0)
        written = (t.tokens > 0).unsqueeze(0) & live
        assert has_copy[written].all(), "a written page has no copy in any tier (lost)"
        warm = t.warm_slot >= 0
        assert not (warm & (t.device_slot >= 0)).any(), "a page is both full precision and warm on the device"
        assert ((t.host_slot >= 0) | (t.disk_slot >= 0))[warm].all(), "a warm page has no exact copy"
        assert ((t.device_slot >= 0) | ~(live & t.t0.unsqueeze(0))).all(), "a T0 page is not resident"
        assert not (t.staged & ((t.device_slot >= 0) | (t.warm_slot >= 0) | ~live)).any(), \
            "a staged page is resident or dead"
        assert int(t.staged.sum(1).max()) <= self.staging_pages, "the staging area is over its pages"
        assert not (t.prefetched & (t.device_slot < 0)).any(), "a pending prefetched page is not resident"
        if self.resident_cap is not None:
            assert int(self.device.used().max()) <= self.resident_cap, "device over the resident capacity"
        counts = self.tier_counts()  # every live page of every layer is in exactly one tier
        assert sum(counts.values()) == self.L * int(alive.sum()), f"tier counts {counts} do not cover the live pages"
        if not self._restored:  # the move counters balance the pools (a rollback restores pools, not counters)
            m = self.metrics
            dev = m.created_pages + m.fetched_pages + m.copied_pages - m.evicted_pages - m.released_pages
            assert int(self.device.used().sum()) == dev, "device slots do not balance the counted moves"
            if self.warm is not None:
                warm = m.compressed_pages - m.warm_promotions - m.warm_drops - m.released_warm_pages
                assert int(self.warm.used().sum()) == warm, "warm slots do not balance the counted moves"

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
