"""Window migration and prefetch inside the TierManager: the design note's thresholds at
every window boundary (demote idle or low-scoring pages, promote hot ones, label hot keys
T1), and the prefetcher's admissions ahead of the steps that need them. A mixin of
:class:`~tieredkv.runtime.tiered.manager.TierManager`.
"""

from __future__ import annotations

import torch


class WindowMigration:
    def _migrate(self) -> None:
        """Window boundary: the design note's thresholds. Demote (device -> host) pages idle
        for ``demote_idle_windows`` windows or scoring below ``demote_score`` — in the layers
        whose device tier is under pressure (less free room than the next window's new pages:
        a budget that holds the work demotes nothing); promote host pages accessed >=
        ``promote_accesses`` times this window with a score above ``promote_score`` into free
        device slots (a prefetch)."""
        c, t = self.config.migration, self.table
        t.idle_windows = torch.where(t.win_access > 0, torch.zeros_like(t.idle_windows), t.idle_windows + 1)
        if self.resident_cap is not None:
            pressed = self.pressed_layers()  # [L]
            demote = self._candidates(None) & ((t.idle_windows >= c.demote_idle_windows) |
                                               (t.importance < c.demote_score)) & pressed.unsqueeze(1)
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

    def pressed_layers(self) -> torch.Tensor:
        """[L] bool: the layers whose device tier has less free room than the next migration
        window's new pages (one page per ``P`` tokens of ``window_steps`` decode steps, plus the
        page being written, for every sequence); all False without a device budget."""
        if self.resident_cap is None:
            return torch.zeros(self.L, dtype=torch.bool)
        headroom = self.num_sequences * (-(-self.config.migration.window_steps // self.P) + 1)
        return (self.resident_cap - self.device.used()) < headroom

    def pressed(self) -> bool:
        """Whether any layer's device tier is pressed (:meth:`pressed_layers`)."""
        return bool(self.pressed_layers().any())

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
