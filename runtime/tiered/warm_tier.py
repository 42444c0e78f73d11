"""The warm sub-tier of T2 inside the TierManager: which pages are held only encoded, which
of them a decode step reads from their exact copy instead, demotion of full-precision pages
into it (written back first: the host keeps the exact copy), and promotion back out of it
when a page turns hot. A mixin of :class:`~tieredkv.runtime.tiered.manager.TierManager`.
"""

from __future__ import annotations

import torch

from tieredkv.runtime.tiered.store import _rank_within_groups

INF = float("inf")


class WarmTier:
    def warm_only(self, layer: int | slice, rows) -> torch.Tensor:
        """Mask of records ``rows`` in ``layer`` held on the device only in the warm pool
        (encoded; no full-precision slot)."""
        t = self.table
        return (t.device_slot[layer, rows] < 0) & (t.warm_slot[layer, rows] >= 0)

    def exact_read_choice(self, layer: int | slice, recs: torch.Tensor, n: int,
                          valid: torch.Tensor | None = None) -> torch.Tensor:
        """The warm pages that a decode step reads from their exact copy off the device instead
        of decoding them (``warm.exact_reads``): of records ``recs`` in ``layer`` (a row [M] or
        rows [B, M] of one sequence's pages each; with ``slice(None)`` every layer, [L, ...]), at
        most ``n`` per layer and row — the warm-only pages most relevant at the last step that
        listed them (``last_relevance``: the attention share they drew where attended, the
        scorer's estimate elsewhere; equal values: the lower column first), never one scored 0
        nor one ``valid`` leaves out (padding columns). Known before the step runs, so an
        engine's runtime stages the same pages the PyTorch backend reads exact."""
        cand = self.warm_only(layer, recs) & (self.table.last_relevance[layer, recs] > 0)
        if valid is not None:
            cand &= valid
        chosen = torch.zeros_like(cand)
        if n and cand.any():
            rel = self.table.last_relevance[layer, recs]
            ranked = torch.where(cand, rel, torch.full_like(rel, -1.0))
            top = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :n]
            chosen.scatter_(-1, top, True)
        return chosen & cand

    def _drop_warm(self, layers: torch.Tensor, recs: torch.Tensor) -> int:
        """Release the warm copies among pages (``layers``, ``recs``); returns how many there were."""
        if self.warm is None or not int(self.warm.used().sum()):  # (an empty tier holds no copy to look up)
            return 0
        t = self.table
        warm = t.warm_slot[layers, recs] >= 0
        layers, recs = layers[warm], recs[warm]
        if len(recs):
            self.warm.release(layers, t.warm_slot[layers, recs])
            t.warm_slot[layers, recs] = -1
        return len(recs)

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
        prio = None
        if short.any():
            cand = t.warm_slot >= 0
            if protect is not None:
                cand &= ~protect
            prio = self.policy.priority(self._stats())
            drop_layers, drop_recs = self._lowest(cand, prio, short)
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
        if self.warm.num_rungs > 1:
            self._grade(layers, recs, protect, self.policy.priority(self._stats()) if prio is None else prio)
        else:
            k, v = self.device.read(layers, t.device_slot[layers, recs])
            slots = self.warm.alloc(layers, recs)
            self.warm.write(layers, slots, k, v)
            t.warm_slot[layers, recs] = slots
        self.device.release(layers, t.device_slot[layers, recs])
        t.device_slot[layers, recs] = -1
        t.t1[layers, recs] = False
        self.metrics.compressed_pages += len(recs)
        self.metrics.evicted_pages += len(recs)

    def _grade(self, layers: torch.Tensor, recs: torch.Tensor, protect: torch.Tensor | None,
               prio: torch.Tensor) -> None:
        """A warm ladder's placement: the pages (``layers``, ``recs``) entering the warm tier (room
        for them is made) and the pages it holds are ranked per layer by the policy's priority
        ``prio`` [L, R]; the highest-ranked fill the top rung, the next the rung below, and so on
        (``protect``-ed pages keep their rung). A page whose rung changes is encoded again from
        its exact copy — the device page of an entering one, the host / disk copy of a held one
        (counted as a host-to-device read) — so a page's precision follows its importance."""
        t, warm = self.table, self.warm
        held = t.warm_slot >= 0
        entering = torch.zeros_like(held)
        entering[layers, recs] = True
        fixed = held & protect if protect is not None else torch.zeros_like(held)
        member = (held | entering) & ~fixed
        cur = torch.full(held.shape, -1, dtype=torch.long)
        cur[held] = warm.rung_of(t.warm_slot[held])
        # each rung's room for the ranked pages: its capacity less the protected pages it keeps
        kept = torch.stack([(fixed & (cur == r)).sum(1) for r in range(warm.num_rungs)])  # [rungs, L]
        bounds = torch.cumsum(warm.capacities.unsqueeze(1) - kept, 0).T.contiguous()  # [L, rungs]
        order = prio.float().masked_fill(~member, -INF).argsort(dim=1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
        target = torch.searchsorted(bounds, rank, right=True)  # the rung whose room covers the rank
        ml, mr = (member & (target != cur)).nonzero(as_tuple=True)
        if not len(ml):
            return
        k, v = self.read_pages(ml, mr, self.device.dtype, exact=True)  # before any slot changes
        old = t.warm_slot[ml, mr]
        was = old >= 0
        warm.release(ml[was], old[was])
        slots = warm.alloc(ml, mr, target[ml, mr])
        assert slots is not None, "internal: a warm rung lacks the room the ranking gave it"
        warm.write(ml, slots, k, v)
        t.warm_slot[ml, mr] = slots
        moved = int(was.sum())
        self.metrics.regraded_pages += moved
        self._count_h2d(moved, int((was & (t.host_slot[ml, mr] < 0)).sum()))

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
