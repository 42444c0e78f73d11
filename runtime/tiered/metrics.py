"""TierMetrics: one dataclass of counters for a run of the tiered cache."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

TIERS = ("T0", "T1", "T2", "T2w", "T3", "T4")


@dataclass
class TierMetrics:
    """Counters accumulated over a cache's life (all layers summed).

    A *hit* is a page a decode step needed (selected for attention, T0 excluded: T0 is
    always resident) that was device-resident at the start of the step; a *miss* one
    that was not. In exact mode a miss is streamed through the staging area before use;
    in masked mode it is skipped (``masked``) and fetched for later steps.
    """

    decode_steps: int = 0
    prefill_steps: int = 0
    hits: int = 0
    misses: int = 0
    masked: int = 0
    streamed_pages: int = 0  # pages copied into the staging area for one step (exact misses, prefill, warm_exact_reads)
    staging_rounds: int = 0  # staging-area fills those copies took (at most staging_pages pages each)
    created_pages: int = 0  # new pages given a device slot (the tokens of a step)
    released_pages: int = 0  # full-precision device slots freed with their sequence (free, truncate)
    released_warm_pages: int = 0  # warm slots freed with their sequence
    copied_pages: int = 0  # private copies of shared pages a truncated sequence writes into (copy on write)
    paused_sequences: int = 0  # sequences preempted by demotion (their pages left the device)
    resumed_sequences: int = 0  # ... whose hot window came back
    fetched_pages: int = 0  # pages admitted to the device (host -> device)
    evicted_pages: int = 0  # pages that left the device
    writebacks: int = 0  # dirty pages written to the host on eviction
    promotions: int = 0  # migration: T3 -> device (prefetch at a window boundary)
    demotions: int = 0  # migration: device -> T3
    hot_key_promotions: int = 0  # T2 -> T1
    hot_key_demotions: int = 0  # T1 -> T2
    spilled_pages: int = 0  # host -> disk (T4)
    compressed_pages: int = 0  # full-precision device pages encoded into the warm sub-tier (T2w)
    warm_reads: int = 0  # warm pages decoded on the attention path
    warm_promotions: int = 0  # warm pages that turned hot and were re-fetched exact (T2w -> T2)
    warm_drops: int = 0  # warm pages released under pressure (their host copy stays)
    regraded_pages: int = 0  # warm ladder: held warm pages moved to another rung (encoded again from the host copy)
    warm_bytes_saved: int = 0  # now: bytes the warm pages would take at full precision minus what they take
    prefetched_pages: int = 0  # pages the prefetcher admitted ahead of use (also in fetched_pages, bytes_h2d)
    prefetch_layer_ahead_pages: int = 0  # ... of them issued inside a step for a later layer
    prefetch_hits: int = 0  # needed pages resident because the prefetcher brought them in (first use)
    prefetch_wasted: int = 0  # prefetched pages that left the device (or were freed) before any step used them
    bytes_prefetch: int = 0
    disk_read_ahead_pages: int = 0  # predicted pages read disk -> host on the worker thread, ahead of use
    predictor_seconds: float = 0.0  # the prefetcher's predictions (its cost, paid on the host every step)
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_disk_read: int = 0
    bytes_disk_write: int = 0
    resident_bytes_max: int = 0
    resident_bytes_trace: list[int] = field(default_factory=list)  # device-owned page bytes after each step
    pages_per_tier: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    bytes_per_tier: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    summary_bytes: int = 0  # per-page min/max key summaries kept on the device for scoring
    scorer_seconds: float = 0.0
    select_seconds: float = 0.0
    attention_seconds: float = 0.0
    manager_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0

    @property
    def prefetch_precision(self) -> float:
        """Prefetched pages a step then needed, of all prefetched (1.0 with no prefetch)."""
        return self.prefetch_hits / self.prefetched_pages if self.prefetched_pages else 1.0

    @property
    def prefetch_recall(self) -> float:
        """Of the needed pages that were not resident without the prefetcher's help (its hits
        plus the misses left), the share it brought in ahead of use."""
        total = self.prefetch_hits + self.misses
        return self.prefetch_hits / total if total else 0.0

    def stall_bytes_per_step(self, page_bytes: int) -> float:
        """Bytes a decode step needed that were not resident when it started (exact mode fetches
        them on the critical path), per decode step."""
        return self.misses * page_bytes / max(1, self.decode_steps)

    #: at most this many points of the resident-bytes series go into to_dict() (every k-th step)
    SERIES_POINTS = 256

    def to_dict(self, *, trace: bool = False) -> dict:
        """Every counter; the resident bytes over time as their mean plus the series (every
        step with ``trace``, else every ``resident_bytes_series_stride``-th step, at most
        SERIES_POINTS points)."""
        d = asdict(self)
        d["hit_rate"] = round(self.hit_rate, 6)
        d["prefetch_precision"] = round(self.prefetch_precision, 6)
        d["prefetch_recall"] = round(self.prefetch_recall, 6)
        tr = d.pop("resident_bytes_trace")
        d["resident_bytes_mean"] = int(sum(tr) / len(tr)) if tr else 0
        stride = 1 if trace else max(1, -(-len(tr) // self.SERIES_POINTS))
        d["resident_bytes_series"] = tr[::stride]
        d["resident_bytes_series_stride"] = stride
        steps = max(1, self.decode_steps)
        d["scorer_ms_per_decode_step"] = round(1000 * self.scorer_seconds / steps, 4)
        d["manager_ms_per_step"] = round(1000 * self.manager_seconds / max(1, self.decode_steps + self.prefill_steps), 4)
        d["predictor_ms_per_decode_step"] = round(1000 * self.predictor_seconds / steps, 4)
        for k in ("scorer_seconds", "select_seconds", "attention_seconds", "manager_seconds", "predictor_seconds"):
            d[k] = round(d[k], 6)
        return d

    def merge(self, other: "TierMetrics") -> None:
        """Add another run's counters (for per-method totals over many sessions)."""
        for k, v in asdict(other).items():
            if k in ("pages_per_tier", "bytes_per_tier"):
                mine = getattr(self, k)
                for t, n in v.items():
                    mine[t] = max(mine[t], n)
            elif k == "resident_bytes_trace":
                self.resident_bytes_trace.extend(v)
            elif k in ("resident_bytes_max", "summary_bytes", "warm_bytes_saved"):
                setattr(self, k, max(getattr(self, k), v))
            else:
                setattr(self, k, getattr(self, k) + v)

    def format(self) -> str:
        """Human-readable summary for `tieredkv generate --stats`."""
        mib = 2 ** 20
        lines = [
            f"decode steps {self.decode_steps}, prefill steps {self.prefill_steps}",
            f"hits {self.hits}, misses {self.misses} (hit rate {self.hit_rate:.3f}), masked {self.masked}, "
            f"streamed {self.streamed_pages} pages",
            f"device: fetched {self.fetched_pages}, evicted {self.evicted_pages} (write-backs {self.writebacks}); "
            f"migration: promotions {self.promotions}, demotions {self.demotions}; T1 in {self.hot_key_promotions}, "
            f"out {self.hot_key_demotions}; spilled to disk {self.spilled_pages}",
            f"warm (compressed) sub-tier: compressed {self.compressed_pages}, decoded for attention "
            f"{self.warm_reads}, promoted {self.warm_promotions}, dropped {self.warm_drops}, regraded "
            f"{self.regraded_pages}; saving "
            f"{self.warm_bytes_saved / mib:.2f} MiB now",
            f"prefetch: {self.prefetched_pages} pages ({self.prefetch_layer_ahead_pages} a layer ahead), hits "
            f"{self.prefetch_hits}, wasted {self.prefetch_wasted}; precision {self.prefetch_precision:.3f}, recall "
            f"{self.prefetch_recall:.3f}; predictor {1000 * self.predictor_seconds:.1f} ms",
            f"moved: host->device {self.bytes_h2d / mib:.2f} MiB, device->host {self.bytes_d2h / mib:.2f} MiB, "
            f"disk read {self.bytes_disk_read / mib:.2f} MiB, disk write {self.bytes_disk_write / mib:.2f} MiB",
            f"resident device bytes: max {self.resident_bytes_max / mib:.2f} MiB; page summaries "
            f"{self.summary_bytes / mib:.2f} MiB",
            "pages per tier: " + ", ".join(f"{t} {n}" for t, n in self.pages_per_tier.items()),
            f"time: scorer {1000 * self.scorer_seconds:.1f} ms, selection {1000 * self.select_seconds:.1f} ms, "
            f"attention {1000 * self.attention_seconds:.1f} ms, tier manager {1000 * self.manager_seconds:.1f} ms",
        ]
        return "\n".join(lines)
