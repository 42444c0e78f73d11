"""The tiered KV cache: equality with the paged cache when nothing is limited, exactness when
only residency is limited, budgets and accounting invariants under random work (sequences
added, decoded, forked, truncated, freed, cancelled), shared prefix pages, bit-exact moves
between tiers, head-rank selection, configuration errors of a live cache."""

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from helpers import SMALL_KV as SMALL, tiny_model
from tieredkv.errors import ConfigError, KVCacheFullError
from tieredkv.models.llama import prefill
from tieredkv.runtime.generate import generate
from tieredkv.runtime.paged import PagedKVCache
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.layer_step import LayerStep
from tieredkv.runtime.tiered.policies import POLICIES

LIVE_POLICIES = sorted(n for n, p in POLICIES.items() if not p.needs_trace)
MODEL = tiny_model(seed=3)
PROMPTS = [list(range(5, 205)), list(range(300, 333))]
L = MODEL.config.num_layers


def run(cache, prompts=PROMPTS, n=24):
    return generate(MODEL, cache, prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))


@pytest.fixture(scope="module")
def ref_tokens():
    """The paged cache's greedy tokens for PROMPTS."""
    return [c.token_ids for c in run(PagedKVCache(MODEL.kv_spec()))]


def resident_cap_bytes(cache) -> int:
    return cache.budgets.resident_pages * cache.mgr.page_bytes * L


@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_unlimited_budget_equals_paged_cache(policy, ref_tokens):
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(policy=policy, **SMALL))
    assert [c.token_ids for c in run(cache)] == ref_tokens
    assert cache.metrics.misses == 0 and cache.metrics.bytes_h2d == 0


def test_unlimited_budget_logits_match_paged():
    tokens = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(2))
    paged, tiered = PagedKVCache(MODEL.kv_spec()), TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL))
    a = prefill(MODEL, paged, paged.add_sequence(), tokens, chunk_size=40, all_logits=True)
    b = prefill(MODEL, tiered, tiered.add_sequence(), tokens, chunk_size=40, all_logits=True)
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@pytest.mark.parametrize("budget", ["25%", "40%"])
def test_exact_mode_loses_nothing(policy, budget, ref_tokens):
    """Residency limited, attention unlimited, exact mode: demoted pages are streamed back
    when needed, so the output equals the full cache while residency stays in budget."""
    cfg = TieredKVConfig(policy=policy, device_budget=budget, attention_budget=10**6, **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=224, num_sequences=2)
    assert [c.token_ids for c in run(cache)] == ref_tokens
    m = cache.metrics
    if policy != "full":
        assert 0 < m.resident_bytes_max <= resident_cap_bytes(cache)
        assert m.streamed_pages > 0 and m.bytes_h2d > 0 and m.writebacks > 0
    cache.mgr.check_invariants()


def test_masked_mode_counts_skips():
    cfg = TieredKVConfig(policy="streaming", mode="masked", device_budget="30%", **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=224)
    run(cache, PROMPTS[:1])
    m = cache.metrics
    assert m.masked == m.misses > 0 and m.streamed_pages > 0  # prefill streams, decode skips


def test_chunked_prefill_stays_within_the_budget():
    cfg = TieredKVConfig(policy="lru", device_budget=96, **SMALL)  # 96 tokens = 12 pages per layer
    cache = TieredKVCache(MODEL.kv_spec(), cfg)
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, torch.arange(400) % 500, chunk_size=512)
    assert cache.metrics.prefill_steps > 1  # the cache limited the chunk size
    assert max(cache.metrics.resident_bytes_trace) <= resident_cap_bytes(cache)
    assert cache.length(sid) == 400
    cache.mgr.check_invariants()


@pytest.mark.parametrize("chunk", [13, 17, 30, 31])
def test_prefill_chunks_that_end_mid_page_stay_exact(chunk):
    """A chunk that ends inside a page leaves that page partial; by the next chunk it is out of
    the recent window, may have left the device, and is written again: it must come back
    with its tokens, and its stale copies off the device must go. (Found by the serving
    engine: logits were off by 3e-2.)"""
    tokens = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(5))
    full = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL))
    want = prefill(MODEL, full, full.add_sequence(), tokens, chunk_size=chunk, all_logits=True)
    cfg = TieredKVConfig(device_budget=80, attention_budget=10 ** 6, **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg)
    got = prefill(MODEL, cache, cache.add_sequence(), tokens, chunk_size=chunk, all_logits=True)
    assert (got - want).abs().max().item() <= 1e-5
    cache.mgr.check_invariants()


def test_a_paused_partial_page_comes_back_exact():
    """Preemption by demotion mid-page: the partial page goes to the host; after resume the
    next tokens are written into it again, and a later eviction writes the new content back."""
    tokens = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(6))
    full = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL))
    want = prefill(MODEL, full, full.add_sequence(), tokens, chunk_size=20, all_logits=True)
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget=96, attention_budget=10 ** 6, **SMALL))
    sid, other = cache.add_sequence(), cache.add_sequence()
    parts = []
    for lo in range(0, 120, 20):
        parts.append(prefill(MODEL, cache, sid, tokens[lo:lo + 20], chunk_size=20, all_logits=True, start_pos=lo))
        cache.pause(sid)  # its pages, the partial one included, leave the device
        prefill(MODEL, cache, other, tokens[:9], chunk_size=9, start_pos=cache.length(other))
        cache.resume(sid)
        cache.mgr.check_invariants()
    assert (torch.cat(parts) - want).abs().max().item() <= 1e-5


def read_back(mgr, layer: int, recs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [KVH, n * P, D] of ``recs`` in ``layer``, from wherever each page lives."""
    k, v = mgr.read_pages(layer, recs, mgr.device.dtype, exact=True)
    return (k.permute(1, 0, 2, 3).reshape(k.shape[1], -1, k.shape[-1]),
            v.permute(1, 0, 2, 3).reshape(v.shape[1], -1, v.shape[-1]))


def test_tier_moves_are_bit_exact(tmp_path):
    """Pages written on the device, evicted to host, spilled to disk and fetched back
    come back bit-identical. Layer 0's keys and values do not depend on attention, so the
    paged cache's copy of the same prompt is the reference."""
    cfg = TieredKVConfig(policy="lru", device_budget=96, host_budget=64, disk_path=str(tmp_path / "t4.bin"),
                         **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg)
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, torch.arange(300) % 500, chunk_size=64)
    paged = PagedKVCache(MODEL.kv_spec())
    pid = paged.add_sequence()
    prefill(MODEL, paged, pid, torch.arange(300) % 500, chunk_size=64)
    mgr = cache.mgr
    assert mgr.metrics.spilled_pages > 0 and mgr.tier_counts()["T4"] > 0
    full_pages = mgr.records_of(sid)[:-1]
    k, v = read_back(mgr, 0, full_pages)
    pk, pv, _ = paged.gather(0, [pid])
    n = len(full_pages) * cfg.page_size
    assert torch.equal(k, pk[0, :, :n]) and torch.equal(v, pv[0, :, :n])
    mgr.check_invariants()
    cache.free_sequence(sid)
    assert mgr.device.used().sum() == 0 and mgr.host.used().sum() == 0 and mgr.disk.used().sum() == 0


# ----------------------------------------------------------------------------- shared pages (fork)


def test_fork_shares_full_pages_and_equals_independent_sequences():
    """A fork starts with the source's full pages, shared (one copy in every tier); both then
    generate exactly what two independent sequences generate, under a device budget; freeing
    one keeps the shared pages for the other; freeing both returns everything."""
    prompt = torch.randint(0, 512, (61,), generator=torch.Generator().manual_seed(7))
    tail = [int(t) for t in torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(8))]
    cfg = TieredKVConfig(policy="lfu-importance", device_budget=48, attention_budget=10**6, **SMALL)

    def continue_(cache, sid, start, tokens):
        return prefill(MODEL, cache, sid, torch.tensor(tokens), start_pos=start, chunk_size=1, all_logits=True)

    cache = TieredKVCache(MODEL.kv_spec(), cfg, num_sequences=2)  # 12 pages per layer for 13 or more
    a = cache.add_sequence()
    prefill(MODEL, cache, a, prompt, chunk_size=16)
    b = cache.fork(a)  # the 56 tokens of 7 full pages
    assert cache.length(b) == 56 and cache.mgr.table.refs[cache.mgr.records_of(b)].tolist() == [2] * 7
    cache.mgr.check_invariants()
    got_b = continue_(cache, b, 56, prompt[56:].tolist() + tail)
    got_a = continue_(cache, a, 61, tail[::-1])
    cache.mgr.check_invariants()
    ref = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL))
    r = ref.add_sequence()
    prefill(MODEL, ref, r, prompt, chunk_size=16)
    want_a = continue_(ref, r, 61, tail[::-1])
    r2 = ref.add_sequence()
    prefill(MODEL, ref, r2, prompt[:56], chunk_size=16)
    want_b = continue_(ref, r2, 56, prompt[56:].tolist() + tail)
    assert torch.allclose(got_a, want_a, atol=1e-5) and torch.allclose(got_b, want_b, atol=1e-5)
    assert cache.metrics.evicted_pages > 0 and cache.metrics.streamed_pages > 0  # the budget was at work
    shared = cache.mgr.records_of(b)[:7]
    cache.free_sequence(a)
    cache.mgr.check_invariants()
    assert cache.mgr.table.alive[shared].all() and (cache.mgr.table.refs[shared] == 1).all()
    cache.free_sequence(b)
    cache.mgr.check_invariants()
    assert int(cache.mgr.device.used().sum()) == 0 and not cache.mgr.table.alive.any()


def test_truncating_into_a_shared_page_copies_it():
    """A sequence truncated inside a shared page writes into a private copy (copy on write):
    the other sequence's page is untouched, and the copy holds the same K/V."""
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL))
    a = cache.add_sequence()
    prefill(MODEL, cache, a, torch.arange(40) % 500, chunk_size=40)
    b = cache.fork(a, 32)
    shared = int(cache.mgr.records_of(b)[-1])
    before = read_back(cache.mgr, 1, torch.tensor([shared]))
    cache.truncate(b, 29)
    own = int(cache.mgr.records_of(b)[-1])
    assert own != shared and int(cache.mgr.table.refs[shared]) == 1 and cache.metrics.copied_pages == L
    assert all(torch.equal(x, y) for x, y in zip(read_back(cache.mgr, 1, torch.tensor([own])), before))
    prefill(MODEL, cache, b, torch.tensor([7, 8, 9]), start_pos=29, chunk_size=3)
    assert all(torch.equal(x, y) for x, y in zip(read_back(cache.mgr, 1, torch.tensor([shared])), before))
    cache.mgr.check_invariants()


def test_fork_needs_whole_pages():
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL))
    a = cache.add_sequence()
    prefill(MODEL, cache, a, torch.arange(20) % 500, chunk_size=20)
    for bad in (4, 24, -8):
        with pytest.raises(ConfigError, match="multiple of the page size"):
            cache.fork(a, bad)
    assert cache.length(cache.fork(a)) == 16


# ----------------------------------------------------------------------------- invariants under random work
work = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 90)),
    st.tuples(st.just("decode"), st.integers(1, 6)),
    st.tuples(st.just("fork"), st.integers(0, 5)),
    st.tuples(st.just("truncate"), st.integers(0, 40)),
    st.tuples(st.just("free"), st.integers(0, 5)),
    st.tuples(st.just("cancel"), st.integers(0, 5)),
), min_size=1, max_size=10)


@settings(max_examples=40, deadline=None)
# a truncation moves the recent window back onto pages that had left the device: found by CI
@example(ops=[("add", 25), ("add", 33), ("add", 41), ("truncate", 2)], policy="h2o", mode="exact", budget=48,
         attention=None, warm="int4", host=None, prefetch=None)
@given(ops=work, policy=st.sampled_from(LIVE_POLICIES), mode=st.sampled_from(["exact", "masked"]),
       budget=st.sampled_from([None, 48, 96, 240]), attention=st.sampled_from([None, 48, 10**6]),
       warm=st.sampled_from([None, "int4", "fp8-r2"]), host=st.sampled_from([None, 12]),
       prefetch=st.sampled_from([None, "last", "vote", "recency", "quest-next-layer", "gru"]))
def test_property_invariants(ops, policy, mode, budget, attention, warm, host, prefetch):
    """Random add / decode / fork / truncate / free / cancel: after every step no page is lost
    or duplicated, reference counts match the sequences sharing pages, capacities hold (the warm
    sub-tier's encoded bytes included), accounting balances (tier counts cover the live pages,
    counted moves balance the pools); freed sequences return every slot and record. ``host``: a
    host budget of 12 pages per sequence with a T4 file. ``prefetch``: a predictor prefetches
    after every decode step (and a layer ahead): the staging area never overflows, and every
    prefetched page ends up used or counted as wasted (no prefetch buffer is leaked)."""
    import tempfile

    disk = tempfile.mkdtemp() + "/t4.bin" if host else None
    cfg = TieredKVConfig(policy=policy, mode=mode, device_budget=budget, attention_budget=attention,
                         host_budget=host and host * SMALL["page_size"], disk_path=disk,
                         prefetch_predictor=prefetch, **{**SMALL, "warm_codec": warm})
    try:
        cache = TieredKVCache(MODEL.kv_spec(), cfg, num_sequences=3)
    except ConfigError:
        return  # attention budget below T0, device budget below the hot window: rejected up front
    live: list[int] = []
    gen = torch.Generator().manual_seed(0)
    for op, arg in ops:
        if op == "add" and len(live) < 3:
            sid = cache.add_sequence()
            try:
                prefill(MODEL, cache, sid, torch.randint(0, 512, (arg,), generator=gen), chunk_size=32)
            except KVCacheFullError:
                cache.free_sequence(sid)
                continue
            live.append(sid)
        elif op == "fork" and live and len(live) < 3:
            live.append(cache.fork(live[arg % len(live)]))
        elif op == "truncate" and live:
            sid = live[arg % len(live)]
            cache.truncate(sid, max(0, cache.length(sid) - arg))
        elif op == "decode" and live:
            for _ in range(arg):
                ids = [s for s in live if cache.length(s) > 0]
                if not ids:
                    break
                pos = torch.tensor([cache.length(s) for s in ids])
                try:
                    MODEL(torch.randint(0, 512, (len(ids), 1), generator=gen), pos.view(-1, 1), cache, ids)
                except KVCacheFullError:
                    break
                cache.mgr.check_invariants()
        elif op in ("free", "cancel") and live:
            cache.free_sequence(live.pop(arg % len(live)))
        cache.mgr.check_invariants()
        m = cache.metrics
        if cache.mgr.resident_cap is not None:
            b = cache.budgets
            assert m.resident_bytes_max <= (b.device_pages - b.staging_pages) * cache.mgr.page_bytes * L
    for sid in live:
        cache.free_sequence(sid)
    mgr = cache.mgr
    assert int(mgr.device.used().sum()) == 0 and int(mgr.host.used().sum()) == 0
    assert mgr.warm is None or int(mgr.warm.used().sum()) == 0
    assert mgr.disk is None or int(mgr.disk.used().sum()) == 0
    assert len(mgr.table.free) == mgr.table.capacity and not mgr.table.alive.any()
    assert not mgr.table.staged.any() and not mgr.table.prefetched.any()
    m = mgr.metrics
    assert m.prefetched_pages == m.prefetch_hits + m.prefetch_wasted


# ----------------------------------------------------------------------------- selection


def test_head_rank_selection(ref_tokens):
    """selection_aggregate = "head-rank": unlimited budgets equal the paged cache; under an
    attention budget it attends other pages than "share" (same count), and the cache keeps
    its invariants; engines refuse it (test_engine_backend)."""
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(selection_aggregate="head-rank", **SMALL))
    assert [c.token_ids for c in run(cache)] == ref_tokens
    tokens = torch.randint(0, 512, (180,), generator=torch.Generator().manual_seed(4))
    attended = {}
    for agg in ("share", "head-rank"):
        cfg = TieredKVConfig(device_budget="30%", attention_budget="20%", selection_aggregate=agg, **SMALL)
        steps = []

        class Recorder:  # the cache hands every step's access record of each sequence to its recorder
            def record(self, access, *, seq, num_new, decode, page_size, t0):
                if decode:
                    steps.append({tuple(x) for x in access.needed.nonzero().tolist()})  # (layer, page) needed

        cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=200, recorder=Recorder())
        sid = cache.add_sequence()
        prefill(MODEL, cache, sid, tokens[:150], chunk_size=64)
        for i in range(150, 160):
            prefill(MODEL, cache, sid, tokens[i : i + 1], start_pos=i, chunk_size=1)
        cache.mgr.check_invariants()
        assert len(steps) == 10
        attended[agg] = steps
    assert [len(x) for x in attended["share"]] == [len(x) for x in attended["head-rank"]]  # the same budget...
    assert attended["share"] != attended["head-rank"]  # ... spent on other pages


def test_exact_mode_output_does_not_depend_on_the_policy():
    """Selection reads scores only, so with a limited attention budget every policy attends
    the same pages in exact mode: identical logits; only the bytes moved differ."""
    tokens = torch.randint(0, 512, (180,), generator=torch.Generator().manual_seed(4))
    outs, moved = {}, {}
    for policy in LIVE_POLICIES:
        if policy == "full":
            continue
        cfg = TieredKVConfig(policy=policy, device_budget="30%", attention_budget="20%", **SMALL)
        cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=200)
        sid = cache.add_sequence()
        prefill(MODEL, cache, sid, tokens[:150], chunk_size=64)
        outs[policy] = prefill(MODEL, cache, sid, tokens[150:], start_pos=150, chunk_size=1, all_logits=True)
        moved[policy] = cache.metrics.bytes_h2d
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values())
    assert len(set(moved.values())) > 1  # ... while the policies do move different pages


@pytest.mark.parametrize("mode", ["exact", "masked"])
def test_accounting_balances_after_eos_and_cancel(mode):
    """A batch where one sequence ends on EOS and one is cancelled mid-generation: every
    page and record comes back, the cache is empty and consistent afterwards."""
    import dataclasses

    cfg = TieredKVConfig(policy="lfu-importance", mode=mode, device_budget="60%", **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=240, num_sequences=3)
    first = run(PagedKVCache(MODEL.kv_spec()), [PROMPTS[1]], n=3)[0].token_ids
    saved = MODEL.config
    MODEL.config = dataclasses.replace(saved, eos_token_ids=(first[2],))  # prompt 1 stops at its 3rd token
    checks = []

    def on_token(event):
        cache.mgr.check_invariants()
        checks.append(event.index)
        return False if event.index == 2 and len([i for i in checks if i == 2]) == 4 else None

    try:
        out = generate(MODEL, cache, [PROMPTS[0], PROMPTS[1], list(range(50, 120))],
                       SamplingParams(max_new_tokens=12), on_token=on_token)
    finally:
        MODEL.config = saved
    assert [o.finish_reason for o in out] == ["length", "eos", "cancelled"]
    cache.mgr.check_invariants()
    assert cache.mgr.tier_counts() == {"T0": 0, "T1": 0, "T2": 0, "T2w": 0, "T3": 0, "T4": 0}
    assert int(cache.mgr.device.used().sum()) == 0 and int(cache.mgr.host.used().sum()) == 0


# ----------------------------------------------------------------------------- a live cache's configuration


def test_offline_policies_are_refused_by_a_live_cache():
    with pytest.raises(ConfigError, match="offline oracle"):
        TieredKVCache(MODEL.kv_spec(), TieredKVConfig(policy="belady", device_budget=96, **SMALL))


def test_tier_figures_survive_freeing_the_sequences():
    """Pages per tier, bytes per tier and bytes saved are the figures at the end of the last
    step, not zeros after generation freed the sequences."""
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget=96, warm_fraction=0.5,
                                                          **{**SMALL, "warm_codec": "int4"}), num_sequences=2)
    run(cache)
    m = cache.metrics
    assert not cache.mgr.table.alive.any()
    assert sum(m.pages_per_tier.values()) > 0 and m.pages_per_tier["T2w"] > 0 and m.warm_bytes_saved > 0
    assert m.bytes_per_tier["T3"] == m.pages_per_tier["T3"] * cache.mgr.page_bytes


def test_budget_too_small_for_the_hot_window():
    with pytest.raises(ConfigError, match="too small to hold the hot window"):
        TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget="5%", **SMALL), full_tokens=400)
    with pytest.raises(ConfigError, match="needs the size of the full cache"):
        TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget="25%", **SMALL))


@pytest.mark.parametrize("device_tokens", [None, 160, 120])
def test_exact_mode_logits_do_not_depend_on_a_co_running_sequence(device_tokens):
    """Under a binding device budget the sequences compete for residency, but exact mode
    streams whatever is not resident: a sequence's logits with another one decoding beside it
    equal its logits alone up to float rounding of the batched matmuls (measured 1.2e-7)."""
    spec = MODEL.kv_spec()
    token_bytes = spec.token_bytes_per_layer * spec.num_layers
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 500, (150,), generator=g), torch.randint(3, 500, (130,), generator=g)

    @torch.no_grad()
    def logits_of_a(with_b: bool):
        budget = None if device_tokens is None else f"{device_tokens * token_bytes}B"
        cache = TieredKVCache(spec, TieredKVConfig(device_budget=budget, attention_budget=10**6, **SMALL))
        ids = [cache.add_sequence()]
        prefill(MODEL, cache, ids[0], a, chunk_size=32)
        if with_b:
            ids.append(cache.add_sequence())
            prefill(MODEL, cache, ids[1], b, chunk_size=32)
        tok, out = torch.full((len(ids), 1), 7), []
        for _ in range(30):
            logits = MODEL(tok, torch.tensor([[cache.length(s)] for s in ids]), cache, ids)
            out.append(logits[0, -1])
            tok = logits[:, -1].argmax(-1, keepdim=True)
        cache.mgr.check_invariants()
        return torch.stack(out), cache.metrics

    alone, _ = logits_of_a(False)
    together, m = logits_of_a(True)
    assert (together - alone).abs().max().item() <= 1e-5
    if device_tokens is not None:
        assert m.streamed_pages > 0 and m.evicted_pages > 0  # the budget binds


def test_kv_head_selection(ref_tokens, monkeypatch):
    """selection_aggregate = "kv-head": unlimited budgets equal the paged cache; under an
    attention budget every kv head attends at most the budget (T0 included), the pages fetched
    are the union of the heads' selections, and the cache keeps its invariants."""
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(selection_aggregate="kv-head", **SMALL))
    assert [c.token_ids for c in run(cache)] == ref_tokens
    cfg = TieredKVConfig(device_budget="30%", attention_budget="20%", selection_aggregate="kv-head", **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=200)
    seen = []
    inner = LayerStep.gather_and_attend

    def spy(self, layer, q, selected, attended, heads, exact):
        if heads is not None:  # decode steps (prefill attends every page with every head)
            n = self.plan.lengths[0]
            seen.append((attended[0, :n].clone(), heads[0, :, :n].clone(), self.t0[0, :n].clone()))
        return inner(self, layer, q, selected, attended, heads, exact)

    monkeypatch.setattr(LayerStep, "gather_and_attend", spy)
    tokens = torch.randint(0, 512, (180,), generator=torch.Generator().manual_seed(4))
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, tokens[:150], chunk_size=64)
    assert not seen
    for i in range(150, 160):
        prefill(MODEL, cache, sid, tokens[i : i + 1], start_pos=i, chunk_size=1)
    cache.mgr.check_invariants()
    budget = cache.budgets.attention_pages
    assert len(seen) == 10 * L
    wider = 0
    for attended, heads, t0 in seen:
        assert heads.shape == (MODEL.config.num_kv_heads, len(attended))
        assert torch.equal(heads.any(0), attended) and (heads[:, t0] | ~attended[t0]).all()
        assert (heads.sum(1) <= max(budget, int(t0.sum()))).all()
        wider += int(attended.sum()) > budget
    assert wider  # the heads disagree: the union is larger than one head's budget


def test_dense_layers_attend_every_page(monkeypatch):
    """dense_layers = n: layers below n attend every page, the others select within the budget;
    dense_layers = L gives the logits of an unlimited attention budget."""
    tokens = torch.randint(0, 512, (180,), generator=torch.Generator().manual_seed(4))

    def decode(**kw):
        cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget="30%", **SMALL, **kw), full_tokens=200)
        sid = cache.add_sequence()
        prefill(MODEL, cache, sid, tokens[:150], chunk_size=64)
        needed = []
        inner = LayerStep.record

        def spy(self):
            if self.decode:
                needed.extend((layer, int(a.sum()), self.plan.lengths[0]) for layer, a in enumerate(self.rec.attended))
            return inner(self)

        monkeypatch.setattr(LayerStep, "record", spy)
        out = prefill(MODEL, cache, sid, tokens[150:160], start_pos=150, chunk_size=1, all_logits=True)
        cache.mgr.check_invariants()
        return out, needed

    every, _ = decode(attention_budget="100%")
    dense, _ = decode(attention_budget="20%", dense_layers=L)
    assert torch.equal(dense, every)
    _, needed = decode(attention_budget="20%", dense_layers=1)
    assert all((n == m) == (layer == 0) for layer, n, m in needed)


def test_a_float32_cache_at_the_float16_reference_holds_half_the_pages(ref_tokens):
    """Issue #35: a percentage counts the full cache's float16 bytes by default, so the tiny
    model's float32 pages get half the pages the float32 reference gives them, the cache never
    owns more than those float16 bytes, and exact mode still loses nothing."""
    spec = MODEL.kv_spec()
    assert spec.dtype == torch.float32
    full = len(PROMPTS[0]) + 24
    tokens = {ref: TieredKVCache(spec, TieredKVConfig(**{**SMALL, "budget_reference": ref}, device_budget="50%",
                                                      attention_budget="100%"), full_tokens=full)
              for ref in ("float16", "float32")}
    f16, f32 = tokens["float16"], tokens["float32"]
    assert f16.budgets.device_pages == full // 2 // 2 // 8 == f32.budgets.device_pages // 2
    assert f16.budgets.given[0].bytes == full // 2 * spec.token_bytes_per_layer // 2 * L
    assert [c.token_ids for c in run(f16, PROMPTS[:1])] == ref_tokens[:1]
    m = f16.metrics
    assert 0 < m.resident_bytes_max <= resident_cap_bytes(f16) <= f16.budgets.given[0].bytes
    assert m.misses > 0  # the budget bit: pages were streamed back


@pytest.mark.parametrize("budget", [None, 4096, 96])
def test_storage_grows_at_admission_not_mid_decode(budget):
    """The serving engine says how long each admitted request can grow (``expect``): the page
    table and the pools grow then, so that no decode step copies them — with no budget, a
    budget that holds the work and one that binds (then the host pool too: the budget shared by
    the prompts, so that their working sets fit it together and they run at once)."""
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget=budget, **SMALL), num_sequences=len(PROMPTS))
    m, sizes = cache.mgr, []
    begin = cache.begin_step

    def spy(seq_ids, num_new):
        step = begin(seq_ids, num_new)
        sizes.append((num_new, m.device.capacity, m.host.capacity, m.table.capacity))
        return step

    cache.begin_step = spy
    run(cache)
    last_prefill = max(i for i, s in enumerate(sizes) if s[0] > 1)
    assert {s[1:] for s in sizes[last_prefill:]} == {sizes[last_prefill][1:]}
    pages = sum(-(-(len(p) + 24) // cache.page_size) for p in PROMPTS)
    assert m.table.capacity >= pages
    assert m.device.capacity >= min(pages, m.resident_cap or pages)
    if budget == 96:
        assert m.host.capacity >= pages
    assert m._expected == {}  # freed with the sequences
