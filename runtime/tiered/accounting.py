"""Accounting and invariants of the TierManager: pages and bytes per tier, the
resident-bytes series, the point-in-time metrics, and the invariants the property tests
check after every step. A mixin of :class:`~tieredkv.runtime.tiered.manager.TierManager`.
"""

from __future__ import annotations

import torch

from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.step import TIER_CODES


class TierAccounting:
    def tiers(self) -> torch.Tensor:
        """[L, R] int8: the tier holding each page now (``step.TIER_CODES``; dead records: disk)."""
        t = self.table
        tier = torch.full(t.device_slot.shape, TIER_CODES["disk"], dtype=torch.int8)
        tier[t.host_slot >= 0] = TIER_CODES["host"]
        tier[t.warm_slot >= 0] = TIER_CODES["warm"]
        tier[t.device_slot >= 0] = TIER_CODES["device"]
        return tier

    def all_resident(self) -> bool:
        """Every live page full precision on the device in every layer: then the counts per tier
        follow from the records alone (slots are held by live records only, one per layer)."""
        return int(self.device.used().sum()) == self.L * int(self.table.alive.sum())

    def tier_counts(self) -> dict[str, int]:
        """Pages per tier now (a page with a device copy counts in T0 / T1 / T2; a warm copy
        counts in T2w besides)."""
        if not self.all_resident():
            return self._tier_counts_by_page()
        t, L = self.table, self.L
        t0 = L * int((t.alive & t.t0).sum())
        t1 = int((t.t1 & ~t.t0 & t.alive).sum())
        warm = 0 if self.warm is None else int(self.warm.used().sum())
        return {"T0": t0, "T1": t1, "T2": L * int(t.alive.sum()) - t0 - t1, "T2w": warm, "T3": 0, "T4": 0}

    def _tier_counts_by_page(self) -> dict[str, int]:
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
        """Bytes per tier now (``counts``: the page counts of now, when known); the metrics are
        left as they are. The warm pages count at their rung's bytes."""
        counts = self.tier_counts() if counts is None else counts
        return {tier: self.warm_bytes() if tier == "T2w" else n * self.page_bytes for tier, n in counts.items()}

    def warm_bytes(self) -> int:
        """Bytes of the encoded pages the warm sub-tier holds now."""
        return 0 if self.warm is None else self.warm.bytes_used()

    def resident_bytes(self) -> int:
        """Device-owned page bytes: full-precision pages plus encoded warm pages."""
        return int(self.device.used().sum()) * self.page_bytes + self.warm_bytes()

    def resident_token_bytes(self) -> int:
        """Of :meth:`resident_bytes`, the bytes that hold tokens (a partial page holds fewer than P)."""
        if not self.all_resident() or (self.warm is not None and int(self.warm.used().sum())):
            return self._resident_token_bytes_by_page()
        t = self.table
        return self.L * int((t.tokens * t.alive).sum()) * self.page_bytes // self.P

    def _resident_token_bytes_by_page(self) -> int:
        t = self.table
        tokens = t.tokens.unsqueeze(0)
        full = int((tokens * (t.device_slot >= 0)).sum()) * self.page_bytes // self.P
        warm = t.warm_slot >= 0
        if not bool(warm.any()):
            return full
        return full + int((tokens.expand_as(warm)[warm] * self.warm.page_bytes_of(t.warm_slot[warm])).sum()) // self.P

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
        m.warm_bytes_saved = counts["T2w"] * self.page_bytes - self.warm_bytes()
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
            assert torch.equal(pool.used(), (pool.owner >= 0).sum(1)), f"{pool.name}: slot count off"
            if pool.max_capacity is not None:
                assert int(pool.used().max()) <= pool.max_capacity, f"{pool.name}: over capacity"
        assert self.tier_counts() == self._tier_counts_by_page(), "tier counts differ from the per-page count"
        assert self.resident_token_bytes() == self._resident_token_bytes_by_page(), "token bytes differ from the per-page sum"
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
