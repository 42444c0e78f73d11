"""TieredKVCache: the KV cache of DESIGN.md's decode step.

Per layer and step (``attend``):
  1. the new tokens' K/V are written into their page on the device (T0), and the page's
     min/max key summary and saliency are updated;
  2. *decode step* (one new token): ImportanceScore scores every page of the sequence
     from the device-resident summaries; the step attends to T0 plus the top pages by
     score within the attention budget. A selected page that is not resident is a miss:
     ``exact`` streams it through the staging area before use, ``masked`` skips it;
     *prefill chunk* (several new tokens): exact attention over every page, streaming
     the non-resident ones through the staging area;
  3. TieredAttention computes the output over page blocks (resident pages, then staging
     blocks) merged by log-sum-exp, and the attention mass of every attended page.
Between steps the TierManager updates statistics, migrates and admits pages.

With an unlimited device budget (or the ``full`` policy) and no attention budget every
page is resident and attended: the output equals the paged cache's.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tieredkv.errors import ConfigError
from tieredkv.models.cache import KVCache, KVSpec, Step
from tieredkv.plugins.tiered_attention import PAD_PAGE_INDEX, attention_over_pages
from tieredkv.plugins.codec import CODECS
from tieredkv.plugins.codec import page_bytes as codec_page_bytes
from tieredkv.plugins.importance_score import RELEVANCE_ONLY, importance_score, mix
from tieredkv.plugins.select_pages import ATTEND_ALL, select_pages
from tieredkv.runtime.tiered.config import KV_DTYPES, TieredKVConfig, resolve_budgets
from tieredkv.runtime.tiered.manager import StepAccess, TierManager
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.policies import make_policy
from tieredkv.runtime.tiered.scorer import ImportanceScorer


class TieredKVCache(KVCache):
    def __init__(self, spec: KVSpec, config: TieredKVConfig | None = None, *, full_tokens: int | None = None,
                 num_sequences: int = 1, scorer: ImportanceScorer | None = None, device: str = "cpu",
                 recorder=None) -> None:
        self.config = config = config or TieredKVConfig()
        if config.kv_dtype is not None:
            spec = dataclasses.replace(spec, dtype=KV_DTYPES[config.kv_dtype])
        self.spec = spec
        warm_bytes = None
        if config.warm_codec is not None:
            warm_bytes = codec_page_bytes(CODECS[config.warm_codec], spec.num_kv_heads, config.page_size, spec.head_dim)
        self.budgets = resolve_budgets(config, num_layers=spec.num_layers,
                                       token_bytes_per_layer=spec.token_bytes_per_layer,
                                       full_tokens=full_tokens, num_sequences=num_sequences,
                                       warm_page_bytes=warm_bytes)
        self.policy = make_policy(config.policy, lfu_importance_weights=config.lfu_importance_weights)
        if self.policy.needs_trace:
            raise ConfigError(f"policy {config.policy!r} is an offline oracle: it needs the future accesses of a "
                              "recorded trace (tools/bench_tiered.py hitrate replays one); a live cache cannot run "
                              "it. Use lru, lfu, lfu-importance, h2o, streaming or full")
        self.scorer = scorer or ImportanceScorer.for_model(spec.num_layers, spec.head_dim, path=config.scorer_weights,
                                                           weights=config.score_weights)
        self.selection_weights = config.selection_weights
        self.mgr = TierManager(num_layers=spec.num_layers, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                               dtype=spec.dtype, config=config, budgets=self.budgets, policy=self.policy,
                               device=device)
        self.recorder = recorder
        self._snapshot_steps = -1
        self._next_id = 0
        self._access: StepAccess | None = None
        self._step_ctx: list[dict] = []

    # ------------------------------------------------------------------ sequences
    @property
    def metrics(self) -> TierMetrics:
        """The counters. The point-in-time figures (pages and bytes per tier, bytes saved) are
        those at the end of the last step: freeing sequences afterwards does not zero them."""
        self._snapshot()
        return self.mgr.metrics

    def _snapshot(self) -> None:
        m = self.mgr.metrics
        steps = m.decode_steps + m.prefill_steps
        if steps != self._snapshot_steps:
            self.mgr.refresh_metrics()
            self._snapshot_steps = steps

    def add_sequence(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self.mgr.add_sequence(sid)
        return sid

    def free_sequence(self, seq_id: int) -> None:
        self._snapshot()  # keep the figures of the last step
        self.mgr.free_sequence(seq_id)

    def close(self) -> None:
        """Free every sequence left and remove the T4 file (disk_path); the metrics stay."""
        for sid in list(self.mgr.seq_pages):
            self.free_sequence(sid)
        if self.mgr.disk is not None:
            self.mgr.disk.close()

    def length(self, seq_id: int) -> int:
        return self.mgr.seq_len[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        self.mgr.truncate(seq_id, length)

    def checkpoint(self, seq_id: int):
        return self.mgr.checkpoint()

    def rollback(self, seq_id: int, state) -> None:
        self.mgr.rollback(state)

    def kv_bytes(self) -> int:
        """Device-resident K/V bytes (T0 + T1 + T2)."""
        return self.mgr.resident_bytes()

    def max_step_tokens(self) -> int | None:
        """The most new tokens one step may bring while residency stays within the
        device budget (new pages must fit next to T0 of the other sequences)."""
        cap = self.mgr.resident_cap
        if cap is None:
            return None
        return max(1, (cap - self.config.t0_pages * max(1, len(self.mgr.seq_pages))) * self.config.page_size)

    # ------------------------------------------------------------------ steps
    def begin_step(self, seq_ids, num_new: int) -> Step:
        step = super().begin_step(seq_ids, num_new)
        mgr = self.mgr
        mgr.begin_step(step.seq_ids, num_new)
        L, R = mgr.L, mgr.R
        self._access = StepAccess(
            needed=torch.zeros(L, R, dtype=torch.bool), missing=torch.zeros(L, R, dtype=torch.bool),
            streamed=torch.zeros(L, R, dtype=torch.bool), mass=torch.zeros(L, R),
            importance=torch.zeros(L, R), scored=torch.zeros(L, R, dtype=torch.bool))
        P = self.config.page_size
        self._step_ctx = []
        for sid, past in zip(step.seq_ids, step.past):
            recs = mgr.records_of(sid)
            n = past + num_new
            pos = torch.arange(past, n)
            # a sequence's records are usually consecutive: then a slice (a view) addresses its rows
            contiguous = len(recs) > 0 and int(recs[-1]) - int(recs[0]) == len(recs) - 1 and bool((recs.diff() > 0).all())
            rows = slice(int(recs[0]), int(recs[-1]) + 1) if contiguous else recs
            tokens = mgr.rec_tokens[rows]
            index = mgr.rec_index[rows]
            distance = (n - 1) - (index * P + tokens - 1)
            self._step_ctx.append({
                "recs": recs,
                "rows": rows,
                "t0": mgr.rec_t0[rows],
                "write_recs": recs[pos // P],
                "write_off": pos % P,
                "index": index,
                "tokens": tokens,
                "distance": distance,
                "pos": self.scorer.positions(distance),  # [L, M]: the same distances for every layer
                "seq_len": torch.tensor([n]),
                "past": torch.tensor([past]),
            })
        return step

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        mgr = self.mgr
        recs = torch.cat([c["write_recs"] for c in self._step_ctx])
        offs = torch.cat([c["write_off"] for c in self._step_ctx])
        kt = k.transpose(1, 2).reshape(-1, *k.shape[1:2], k.shape[-1])  # [B*T, KVH, D] in (b, t) order
        vt = v.transpose(1, 2).reshape(-1, *v.shape[1:2], v.shape[-1])
        slots = mgr.dev_slot[layer, recs]
        mgr.device.k[layer, slots, :, offs] = kt.to(mgr.device.dtype)
        mgr.device.v[layer, slots, :, offs] = vt.to(mgr.device.dtype)
        kf = kt.float()
        idx = recs.view(-1, 1, 1).expand_as(kf)
        mgr.kmin[layer].scatter_reduce_(0, idx, kf, "amin")
        mgr.kmax[layer].scatter_reduce_(0, idx, kf, "amax")
        mgr.sal_sum[layer].index_add_(0, recs, self.scorer.token_saliency(layer, kt))

    def _attend_pages(self, layer: int, q: torch.Tensor, recs: torch.Tensor,
                      ctx: dict, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [1, H, T, D] over pages ``recs``: full-precision resident ones read
        from the device pool, warm ones decoded, the others streamed through the staging area (``ceil(n / staging_pages)``
        rounds of at most ``staging_pages`` pages, counted in the metrics). On the GPU the
        kernel processes each round as a block and merges blocks by log-sum-exp
        (``merge_attention``); on the CPU the rounds are gathered into one call, which is
        the same arithmetic. Returns (out, mass per page)."""
        mgr = self.mgr
        n = len(recs)
        dslot = mgr.dev_slot[layer].index_select(0, recs)
        full = dslot >= 0
        k_dev, v_dev = mgr.device.k[layer], mgr.device.v[layer]
        if bool(full.all()):
            k, v = k_dev.index_select(0, dslot), v_dev.index_select(0, dslot)
        else:
            k = torch.empty((n, *mgr.device.page_shape), dtype=q.dtype)
            v = torch.empty_like(k)
            idx = full.nonzero().flatten()
            k.index_copy_(0, idx, k_dev.index_select(0, dslot[idx]).to(q.dtype))
            v.index_copy_(0, idx, v_dev.index_select(0, dslot[idx]).to(q.dtype))
            rest = (~full).nonzero().flatten()
            warm = mgr.warm_slot[layer].index_select(0, recs[rest]) >= 0
            for idx, read in ((rest[warm], mgr.read_warm), (rest[~warm], mgr.stream)):
                if len(idx):
                    ks, vs = read(layer, recs.index_select(0, idx))
                    k.index_copy_(0, idx, ks.to(q.dtype))
                    v.index_copy_(0, idx, vs.to(q.dtype))
        k, v = k.to(q.dtype), v.to(q.dtype)
        # pages stay in logical order whatever their residency: the arithmetic is identical
        out, _, probs = attention_over_pages(q, k.unsqueeze(0), v.unsqueeze(0), torch.ones(1, n, dtype=torch.bool),
                                             index.unsqueeze(0), ctx["seq_len"], ctx["past"], with_lse=False)
        return out, probs.mean(1).sum(1)[0]  # mass per page: mean over heads, sum over queries

    def attend(self, step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mgr = self.mgr
        self._write(layer, k, v)
        decode = step.num_new == 1
        outs = []
        for b, ctx in enumerate(self._step_ctx):
            recs, rows, t0 = ctx["recs"], ctx["rows"], ctx["t0"]
            t_score = time.perf_counter()
            sal = self._saliency(layer, ctx)
            cand = ~t0 if not t0.all() else t0
            args = (q[b : b + 1, :, -1], mgr.kmin[layer, rows].unsqueeze(0), mgr.kmax[layer, rows].unsqueeze(0),
                    ctx["tokens"].unsqueeze(0), ctx["distance"].unsqueeze(0), sal.unsqueeze(0), cand.unsqueeze(0),
                    self.scorer.position[layer])
            rel = importance_score(*args, RELEVANCE_ONLY)[0]
            pos = ctx["pos"][layer]
            t_sel = time.perf_counter()
            resident = mgr.resident(layer, rows)
            if decode:
                aggregate = self.config.selection_aggregate
                score = rel if self.selection_weights == RELEVANCE_ONLY and aggregate == "share" else \
                    importance_score(*args, self.selection_weights, aggregate=aggregate)[0]
                budget = self.budgets.attention_pages
                selected = select_pages(score.unsqueeze(0), torch.ones(1, len(t0), dtype=torch.bool), t0.unsqueeze(0),
                                        torch.tensor([ATTEND_ALL if budget is None else budget]))[0]
                attended = selected if self.config.mode == "exact" else selected & resident
            else:
                selected = attended = torch.ones_like(t0)
            t_att = time.perf_counter()
            sub = attended.nonzero().flatten()
            out, mass = self._attend_pages(layer, q[b : b + 1], recs[sub], ctx, ctx["index"][sub])
            mass_all = torch.zeros(len(recs))
            mass_all[sub] = mass
            self._record(layer, ctx, decode=decode, selected=selected, attended=attended, resident=resident,
                         rel=rel, sal=sal, mass=mass_all)
            outs.append(out)
            t_end = time.perf_counter()
            m = mgr.metrics
            m.scorer_seconds += t_sel - t_score
            m.select_seconds += t_att - t_sel
            m.attention_seconds += t_end - t_att
        return torch.cat(outs, dim=0)

    def _saliency(self, layer: int, ctx: dict) -> torch.Tensor:
        return self.mgr.sal_sum[layer, ctx["rows"]] / ctx["tokens"].clamp(min=1)

    def _record(self, layer: int, ctx: dict, *, decode: bool, selected: torch.Tensor, attended: torch.Tensor,
                resident: torch.Tensor, rel: torch.Tensor, sal: torch.Tensor, mass: torch.Tensor) -> None:
        """The step's access record of one sequence in one layer (what the TierManager learns
        from): needed and missing pages (decode), masked misses, pages streamed, attention mass
        and the importance kept between steps. ``mass`` [M]: 0 where not attended."""
        acc, rows, t0 = self._access, ctx["rows"], ctx["t0"]
        if decode:
            need = selected & ~t0
            acc.needed[layer, rows] = need
            acc.missing[layer, rows] = need & ~resident
            self.mgr.metrics.masked += int((selected & ~attended).sum())
        acc.streamed[layer, rows] = attended & ~resident
        acc.mass[layer, rows] = mass
        acc.importance[layer, rows] = self._observed_importance(rel, ctx["pos"][layer], sal, attended, mass[attended])
        acc.scored[layer, rows] = True

    # ------------------------------------------------------------------ engine steps
    def engine_feeds(self, step: Step, *, tiered_graph: bool, warm_codec: str | None = None) -> dict[str, torch.Tensor]:
        """The inputs of an engine's step graph (``builder/export.py``) for the open step,
        as CPU tensors (the pools are the device pool itself when nothing is staged).

        A listed page is in a layer's pool when it is resident in full precision, or staged
        for this step: warm pages decoded, and (exact mode, prefill) the non-resident pages
        read from the host/disk tiers — the graph attends the selected pages among them, as
        ``attend`` does. Staging is accounted for the pages actually attended only
        (:meth:`engine_finish`), as if the kernel fetched them on demand. A graph built with
        ``warm_codec`` (the cache's own codec) reads warm pages itself: the feeds carry each
        layer's warm pool as it is (its encoded bytes) and each listed page's warm row, and
        warm pages are not staged."""
        mgr, P = self.mgr, self.config.page_size
        ctxs, L, T = self._step_ctx, mgr.L, step.num_new
        decode = T == 1
        stage_missing = not decode or self.config.mode == "exact"
        B, M = len(ctxs), max(len(c["recs"]) for c in ctxs)
        index = torch.full((B, M), PAD_PAGE_INDEX, dtype=torch.long)
        tokens = torch.zeros(B, M, dtype=torch.long)
        pinned = torch.zeros(B, M, dtype=torch.bool)
        valid = torch.zeros(B, M, dtype=torch.bool)
        recs = torch.zeros(B, M, dtype=torch.long)
        for b, c in enumerate(ctxs):
            n = len(c["recs"])
            index[b, :n], tokens[b, :n], pinned[b, :n], valid[b, :n] = c["index"], c["tokens"], c["t0"], True
            recs[b, :n], recs[b, n:] = c["recs"], c["recs"][0]
        flat = recs.flatten()
        dslot = mgr.dev_slot[:, flat].view(L, B, M)
        wslot = mgr.warm_slot[:, flat].view(L, B, M)
        full = (dslot >= 0) & valid
        warm_in_graph = (wslot >= 0) & valid if warm_codec is not None else torch.zeros_like(full)
        stage = valid & ~full & ~warm_in_graph & ((wslot >= 0) | stage_missing)
        table = torch.where(full, dslot, torch.zeros_like(dslot))
        feeds: dict[str, torch.Tensor] = {}
        for layer in range(L):
            k_pool, v_pool = mgr.device.k[layer], mgr.device.v[layer]
            cols = stage[layer].nonzero()
            if len(cols):
                st_recs = recs[cols[:, 0], cols[:, 1]]
                k_st, v_st = self._stage(layer, st_recs, wslot[layer, cols[:, 0], cols[:, 1]])
                table[layer, cols[:, 0], cols[:, 1]] = k_pool.shape[0] + torch.arange(len(cols))
                k_pool, v_pool = torch.cat([k_pool.float(), k_st]), torch.cat([v_pool.float(), v_st])
            feeds[f"k_pool_{layer}"], feeds[f"v_pool_{layer}"] = k_pool.float(), v_pool.float()
            if warm_codec is not None:
                feeds[f"warm_pool_{layer}"] = self._warm_pool_feed(layer, warm_codec)
        if warm_codec is not None:
            feeds["page_warm_row"] = torch.where(warm_in_graph, wslot, torch.full_like(wslot, -1))
        write_recs = torch.stack([c["write_recs"] for c in ctxs])  # [B, T]
        feeds.update(seq_len=torch.cat([c["seq_len"] for c in ctxs]), page_index=index, page_table=table,
                     page_mask=full | stage | warm_in_graph,
                     write_slot=mgr.dev_slot[:, write_recs.flatten()].view(L, B, T),
                     write_offset=torch.stack([c["write_off"] for c in ctxs]))
        if tiered_graph:
            budget = self.budgets.attention_pages
            attend = PAD_PAGE_INDEX if budget is None or not decode else budget
            feeds.update(page_pinned=pinned, page_tokens=tokens, attend_pages=torch.full((B,), attend),
                         key_min=mgr.kmin[:, flat].view(L, B, M, *mgr.kmin.shape[2:]).float(),
                         key_max=mgr.kmax[:, flat].view(L, B, M, *mgr.kmax.shape[2:]).float(),
                         page_saliency=(mgr.sal_sum[:, flat].view(L, B, M) / tokens.clamp(min=1)).float(),
                         position_table=self.scorer.position.detach().float())
        return feeds

    def _warm_pool_feed(self, layer: int, warm_codec: str) -> torch.Tensor:
        """The warm pool of one layer as a graph input [W, page bytes] uint8: the pool's own rows
        (no copy), or one zero row when the cache keeps no warm tier (the graph then reads none)."""
        if self.mgr.warm is not None:
            if self.config.warm_codec != warm_codec:
                raise ConfigError(f"warm_codec {self.config.warm_codec!r} of the KV config does not match the "
                                  f"engine's {warm_codec!r}")
            return self.mgr.warm.data[layer]
        nb = codec_page_bytes(CODECS[warm_codec], self.spec.num_kv_heads, self.config.page_size, self.spec.head_dim)
        return torch.zeros((1, nb), dtype=torch.uint8)

    def _stage(self, layer: int, recs: torch.Tensor, warm_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages ``recs`` of one layer in float32 for a step's pool: warm ones decoded, the
        others read from their host/disk copy (not counted here)."""
        mgr = self.mgr
        k = torch.empty((len(recs), *mgr.device.page_shape))
        v = torch.empty_like(k)
        warm = warm_slots >= 0
        layers = torch.full_like(recs, layer)
        for idx, read in ((warm.nonzero().flatten(), lambda i: mgr.warm.read(layers[i], warm_slots[i])),
                          ((~warm).nonzero().flatten(), lambda i: mgr.fetch(layer, recs[i]))):
            if len(idx):
                ks, vs = read(idx)
                k.index_copy_(0, idx, ks.float())
                v.index_copy_(0, idx, vs.float())
        return k, v

    def engine_finish(self, step: Step, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        """Finish an engine step: write the new K/V (``k_new``, ``v_new`` [L, B, KVH, T, D]),
        record each layer's access from the graph's selection, relevance and attention mass
        (``attend`` records the same for the torch backend), close the step."""
        mgr = self.mgr
        decode = step.num_new == 1
        for layer in range(mgr.L):
            self._write(layer, outputs["k_new"][layer], outputs["v_new"][layer])
        in_pool = feeds["page_mask"]
        tiered = "page_selected" in outputs
        for layer in range(mgr.L):
            for b, ctx in enumerate(self._step_ctx):
                n, rows = len(ctx["recs"]), ctx["rows"]
                if tiered:
                    selected = outputs["page_selected"][layer, b, :n]
                    rel, mass = outputs["page_relevance"][layer, b, :n], outputs["page_mass"][layer, b, :n]
                else:  # a plain graph attends every page in its pool (the cache has no budget)
                    selected, rel, mass = torch.ones(n, dtype=torch.bool), torch.zeros(n), torch.zeros(n)
                attended = selected & in_pool[layer, b, :n]
                off = attended & (mgr.dev_slot[layer, ctx["recs"]] < 0)
                warm = off & (mgr.warm_slot[layer, ctx["recs"]] >= 0)
                mgr.metrics.warm_reads += int(warm.sum())
                mgr.count_stream(layer, ctx["recs"][off & ~warm])
                self._record(layer, ctx, decode=decode, selected=selected, attended=attended,
                             resident=mgr.resident(layer, rows), rel=rel, sal=self._saliency(layer, ctx), mass=mass)
        self.end_step(step)

    def _observed_importance(self, rel: torch.Tensor, pos: torch.Tensor, sal: torch.Tensor,
                             attended: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """The importance kept between steps: relevance is the observed attention share
        for attended pages (normalized so the top page is 1), the estimate for the others."""
        if attended.any():
            obs = torch.zeros_like(rel)
            obs[attended] = mass / mass.max().clamp(min=1e-30)
            rel = torch.where(attended, obs, rel)
        return mix(self.config.score_weights, rel, pos, sal)

    def end_step(self, step: Step) -> None:
        decode = step.num_new == 1
        if self.recorder is not None:
            self.recorder.record(self, step, self._access, decode=decode)
        self.mgr.end_step(self._access, decode=decode)
        self._access = None
