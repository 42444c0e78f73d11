"""Invariants under load (hypothesis, stateful): random streams of submit / step / cancel /
preempt / drain over the paged cache (a page budget) or the tiered cache (a device budget, a
bounded host tier), both with prefix reuse, never lose or duplicate a page, never exceed a
budget, leave no page referenced by a finished request, and every freed page returns to its
pool. The machine sees the caches through the serving interface only (``KVCache.usage``,
``check``, ``pages_of``), as the engine does."""

import random

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import tiny_model
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving import Engine, PrefixConfig, RequestStatus, SchedulerConfig
from tieredkv.runtime.serving.scheduler import ScheduledStep
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig

MODEL = tiny_model(seed=3)
SPEC = MODEL.kv_spec()
PAGE = 8
TOKEN_BYTES = SPEC.token_bytes_per_layer * SPEC.num_layers
SYSTEMS = [list(range(20, 20 + 3 * PAGE)), list(range(300, 300 + 2 * PAGE + 5))]


class ServingMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(["tiered", "paged"]), device=st.sampled_from([14, 20, 40]),
                host=st.sampled_from([None, 60]), admission=st.sampled_from(["optimistic", "reserve"]),
                preemption=st.sampled_from(["demote", "recompute"]), tiers=st.sampled_from(["device", "disk"]),
                warm=st.sampled_from([None, "int4", "int4>int2:0.5"]))
    def setup(self, kind, device, host, admission, preemption, tiers, warm):
        if kind == "tiered":
            cfg = TieredKVConfig(page_size=PAGE, sink_tokens=4, recent_tokens=16, staging_pages=2,
                                 device_budget=f"{device * PAGE * TOKEN_BYTES}B", attention_budget=10 ** 6,
                                 host_budget=None if host is None else host * PAGE,
                                 warm_codec=None if warm is None else warm.partition(">")[0],
                                 warm_ladder=None if warm is None else warm.partition(">")[2] or None)
            self.cache = TieredKVCache(SPEC, cfg)
        else:  # the paged cache: every page of a request on the device; preemption by recompute
            self.cache = PagedKVCache(SPEC, PagedCacheConfig(page_size=PAGE, max_pages=2 * device, initial_pages=4))
            preemption = "recompute"
        sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=40, prefill_chunk=24, admission=admission,
                                preemption=preemption, max_model_len=200)
        self.engine = Engine(MODEL, self.cache, scheduler=sched, prefix=PrefixConfig(tiers=tiers))
        self.rng = random.Random(device * 7 + (host or 0))

    def live(self):
        return [r for r in self.engine.requests.values() if not r.finished]

    @rule(system=st.integers(0, 2), tail=st.integers(1, 40), new=st.integers(1, 30))
    def submit(self, system, tail, new):
        prompt = (SYSTEMS[system] if system < 2 else []) + [self.rng.randrange(3, 500) for _ in range(tail)]
        try:
            self.engine.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        except Exception as exc:  # a refusal at submission is typed and queues nothing
            assert type(exc).__name__ in ("KVCacheFullError", "ContextLengthError"), exc

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            if self.engine.has_unfinished():
                self.engine.step()

    @precondition(lambda self: bool(self.live()))
    @rule(pick=st.integers(0, 10 ** 6))
    def cancel(self, pick):
        live = self.live()
        assert self.engine.abort(live[pick % len(live)].request_id)

    @precondition(lambda self: len(self.engine.scheduler.running) > 1)
    @rule(pick=st.integers(0, 10 ** 6))
    def preempt(self, pick):
        s = self.engine.scheduler
        s._preempt(s.running[pick % len(s.running)], ScheduledStep())

    @rule()
    def drain(self):
        self.engine.run()
        assert not self.live()

    @invariant()
    def pages_balance(self):
        cache = self.cache
        cache.check()
        self.engine.prefix.check()
        usage, s = cache.usage(), self.engine.scheduler
        assert usage.device_capacity is None or usage.device_pages <= usage.device_capacity
        assert self.engine.prefix is not None and usage.indexed_pages == len(self.engine.prefix)
        # no page is referenced by a finished request: references = live sequences' lists + the index
        live = [r for r in self.live() if r.seq_id is not None]
        assert usage.sequences == len(live)
        assert usage.sequence_refs == sum(len(cache.pages_of(r.seq_id)) for r in live)
        for r in self.engine.requests.values():
            assert (r.status is RequestStatus.PAUSED) == (r in s.paused)
            if r.finished:
                assert r.seq_id is None

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        self.engine.run()
        self.engine.prefix.clear()
        usage = self.cache.usage()
        assert usage.sequences == usage.sequence_refs == usage.indexed_pages == 0
        assert usage.device_pages == 0 and usage.device_bytes == 0, "pages kept after every request and the index let go"
        self.cache.check()
        self.cache.close()


TestServingMachine = ServingMachine.TestCase
TestServingMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
