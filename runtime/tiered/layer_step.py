"""The tiered cache's layers of one step, batched: every sequence of the step at once, tensor
ops only — no Python per sequence or per page inside a layer.

:meth:`LayerStep.open` turns the manager's :class:`StepPlan` into what the layers read, once per
step, on the model's device: the listed pages' logical index, tokens, T0 flags and distances,
the new tokens' device slots in every layer, the warm pages each layer reads exact, and the
step's decisions that do not depend on a layer's query — whether any layer must select (an
attention budget smaller than a sequence's pages), and the width of the compacted page list
a selecting layer attends. Per layer (:meth:`LayerStep.attend`):

1. *score* — only where the step selects (a decode step whose attention budget binds, outside
   ``dense_layers``; or masked mode with pages off the device): ImportanceScore of every listed
   page under the layer's query ([B, M]; [B, KVH, M] for the ``kv-head`` aggregate);
2. *select* — SelectPages: T0 plus the top pages within the attention budget (every valid page
   otherwise); masked mode attends the resident and staged ones;
3. *gather* — the attended pages' K/V from the device pool by slot, compacted to the selected
   columns in logical order; pages held only encoded are decoded, those off the device (exact
   misses, prefill of demoted pages, ``warm.exact_reads``) read by the manager's one reader;
4. *attend* — :func:`attend_pages`, which also gives each page's attention mass.

A decode layer on the CPU in float32 does 3 and 4 in one op instead
(:meth:`LayerStep.attend_in_place`, ``models.cache.tiered_decode_attention``): each page read
where it is — the device pool by slot, the warm pool encoded — and only the pages off the device
read by the manager's reader; no gather, no compaction, unselected pages not read.
With the default ranking and the step's page sources covering the layer, 1 to 4 and the layer's
record are one op call (:meth:`LayerStep.attend_fused`, ``models.cpu_attention.layer_op``): the
same results, without Python between the stages.

What each layer did is kept in [L, B, M] buffers and handed to the manager once, at the end
of the step (:meth:`LayerStep.record`). When the budgets hold the whole work — no selection,
every page full precision on the device — a layer is a gather by slot and an attention, the
paged cache's path.
"""

from __future__ import annotations

import time

import torch

from tieredkv.models.cache import (EXTRA, POOL, WARM, attention, decode_op_applies, gather_pages,
                                   pool_decode_attention, pool_rows, tiered_decode_attention, tiered_in_place)
from tieredkv.models.cpu_attention import layer_op, relevance_op, select_op
from tieredkv.plugins.importance_score import (RELEVANCE_ONLY, distance_bucket, importance_score, mix,
                                               relevance_and_ranking)
from tieredkv.plugins.select_pages import ATTEND_ALL, select_pages
from tieredkv.runtime.tiered.step import StepPlan, StepRecord


def attend_pages(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_mask: torch.Tensor,
                 page_index: torch.Tensor, seq_len: torch.Tensor, past: torch.Tensor, *,
                 allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TieredAttention after the gather (``plugins.tiered_attention.attention_over_pages``'s
    semantics, computed in float32), returning the output and each page's attention mass.

    q [B, H, T, D]; k_pages, v_pages [B, KVH, M, P, D] (head-major: :func:`gather_pages`'s
    layout); page_mask [B, M] bool (or [B, KVH, M]: a
    mask per kv head); page_index, seq_len, past as in ``tiered_attention``; ``allowed``: their
    :func:`allowed_keys` when the caller has it already. Returns out [B, H, T, D] (q's dtype;
    zeros for a query that sees no key) and mass [B, M] float32: the attention probability on
    each page, mean over the query heads, summed over the queries."""
    b, h, t, d = q.shape
    _, kvh, m, p, _ = k_pages.shape
    if allowed is None:
        allowed = allowed_keys(page_mask, page_index, seq_len, past, t, p)
    out, probs = _attend(q, k_pages.reshape(b, kvh, m * p, d), v_pages.reshape(b, kvh, m * p, d), allowed)
    mass = probs.view(b, h, t, m, p).sum(-1).mean(1).sum(1)
    return out, mass


#: the most attention logits (elements) :func:`attend_out` materializes at once
ATTEND_BLOCK = 1 << 21


def attend_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """:func:`_attend`'s output alone, over blocks of queries whose logits fit
    :data:`ATTEND_BLOCK` (a prefill chunk's [G * T, S] logits would otherwise go through memory
    several times: 2.7x slower at T = 512, S = 4,096). Each query's row is computed by the same
    formula on the same keys: equal to :func:`_attend`'s to float32 rounding, and bit for bit
    at SmolLM2's head grouping on this CPU's BLAS (tested; the BLAS may pick another kernel for
    another row count)."""
    b, h, t, _ = q.shape
    block = max(1, ATTEND_BLOCK // max(1, b * h * k.shape[2]))
    if t <= block:
        return _attend(q, k, v, allowed)[0]
    return torch.cat([_attend(q[:, :, i:i + block], k, v, allowed[..., i:i + block, :])[0]
                      for i in range(0, t, block)], dim=2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over gathered keys, in float32: q [B, H, T, D], k, v [B, KVH, S, D], allowed
    [B, 1 or KVH, 1, T, S] (:func:`allowed_keys`) -> (out [B, H, T, D] in q's dtype, zeros for a
    query that sees no key; probs [B, KVH, G * T, S]). One formula whether or not the caller
    wants the probabilities, so measuring page masses never changes a step's output."""
    b, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    logits = torch.matmul(q.float().reshape(b, kvh, g * t, d), k.float().transpose(-1, -2)).view(b, kvh, g, t, s)
    logits = (logits * d ** -0.5).masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0).view(b, kvh, g * t, s)  # no key seen: nan -> 0
    out = torch.matmul(probs, v.float()).view(b, h, t, d).to(q.dtype)
    return out, probs


def allowed_keys(page_mask: torch.Tensor, page_index: torch.Tensor, seq_len: torch.Tensor, past: torch.Tensor,
                 num_queries: int, page_size: int) -> torch.Tensor:
    """Which key slot each query may attend, [B, 1 or KVH, 1, T, M * P] bool: its page kept by
    ``page_mask`` ([B, M] or [B, KVH, M]), inside the sequence, and causal."""
    b, t, p = page_index.shape[0], num_queries, page_size
    m = page_index.shape[1]
    key_pos = (page_index.unsqueeze(-1) * p + torch.arange(p, device=page_index.device)).reshape(b, 1, m * p)
    seen = (key_pos < seq_len.view(b, 1, 1)) & (key_pos <= past.view(b, 1, 1) + torch.arange(t, device=past.device)
                                                .view(1, t, 1))  # [B, T, S]
    keep = page_mask.repeat_interleave(p, dim=-1)  # [B, S] or [B, KVH, S]
    if keep.dim() == 2:
        return (seen & keep.unsqueeze(1)).view(b, 1, 1, t, m * p)
    return (seen.unsqueeze(1) & keep.unsqueeze(2)).view(b, keep.shape[1], 1, t, m * p)


class LayerStep:
    """The open step's state on the layers' side (module docstring). ``cache``: the
    :class:`~tieredkv.runtime.tiered.cache.TieredKVCache` whose step it is."""

    #: decode layers in one call where it applies (:meth:`attend_fused`); False: stage by stage (the
    #: same results; the tests compare the two)
    fuse_layers = True

    def __init__(self, cache, plan: StepPlan) -> None:
        mgr, t, config = cache.mgr, cache.mgr.table, cache.config
        self.cache, self.mgr, self.plan = cache, mgr, plan
        self.dev = dev = torch.device(cache.spec.device)
        L, B, M = mgr.L, plan.batch, plan.width
        self.decode = plan.decode
        self.valid, self.t0, self.recs = plan.valid.to(dev), plan.t0.to(dev), plan.recs.to(dev)
        self.index, self.tokens = plan.index.to(dev), plan.tokens.to(dev)
        self.distance, self.seq_len, self.past = plan.distance.to(dev), plan.seq_len.to(dev), plan.past.to(dev)
        self.candidates = plan.candidates.to(dev)
        # the new tokens' device slots, one [B * T] row per layer (resident all step)
        slots = t.device_slot.index_select(1, plan.write_recs).to(dev)
        self.write_slots = slots.unbind(0)
        # and the same places as rows of each layer's pool viewed [C * KVH * P, D]: one copy per pool
        self.write_rows = pool_rows(slots, plan.write_offsets.to(dev), mgr.kv_heads, mgr.P).unbind(0)
        budget = cache.budgets.attention_pages
        self.budget = ATTEND_ALL if budget is None or not self.decode else budget
        counts = torch.tensor(plan.lengths)
        self.selecting = bool((counts > self.budget).any())
        self.dense_layers = config.selection.dense_layers
        # selected pages per row: every page, or T0 plus the budget's others (T0 alone when it exceeds it)
        t0_counts = plan.t0.sum(1)
        per_row = torch.minimum(counts, torch.maximum(torch.full_like(counts, self.budget), t0_counts))
        self.width = M if config.selection.aggregate == "kv-head" else int(per_row.max())
        masked = self.decode and config.selection.mode == "masked"
        self.off = [False] * L  # masked mode: a layer lists pages it cannot attend (scored for the record)
        if masked:
            there = mgr.resident(slice(None), plan.recs) | t.staged[:, plan.recs]
            self.off = ((~there) & plan.valid).flatten(1).any(1).tolist()
        # full precision on the device in every layer: the gather needs no other reader
        self.all_full = bool((t.device_slot.index_select(1, plan.recs[plan.valid]) >= 0).all())
        n_exact = config.warm.reads_exact(config.selection.mode) if self.decode and mgr.warm is not None else 0
        self.exact_choice = (mgr.exact_read_choice(slice(None), plan.recs, n_exact, plan.valid).to(dev)
                             if n_exact else None)
        self._allowed_all = None  # the keys every query may see when a layer attends every page
        self._inside = None  # of those, [B, M, P] (a decode step through the CPU op)
        self._resident = None  # every layer's (device, warm, host) slots, [L, B, M] (:meth:`layer_slots`)
        self._sources: OpSources | None | bool = False  # the CPU op's page sources (:meth:`op_sources`); False: not yet
        self._select_args: dict = {}  # select_pages's masks and budgets by (rows per sequence, budget)
        #: SelectPages as one CPU op (the reference's result) where the step runs on the CPU; else None
        self.select_op = select_op() if self.decode and self.dev.type == "cpu" else None
        #: a decode step through the CPU op (:meth:`attend_in_place`): the warm pool's layout for the
        #: op where it reads the warm pages encoded, () where warm pages go through the reader; None: no op
        self.in_place = tiered_in_place(mgr, self.dev) if self.decode else None
        #: the selection ranks by relevance alone, by share (the default): the CPU op computes it from
        #: the layer's summaries read by record (:meth:`rank`); None: the PyTorch reference
        self.relevance_op = None
        sel = config.selection
        if (self.decode and self.dev.type == "cpu" and t.kmin.dtype == torch.float32
                and tuple(sel.weights) == RELEVANCE_ONLY and sel.aggregate == "share"):
            self.relevance_op = relevance_op()
            if self.relevance_op is not None:  # its page inputs, the same in every layer of the step
                self._relevance_pages = (self.recs, self.tokens.float(), self.candidates.bool())
        #: a decode layer in one call (:meth:`attend_fused`) where the CPU ops above all apply; None: not
        self.layer_op = (layer_op() if self.fuse_layers and self.relevance_op is not None and self.select_op is not None
                         and self.in_place is not None else None)
        self._fused_args: tuple | None | bool = False  # its arguments the same in every layer; False: not yet
        self.ran = False  # a layer attended (or an engine's graph ran): the step has something to record
        self.moves_inside = cache._speculate  # a layer-ahead prefetch may move pages during the step
        # nothing to do: no selection, every page full precision on the device, room for the next
        # window, no predictor or access log reading the masses -> the attention alone, without the
        # per-page mass (the pages' importance is measured again once the device is pressed)
        self.measure = (self.selecting or any(self.off) or not self.all_full or self.exact_choice is not None
                        or mgr.pressed() or mgr.prefetcher is not None or cache.recorder is not None
                        or self.moves_inside)
        self.rec = StepRecord.empty(L, plan)
        for name in ("selected", "attended", "relevance", "mass"):
            setattr(self.rec, name, getattr(self.rec, name).to(dev))
        #: a decode step stores its keys' summaries at its end, for every layer at once
        #: (``TieredKVCache.end_step``): layer -> the new keys [B, KVH, D]. Nothing reads them sooner:
        #: each sequence writes into its last page, which is in T0 — attended whatever its summary,
        #: never among the pages the ranking scores — and the step's record reads the saliency at the end
        self.new_keys: dict[int, torch.Tensor] | None = {} if self.decode else None
        self.slots = None  # nothing to measure: every layer's device slots of the listed pages, [L, B, M]
        if not self.measure:
            self.slots = t.device_slot.index_select(1, plan.recs.flatten()).view(L, B, M).clamp(min=0).to(dev)
            self.rec.selected[:] = self.valid
            self.rec.attended[:] = self.valid
        if self.exact_choice is not None:
            self.rec.exact = torch.zeros(L, B, M, dtype=torch.bool, device=dev)
        if self.moves_inside:
            self.rec.full, self.rec.warm, self.rec.staged = (torch.zeros(L, B, M, dtype=torch.bool) for _ in range(3))

    # ------------------------------------------------------------------ per layer
    def scores(self, layer: int) -> bool:
        """Whether ``layer`` ranks its pages this step (a decode step that selects, or leaves
        pages unattended in masked mode)."""
        return self.decode and ((self.selecting and layer >= self.dense_layers) or self.off[layer])

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Score, select, gather and attend one layer for every sequence: q [B, H, T, D] ->
        out [B, H, T, D]; what it did goes to the step's record."""
        mgr, m = self.mgr, self.mgr.metrics
        self.ran = True
        t_score = time.perf_counter()
        if not self.measure:  # every listed page, full precision on the device: the paged cache's path
            out = self.attend_all(layer, q)
            m.attention_seconds += time.perf_counter() - t_score
            return out
        out = self.attend_fused(layer, q)
        if out is not None:  # (the scorer's and the selection's time counted in the attention's)
            m.attention_seconds += time.perf_counter() - t_score
            return out
        heads = relevance = None
        if self.scores(layer):
            relevance, ranking = self.rank(layer, q[:, :, -1])
            t_select = time.perf_counter()
            heads = self.select(layer, ranking)  # [B, M], or [B, KVH, M]: per kv head
            selected = heads if heads.dim() == 2 else heads.any(1)
            if heads.dim() == 2:
                heads = None
        else:
            t_select = time.perf_counter()
            selected = self.valid
        attended = self.where_attended(layer, selected)
        exact = None
        if self.exact_choice is not None:
            exact = self.exact_choice[layer] & attended
            if self.moves_inside:
                exact &= mgr.warm_only(layer, self.plan.recs).to(self.dev)
        t_attend = time.perf_counter()
        out, mass = self.gather_and_attend(layer, q, selected, attended, heads, exact)
        rec = self.rec
        rec.selected[layer], rec.attended[layer] = selected, attended
        if mass is not None:
            rec.mass[layer] = mass
        if relevance is not None:
            rec.relevance[layer] = relevance
        if exact is not None:
            rec.exact[layer] = exact
        m.scorer_seconds += t_select - t_score
        m.select_seconds += t_attend - t_select
        m.attention_seconds += time.perf_counter() - t_attend
        return out

    def attend_all(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """A step with nothing to decide or measure (module docstring): the listed pages gathered
        from the device pool by slot and attended, nothing else — the record holds every valid
        page as selected and attended from the start. A decode step attends with the paged
        cache's kernel: on the CPU in float32 the op that reads the pool by slot
        (``models.cache.pool_decode_attention``, the same call as the paged cache's), elsewhere
        ``models.cache.attention`` over the gathered pages (for several sequences the measuring
        path's float32 formula, bit for bit; for one, torch's fused kernel, equal to float32
        rounding); a prefill chunk, and pages stored in another dtype than the model computes in
        (``kv_dtype``), with the measuring path's formula, so that whether a prefill measures
        page masses never changes its output (the prefetch tests hold logits bit-identical)."""
        pool_k, pool_v = self.mgr.device.k[layer], self.mgr.device.v[layer]
        t, p = q.shape[2], pool_k.shape[2]
        allowed = self.allowed_all(t, p)
        if t == 1:
            b, m = self.slots[layer].shape
            out = pool_decode_attention(q, pool_k, pool_v, self.slots[layer], allowed.view(b, m * p))
            if out is not None:
                return out
        k, v = gather_pages(pool_k, self.slots[layer]), gather_pages(pool_v, self.slots[layer])
        b, kvh, m, p, d = k.shape
        k, v = k.view(b, kvh, m * p, d), v.view(b, kvh, m * p, d)
        if t == 1 and k.dtype == q.dtype:
            return attention(q, k, v, allowed.view(b, 1, t, m * p))
        return attend_out(q, k, v, allowed)

    def attend_fused(self, layer: int, q: torch.Tensor) -> torch.Tensor | None:
        """A decode layer in one call (``models.cpu_attention.layer_op``): the relevance and the
        selection (:meth:`rank`, :meth:`select`) where the layer scores, the CPU op over the step's
        page sources (:meth:`attend_in_place`, :meth:`op_sources`) and the layer's record written in
        place — the same results as those methods, without a Python call per stage. Where it applies:
        the step's sources cover the layer, the default ranking (relevance by share: one selection
        per sequence), every listed page attendable (not masked mode's off-device pages); else
        ``None`` and the stages run one by one."""
        args = self.fused_args()
        if (args is None or self.off[layer] or not self._sources.whole[layer]
                or not decode_op_applies(q, self.mgr.device.k)):
            return None
        b, h, _, d = q.shape
        out = self.layer_op(q.reshape(b, h, d).contiguous(), layer, self.scores(layer), *args)
        self._sources.read.append(layer)  # its host pages are counted at the step's end
        return out.view(b, h, 1, d)

    def fused_args(self) -> tuple | None:
        """:meth:`attend_fused`'s arguments that every layer of the step shares (the step's [L, ...]
        tensors; the op takes the layer's index), once per step; None where it does not apply."""
        if self._fused_args is not False:
            return self._fused_args
        self._fused_args = None
        src = self.op_sources() if self.layer_op is not None else None
        if src is None:
            return None
        mgr, t, rec, B = self.mgr, self.mgr.table, self.rec, self.plan.batch
        codec = src._codec
        warm = mgr.warm.data if codec else torch.zeros(0, 0, 0, dtype=torch.uint8)
        attend = torch.full((B,), self.budget, dtype=torch.long)
        self._fused_args = (t.kmin, t.kmax, *self._relevance_pages, self.valid, self.t0, attend, mgr.device.k,
                            mgr.device.v, mgr.host.k, mgr.host.v, warm, list(codec) if codec else [0] * 8, src.kind,
                            src.slot, self.inside().view(B, -1), self.exact_choice, rec.selected, rec.attended,
                            rec.mass, rec.relevance, rec.exact, mgr.device.k.shape[-1] ** -0.5)
        return self._fused_args

    def allowed_all(self, num_queries: int, page_size: int) -> torch.Tensor:
        """The keys every query may see when a layer attends every listed page (the same in every
        layer: :func:`allowed_keys` once per step)."""
        if self._allowed_all is None:
            self._allowed_all = allowed_keys(self.valid, self.index, self.seq_len, self.past, num_queries, page_size)
        return self._allowed_all

    def score_inputs(self, layer: int, q: torch.Tensor) -> tuple:
        """ImportanceScore's inputs for the listed pages of ``layer`` under queries q [B, H, D]."""
        kmin, kmax, saliency = self.mgr.summaries(layer, self.recs, self.tokens)
        return (q, kmin, kmax, self.tokens, self.distance, saliency, self.candidates,
                self.cache.scorer.position[layer])

    def rank(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the relevance [B, M], the selection ranking) of the listed pages under q [B, H, D]:
        the relevance is estimated among the pages that compete for the budget (T0 is attended
        anyway, and its sink pages would dominate the normalization)."""
        if self.relevance_op is not None and q.dtype == torch.float32 and not (torch.is_grad_enabled()
                                                                             and q.requires_grad):
            t = self.mgr.table
            rel = self.relevance_op(q.contiguous(), t.kmin[layer], t.kmax[layer], *self._relevance_pages,
                                    q.shape[-1] ** -0.5)
            return rel, rel
        selection = self.cache.config.selection
        return relevance_and_ranking(*self.score_inputs(layer, q), selection.weights, aggregate=selection.aggregate)

    def relevance_ahead(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The relevance [B, M] of ``layer``'s pages under the previous layer's queries q [B, H, D]
        (the cross-layer predictor's input, the access log's ``spec``)."""
        return importance_score(*self.score_inputs(layer, q), RELEVANCE_ONLY)

    def select(self, layer: int, score: torch.Tensor) -> torch.Tensor:
        """SelectPages: T0 plus the top pages by ``score`` within the attention budget — every
        page in the first ``dense_layers`` layers. ``score`` [B, M], or [B, KVH, M] for the
        kv-head selection, which then selects per kv head."""
        budget = ATTEND_ALL if layer < self.dense_layers else self.budget
        m = score.shape[-1]
        rows = score.reshape(-1, m)
        per = rows.shape[0] // self.valid.shape[0]
        key = (per, budget)  # the rows' masks and budgets: the same in every layer of the step
        if key not in self._select_args:
            self._select_args[key] = (self.valid.repeat_interleave(per, dim=0), self.t0.repeat_interleave(per, dim=0),
                                      torch.full((rows.shape[0],), budget, device=rows.device))
        if self.select_op is not None and rows.dtype == torch.float32:
            picked = self.select_op(rows.contiguous(), *self._select_args[key])
        else:
            picked = select_pages(rows, *self._select_args[key])
        return picked.reshape(score.shape)

    def where_attended(self, layer: int, selected: torch.Tensor) -> torch.Tensor:
        """Of the selected pages, those the layer attends (masked mode: resident or staged)."""
        if not self.off[layer]:
            return selected
        return self.mgr.attended(layer, self.plan, selected.cpu()).to(self.dev)

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (device, warm, host) slots [B, M] of ``layer``'s listed pages (-1: no copy there), on
        the host. Residency holds still during a step unless a layer-ahead prefetch moves pages
        (``moves_inside``): then each layer reads the table; else every layer's are read at once."""
        t, recs = self.mgr.table, self.plan.recs
        if self.moves_inside:
            flat = recs.flatten()
            return tuple(col[layer].index_select(0, flat).view(recs.shape)
                         for col in (t.device_slot, t.warm_slot, t.host_slot))
        return tuple(x[layer] for x in self._resident_slots())

    def _resident_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every layer's (device, warm, host) slots [L, B, M] of the listed pages, read once."""
        if self._resident is None:
            t, flat = self.mgr.table, self.plan.recs.flatten()
            self._resident = tuple(col.index_select(1, flat).view(-1, *self.plan.recs.shape)
                                   for col in (t.device_slot, t.warm_slot, t.host_slot))
        return self._resident

    def gather_and_attend(self, layer: int, q: torch.Tensor, selected: torch.Tensor, attended: torch.Tensor,
                          heads: torch.Tensor | None, exact: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attended pages' K/V, compacted to the selected columns (logical order kept), and
        the attention over them: (out, mass [B, M], 0 where not attended)."""
        mgr, t, plan = self.mgr, self.mgr.table, self.plan
        B, M = plan.batch, plan.width
        dslot = self.layer_slots(layer)[0].to(self.dev)
        if self.moves_inside:  # residency as this layer saw it
            self.rec.full[layer] = dslot.cpu() >= 0
            self.rec.warm[layer] = mgr.warm_only(layer, plan.recs)
            self.rec.staged[layer] = t.staged[layer, plan.recs]
        if self.in_place is not None and decode_op_applies(q, mgr.device.k):
            got = self.attend_in_place(layer, q, dslot, attended, heads, exact)
            if got is not None:
                return got
        cols = None  # the gathering path: the selected columns, compacted
        if self.width < M and layer >= self.dense_layers:
            cols = torch.sort((~selected).to(torch.int8), dim=1, stable=True).indices[:, : self.width]
        pick = (lambda x: x) if cols is None else (lambda x: x.gather(-1, cols if x.dim() == 2 else
                                                                      cols.unsqueeze(1).expand(-1, x.shape[1], -1)))
        dslot, att = pick(dslot), pick(attended)
        pool_k, pool_v = mgr.device.k[layer], mgr.device.v[layer]
        k = gather_pages(pool_k, dslot.clamp(min=0))  # [B, KVH, width, P, D]
        v = gather_pages(pool_v, dslot.clamp(min=0))
        if not self.all_full or exact is not None:
            other = att & (dslot < 0)  # warm pages decoded, off-device pages (and exact reads) from the host / disk
            if bool(other.any()):
                rows, cc = other.nonzero(as_tuple=True)
                recs = pick(self.recs)[rows, cc].cpu()
                ex = False if exact is None else pick(exact)[rows, cc].cpu()
                kp, vp = k.transpose(1, 2), v.transpose(1, 2)  # [B, width, KVH, P, D] views

                def put(idx: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> None:  # each tier's pages once
                    at = (rows[idx], cc[idx])
                    kp[at], vp[at] = ks, vs

                mgr.read_pages_into(layer, recs, pool_k.dtype, put, exact=ex)
        allowed = None
        if cols is None and heads is None and attended is self.valid:  # every page: the same keys in every layer
            allowed = self.allowed_all(q.shape[2], pool_k.shape[2])
        page_mask = att if heads is None else pick(heads) & att.unsqueeze(1)
        out, mass = attend_pages(q, k, v, page_mask, pick(self.index), self.seq_len, self.past, allowed=allowed)
        if cols is not None:
            mass = torch.zeros(B, M, device=mass.device).scatter_(1, cols, mass)
        return out, mass

    def attend_in_place(self, layer: int, q: torch.Tensor, dslot: torch.Tensor, attended: torch.Tensor,
                        heads: torch.Tensor | None,
                        exact: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode layer through ``models.cache.tiered_decode_attention`` (the CPU op): every
        listed page read where it is — the device pool by slot, the warm pool encoded (4-bit codes
        decoded inside the kernel) — and only the pages off the device (host, disk, exact reads;
        warm pages too where the op cannot read the warm pool: a ladder, decoded copies, another
        codec) read by the manager's one reader into a small extra batch — or, when every one of
        them is a host page and the host pool shares the device pool's memory and dtype (the
        CPU), read where it lies in the host pool, the link's copy counted but not made; an
        unselected page is not read at all. Nothing gathered, no compaction: (out, mass [B, M]) as
        :meth:`gather_and_attend`'s, or ``None`` where the op does not apply."""
        mgr, B = self.mgr, self.plan.batch
        pool_k, pool_v = mgr.device.k[layer], mgr.device.v[layer]
        att = attended.cpu()  # (the op runs on the CPU: views, no copies)
        src = self.op_sources()
        if src is not None and src.whole[layer]:  # every page where the step's sources say
            kind, slot = src.kind[layer], src.slot[layer]
            kw = dict(extra_k=mgr.host.k[layer], extra_v=mgr.host.v[layer], **src.warm(layer))
        else:
            src = None
            kind, slot, kw = self.layer_sources(layer, dslot, att, exact)
        # the keys each query may see: those inside its sequence (every layer's, once per step) of
        # the pages attended — allowed_keys's mask, without rebuilding the positions per layer
        page_mask = att.unsqueeze(1) if heads is None else heads.cpu() & att.unsqueeze(1)  # [B, 1 or KVH, M]
        allowed = self.inside().unsqueeze(1) & page_mask.unsqueeze(-1)  # [B, 1 or KVH, M, P]
        got = tiered_decode_attention(q, pool_k, pool_v, kind, slot, allowed.view(B, allowed.shape[1], -1), **kw)
        if got is not None and src is not None:
            src.read.append(layer)  # its host pages are counted at the step's end
        return got

    def layer_sources(self, layer: int, dslot: torch.Tensor, att: torch.Tensor,
                      exact: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """:meth:`attend_in_place`'s general path: (kind, slot [B, M], the op's other sources) of
        ``layer``'s attended pages ``att``, resolved for this layer alone — the pages off the device
        checked one by one, read where they lie in the host pool or copied by the manager's reader."""
        mgr, plan = self.mgr, self.plan
        B, M = plan.batch, plan.width
        pool_k = mgr.device.k[layer]
        warm = self.in_place
        on_dev = dslot >= 0
        exact = None if exact is None else exact.cpu()
        kind = torch.full((B, M), POOL, dtype=torch.int8)
        slot = dslot.clamp(min=0)
        kw = {}
        _, wslot, hslot = self.layer_slots(layer)
        if warm and mgr.warm is not None:
            in_warm = ~on_dev & (wslot >= 0) & att
            if exact is not None:
                in_warm &= ~exact
            kind[in_warm] = WARM
            slot = torch.where(in_warm, wslot, slot)
            kw.update(warm=mgr.warm.data[layer], warm_codec=warm)
        other = att & ~on_dev & (kind == POOL)
        if bool(other.any()):
            rows, cols = other.nonzero(as_tuple=True)
            recs, ex = self.recs.cpu()[rows, cols], False if exact is None else exact[rows, cols]
            kind[rows, cols] = EXTRA
            at = (rows, cols)
            hslot = mgr.host_slots_in_place(layer, recs, exact=ex, like=pool_k,
                                            slots=(dslot.cpu()[at], wslot[at], hslot[at]))
            if hslot is not None:  # every one on the host, in the device pool's memory: read where it lies
                slot[rows, cols] = hslot
                kw.update(extra_k=mgr.host.k[layer], extra_v=mgr.host.v[layer])
            else:
                ek = torch.empty((len(rows), *pool_k.shape[1:]), dtype=pool_k.dtype, device=pool_k.device)
                ev = torch.empty_like(ek)

                def put(idx: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> None:
                    ek.index_copy_(0, idx, ks)
                    ev.index_copy_(0, idx, vs)

                mgr.read_pages_into(layer, recs, pool_k.dtype, put, exact=ex)
                slot[rows, cols] = torch.arange(len(rows))
                kw.update(extra_k=ek, extra_v=ev)
        return kind, slot, kw

    def inside(self) -> torch.Tensor:
        """[B, M, P] the keys inside each sequence of its listed pages (:meth:`allowed_all` for one
        query, once per step)."""
        if self._inside is None:
            self._inside = self.allowed_all(1, self.mgr.device.k.shape[3]).view(*self.plan.recs.shape, -1)
        return self._inside

    def op_sources(self) -> "OpSources | None":
        """Where every layer's listed pages lie for the CPU op (:meth:`attend_in_place`), worked out
        once per step: residency holds still during the step (no layer-ahead prefetch), the op runs
        on the CPU and the host pool lies in the device pool's memory and dtype. A page is read from
        the device pool by slot; else from the warm pool encoded where the op reads it (not one of
        the layer's exact reads); else from the host pool where it lies (the copy a deployment makes
        across the link counted at the step's end, :meth:`count_host_reads`). A layer any of whose
        listed pages none of those holds (on the disk; a warm page the op cannot read) takes
        :meth:`attend_in_place`'s general path, which reads only its attended pages' sources.
        None where the step has no such sources (the general path in every layer)."""
        if self._sources is not False:
            return self._sources
        self._sources = None
        mgr = self.mgr
        if self.moves_inside or self.in_place is None or self.dev.type != "cpu":
            return None
        if not mgr.host_in_place(mgr.device.k):
            return None
        dslot, wslot, hslot = self._resident_slots()  # [L, B, M] each
        on_dev = dslot >= 0
        kind = torch.full(dslot.shape, POOL, dtype=torch.int8)
        slot = dslot.clamp(min=0)
        exact = self.exact_choice.cpu() if self.exact_choice is not None else None
        encoded = (wslot >= 0) if exact is None else (wslot >= 0) & ~exact  # held warm and not read exact
        if self.in_place and mgr.warm is not None:
            in_warm = ~on_dev & encoded
            kind[in_warm] = WARM
            slot = torch.where(in_warm, wslot, slot)
        host = ~on_dev & (kind == POOL)
        kind[host] = EXTRA
        slot = torch.where(host, hslot, slot)
        unreadable = host & ((hslot < 0) | encoded)  # on the disk, or warm where the op cannot read it
        whole = (~unreadable.flatten(1).any(1)).tolist()
        self._sources = OpSources(kind, slot, host, whole, self.in_place if mgr.warm is not None else (), mgr)
        return self._sources

    def count_host_reads(self) -> None:
        """The host pages the layers read where they lie through :meth:`op_sources` (the layers
        the op ran with them) counted as :meth:`~tieredkv.runtime.tiered.moves.PageMoves.host_slots_in_place`
        counts them: one batched copy per layer that read any."""
        src = self._sources
        if not src or not src.read:
            return
        layers = torch.tensor(src.read)
        read = (self.rec.attended.cpu()[layers] & src.host[layers]).flatten(1).sum(1).tolist()
        for layer, n in zip(src.read, read):
            if n:
                self.mgr.count_host_pages(n, like=self.mgr.device.k[layer])

    # ------------------------------------------------------------------ the step's end
    def record(self) -> StepRecord:
        """The step's record for the manager (host tensors): the relevance — the observed
        attention share where a page was attended (normalized so the row's top page is 1), the
        scorer's estimate elsewhere — and the importance kept between steps, mixed from it, the
        position signal and the saliency with ``score_weights``."""
        rec, cache = self.rec, self.cache
        self.count_host_reads()
        attended, mass = rec.attended, rec.mass
        if not self.measure:
            host = lambda x: None if x is None else x.detach().cpu()  # noqa: E731
            return StepRecord(selected=host(rec.selected), attended=host(attended), relevance=None, mass=None)
        top = torch.where(attended, mass, torch.zeros_like(mass)).amax(-1, keepdim=True).clamp(min=1e-30)
        relevance = torch.where(attended, mass / top, rec.relevance)
        position = cache.scorer.position.detach()
        pos = position[:, distance_bucket(self.distance, position.shape[1])].clamp(0.0, 1.0)  # [L, B, M]
        saliency = self.mgr.saliency(slice(None), self.recs, self.tokens)
        importance = mix(cache.config.migration.score_weights, relevance, pos, saliency)
        host = lambda x: None if x is None else x.detach().cpu()  # noqa: E731
        return StepRecord(selected=host(rec.selected), attended=host(attended), relevance=host(relevance),
                          mass=host(mass), importance=host(importance), exact=host(rec.exact), full=rec.full,
                          warm=rec.warm, staged=rec.staged)


class OpSources:
    """Every layer's listed pages as the CPU op reads them (:meth:`LayerStep.op_sources`): kind and
    slot [L, B, M] (``models.cache`` POOL / WARM / EXTRA: the host pool here), host [L, B, M] bool
    (read from the host pool), whole [L] (every listed page of the layer has a source), read: the
    layers the op ran with them (their host pages counted at the step's end)."""

    def __init__(self, kind: torch.Tensor, slot: torch.Tensor, host: torch.Tensor, whole: list[bool], codec, mgr):
        self.kind, self.slot, self.host, self.whole = kind, slot, host, whole
        self.read: list[int] = []
        self._codec, self._mgr = codec, mgr

    def warm(self, layer: int) -> dict:
        """The op's warm-pool arguments for ``layer`` (none where it reads no warm page)."""
        if not self._codec:
            return {}
        return {"warm": self._mgr.warm.data[layer], "warm_codec": self._codec}
