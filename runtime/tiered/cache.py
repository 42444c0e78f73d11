"""TieredKVCache: the KV cache of the tiered design's decode step, for the PyTorch reference model.

Per step: ``begin_step`` asks the TierManager for the step's plan (new pages, where the new
tokens go, every sequence's pages as [B, M] tensors) and opens a
:class:`~tieredkv.runtime.tiered.layer_step.LayerStep`. Per layer (``attend``), for every
sequence at once:
  1. ``store``: the new tokens' K/V into their device pages (KVAppend), with the key
     summaries and saliency the scorer reads (a decode step that scores and measures nothing
     folds them in at its end, for every layer at once);
  2. where the step selects (an attention budget smaller than a sequence's pages, or masked
     mode with pages off the device), ImportanceScore ranks every listed page; SelectPages
     picks T0 plus the top pages within the attention budget; a selected page that is not
     resident is a miss: ``exact`` mode reads it from the host (or disk) before use, ``masked``
     skips it;
  3. TieredAttention over the attended pages — gathered by slot from the device pool,
     decoded from the warm pool, read off the device by the manager's one reader — gives the
     output and each page's attention mass.
``end_step``: what every layer did goes to the manager once (``record_step``: needed, missed,
streamed, mass, the importance kept between steps), which updates statistics, migrates and
admits pages. The engine backends run steps 1-3 in their graph and hand the outputs back
through ``engine_io``.

With an unlimited device budget (or the ``full`` policy) and no attention budget every
page is resident and attended: the output equals the paged cache's.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence

import torch

from tieredkv.errors import ConfigError
from tieredkv.models.cache import KVCache, KVSpec, KVUsage, Step
from tieredkv.plugins.codec import CODECS, page_bytes as codec_page_bytes
from tieredkv.runtime.tiered.budgets import resolve_budgets
from tieredkv.runtime.tiered.config import KV_DTYPES, TieredKVConfig
from tieredkv.runtime.tiered.layer_step import LayerStep
from tieredkv.runtime.tiered.manager import TierManager
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.page_table import hot_page_count, hot_records
from tieredkv.runtime.tiered.policies import make_policy
from tieredkv.runtime.tiered.prefetch import make_prefetcher
from tieredkv.runtime.tiered.scorer import ImportanceScorer
from tieredkv.runtime.tiered.step import StepPlan
from tieredkv.runtime.tiered.trace import AccessLogger


class TieredKVCache(KVCache):
    """``full_tokens`` / ``num_sequences``: the size of the work at hand, which percentage
    budgets resolve against. ``recorder``: receives every step's access record of each
    sequence (``TraceRecorder``). ``keep_decoded_warm``: the warm pool keeps decoded copies
    of its pages (a CPU evaluation aid; identical numerics, see ``WarmPool``)."""

    def __init__(self, spec: KVSpec, config: TieredKVConfig | None = None, *, full_tokens: int | None = None,
                 num_sequences: int = 1, scorer: ImportanceScorer | None = None, recorder=None,
                 keep_decoded_warm: bool = False) -> None:
        self.config = config = config or TieredKVConfig()
        if config.kv_dtype is not None:
            spec = dataclasses.replace(spec, dtype=KV_DTYPES[config.kv_dtype])
        self.spec = spec
        warm_bytes = None
        if config.warm.codec is not None:  # one encoded page's bytes per rung of the warm tier
            warm_bytes = tuple(codec_page_bytes(CODECS[c], spec.num_kv_heads, config.page_size, spec.head_dim)
                               for c, _ in config.warm.rungs())
        self.budgets = resolve_budgets(config, num_layers=spec.num_layers,
                                       token_bytes_per_layer=spec.token_bytes_per_layer,
                                       full_tokens=full_tokens, dtype=spec.dtype, num_sequences=num_sequences,
                                       warm_page_bytes=warm_bytes)
        migration = config.migration
        policy = make_policy(migration.policy, lfu_importance_weights=migration.lfu_importance_weights)
        if policy.needs_trace:
            raise ConfigError(f"policy {migration.policy!r} is an offline oracle: it needs the future accesses of a "
                              "recorded trace (tools/bench_tiered.py hitrate replays one); a live cache cannot run "
                              "it. Use lru, lfu, lfu-importance, h2o, streaming or full")
        scorer = scorer or ImportanceScorer.for_model(spec.num_layers, spec.head_dim, path=config.scorer_weights,
                                                      weights=migration.score_weights)
        if scorer.position.device != torch.device(spec.device):  # the scorer runs where the layers do
            scorer = copy.deepcopy(scorer).to(spec.device)
        self.scorer = scorer
        self.prefetcher = make_prefetcher(config)
        self.mgr = TierManager(num_layers=spec.num_layers, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                               dtype=spec.dtype, config=config, budgets=self.budgets, policy=policy,
                               keep_decoded_warm=keep_decoded_warm, prefetcher=self.prefetcher,
                               device=spec.device)
        if recorder is None and config.prefetch.access_log is not None:
            recorder = AccessLogger(config.prefetch.access_log, meta={"config": repr(config.flat())})
        self.recorder = recorder
        self.mgr.log_tiers = recorder is not None
        #: score every layer's pages under the previous layer's query (the log's ``spec``, the
        #: cross-layer predictor's input)
        self._speculate = bool(getattr(recorder, "speculate", False)) or (
            self.prefetcher is not None and self.prefetcher.predictor.lead == "layer")
        self.plan: StepPlan | None = None  # the open step's
        self.layers: LayerStep | None = None  # the open step's layers
        self._snapshot_steps = -1
        self._next_id = 0

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

    def add_sequence(self, *, shared: list[int] | tuple[int, ...] = ()) -> int:
        """A new sequence; ``shared``: records (live full pages, e.g. prefix-index hits) it
        starts with, in order — it then has ``len(shared) * page_size`` tokens."""
        sid = self._next_id
        self._next_id += 1
        self.mgr.add_sequence(sid, shared=shared)
        return sid

    # ------------------------------------------------------------------ the serving interface
    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def device_capacity(self) -> int | None:
        """Full-precision pages per layer the device may own (T0 + T1 + T2)."""
        return self.mgr.resident_cap

    @property
    def host_capacity(self) -> int | None:
        return None if self.mgr.disk is not None else self.budgets.host_pages

    @property
    def demotes(self) -> bool:
        return True

    @property
    def shares_pages(self) -> bool:
        return True

    def _hot(self, tokens: int) -> int:
        w = self.config.window
        return hot_page_count(tokens, self.page_size, w.sink_tokens, w.recent_tokens)

    def device_pages(self, tokens_now: int, tokens_after: int, *, prompt: int | None = None) -> int:
        """A running sequence holds its hot window (T0) on the device, and a new page while it
        writes one: the engine feeds a chunk in forward calls whose new pages fit next to the
        hot windows held (:meth:`max_step_tokens`), so a chunk needs one page of room to make
        progress, whatever its length. While it prefills its prompt, at least the hot window it
        will hold once its prompt is in (reserved from its admission on)."""
        P = self.page_size
        grown = self._hot(tokens_now) + min(1, -(-tokens_after // P) - -(-tokens_now // P))
        held = max(self._hot(tokens_after), grown)
        return held if prompt is None else max(held, self._hot(prompt + 1))

    def admission_pages(self, prompt: int, first_chunk: int) -> int:
        """Its hot window once its prompt is in (the page its first decode writes included), and
        one page more: a prefill chunk that crosses into a new page while the hot window is
        full needs it. Only the newest admission keeps that page free, so the requests admitted
        share one page of headroom (:meth:`device_pages` reserves the hot window alone): every
        prefill can make progress, and the hot windows alone may fill the budget."""
        return self._hot(prompt + 1) + 1

    def reserve_pages(self, tokens: int) -> int:
        """A full hot window: the rest of a sequence may live off the device."""
        return self.config.t0_pages

    def holds_working_sets(self, token_counts: Sequence[int]) -> bool:
        """Whether the device holds every page these sequences attend in a step: their hot windows
        at full precision and their other attended pages (all of them, or the attention budget's
        share) at full precision or in the warm pool. Past that, every step reads the rest from
        the host (exact mode) — the scheduler then keeps a request waiting instead. Masked mode
        reads nothing from the host in a step (it attends what the device holds): always True."""
        cap = self.mgr.resident_cap
        if cap is None or self.config.selection.mode == "masked":
            return True
        P, budget = self.page_size, self.budgets.attention_pages
        hot = attended = 0
        for tokens in token_counts:
            h, n = self._hot(tokens), -(-tokens // P)
            hot += h
            attended += n if budget is None else min(n, max(budget, h))
        warm = self.budgets.warm_pages if self.mgr.warm is not None else 0
        return hot <= cap and attended - hot <= cap - hot + warm

    def expect(self, seq_id: int, tokens: int) -> None:
        self.mgr.expect(seq_id, -(-tokens // self.page_size))

    def allocate_slots(self, seq_ids, num_new: int) -> bool:
        """Whether the device can hold the hot windows (T0) of every running sequence once the
        step's sequences have ``num_new`` more tokens: the pages ``begin_step`` makes resident,
        evicting others by policy (nothing is taken here: eviction moves no page a step needs)."""
        cap = self.mgr.resident_cap
        if cap is None:
            return True
        t, P, w = self.mgr.table, self.page_size, self.config.window
        step, pinned, new = set(seq_ids), set(), 0
        for seq, pages in t.seq_pages.items():
            if seq in t.paused:
                continue
            n = t.seq_len[seq] + (num_new if seq in step else 0)
            held = hot_records(pages, n, P, w.sink_tokens, w.recent_tokens)
            pinned.update(held)
            new += hot_page_count(n, P, w.sink_tokens, w.recent_tokens) - len(held)  # pages the step creates
        return len(pinned) + new <= cap

    def usage(self) -> KVUsage:
        t, m = self.mgr.table, self.mgr
        alive = int(t.alive.sum())
        return KVUsage(sequences=len(t.seq_len), device_pages=int(m.device.used().max()) if alive else 0,
                       device_capacity=m.resident_cap, device_bytes=self.kv_bytes(),
                       token_bytes=m.resident_token_bytes(), sequence_refs=int(t.refs.sum()) - int(t.cached.sum()),
                       indexed_pages=int(t.cached.sum()), tier_bytes=m.tier_bytes())

    def counters(self) -> dict[str, int]:
        m = self.metrics
        names = ("hits", "misses", "masked", "bytes_h2d", "bytes_d2h", "bytes_disk_read", "bytes_disk_write",
                 "promotions", "demotions", "fetched_pages", "evicted_pages", "spilled_pages", "compressed_pages")
        return {name: int(getattr(m, name)) for name in names}

    def pages_of(self, seq_id: int) -> list[int]:
        """The records (pages) of a sequence, in logical order."""
        return self.mgr.records_of(seq_id).tolist()

    def hold_pages(self, records) -> None:
        """The prefix index keeps these full pages past their sequences (one reference each)."""
        self.mgr.hold(torch.tensor(list(records), dtype=torch.long))

    def drop_pages(self, records) -> None:
        """The prefix index lets these pages go; the ones no sequence lists are freed."""
        self.mgr.let_go(torch.tensor(list(records), dtype=torch.long))

    def page_refs(self, records) -> list[int]:
        return self.mgr.table.refs[torch.tensor(list(records), dtype=torch.long)].tolist()

    def pages_indexed(self, records) -> list[bool]:
        return self.mgr.table.cached[torch.tensor(list(records), dtype=torch.long)].tolist()

    def page_tiers(self, records) -> list[str]:
        """Where each page is (the tier holding most of its layers): ``device`` (full precision or
        warm), ``host`` or ``disk``."""
        t, recs = self.mgr.table, torch.tensor(list(records), dtype=torch.long)
        dev = self.mgr.resident(slice(None), recs)
        host = ~dev & (t.host_slot[:, recs] >= 0)
        counts = torch.stack([dev.sum(0), host.sum(0), (~dev & ~host).sum(0)])
        return [("device", "host", "disk")[i] for i in counts.argmax(0).tolist()]

    def read_pages(self, records) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact K, V of full pages in every layer, [L, n, KVH, P, D], in host memory — from
        whichever tier holds each (a warm page from its exact copy)."""
        recs, L = torch.tensor(list(records), dtype=torch.long), self.mgr.L
        layers = torch.arange(L).repeat_interleave(len(recs))
        k, v = self.mgr.read_pages(layers, recs.repeat(L), self.spec.dtype, exact=True)
        k, v = self.mgr.transfers.to_host(k, v, pages=len(recs) * L)  # one copy down when the device tier is a GPU
        return k.view(L, len(recs), *k.shape[1:]), v.view(L, len(recs), *v.shape[1:])

    def write(self, step: Step, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store(layer, k, v)

    @property
    def warm_codec(self) -> tuple[str, object] | None:
        warm = self.mgr.warm
        return None if warm is None else (self.config.warm.codec, warm.codec)

    def check(self) -> None:
        self.mgr.check_invariants()

    def pause(self, seq_id: int) -> None:
        """Preempt by demotion: the sequence's pages leave the device, nothing is lost."""
        self.mgr.pause(seq_id)

    def resume(self, seq_id: int) -> None:
        self.mgr.resume(seq_id)

    def fork(self, seq_id: int, num_tokens: int | None = None) -> int:
        """A new sequence that starts with the first ``num_tokens`` tokens of ``seq_id`` (default:
        all of its full pages), sharing their pages (reference-counted, copied only if a
        truncation makes one partial again). ``num_tokens`` must be a multiple of the page
        size within the source's full pages: the caller feeds the rest itself."""
        P = self.config.page_size
        full = self.length(seq_id) // P * P
        num_tokens = full if num_tokens is None else num_tokens
        if num_tokens % P or not 0 <= num_tokens <= full:
            raise ConfigError(f"fork: num_tokens must be a multiple of the page size ({P}) between 0 and the "
                              f"{full} tokens of sequence {seq_id}'s full pages, got {num_tokens}")
        sid = self._next_id
        self._next_id += 1
        self.mgr.add_sequence(sid, shared=self.mgr.records_of(seq_id)[: num_tokens // P].tolist())
        return sid

    def free_sequence(self, seq_id: int) -> None:
        self._snapshot()  # keep the figures of the last step
        if isinstance(self.recorder, AccessLogger):
            self.recorder.finish(seq_id)
        self.mgr.free_sequence(seq_id)

    def close(self) -> None:
        """Free every sequence left and remove the T4 file (disk_path); the metrics stay."""
        for sid in list(self.mgr.table.seq_pages):
            self.free_sequence(sid)
        self.mgr.close()
        if self.mgr.disk is not None:
            self.mgr.disk.close()

    def length(self, seq_id: int) -> int:
        return self.mgr.length(seq_id)

    def truncate(self, seq_id: int, length: int) -> None:
        self.mgr.truncate(seq_id, length)

    def checkpoint(self, seq_id: int):
        return self.mgr.checkpoint()

    def rollback(self, seq_id: int, state) -> None:
        self.mgr.rollback(state)

    def kv_bytes(self) -> int:
        """Device-resident K/V bytes (T0 + T1 + T2)."""
        return self.mgr.resident_bytes()

    def max_step_tokens(self, *, fixed: bool = False) -> int | None:
        """The most new tokens one forward call may bring while residency stays within the
        device budget: its new pages fit next to the hot windows the open sequences hold now
        (one admitted but not prefilled yet holds none, a paused one none); ``fixed``: next to
        a full hot window (T0) of every open sequence, a limit that holds whatever their
        lengths become (the evaluation's prefill feeds a whole prompt in chunks of that size)."""
        cap = self.mgr.resident_cap
        if cap is None:
            return None
        t = self.mgr.table
        if fixed:
            hot = self.config.t0_pages * max(1, self.mgr.num_sequences)
        else:
            hot = sum(self._hot(t.seq_len[s]) for s in t.seq_pages if s not in t.paused)
        return max(1, (cap - hot) * self.config.page_size)

    # ------------------------------------------------------------------ steps
    def begin_step(self, seq_ids, num_new: int) -> Step:
        step = super().begin_step(seq_ids, num_new)
        self.plan = self.mgr.begin_step(step.seq_ids, num_new)
        self.layers = LayerStep(self, self.plan)
        return step

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The open step's new K/V of one layer, k, v [B, KVH, T, D], into the cache."""
        kt = k.transpose(1, 2).reshape(-1, *k.shape[1:2], k.shape[-1])  # [B*T, KVH, D] in (b, t) order
        vt = v.transpose(1, 2).reshape(-1, *v.shape[1:2], v.shape[-1])
        slots, rows = self.layers.write_slots[layer], self.layers.write_rows[layer]
        if self.layers.new_keys is not None:  # a decode step: nothing reads the summaries before it ends
            self.mgr.append_tokens(layer, self.plan, kt, vt, slots, rows)
            self.layers.new_keys[layer] = kt
            return
        self.mgr.write_tokens(layer, self.plan, kt, vt, self.scorer.token_saliency(layer, kt), slots=slots, rows=rows)

    def attend(self, step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store(layer, k, v)
        speculate = self._speculate and self.plan.decode
        if speculate and layer == 0 and self.prefetcher is not None:
            self._prefetch_layer(0, None)  # layer 0 has no previous layer: the predictor's fallback
        out = self.layers.attend(layer, q)
        if speculate and layer + 1 < self.spec.num_layers:
            self._prefetch_layer(layer + 1, q)
        return out

    def _prefetch_layer(self, layer: int, q: torch.Tensor | None) -> None:
        """Inside a decode step: layer ``layer``'s pages scored under the previous layer's query
        ``q`` [B, H, T, D] (the access log's ``spec``; None: unknown), then — with a
        cross-layer predictor — prefetched before the layer selects."""
        acc, plan = self.mgr._access, self.plan
        if acc.spec is None:
            acc.spec = torch.full(acc.needed.shape, float("nan"))
        if q is not None:
            t_start = time.perf_counter()
            spec = self.layers.relevance_ahead(layer, q[:, :, -1]).cpu()
            acc.spec[layer, plan.recs[plan.valid]] = spec[plan.valid]
            self.mgr.metrics.predictor_seconds += time.perf_counter() - t_start
        if self.prefetcher is not None:
            self.prefetcher.within_step(self.mgr, acc.spec, layers=layer)

    def end_step(self, step: Step) -> None:
        """Close the step: what every layer did to the manager (once), the access log, then the
        manager's statistics, migration and admissions."""
        keys = self.layers.new_keys
        if keys:  # the deferred key summaries of the layers stored, at once
            layers = sorted(keys)
            k = torch.stack([keys[i] for i in layers])  # [L', B, KVH, D]
            which = None if len(layers) == self.spec.num_layers else torch.tensor(layers)
            self.mgr.fold_summaries(self.plan, k, self.scorer.token_saliency_all(k, which), which)
        # (a step that only stored pages, e.g. loaded from the remote tier, records nothing)
        rec = self.layers.record() if self.layers.ran else None
        decode = step.num_new == 1
        if self.recorder is None:
            self.mgr.close_step(self.plan, rec, decode=decode)
        else:  # the access log reads the step's access record between the two
            if rec is not None:
                self.mgr.record_step(self.plan, rec)
            for sid in step.seq_ids:
                self.recorder.record(self.mgr.seq_access(sid), seq=sid, num_new=step.num_new, decode=decode,
                                     page_size=self.config.page_size, t0=self.mgr.table.t0[self.mgr.records_of(sid)])
            self.mgr.end_step(decode=decode)
        self.plan = self.layers = None
