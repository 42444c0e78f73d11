"""Page moves of the TierManager: the one reader of pages, and every copy between tiers —
write-back to the host, eviction, demand admission, room-making by the replacement policy,
the bounded host tier's spill to disk (T4) and disk read-ahead.

A mixin of :class:`~tieredkv.runtime.tiered.manager.TierManager` (its state: ``table``,
``device`` / ``host`` / ``disk`` / ``warm`` pools, ``metrics``, ``policy``, ``transfers``); every
move is a handful of vectorized ops over (layer, record) pairs, never a Python loop over pages. On
the CPU the ranking of victims and wanted pages, the eviction and the admission are ops of the
extension (``models/csrc/tier_step.cpp``: ``pick_pages``; ``models/csrc/tier_moves.cpp``), one pass
each; the torch code here is their reference (tests/runtime/tiered/test_tier_moves_op.py) and the
path where they do not apply.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from tieredkv.errors import KVCacheFullError
from tieredkv.models.cpu_attention import tier_step_ops
from tieredkv.runtime.tiered.policies import PageStats
from tieredkv.runtime.tiered.store import WarmPool, _rank_within_groups

INF = float("inf")


class PageMoves:
    def _release(self, freed: torch.Tensor) -> None:
        """Records nobody holds any more give back every slot of every tier."""
        if len(freed) == 0:
            return
        self._settle()
        self._unprefetch(slice(None), freed)
        for pool, slots in self._pools():
            if pool is None:
                continue
            n = self._release_copies(pool, slots, freed)
            if pool is self.device:
                self.metrics.released_pages += n
            elif pool is self.warm:
                self.metrics.released_warm_pages += n
        self.table.release(freed)

    def _drop_copies(self, recs: torch.Tensor) -> None:
        """Pages about to change give up their copies in the warm, host and disk tiers."""
        self._settle()
        for pool, slots in self._pools()[1:]:  # warm, host, disk
            if pool is None or not int(pool.used().sum()):  # (an empty tier holds no copy to look up)
                continue
            n = self._release_copies(pool, slots, recs)
            if pool is self.warm:
                self.metrics.warm_drops += n

    @staticmethod
    def _release_copies(pool, slots: torch.Tensor, recs: torch.Tensor) -> int:
        """``pool``'s copies of records ``recs``, in every layer, released (their ``slots`` [L, R]
        entries set to -1); returns how many there were."""
        sub = slots[:, recs]
        layers, cols = (sub >= 0).nonzero(as_tuple=True)
        if len(layers):
            pool.release(layers, sub[layers, cols])
            slots[layers, recs[cols]] = -1
        return len(layers)

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
        k = torch.empty((len(recs), self.kv_heads, self.P, self.head_dim), dtype=dtype, device=dev)
        v = torch.empty_like(k)

        def put(idx: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> None:
            k.index_copy_(0, idx, ks)
            v.index_copy_(0, idx, vs)

        self.read_pages_into(layers, recs, dtype, put, exact=exact)
        return k, v

    def read_pages_into(self, layers: int | torch.Tensor, recs: torch.Tensor, dtype: torch.dtype, put, *,
                        exact: bool | torch.Tensor = False) -> None:
        """:meth:`read_pages` handing each tier's pages to ``put(idx, k, v)`` (``idx``: their
        positions in ``recs``, on the device; ``k``, ``v`` [n, KVH, P, D] in ``dtype``) instead of
        copying them into one tensor first: a caller that gathers pages into its own layout
        writes each page once."""
        t = self.table
        if self._pending:
            self._settle()
        dev = self.device.device
        if isinstance(layers, int):
            layers = torch.full_like(recs, layers)
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
            put(idx.to(dev), ks.to(dtype), vs.to(dtype))

    def host_slots_in_place(self, layer: int, recs: torch.Tensor, *, exact: bool | torch.Tensor = False,
                            like: torch.Tensor, slots: tuple | None = None) -> torch.Tensor | None:
        """The host-pool slots of pages ``recs`` of ``layer`` when :meth:`read_pages_into` would read
        every one of them from the host tier and the host pool lies where the device pool
        (``like``: one layer of it) does, in its dtype — the CPU, where both pools are the same
        memory: the caller then reads ``host.k[layer]`` / ``host.v[layer]`` at those slots where
        they lie, and the copy a deployment makes across the link is counted as
        :meth:`read_pages_into` counts it (``transfers``), not made. ``None`` otherwise (a page on
        the device, read from the warm pool or the disk, or a host pool elsewhere): read them.
        ``slots``: the pages' (device, warm, host) slots where the caller has read them already."""
        if not self.host_in_place(like):
            return None
        t = self.table
        if slots is None:
            slots = tuple(col[layer].index_select(0, recs) for col in (t.device_slot, t.warm_slot, t.host_slot))
        dslot, wslot, hslot = slots
        off = (dslot >= 0) | (hslot < 0)
        warm = (wslot >= 0) & ~torch.as_tensor(exact)
        if bool((off | warm).any()):
            return None
        self.count_host_pages(len(recs), like=like)
        return hslot

    def host_in_place(self, like: torch.Tensor) -> bool:
        """Whether host pages may be read where they lie in the host pool: it shares the memory and
        dtype of the device pool (``like``: a tensor of it) — the CPU. Pending moves are settled
        first, so that the host pool holds what the table says."""
        if self.host.k.device != like.device or self.host.k.dtype != like.dtype:
            return False
        if self._pending:
            self._settle()
        return True

    def count_host_pages(self, pages: int, *, like: torch.Tensor) -> None:
        """Count ``pages`` host pages read where they lie as the batched copy a deployment makes
        across the link (``like``: one layer of the device pool, [C, KVH, P, D])."""
        self.transfers.count_to_device(pages, 2 * pages * like[0].numel() * like.element_size())

    def _count_h2d(self, pages: int, from_disk: int) -> None:
        """Account ``pages`` pages copied host -> device, ``from_disk`` of them read from the disk tier."""
        self.metrics.bytes_h2d += pages * self.page_bytes
        self.metrics.bytes_disk_read += from_disk * self.page_bytes

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
        ops = self._move_ops()
        if ops is not None and self.host.max_capacity is None:  # (a bounded host tier may spill: the torch path)
            self._evict_native(ops, layers, recs)
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

    def admit(self, layers: torch.Tensor, recs: torch.Tensor, *, already_streamed: torch.Tensor | None = None) -> None:
        """Non-resident pages become resident (free slots must exist), copied exact from the
        host or disk. Pages streamed this step adopt their staging copy: no second transfer is
        counted."""
        if len(recs) == 0:
            return
        ops = self._move_ops()
        if ops is not None and self._admit_native(ops, layers, recs, already_streamed):
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

    def _move_ops(self):
        """The extension's page moves (``models/csrc/tier_moves.cpp``) when they apply: built and on,
        both pools and the page table on the CPU in one dtype, the table's columns contiguous;
        else ``None`` (the torch code, their reference). Settles the disk reads in flight first."""
        ops = tier_step_ops()
        if ops is None:
            return None
        t, dev, host = self.table, self.device, self.host
        cols = (t.device_slot, t.host_slot, t.disk_slot, t.warm_slot, t.t1, t.prefetched, t.staged)
        if (dev.k.device.type != "cpu" or host.k.device.type != "cpu" or dev.k.dtype != host.k.dtype
                or not all(c.device.type == "cpu" and c.is_contiguous() for c in cols)):
            return None
        if self._pending:
            self._settle()
        return ops

    def _evict_native(self, ops, layers: torch.Tensor, recs: torch.Tensor) -> None:
        """:meth:`evict` in one op (the host pool grown first when its dirty pages need it)."""
        t, dev, host = self.table, self.device, self.host
        layers, recs = layers.contiguous(), recs.contiguous()
        dev_used, host_used = dev.used(), host.used()  # (copies: the op counts the moves in them)
        while True:
            wasted, written, moved, _ = ops.evict_pages(layers, recs, t.device_slot, t.host_slot, t.disk_slot, t.t1,
                                                    t.prefetched, t.staged, dev.k, dev.v, dev.owner, dev_used,
                                                    host.k, host.v, host.owner, host_used).tolist()
            if wasted >= 0:
                break
            host.reserve(written)  # the slots its layers need in all: grown as alloc grows it, then again
        dev.set_used(dev_used)
        host.set_used(host_used)
        self._count_evicted(wasted, written, moved)

    def _count_evicted(self, wasted: int, written: int, moved: int) -> None:
        """Account an eviction op's moves: prefetched pages left unused, dirty pages written back
        (one batched device -> host copy), pages evicted."""
        m = self.metrics
        m.prefetch_wasted += wasted
        if written:
            self.transfers.to_host_counted(written, written * self.device.page_bytes)
            m.writebacks += written
            m.bytes_d2h += written * self.page_bytes
        m.evicted_pages += moved

    def _admit_native(self, ops, layers: torch.Tensor, recs: torch.Tensor, streamed: torch.Tensor | None) -> bool:
        """:meth:`admit` in one op when every page has a host copy (the device pool grown first
        when it must be); ``False`` when one lives on disk only (nothing done: the torch path)."""
        t, dev, host, warm = self.table, self.device, self.host, self.warm
        layers, recs = layers.contiguous(), recs.contiguous()
        streamed = None if streamed is None else streamed.contiguous()
        if warm is not None and not isinstance(warm, WarmPool):  # a ladder's slots span its rungs: released here
            self.metrics.warm_promotions += self._drop_warm(layers, recs)
            warm = None
        dev_used, warm_used = dev.used(), None if warm is None else warm.used()  # (copies: the op counts in them)
        while True:
            released, fresh, moved, _ = ops.admit_pages(layers, recs, streamed, t.device_slot, t.host_slot, t.warm_slot,
                                                    dev.k, dev.v, dev.owner, dev_used, host.k, host.v, host.owner,
                                                    None if warm is None else warm.owner, warm_used).tolist()
            if released == -2:
                return False
            if released >= 0:
                break
            assert dev.max_capacity is None or fresh <= dev.max_capacity, "admit() called without room"
            dev.reserve(fresh)
        dev.set_used(dev_used)
        if warm is not None:
            warm.set_used(warm_used)
        self._count_admitted(released, fresh, moved)
        return True

    def _count_admitted(self, released: int, fresh: int, moved: int) -> None:
        """Account an admission op's moves: warm copies released, pages copied host -> device that
        were not streamed this step (one batched copy of all ``moved``), pages admitted."""
        self.metrics.warm_promotions += released
        self.transfers.count_to_device(moved, moved * self.device.page_bytes)
        self._count_h2d(fresh, 0)
        self.metrics.fetched_pages += moved

    def _unprefetch(self, layers, recs) -> None:
        """Pages leaving the device (or freed) that the prefetcher brought in and no step used:
        wasted prefetch."""
        t = self.table
        wasted = t.prefetched[layers, recs] | t.staged[layers, recs]
        self.metrics.prefetch_wasted += int(wasted.sum())
        t.prefetched[layers, recs] = False
        t.staged[layers, recs] = False

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

    def _stats(self) -> PageStats:
        t = self.table
        next_use = self.next_use(t) if self.next_use is not None else None
        return PageStats(t.last_access, t.frequency, t.importance, t.acc_mass, t.index.expand(self.L, -1), next_use)

    def _lowest(self, cand: torch.Tensor, prio: torch.Tensor, counts: torch.Tensor, *, largest: bool = False):
        """The ``counts[l]`` lowest-priority candidates of each layer (``largest``: the highest) ->
        (layers, records), layer by layer, within a layer by rank; among equal priorities the lower
        record first (NaN ranks as +inf)."""
        return self._pick(prio, counts, largest, cand=cand)

    def _highest(self, cand: torch.Tensor, prio: torch.Tensor, counts: torch.Tensor):
        return self._lowest(cand, prio, counts, largest=True)

    def _lowest_resident(self, prio: torch.Tensor, counts: torch.Tensor, protect: torch.Tensor | None):
        """:meth:`_lowest` among :meth:`_candidates` (``prio``: [L, R]): the policy's victims."""
        return self._pick(prio, counts, False, protect=protect, resident=True)

    def _pick(self, prio: torch.Tensor, counts: torch.Tensor, largest: bool, *, cand: torch.Tensor | None = None,
              protect: torch.Tensor | None = None, resident: bool = False):
        """:meth:`_lowest` over ``cand`` or, ``resident``, over :meth:`_candidates` (``protect``). On
        the CPU one pass of the extension's ``pick_pages``, which reads the residency, T0 and
        ``protect`` itself (no [L, R] mask built first); :func:`pick_lowest` is the torch code it equals."""
        t = self.table
        ops = tier_step_ops() if prio.device.type == "cpu" and t.device_slot.device.type == "cpu" else None
        if ops is not None:
            def c(x):
                return None if x is None else x.contiguous()

            return ops.pick_pages(prio.float().contiguous(), counts.to(torch.long).contiguous(), largest, c(cand),
                                  c(t.device_slot) if resident else None, c(t.t0) if resident else None, c(protect))
        if resident:
            cand = self._candidates(protect)
        return pick_lowest(cand, -prio if largest else prio, counts)

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
            layers, recs = self._lowest_resident(self.policy.priority(self._stats()), short, protect)
            self.demote(layers, recs, protect)
        return torch.minimum(need, self.resident_cap - self.device.used())


def pick_lowest(cand: torch.Tensor, prio: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch code of ``pick_pages`` (models/csrc/tier_step.cpp), its reference: per layer ``l``
    of ``cand`` [L, W], the ``counts[l]`` candidates of lowest ``prio`` [L, W] -> (layers, positions),
    layer by layer, within a layer by rank; equal priorities: the lower position first; NaN as +inf.
    A layer's candidates are packed into [L, width] in position order (the fillers after them)
    and sorted stably."""
    L = cand.shape[0]
    per = torch.count_nonzero(cand, dim=1)
    counts = torch.minimum(counts.clamp(min=0), per)
    k = int(counts.max()) if len(counts) else 0
    if k == 0:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    layers, pos = cand.nonzero(as_tuple=True)  # row-major: layer by layer, positions ascending
    col = torch.arange(len(layers)) - (torch.cumsum(per, 0) - per)[layers]
    width = int(per.max())
    p = torch.full((L, width), INF)
    p[layers, col] = prio[layers, pos].float().nan_to_num(nan=INF, posinf=INF, neginf=-INF)
    packed = torch.zeros(L, width, dtype=torch.long)
    packed[layers, col] = pos
    order = torch.sort(p, dim=1, stable=True).indices[:, :k]
    take = torch.arange(k).unsqueeze(0) < counts.unsqueeze(1)
    return torch.arange(L).unsqueeze(1).expand(-1, k)[take], packed.gather(1, order)[take]
