"""The step's accounting of the TierManager: a step's record folded into its access record
(:meth:`StepFold.record_step`) and the access record into the page table's statistics
(:meth:`StepFold.fold_statistics`). A mixin of :class:`~tieredkv.runtime.tiered.manager.TierManager`.

Both run once per step over every layer. On the CPU they are one pass each through the
extension's ops (``models/csrc/tier_step.cpp``, :func:`~tieredkv.models.cpu_attention.tier_step_ops`);
the torch code here is the reference they equal bit for bit (tests/runtime/tiered/test_tier_step_op.py)
and the path wherever the ops are off (``TIEREDKV_CPU_MANAGER=torch``) or not built.
"""

from __future__ import annotations

import time

import torch

from tieredkv.models.cpu_attention import tier_step_ops
from tieredkv.runtime.tiered.masks import any_, count_, select_
from tieredkv.runtime.tiered.page_table import HIST_MASK
from tieredkv.runtime.tiered.policies.lfu_importance import LFUImportancePolicy
from tieredkv.runtime.tiered.step import StepPlan, StepRecord

#: the per-layer counts of ``close_decode_step`` (models/csrc/tier_close.cpp), in its order: fold_record's,
#: fold_end's, evict_pages', admit_pages'
CLOSE_COUNTS = ("masked", "warm_reads", "streamed", "from_disk", "rounds", "needed", "missed", "wasted", "written",
                "evicted", "released", "fresh", "admitted")


def wanted_pages(missing: torch.Tensor, needed: torch.Tensor, staged: torch.Tensor, device_slot: torch.Tensor,
                 alive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages a closing step wants on the device (its [L, R] ``missing`` and ``needed`` pages and
    the table's ``staged`` ones: needed and missing, or needed and staged) that have no
    ``device_slot`` and are ``alive`` [R] -> (want [L, R], protect = needed | want: what making room
    must not evict, how many each layer wants [L]). The torch code of the extension's
    ``wanted_pages``, its reference."""
    want = (missing | (needed & staged)) & (device_slot < 0) & alive.unsqueeze(0)
    return want, needed | want, torch.count_nonzero(want, dim=1)


def _plane(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A record input for the op: contiguous, of ``dtype``; one expanded over the layers as its [B, M]."""
    if x is None:
        return None
    if x.dim() == 3 and x.stride(0) == 0:
        x = x[0]
    return x.to(dtype).contiguous()


def _record_planes(plan: StepPlan, rec: StepRecord) -> tuple:
    """The plan's records, validity and T0 and the record's planes, as ``fold_record`` and
    ``close_decode_step`` take them (their first twelve inputs)."""
    b, f = torch.bool, torch.float32
    return (plan.recs.contiguous(), plan.valid.contiguous(), plan.t0.contiguous(), _plane(rec.selected, b),
            _plane(rec.attended, b), _plane(rec.mass, f), _plane(rec.importance, f), _plane(rec.relevance, f),
            _plane(rec.exact, b), _plane(rec.full, b), _plane(rec.warm, b), _plane(rec.staged, b))


class StepFold:
    #: whether :meth:`close_step` may take the one-op path (False: always the two calls; tests compare)
    close_in_one_op = True

    def close_step(self, plan: StepPlan, rec: StepRecord | None, *, decode: bool) -> None:
        """The step's end: :meth:`record_step` (``rec``: None when the step's layers recorded nothing)
        then :meth:`end_step`. A decode step that the extension's ``close_decode_step`` covers runs
        it instead: one pass over the layers, each layer's record, statistics, victims, evictions
        and admissions while its rows sit in the cache (models/csrc/tier_close.cpp) — the same
        state, metrics and transfer counts as the two calls."""
        if rec is not None and decode and self.close_in_one_op and self._close_native(plan, rec):
            return
        if rec is not None:
            self.record_step(plan, rec)
        self.end_step(decode=decode)

    def _close_native(self, plan: StepPlan, rec: StepRecord) -> bool:
        """:meth:`close_step` through ``close_decode_step`` where it applies — no prefetcher and
        nothing staged, no warm tier, a device budget, the lfu-importance policy (its priority
        computed in the op) without an oracle, an unbounded host tier, not a migration window's
        end, the moves on the CPU — else False with nothing done. (``manager_seconds`` then counts
        the record's fold too, which ``record_step`` leaves out.)"""
        t, m = self.table, self.metrics
        if (self.prefetcher is not None or self.warm is not None or self.resident_cap is None
                or self.next_use is not None or type(self.policy) is not LFUImportancePolicy
                or self.host.max_capacity is not None or plan.recs.device.type != "cpu"
                or (self.step_no + 1) % self.config.migration.window_steps == 0):
            return False
        ops = self._move_ops()  # (None where the moves' op does not apply; settles disk reads in flight)
        if ops is None or any_(t.staged):
            return False
        t_start = time.perf_counter()
        self.step_no += 1
        m.decode_steps += 1
        acc, dev, host, L = self._access, self.device, self.host, self.L
        want = self._close_want
        if want is None or want.shape != t.device_slot.shape:
            want = self._close_want = torch.empty(t.device_slot.shape, dtype=torch.bool)
        need, room, stage = (torch.zeros(L, dtype=torch.long) for _ in range(3))
        counts = torch.zeros(L, len(CLOSE_COUNTS), dtype=torch.long)
        dev_used, host_used = dev.used(), host.used()  # (copies: the op counts the moves in them)
        planes = _record_planes(plan, rec)
        while True:
            status, amount = ops.close_decode_step(
                *planes, acc.needed, acc.missing, acc.streamed, acc.scored, acc.mass, acc.importance,
                acc.relevance, t.device_slot, t.warm_slot, t.host_slot, t.disk_slot, t.staged, t.prefetched, t.t1,
                t.alive, t.t0, t.last_access, t.frequency, t.win_access, t.hist, t.acc_mass, t.last_relevance,
                t.importance, dev.k, dev.v, dev.owner, dev_used, host.k, host.v, host.owner, host_used, want, need,
                room, stage, counts, self.resident_cap, self.policy.w_freq, self.policy.w_imp, self.step_no,
                HIST_MASK, self.staging_pages).tolist()
            if status in (0, 3):
                break
            # a pool short of slots (the layers done so far stay done): grown as alloc grows it, then again
            pool = host if status == 1 else dev
            assert pool.max_capacity is None or amount <= pool.max_capacity, "close_step: a pool cannot grow enough"
            pool.reserve(amount)
        dev.set_used(dev_used)
        host.set_used(host_used)
        c = counts.sum(0).tolist()
        self._count_record(rec, *c[:5])
        needed, missed = c[5:7]
        m.hits += needed - missed
        m.misses += missed
        self._count_evicted(*c[7:10])
        if c[12]:
            self._count_admitted(*c[10:13])
        if status == 3:  # a wanted page has a warm copy or lives on disk: end_step's own admission
            self._admit_wanted(want, need, room)
        self.closed_in_one_op += 1
        self._finish_step(True, t_start)
        return True

    def record_step(self, plan: StepPlan, rec: StepRecord) -> None:
        """What the step did with the listed pages of every layer (``rec``: [L, B, M] host
        tensors, once per step): the pages it needed and missed (decode; T0 excluded), masked
        misses, the pages streamed through the staging area, the attention mass, the relevance
        and the importance kept between steps. Accounts the step's reads of pages that are not
        full-precision resident (warm decodes; streamed pages, staging rounds per layer and
        sequence, host-to-device and disk bytes). A page several sequences list collects from
        each: flags or-ed, masses summed, the highest importance and relevance kept."""
        acc, t = self._access, self.table
        ops = tier_step_ops() if plan.recs.device.type == "cpu" and t.device_slot.device.type == "cpu" else None
        if ops is None:
            return self._record_step_torch(plan, rec)
        counts = ops.fold_record(*_record_planes(plan, rec), t.device_slot, t.warm_slot, t.host_slot, t.staged,
                                 acc.needed, acc.missing, acc.streamed, acc.scored, acc.mass, acc.importance,
                                 acc.relevance, plan.decode, self.staging_pages)
        self._count_record(rec, *counts.tolist())

    def _count_record(self, rec: StepRecord, masked: int, warm_reads: int, streamed: int, from_disk: int,
                      rounds: int) -> None:
        """Account a folded record's counts (``fold_record``'s): masked misses; where the step measured
        its reads, the warm reads, the pages streamed, their staging rounds and link bytes."""
        m = self.metrics
        m.masked += masked
        if rec.mass is not None:
            m.warm_reads += warm_reads
            m.streamed_pages += streamed
            m.staging_rounds += rounds
            self._count_h2d(streamed, from_disk)

    def _record_step_torch(self, plan: StepPlan, rec: StepRecord) -> None:
        acc, t, m, L = self._access, self.table, self.metrics, self.L
        recs, valid = plan.recs, plan.valid.unsqueeze(0)
        # the flat [L, R] index of every entry, padding included: a padding column lists its row's first
        # record and adds nothing (flags or-ed with False, masses 0, maxima with 0: values start at 0) —
        # dense scatters, 4-10x faster than selecting the valid entries by mask first
        rows = (torch.arange(L).view(L, 1, 1) * t.capacity + recs).flatten()

        def flag(column: torch.Tensor, mask: torch.Tensor) -> None:  # column[L, R] |= mask[L, B, M], by record
            column.view(torch.uint8).view(-1).scatter_reduce_(0, rows, mask.view(torch.uint8).flatten(), "amax")

        if rec.mass is None:  # not measured (every page attended full precision on the device, nothing streamed):
            # what the step needed; importance and relevance stay as they were
            if plan.decode:
                flag(acc.needed, (rec.selected & valid & ~plan.t0).expand(L, -1, -1))
            return
        at = lambda column: column.view(-1).index_select(0, rows).view(L, *recs.shape)  # noqa: E731 [L, R] -> [L, B, M]
        dslot = at(t.device_slot)
        full = dslot >= 0 if rec.full is None else rec.full
        warm = ((dslot < 0) & (at(t.warm_slot) >= 0)) if rec.warm is None else rec.warm
        staged = at(t.staged) if rec.staged is None else rec.staged
        resident = full | warm
        keep = valid.expand(L, -1, -1)
        selected, attended = rec.selected & keep, rec.attended & keep

        def kept(values: torch.Tensor) -> torch.Tensor:
            return torch.where(keep, values.float(), 0.0).flatten()

        if plan.decode:
            need = selected & ~plan.t0
            flag(acc.needed, need)
            flag(acc.missing, need & ~resident & ~staged)
            m.masked += count_(selected & ~attended)
        streamed = attended & ~resident
        warm_read = attended & warm
        if rec.exact is not None:  # warm pages read from their exact copy (warm.exact_reads) are streamed
            exact = rec.exact & keep
            warm_read &= ~exact
            streamed |= exact
        flag(acc.streamed, streamed)
        acc.mass.view(-1).index_add_(0, rows, kept(rec.mass))
        importance = rec.mass if rec.importance is None else rec.importance
        relevance = rec.mass if rec.relevance is None else rec.relevance
        for column, values in ((acc.importance, importance), (acc.relevance, relevance)):
            column.view(-1).scatter_reduce_(0, rows, kept(values), "amax")  # values >= 0, start at 0
        flag(acc.scored, keep)
        pages = attended & ~full & ~warm_read & ~staged  # streamed this step: [L, B, M]
        per = torch.count_nonzero(pages, dim=-1)  # per layer and sequence
        m.warm_reads += count_(warm_read)
        m.streamed_pages += int(per.sum())
        m.staging_rounds += int((-(-per // max(1, self.staging_pages))).sum())
        self._count_h2d(int(per.sum()), count_(pages & (at(t.host_slot) < 0)))

    def wanted(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`wanted_pages` of the open step: one pass of the extension's op on the CPU."""
        t, access = self.table, self._access
        args = (access.missing, access.needed, t.staged, t.device_slot, t.alive)
        ops = tier_step_ops() if t.device_slot.device.type == "cpu" else None
        if ops is None:
            return wanted_pages(*args)
        return ops.wanted_pages(*(x.contiguous() for x in args))

    def fold_statistics(self, decode: bool) -> tuple[int, int]:
        """The open step's access record into the page table's statistics: for a decode step
        (``step_no`` already counts it) each needed page's last access, frequency, window
        accesses and history bit; where the step scored pages, their accumulated attention
        mass, relevance and importance. Returns (pages needed, pages needed and missing)."""
        t, access = self.table, self._access
        ops = tier_step_ops() if t.device_slot.device.type == "cpu" else None
        if ops is not None:
            needed, missed = ops.fold_end(
                access.needed, access.missing, access.scored, access.mass, access.relevance, access.importance,
                t.last_access, t.frequency, t.win_access, t.hist, t.acc_mass, t.last_relevance, t.importance,
                decode, self.step_no, HIST_MASK).tolist()
            return needed, missed
        missed = count_(access.missing)  # (decode steps only; a subset of the pages needed)
        needed = access.needed
        if decode:
            t.last_access.masked_fill_(needed, self.step_no)
            as_long = needed.to(torch.long)  # (adding a bool mask to a long column casts per element: 7x slower)
            t.frequency += as_long
            t.win_access += as_long
            t.hist.bitwise_left_shift_(1).bitwise_and_(HIST_MASK).bitwise_or_(as_long)  # in place: no [L, R] copies
        if any_(access.scored):  # (a step that measured nothing leaves the importance as it was)
            t.acc_mass += access.mass
            select_(t.last_relevance, access.scored, access.relevance)
            select_(t.importance, access.scored, access.importance)
        return count_(needed), missed
