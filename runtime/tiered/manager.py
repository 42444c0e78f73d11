"""TierManager: where every page of every layer lives, and every decision that moves it.

Pages are *records* shared by all layers (record r is logical page i of sequence s in
every layer); residency and statistics are per (layer, record): [L, R] tensors, so a
decision is a handful of vectorized ops over all layers at once — no per-page Python.

Tiers (DESIGN.md, "the honest tiers"):
  T0 hot      device; the sink pages, the recent-window pages and the page being written
              of each sequence; never evicted, always attended;
  T1 hot keys device; a label on the most-accessed resident pages (capacity
              ``hot_key_pages`` per layer). On CUDA this region is what an L2
              access-policy window would cover; here it is accounting only;
  T2 device   the other resident pages; T0 + T1 + T2 <= the device budget minus staging;
  T2w warm    (with ``warm_codec``) pages encoded with a KV codec in a fixed share of the
              device bytes: the policy's victims and the pages demoted at window
              boundaries are written back to the host when dirty (the host keeps the exact
              copy), then compressed here instead of leaving the device; attention decodes
              them; a warm page that turns hot (migration thresholds) is re-fetched exact
              from the host into a full-precision slot; under pressure the warm tier drops
              its lowest-priority pages (no bytes move: the host copy exists);
  T3 host     every page that has been written back (inclusive: a clean resident page
              keeps its host copy, so evicting it moves no bytes);
  T4 disk     host overflow, in a memory-mapped file (optional).

Invariants (the property tests check them after every step):
  * every live page has at least one copy (device, host or disk) — nothing is lost;
    a warm (compressed) page always has an exact copy on the host or disk;
  * a page is never both full-precision and warm on the device;
  * slot tables and pool owners are each other's inverse; no slot holds two pages;
  * device-owned pages per layer <= resident capacity; host pages <= host budget;
  * every live page of every layer is counted in exactly one tier, and the counted moves
    balance the pools: device slots = created + fetched - evicted - released, warm slots =
    compressed - warm promotions - warm drops - released;
  * freeing a sequence returns all of its slots and records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tieredkv.errors import KVCacheFullError
from tieredkv.runtime.tiered.config import ResolvedBudgets, TieredKVConfig
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.policies import PageStats, ReplacementPolicy
from tieredkv.runtime.tiered.store import DiskPool, TierPool, WarmPool, _rank_within_groups

INF = float("inf")


@dataclass
class StepAccess:
    """What one step did, per (layer, record): pages it needed (selected, T0 excluded),
    which of those were not resident, the attention mass each page received, and the
    importance the scorer gave each page."""

    needed: torch.Tensor  # [L, R] bool
    missing: torch.Tensor  # [L, R] bool
    streamed: torch.Tensor  # [L, R] bool: copied to staging this step (exact misses, prefill)
    mass: torch.Tensor  # [L, R] float
    importance: torch.Tensor  # [L, R] float
    scored: torch.Tensor  # [L, R] bool: importance was computed


class TierManager:
    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 config: TieredKVConfig, budgets: ResolvedBudgets, policy: ReplacementPolicy,
                 device: str = "cpu") -> None:
        self.L, self.P = num_layers, config.page_size
        self.config, self.budgets, self.policy = config, budgets, policy
        self.kv_heads, self.head_dim = kv_heads, head_dim
        unlimited = policy.unlimited or budgets.device_pages is None
        self.resident_cap = None if unlimited else budgets.resident_pages
        self.device = TierPool("device", num_layers, kv_heads, self.P, head_dim, dtype, self.resident_cap, device=device)
        self.host = TierPool("host", num_layers, kv_heads, self.P, head_dim, dtype, budgets.host_pages, pin=True)
        self.disk = (DiskPool(config.disk_path, num_layers, kv_heads, self.P, head_dim, dtype)
                     if config.disk_path else None)
        self.warm = None
        if config.warm_codec is not None and not unlimited and budgets.warm_pages > 0:
            from tieredkv.plugins.codec import CODECS

            self.warm = WarmPool(num_layers, CODECS[config.warm_codec], (kv_heads, self.P, head_dim),
                                 budgets.warm_pages, device=device)
        self.staging_pages = 0 if unlimited else budgets.staging_pages
        self.page_bytes = self.device.page_bytes
        self.metrics = TierMetrics()
        self.step_no = 0  # decode steps so far (the clock of recency statistics)
        self.next_use_fn = None  # set by the trace replayer for the Belady oracle
        self._restored = False  # a rollback happened (the move counters no longer balance the pools)
        # records
        self.R = 0
        self.free_records: list[int] = []
        self.seq_pages: dict[int, list[int]] = {}
        self.seq_len: dict[int, int] = {}
        self._alloc_records(64)

    # ------------------------------------------------------------------ records
    def _alloc_records(self, n: int) -> None:
        old, new = self.R, self.R + n
        L = self.L

        def grow(t: torch.Tensor | None, fill, shape_tail=(), dtype=torch.long, per_layer=True):
            shape = ((L, n) if per_layer else (n,)) + tuple(shape_tail)
            pad = torch.full(shape, fill, dtype=dtype)
            if t is None:
                return pad
            return torch.cat([t, pad], dim=1 if per_layer else 0)

        g = lambda name, *a, **k: setattr(self, name, grow(getattr(self, name, None), *a, **k))  # noqa: E731
        g("rec_seq", -1, per_layer=False)
        g("rec_index", 0, per_layer=False)
        g("rec_tokens", 0, per_layer=False)
        g("rec_t0", False, dtype=torch.bool, per_layer=False)
        g("dev_slot", -1)
        g("host_slot", -1)
        g("disk_slot", -1)
        g("warm_slot", -1)
        g("last_access", 0)
        g("frequency", 0)
        g("win_access", 0)
        g("idle_windows", 0)
        g("t1", False, dtype=torch.bool)
        g("importance", 0.0, dtype=torch.float32)
        g("acc_mass", 0.0, dtype=torch.float32)
        g("kmin", INF, (self.kv_heads, self.head_dim), dtype=torch.float32)
        g("kmax", -INF, (self.kv_heads, self.head_dim), dtype=torch.float32)
        g("sal_sum", 0.0, dtype=torch.float32)
        self.free_records.extend(range(new - 1, old - 1, -1))
        self.R = new

    def _new_record(self, seq: int, index: int) -> int:
        if not self.free_records:
            self._alloc_records(self.R)
        r = self.free_records.pop()
        self.rec_seq[r], self.rec_index[r], self.rec_tokens[r], self.rec_t0[r] = seq, index, 0, True
        for name, value in (("dev_slot", -1), ("host_slot", -1), ("disk_slot", -1), ("warm_slot", -1), ("frequency", 0),
                            ("win_access", 0), ("idle_windows", 0), ("t1", False), ("importance", 1.0),
                            ("acc_mass", 0.0), ("kmin", INF), ("kmax", -INF), ("sal_sum", 0.0)):
            getattr(self, name)[:, r] = value
        self.last_access[:, r] = self.step_no
        return r

    @property
    def alive(self) -> torch.Tensor:
        return self.rec_seq >= 0

    def _pools(self):
        """(pool, slot table) of every tier that may hold pages."""
        return ((self.device, self.dev_slot), (self.warm, self.warm_slot), (self.host, self.host_slot),
                (self.disk, self.disk_slot))

    def resident(self, layer: int, rows) -> torch.Tensor:
        """Device-resident (full precision or warm) mask of records ``rows`` in ``layer``."""
        return (self.dev_slot[layer, rows] >= 0) | (self.warm_slot[layer, rows] >= 0)

    def read_warm(self, layer: int, recs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode warm pages of one layer for attention (float32)."""
        self.metrics.warm_reads += len(recs)
        layers = torch.full_like(recs, layer)
        return self.warm.read(layers, self.warm_slot[layer, recs])

    def records_of(self, seq: int) -> torch.Tensor:
        return torch.tensor(self.seq_pages[seq], dtype=torch.long)

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq: int) -> None:
        self.seq_pages[seq] = []
        self.seq_len[seq] = 0

    def free_sequence(self, seq: int) -> None:
        recs = self.records_of(seq)
        self._drop_records(recs)
        del self.seq_pages[seq], self.seq_len[seq]

    def _drop_records(self, recs: torch.Tensor) -> None:
        if len(recs) == 0:
            return
        for pool, table in self._pools():
            if pool is None:
                continue
            sub = table[:, recs]
            layers, cols = (sub >= 0).nonzero(as_tuple=True)
            pool.release(layers, sub[layers, cols])
            table[:, recs] = -1
            if pool is self.device:
                self.metrics.released_pages += len(layers)
            elif pool is self.warm:
                self.metrics.released_warm_pages += len(layers)
        self.rec_seq[recs] = -1
        self.t1[:, recs] = False
        self.free_records.extend(recs.tolist())

    def truncate(self, seq: int, length: int) -> None:
        keep = -(-length // self.P)
        pages = self.seq_pages[seq]
        self._drop_records(torch.tensor(pages[keep:], dtype=torch.long))
        del pages[keep:]
        self.seq_len[seq] = min(self.seq_len[seq], length)
        if pages:
            self.rec_tokens[pages[-1]] = self.seq_len[seq] - (len(pages) - 1) * self.P
        self._update_t0()

    # ------------------------------------------------------------------ T0
    def _update_t0(self) -> None:
        c = self.config
        sink_pages = -(-c.sink_tokens // self.P)
        self.rec_t0.zero_()
        for seq, pages in self.seq_pages.items():
            if not pages:
                continue
            n = self.seq_len[seq]
            first_recent = max(0, n - c.recent_tokens) // self.P
            recs = torch.tensor(pages, dtype=torch.long)
            idx = torch.arange(len(pages))
            self.rec_t0[recs] = (idx < sink_pages) | (idx >= min(first_recent, len(pages) - 1))

    # ------------------------------------------------------------------ step begin: new pages
    def begin_step(self, seqs: tuple[int, ...], num_new: int) -> None:
        """Create the records the step's new tokens need and give them device slots,
        evicting by policy first when the resident capacity would be exceeded."""
        t0 = time.perf_counter()
        new: list[int] = []
        for seq in seqs:
            n = self.seq_len[seq] + num_new
            pages = self.seq_pages[seq]
            while len(pages) * self.P < n:
                pages.append(self._new_record(seq, len(pages)))
                new.append(pages[-1])
            self.seq_len[seq] = n
            for i in range(max(0, len(pages) - -(-num_new // self.P) - 1), len(pages)):
                self.rec_tokens[pages[i]] = min(self.P, n - i * self.P)
        self._update_t0()
        if new:
            recs = torch.tensor(new, dtype=torch.long)
            want = torch.zeros(self.L, self.R, dtype=torch.bool)
            want[:, recs] = True
            self._make_room(want.sum(1), protect=want)
            layers, cols = want.nonzero(as_tuple=True)
            slots = self.device.alloc(layers, cols)
            if slots is None:
                raise KVCacheFullError(
                    f"the device budget ({self.resident_cap} resident pages per layer) cannot take "
                    f"{len(new)} new page(s): every resident page is in T0 (sinks + recent window) of a live sequence. "
                    "Raise the device budget, lower recent_tokens, or run fewer sequences at once.")
            self.dev_slot[layers, cols] = slots
            self.metrics.created_pages += len(layers)
        self.metrics.manager_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ moves
    def _source_read(self, layers: torch.Tensor, recs: torch.Tensor,
                     count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of non-resident pages from the host (or disk). Bytes are counted for the
        pages where ``count`` is True (default: all)."""
        hs = self.host_slot[layers, recs]
        k = torch.empty((len(recs), self.kv_heads, self.P, self.head_dim), dtype=self.device.dtype)
        v = torch.empty_like(k)
        on_host = hs >= 0
        if on_host.any():
            k[on_host], v[on_host] = self.host.read(layers[on_host], hs[on_host])
        if (~on_host).any():
            ds = self.disk_slot[layers[~on_host], recs[~on_host]]
            if (ds < 0).any():
                raise RuntimeError("internal: a page has no copy in any tier")  # the invariant tests guard this
            k[~on_host], v[~on_host] = self.disk.read(layers[~on_host], ds)
        count = torch.ones(len(recs), dtype=torch.bool) if count is None else count
        self.metrics.bytes_disk_read += int((count & ~on_host).sum()) * self.page_bytes
        self.metrics.bytes_h2d += int(count.sum()) * self.page_bytes
        return k, v

    def stream(self, layer: int, recs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy non-resident pages of one layer into the staging area (for one step's attention)."""
        self.count_stream(layer, recs)
        return self.fetch(layer, recs)

    def fetch(self, layer: int, recs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of non-resident pages of one layer from their host/disk copies, not accounted
        (the caller accounts what it uses with :meth:`count_stream`)."""
        return self._source_read(torch.full_like(recs, layer), recs, torch.zeros(len(recs), dtype=torch.bool))

    def count_stream(self, layer: int, recs: torch.Tensor) -> None:
        """Account one step's streaming of non-resident pages ``recs`` of one layer: pages,
        staging rounds, host-to-device bytes and the disk reads among them."""
        if not len(recs):
            return
        m = self.metrics
        m.streamed_pages += len(recs)
        m.staging_rounds += -(-len(recs) // max(1, self.staging_pages))
        m.bytes_disk_read += int((self.host_slot[layer, recs] < 0).sum()) * self.page_bytes
        m.bytes_h2d += len(recs) * self.page_bytes

    def _ensure_host_room(self, need: torch.Tensor, leaving: torch.Tensor) -> None:
        """Free host slots per layer [L] when the host budget is bounded: drop host copies of
        device-resident pages first (no bytes move), then spill the lowest-priority host-only
        pages to disk."""
        if self.host.max_capacity is None:
            return
        short = (need - self.host.free()).clamp(min=0)
        if not short.any():
            return
        prio = self.policy.priority(self._stats())
        # 1) host copies of pages that stay resident: cheapest (they become dirty again)
        cand = (self.host_slot >= 0) & (self.dev_slot >= 0) & ~leaving
        short = self._drop_host_copies(cand, prio, short, spill=False)
        if short.any():
            if self.disk is None:
                raise KVCacheFullError(
                    f"host budget ({self.host.max_capacity} pages per layer) is full and no disk tier (disk_path) "
                    "is configured; a demoted page would be lost. Raise host_budget or set disk_path.")
            cand = (self.host_slot >= 0) & (self.dev_slot < 0)
            self._drop_host_copies(cand, prio, short, spill=True)

    def _drop_host_copies(self, cand: torch.Tensor, prio: torch.Tensor, short: torch.Tensor, *, spill: bool):
        layers, recs = self._lowest(cand, prio, short)
        if len(recs):
            if spill:
                k, v = self.host.read(layers, self.host_slot[layers, recs])
                ds = self.disk.alloc(layers, recs)
                self.disk.write(layers, ds, k, v)
                self.disk_slot[layers, recs] = ds
                self.metrics.spilled_pages += len(recs)
                self.metrics.bytes_disk_write += len(recs) * self.page_bytes
            self.host.release(layers, self.host_slot[layers, recs])
            self.host_slot[layers, recs] = -1
        got = torch.bincount(layers, minlength=self.L)
        return (short - got).clamp(min=0)

    def evict(self, layers: torch.Tensor, recs: torch.Tensor) -> None:
        """Full-precision pages leave the device; dirty ones (no host/disk copy) are written
        back first."""
        if len(recs) == 0:
            return
        self._write_back(layers, recs)
        self.device.release(layers, self.dev_slot[layers, recs])
        self.dev_slot[layers, recs] = -1
        self.t1[layers, recs] = False
        self.metrics.evicted_pages += len(recs)

    def _write_back(self, layers: torch.Tensor, recs: torch.Tensor) -> None:
        """Copy the dirty ones of these full-precision device pages to the host; when more
        leave at once than a bounded host tier can take, the rest go on to the disk tier."""
        dirty = (self.host_slot[layers, recs] < 0) & (self.disk_slot[layers, recs] < 0)
        if not dirty.any():
            return
        dl, dr = layers[dirty], recs[dirty]
        leaving = torch.zeros(self.L, self.R, dtype=torch.bool)
        leaving[layers, recs] = True
        self._ensure_host_room(torch.bincount(dl, minlength=self.L), leaving)
        k, v = self.device.read(dl, self.dev_slot[dl, dr])
        to_host = torch.ones(len(dr), dtype=torch.bool)
        if self.host.max_capacity is not None:
            rank, _ = _rank_within_groups(dl, self.L)
            to_host = rank < self.host.free()[dl]
        if to_host.any():
            hs = self.host.alloc(dl[to_host], dr[to_host])
            self.host.write(dl[to_host], hs, k[to_host], v[to_host])
            self.host_slot[dl[to_host], dr[to_host]] = hs
        if not to_host.all():  # _ensure_host_room guarantees a disk tier here
            ol, orr = dl[~to_host], dr[~to_host]
            ds = self.disk.alloc(ol, orr)
            self.disk.write(ol, ds, k[~to_host], v[~to_host])
            self.disk_slot[ol, orr] = ds
            self.metrics.spilled_pages += len(orr)
            self.metrics.bytes_disk_write += len(orr) * self.page_bytes
        self.metrics.writebacks += len(dr)
        self.metrics.bytes_d2h += len(dr) * self.page_bytes

    def demote(self, layers: torch.Tensor, recs: torch.Tensor, protect: torch.Tensor | None = None) -> None:
        """Full-precision device pages the policy let go: into the warm sub-tier when there is
        one (compressed; the warm tier drops its lowest-priority pages for room, never
        ``protect``-ed ones), else off the device. Pages beyond the warm capacity leave."""
        if self.warm is None or len(recs) == 0:
            self.evict(layers, recs)
            return
        self._write_back(layers, recs)  # the host keeps the exact copy
        need = torch.bincount(layers, minlength=self.L)
        short = (need - self.warm.free()).clamp(min=0)
        if short.any():
            cand = self.warm_slot >= 0
            if protect is not None:
                cand &= ~protect
            wl, wr = self._lowest(cand, self.policy.priority(self._stats()), short)
            self.warm.release(wl, self.warm_slot[wl, wr])
            self.warm_slot[wl, wr] = -1
            self.metrics.warm_drops += len(wr)
        rank, _ = _rank_within_groups(layers, self.L)
        fits = rank < self.warm.free()[layers]
        if (~fits).any():
            self.evict(layers[~fits], recs[~fits])
        layers, recs = layers[fits], recs[fits]
        if len(recs) == 0:
            return
        k, v = self.device.read(layers, self.dev_slot[layers, recs])
        ws = self.warm.alloc(layers, recs)
        self.warm.write(layers, ws, k, v)
        self.warm_slot[layers, recs] = ws
        self.device.release(layers, self.dev_slot[layers, recs])
        self.dev_slot[layers, recs] = -1
        self.t1[layers, recs] = False
        self.metrics.compressed_pages += len(recs)
        self.metrics.evicted_pages += len(recs)

    def admit(self, layers: torch.Tensor, recs: torch.Tensor, *, already_streamed: torch.Tensor | None = None) -> None:
        """Non-resident pages become resident (free slots must exist). Pages streamed this
        step adopt their staging copy: no second transfer is counted."""
        if len(recs) == 0:
            return
        slots = self.device.alloc(layers, recs)
        assert slots is not None, "admit() called without room"
        # pages streamed this step adopt their staging copy: their bytes were counted then
        fresh = None if already_streamed is None else ~already_streamed
        k, v = self._source_read(layers, recs, count=fresh)
        self.device.write(layers, slots, k, v)
        self.dev_slot[layers, recs] = slots
        self.metrics.fetched_pages += len(recs)

    # ------------------------------------------------------------------ decisions
    def _stats(self) -> PageStats:
        next_use = self.next_use_fn() if self.next_use_fn is not None else None
        return PageStats(self.last_access, self.frequency, self.importance, self.acc_mass,
                         self.rec_index.expand(self.L, -1), next_use)

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

    def _candidates(self, protect: torch.Tensor | None) -> torch.Tensor:
        cand = (self.dev_slot >= 0) & ~self.rec_t0.unsqueeze(0)
        return cand if protect is None else cand & ~protect

    def _make_room(self, need: torch.Tensor, protect: torch.Tensor | None) -> torch.Tensor:
        """Evict lowest-priority pages so that ``need[l]`` slots are free per layer; returns
        the slots actually available per layer."""
        if self.resident_cap is None:
            return need
        free = self.resident_cap - self.device.used()
        short = (need - free).clamp(min=0)
        if short.any():
            cand = self._candidates(protect)
            layers, recs = self._lowest(cand, self.policy.priority(self._stats()), short)
            self.demote(layers, recs, protect)
        return torch.minimum(need, self.resident_cap - self.device.used())

    def end_step(self, access: StepAccess, *, decode: bool) -> None:
        t0 = time.perf_counter()
        m = self.metrics
        if decode:
            self.step_no += 1
            m.decode_steps += 1
            self.last_access[access.needed] = self.step_no
            self.frequency += access.needed.long()
            self.win_access += access.needed.long()
            m.hits += int((access.needed & ~access.missing).sum())
            m.misses += int(access.missing.sum())
        else:
            m.prefill_steps += 1
        self.acc_mass += access.mass
        self.importance = torch.where(access.scored, access.importance, self.importance)
        if decode and self.step_no % self.config.window_steps == 0:
            self._migrate()
        # demand admission: pages this step needed but did not find resident
        want = access.missing & (self.dev_slot < 0) & self.alive.unsqueeze(0)
        if want.any() and self.resident_cap is not None:
            room = self._make_room(want.sum(1), protect=access.needed | want)
            layers, recs = self._highest(want, self.importance, room)
            self.admit(layers, recs, already_streamed=access.streamed[layers, recs])
        elif want.any():
            layers, recs = want.nonzero(as_tuple=True)
            self.admit(layers, recs, already_streamed=access.streamed[layers, recs])
        self._record_residency()
        m.manager_seconds += time.perf_counter() - t0

    def _highest(self, cand: torch.Tensor, prio: torch.Tensor, counts: torch.Tensor):
        return self._lowest(cand, -prio, counts)

    def _migrate(self) -> None:
        """Window boundary: the design note's thresholds. Demote (device -> host) pages idle
        for ``demote_idle_windows`` windows or scoring below ``demote_score``; promote
        host pages accessed >= ``promote_accesses`` times this window with a score above
        ``promote_score`` into free device slots (a prefetch)."""
        c = self.config
        self.idle_windows = torch.where(self.win_access > 0, torch.zeros_like(self.idle_windows),
                                        self.idle_windows + 1)
        if self.resident_cap is not None:
            demote = self._candidates(None) & ((self.idle_windows >= c.demote_idle_windows) |
                                               (self.importance < c.demote_score))
            layers, recs = demote.nonzero(as_tuple=True)
            self.demote(layers, recs)
            self.metrics.demotions += len(recs)
            if self.warm is not None:
                self._promote_warm()
            promote = (self.alive.unsqueeze(0) & (self.dev_slot < 0) & (self.win_access >= c.promote_accesses)
                       & (self.importance > c.promote_score))
            room = (self.resident_cap - self.device.used()).clamp(min=0)
            layers, recs = self._highest(promote, self.importance, room)
            self.admit(layers, recs)
            self.metrics.promotions += len(recs)
        self._update_hot_keys()
        self.win_access.zero_()

    def _promote_warm(self) -> None:
        """Warm pages that turned hot (the promotion thresholds) get a full-precision slot
        again, re-fetched exact from the host; full-precision victims take their place."""
        c = self.config
        hot = ((self.warm_slot >= 0) & (self.win_access >= c.promote_accesses)
               & (self.importance > c.promote_score))
        if not hot.any():
            return
        room = self._make_room(hot.sum(1), protect=hot)
        layers, recs = self._highest(hot & (self.warm_slot >= 0), self.importance, room)
        self.warm.release(layers, self.warm_slot[layers, recs])
        self.warm_slot[layers, recs] = -1
        self.admit(layers, recs)
        self.metrics.warm_promotions += len(recs)

    def _update_hot_keys(self) -> None:
        """At a window boundary. T1: up to ``hot_key_pages`` resident non-T0 pages per layer, the most frequently
        accessed among those with >= promote_accesses accesses and score > promote_score;
        a T1 page idle too long or scoring below demote_score falls back to T2."""
        cap = self.budgets.hot_key_pages
        if cap == 0:
            return
        c = self.config
        resident = self._candidates(None)
        keep = self.t1 & resident & (self.idle_windows < c.demote_idle_windows) & (self.importance >= c.demote_score)
        self.metrics.hot_key_demotions += int((self.t1 & resident & ~keep).sum())
        eligible = resident & ~keep & (self.frequency >= c.promote_accesses) & (self.importance > c.promote_score)
        room = (cap - keep.sum(1)).clamp(min=0)
        layers, recs = self._highest(eligible, self.frequency.float(), room)
        self.t1 = keep
        self.t1[layers, recs] = True
        self.metrics.hot_key_promotions += len(recs)

    # ------------------------------------------------------------------ accounting
    def tier_counts(self) -> dict[str, int]:
        alive = self.alive.unsqueeze(0)
        dev = (self.dev_slot >= 0) & alive
        t0 = dev & self.rec_t0.unsqueeze(0)
        t1 = dev & self.t1 & ~t0
        warm = (self.warm_slot >= 0) & alive
        host_only = alive & ~dev & ~warm & (self.host_slot >= 0)
        return {"T0": int(t0.sum()), "T1": int(t1.sum()), "T2": int((dev & ~t0 & ~t1).sum()),
                "T2w": int(warm.sum()), "T3": int(host_only.sum()),
                "T4": int((alive & ~dev & ~warm & ~host_only & (self.disk_slot >= 0)).sum())}

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
        m.bytes_per_tier = {t: n * (self.warm_page_bytes if t == "T2w" else self.page_bytes)
                            for t, n in counts.items()}
        m.warm_bytes_saved = counts["T2w"] * (self.page_bytes - self.warm_page_bytes)
        m.summary_bytes = int(self.alive.sum()) * self.L * 2 * self.kv_heads * self.head_dim * 4
        return m

    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant (module docstring) does not hold."""
        alive = self.alive
        for pool, table in self._pools():
            if pool is None:
                assert (table < 0).all()
                continue
            layers, recs = (table >= 0).nonzero(as_tuple=True)
            assert alive[recs].all(), f"{pool.name}: slot held by a dead record"
            assert (pool.owner[layers, table[layers, recs]] == recs).all(), f"{pool.name}: owner/slot mismatch"
            assert int((pool.owner >= 0).sum()) == len(recs), f"{pool.name}: orphan slot"
            if pool.max_capacity is not None:
                assert int(pool.used().max()) <= pool.max_capacity, f"{pool.name}: over capacity"
        live = alive.unsqueeze(0).expand(self.L, -1)
        has_copy = (self.dev_slot >= 0) | (self.host_slot >= 0) | (self.disk_slot >= 0)
        written = (self.rec_tokens > 0).unsqueeze(0) & live
        assert has_copy[written].all(), "a written page has no copy in any tier (lost)"
        warm = self.warm_slot >= 0
        assert not (warm & (self.dev_slot >= 0)).any(), "a page is both full precision and warm on the device"
        assert ((self.host_slot >= 0) | (self.disk_slot >= 0))[warm].all(), "a warm page has no exact copy"
        assert ((self.dev_slot >= 0) | ~(live & self.rec_t0.unsqueeze(0))).all(), "a T0 page is not resident"
        if self.resident_cap is not None:
            assert int(self.device.used().max()) <= self.resident_cap, "device over the resident capacity"
        counts = self.tier_counts()  # every live page of every layer is in exactly one tier
        assert sum(counts.values()) == self.L * int(alive.sum()), f"tier counts {counts} do not cover the live pages"
        if not self._restored:  # the move counters balance the pools (a rollback restores pools, not counters)
            m = self.metrics
            dev = m.created_pages + m.fetched_pages - m.evicted_pages - m.released_pages
            assert int(self.device.used().sum()) == dev, "device slots do not balance the counted moves"
            if self.warm is not None:
                warm = m.compressed_pages - m.warm_promotions - m.warm_drops - m.released_warm_pages
                assert int(self.warm.used().sum()) == warm, "warm slots do not balance the counted moves"
        listed = sorted(r for pages in self.seq_pages.values() for r in pages)
        assert listed == sorted(alive.nonzero().flatten().tolist()), "records and sequences disagree"
        assert sorted(listed + self.free_records) == list(range(self.R)), "a record is lost or duplicated"

    # ------------------------------------------------------------------ checkpoint
    _STATE = ("rec_seq", "rec_index", "rec_tokens", "rec_t0", "dev_slot", "host_slot", "disk_slot", "warm_slot",
              "last_access",
              "frequency", "win_access", "idle_windows", "t1", "importance", "acc_mass", "kmin", "kmax", "sal_sum")

    def checkpoint(self) -> dict:
        """A copy of all mutable state except the metrics (which keep accumulating)."""
        state = {name: getattr(self, name).clone() for name in self._STATE}
        state.update(R=self.R, free_records=list(self.free_records), step_no=self.step_no,
                     seq_pages={s: list(p) for s, p in self.seq_pages.items()}, seq_len=dict(self.seq_len))
        for tag, pool in (("device", self.device), ("host", self.host)):
            state[tag] = (pool.k.clone(), pool.v.clone(), pool.owner.clone())
        if self.disk is not None:
            state["disk"] = (self.disk.mm.copy(), self.disk.owner.clone())
        if self.warm is not None:
            memo = getattr(self.warm, "_memo", None)
            state["warm"] = (self.warm.data.clone(), self.warm.owner.clone(),
                             None if memo is None else tuple(t.clone() for t in memo))
        return state

    def rollback(self, state: dict) -> None:
        self._restored = True
        for name in self._STATE:
            setattr(self, name, state[name].clone())
        self.R, self.step_no = state["R"], state["step_no"]
        self.free_records = list(state["free_records"])
        self.seq_pages = {s: list(p) for s, p in state["seq_pages"].items()}
        self.seq_len = dict(state["seq_len"])
        for tag, pool in (("device", self.device), ("host", self.host)):
            k, v, owner = state[tag]
            pool.k, pool.v, pool.owner = k.clone(), v.clone(), owner.clone()
        if self.disk is not None:
            data, owner = state["disk"]
            if data.shape[0] != self.disk.capacity:
                self.disk._grow(data.shape[0])
            self.disk.mm[: data.shape[0]] = data
            self.disk.owner = owner.clone()
        if self.warm is not None:
            data, owner, memo = state["warm"]
            self.warm.data, self.warm.owner = data.clone(), owner.clone()
            self.warm._memo = None if memo is None else tuple(t.clone() for t in memo)
