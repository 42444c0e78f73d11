"""The warm sub-tier of T2: cold pages compressed with a KV codec inside the
device budget — more pages resident in the same bytes, decoded on the attention path
exactly as the codec reference decodes them, re-fetched exact from the host when they
turn hot, every byte accounted."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import tiny_model
from tieredkv.errors import ConfigError
from tieredkv.models.llama import prefill
from tieredkv.plugins.codec import CODECS, decode_pages, encode_pages, page_bytes
from tieredkv.runtime.paged import PagedKVCache
from tieredkv.runtime.tiered.budgets import resolve_budgets
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.layer_step import LayerStep

#: the tiny model's float32 pages: percentages count their own bytes (as the tests were sized)
SMALL = dict(page_size=8, sink_tokens=4, recent_tokens=16, staging_pages=2, budget_reference="float32")
MODEL = tiny_model(seed=3)
L = MODEL.config.num_layers


def warm_cache(codec="int4", budget="30%", fraction=0.5, full_tokens=240, keep_decoded_warm=False, **kw):
    cfg = TieredKVConfig(policy="lfu-importance", device_budget=budget, warm_codec=codec, warm_fraction=fraction,
                         **SMALL, **kw)
    return TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=full_tokens, keep_decoded_warm=keep_decoded_warm)


def decode_after_prefill(cache, sid, n_prompt, n_decode):
    gen = torch.Generator().manual_seed(1)
    prefill(MODEL, cache, sid, torch.randint(0, 512, (n_prompt,), generator=gen), chunk_size=32)
    for i in range(n_decode):
        MODEL(torch.randint(0, 512, (1, 1), generator=gen), torch.tensor([[n_prompt + i]]), cache, [sid])
        cache.mgr.check_invariants()


def host_copy(mgr, layer, rec):
    k, v = mgr.read_pages(torch.tensor([layer]), torch.tensor([rec]), torch.float32, exact=True)
    return k[0], v[0]


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_more_pages_in_the_same_bytes(codec):
    """The budget counts encoded bytes: the warm pages fit in the bytes given up by the full-
    precision region, and the device holds more pages in total."""
    cache = warm_cache(codec, budget="60%")
    b, mgr = cache.budgets, cache.mgr
    assert b.warm_pages > 0 and b.warm_given > 0
    assert b.warm_pages * mgr.warm.page_bytes <= b.warm_given * mgr.page_bytes
    assert b.resident_pages + b.warm_pages > b.device_pages - b.staging_pages
    assert b.attention_pages == b.resident_pages + b.warm_pages


@pytest.mark.parametrize("codec", ["int4", "fp8-r2", "fp8-r2-delta"])
def test_warm_pages_decode_like_the_codec_and_stay_in_budget(codec):
    cache = warm_cache(codec, attention_budget=10**6)
    sid = cache.add_sequence()
    decode_after_prefill(cache, sid, 200, 24)
    mgr, m = cache.mgr, cache.metrics
    mgr.check_invariants()
    assert m.compressed_pages > 0 and m.warm_reads > 0 and m.pages_per_tier["T2w"] > 0
    b = cache.budgets
    assert m.resident_bytes_max <= (b.device_pages - b.staging_pages) * mgr.page_bytes * L
    assert m.warm_bytes_saved == m.pages_per_tier["T2w"] * (mgr.page_bytes - mgr.warm.page_bytes) > 0
    assert m.bytes_per_tier["T2w"] == m.pages_per_tier["T2w"] * mgr.warm.page_bytes
    # every warm page: what attention reads == the codec reference applied to the exact host copy
    shape = mgr.warm.shape
    for layer in (0, L - 1):
        recs = (mgr.table.warm_slot[layer] >= 0).nonzero().flatten()
        assert len(recs) > 0
        k, v = mgr.read_pages(layer, recs, torch.float32)
        exact = [host_copy(mgr, layer, int(r)) for r in recs]
        ek, ev = torch.stack([e[0] for e in exact]), torch.stack([e[1] for e in exact])
        rk, rv = decode_pages(encode_pages(ek, ev, CODECS[codec]), CODECS[codec], shape)
        assert torch.equal(k, rk) and torch.equal(v, rv)
        assert not torch.equal(k, ek.float())  # lossy: really compressed


def test_hot_warm_page_is_refetched_exact():
    cache = warm_cache("int2", attention_budget=10**6)
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, torch.arange(200) % 500, chunk_size=32)
    mgr = cache.mgr
    layer = 1
    table = mgr.table
    rec = int((table.warm_slot[layer] >= 0).nonzero().flatten()[0])
    exact_k, exact_v = host_copy(mgr, layer, rec)
    table.win_access[layer, rec] = cache.config.migration.promote_accesses  # it turned hot
    table.importance[layer, rec] = 0.99
    h2d = mgr.metrics.bytes_h2d
    mgr._promote_warm()
    assert table.warm_slot[layer, rec] == -1 and table.device_slot[layer, rec] >= 0
    assert mgr.metrics.warm_promotions >= 1 and mgr.metrics.bytes_h2d > h2d
    k, v = mgr.device.read(torch.tensor([layer]), table.device_slot[layer, rec].view(1))
    assert torch.equal(k[0], exact_k) and torch.equal(v[0], exact_v)
    mgr.check_invariants()
    cache.free_sequence(sid)
    assert int(mgr.warm.used().sum()) == 0 and int(mgr.device.used().sum()) == 0


def test_warm_fraction_one_compresses_everything_but_t0():
    """warm_fraction=1 with a budget of the whole sequence: every page outside T0's
    reservation is warm
    (the codec-quality protocol of tools/eval/codec_quality.py)."""
    cache = warm_cache("fp8-r2", budget=200, fraction=1.0, full_tokens=200, attention_budget=10**6)
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, torch.arange(200) % 500, chunk_size=32)
    counts = cache.mgr.tier_counts()
    pages = -(-200 // SMALL["page_size"])
    assert sum(counts.values()) == pages * L and counts["T3"] == 0
    # the full-precision region is only T0's reservation (+ the page being allocated)
    assert cache.budgets.resident_pages == cache.config.t0_pages + 1
    assert counts["T0"] + counts["T1"] + counts["T2"] <= cache.budgets.resident_pages * L


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(20, 400), full=st.integers(1, 600), seqs=st.integers(1, 3),
       codec=st.sampled_from(sorted(CODECS)), dtype=st.sampled_from(["float32", "float16"]))
def test_auto_warm_fraction_is_the_least_share_that_holds_the_work(budget, full, seqs, codec, dtype):
    """warm_fraction="auto": the warm tier takes the fewest device pages with which the exact
    and the compressed pages hold every page of the work; all the spare ones when even that
    is not enough; none when the work fits exact. Never more than a fixed fraction of 1."""
    spec = MODEL.kv_spec()
    tok = spec.token_bytes_per_layer // (2 if dtype == "float16" else 1)
    wpb = page_bytes(CODECS[codec], spec.num_kv_heads, SMALL["page_size"], spec.head_dim)

    def resolve(fraction):
        cfg = TieredKVConfig(device_budget=budget * seqs, warm_codec=codec, warm_fraction=fraction, **SMALL)
        try:
            return resolve_budgets(cfg, num_layers=L, token_bytes_per_layer=tok, full_tokens=full,
                                   dtype=getattr(torch, dtype), num_sequences=seqs, warm_page_bytes=wpb)
        except ConfigError:
            return None
    auto, one = resolve("auto"), resolve(1.0)
    if one is None:
        assert auto is None  # too small for the hot window either way
        return
    if tok * SMALL["page_size"] <= wpb:  # the codec saves nothing on these pages: it gets none
        assert auto.warm_given == 0
        return
    need = -(-full // SMALL["page_size"]) * seqs
    held = auto.resident_pages + auto.warm_pages
    assert auto.warm_given <= one.warm_given
    if auto.warm_given < one.warm_given:
        assert held >= need  # it holds the work ...
        if auto.warm_given:  # ... and one page fewer given to the warm tier would not
            fewer = auto.resident_pages + 1 + (auto.warm_given - 1) * tok * SMALL["page_size"] // wpb
            assert fewer < need
    else:
        assert auto == one
    if one.resident_pages + one.warm_given >= need:  # the device's own slots hold the work exact
        assert auto.warm_given == 0


def test_auto_is_the_default_and_compresses_nothing_that_fits_exact():
    assert TieredKVConfig().warm.fraction == "auto"
    roomy = warm_cache(budget=320, fraction="auto", full_tokens=200)  # the whole work fits exact
    assert roomy.budgets.warm_given == 0 and roomy.budgets.warm_pages == 0
    sid = roomy.add_sequence()
    prefill(MODEL, roomy, sid, torch.arange(200) % 500, chunk_size=32)
    assert roomy.mgr.metrics.compressed_pages == 0 and roomy.mgr.tier_counts()["T3"] == 0
    tight = warm_cache(budget="30%", fraction="auto", full_tokens=240)  # not even all-int4 holds it
    assert tight.budgets == warm_cache(budget="30%", fraction=1.0, full_tokens=240).budgets
    middle = warm_cache(budget="75%", fraction="auto", full_tokens=240)
    assert 0 < middle.budgets.warm_given < warm_cache(budget="75%", fraction=1.0, full_tokens=240).budgets.warm_given


def test_float16_storage_halves_the_bytes_and_stays_close():
    tokens = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(2))
    paged = PagedKVCache(MODEL.kv_spec())
    half = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(kv_dtype="float16", **SMALL))
    a = prefill(MODEL, paged, paged.add_sequence(), tokens, chunk_size=40, all_logits=True)
    b = prefill(MODEL, half, half.add_sequence(), tokens, chunk_size=40, all_logits=True)
    assert half.mgr.device.k.dtype == torch.float16
    assert half.kv_bytes() * 2 == TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL)).mgr.page_bytes * \
        half.mgr.device.used().sum().item()
    assert 0 < (a - b).abs().max().item() < 5e-2


def test_keeping_decoded_warm_pages_changes_nothing():
    """The CPU evaluation aid (keep_decoded_warm) gives bit-identical logits, also across a
    checkpoint and rollback (the warm pool restores its decoded copies with its bytes)."""
    tokens = torch.randint(0, 512, (160,), generator=torch.Generator().manual_seed(5))
    outs = []
    for keep in (False, True):
        cache = warm_cache("int4", budget="60%", attention_budget=10**6, full_tokens=200, keep_decoded_warm=keep)
        assert (cache.mgr.warm.decoded is not None) == keep
        sid = cache.add_sequence()
        logits = [prefill(MODEL, cache, sid, tokens[:120], chunk_size=24, all_logits=True)]
        state = cache.checkpoint(sid)
        prefill(MODEL, cache, sid, tokens[120:150], start_pos=120, chunk_size=1)
        cache.rollback(sid, state)
        logits.append(prefill(MODEL, cache, sid, tokens[120:], start_pos=120, chunk_size=1, all_logits=True))
        assert cache.metrics.warm_reads > 0
        outs.append(torch.cat(logits))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("budget", ["25%", "12.5%"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_auto_resolves_like_fraction_one_where_the_suite_measured_it(budget, dtype):
    """docs/benchmarks.md §7 reports the warm_fraction=1 runs at 25 % and 12.5 % of a 2k
    SmolLM2-135M context as the "auto" default's: there the two resolve to the same budgets
    (those runs counted a percentage in the stored dtype's bytes: ``budget_reference`` = it)."""
    from tieredkv.models.cache import KVSpec

    spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=dtype)
    wpb = page_bytes(CODECS["int4"], 3, 16, 64)
    for full in range(1900, 2200, 7):  # the suite's prompts: about 2048 tokens, answer included
        reference = str(dtype).removeprefix("torch.")
        auto, one = (resolve_budgets(TieredKVConfig(device_budget=budget, warm_fraction=f, budget_reference=reference),
                                     num_layers=30, token_bytes_per_layer=spec.token_bytes_per_layer,
                                     full_tokens=full, dtype=dtype, warm_page_bytes=wpb) for f in ("auto", 1.0))
        assert auto == one, full


def test_exact_reads_of_every_warm_page_equal_the_full_cache():
    """warm_exact_reads covering every warm page, every page attended: each decode step reads
    its warm pages from their exact copies, so the logits are the paged cache's; read through
    the codec instead (0) they are not (int4's error). The prompt fits the device exact (its
    prefill reads no warm page); the decode steps push pages into the warm tier."""
    tokens = torch.randint(0, 512, (240,), generator=torch.Generator().manual_seed(7))
    paged = PagedKVCache(MODEL.kv_spec())
    sid = paged.add_sequence()
    prefill(MODEL, paged, sid, tokens[:160], chunk_size=160)
    want = prefill(MODEL, paged, sid, tokens[160:], start_pos=160, chunk_size=1, all_logits=True)
    got = {}
    for n in (0, 1024):
        cache = warm_cache("int4", budget=320, fraction=0.5, attention_budget=10**6, warm_exact_reads=n)
        sid = cache.add_sequence()
        prefill(MODEL, cache, sid, tokens[:160], chunk_size=160)
        assert cache.metrics.warm_reads == 0
        got[n] = prefill(MODEL, cache, sid, tokens[160:], start_pos=160, chunk_size=1, all_logits=True)
        cache.mgr.check_invariants()
        assert cache.metrics.pages_per_tier["T2w"] > 0
        assert (cache.metrics.warm_reads > 0) == (n == 0)
    assert torch.allclose(got[1024], want, atol=1e-5, rtol=0)
    assert (got[0] - want).abs().max() > 1e-3


def test_exact_reads_take_the_warm_pages_most_relevant_last_step_and_count_their_bytes(monkeypatch):
    """warm_exact_reads = 2: per layer and decode step, of the warm pages the two most relevant at
    their last step (and no other page) are read exact where attended, and each costs one page
    of host-to-device bytes instead of a warm decode."""
    seen = []
    inner = LayerStep.gather_and_attend

    def spy(self, layer, q, selected, attended, heads, exact):
        if self.decode:
            t, rows = self.mgr.table, self.plan.row(0)
            warm = (t.device_slot[layer, rows] < 0) & (t.warm_slot[layer, rows] >= 0)
            got = None if exact is None or not exact.any() else exact[0].clone()
            seen.append((got, warm, attended[0].clone(), t.last_relevance[layer, rows].clone()))
        return inner(self, layer, q, selected, attended, heads, exact)

    monkeypatch.setattr(LayerStep, "gather_and_attend", spy)
    runs = {}
    for n in (0, 2):
        cache = warm_cache("int4", budget="30%", fraction=1.0, warm_exact_reads=n)
        seen.clear()
        sid = cache.add_sequence()
        decode_after_prefill(cache, sid, 200, 8)
        runs[n] = (cache.metrics.bytes_h2d, cache.metrics.warm_reads, cache.mgr.page_bytes, list(seen))
    assert all(e is None for e, *_ in runs[0][3])
    steps = runs[2][3]
    assert len(steps) == 8 * L
    read = 0
    for exact, warm, attended, rel in steps:
        cand = warm & (rel > 0)
        exact = torch.zeros_like(warm) if exact is None else exact
        assert not (exact & ~(cand & attended)).any() and int(exact.sum()) <= 2
        for p in exact.nonzero().flatten():  # among the two most relevant candidates
            assert int((rel[cand] > rel[p]).sum()) < 2
        if attended[cand].all():  # every candidate attended: the two most relevant, or all of them
            assert int(exact.sum()) == min(2, int(cand.sum()))
        read += int(exact.sum())
    assert read > 0
    (h0, w0, page_bytes, _), (h2, w2, _, _) = runs[0], runs[2]
    assert h2 - h0 == read * page_bytes and w0 - w2 == read


def test_exact_read_choice_ranks_warm_pages_by_last_relevance():
    """TierManager.exact_read_choice — what both backends read exact — against a plain oracle:
    per layer the n warm-only pages of highest last_relevance (equal values: lower column), none
    scored 0; the all-layers call equals the per-layer ones (the engine's runtime uses the former,
    the PyTorch backend the latter)."""
    cache = warm_cache("int4", budget="30%", fraction=1.0, warm_exact_reads=0)
    sid = cache.add_sequence()
    decode_after_prefill(cache, sid, 200, 4)
    mgr, t = cache.mgr, cache.mgr.table
    rows = mgr.records_of(sid)
    t.last_relevance[:, rows[3]] = t.last_relevance[:, rows[5]]  # a tie
    t.last_relevance[:, rows[7]] = 0.0  # never chosen
    for n in (0, 1, 3, 1000):
        every = mgr.exact_read_choice(slice(None), rows, n)
        for layer in range(L):
            got = mgr.exact_read_choice(layer, rows, n)
            assert torch.equal(every[layer], got)
            warm = (t.device_slot[layer, rows] < 0) & (t.warm_slot[layer, rows] >= 0)
            rel = t.last_relevance[layer, rows]
            cand = [j for j in range(len(rows)) if warm[j] and rel[j] > 0]
            want = sorted(cand, key=lambda j: (-float(rel[j]), j))[:n]
            assert got.nonzero().flatten().tolist() == sorted(want), (layer, n)
    assert mgr.exact_read_choice(slice(None), rows, 1000).sum() > 0


def test_exact_reads_setting():
    assert TieredKVConfig().warm.exact_reads == "auto"
    assert TieredKVConfig().warm.reads_exact("exact") == 4 and TieredKVConfig().warm.reads_exact("masked") == 0
    assert TieredKVConfig(warm_exact_reads=3, mode="masked").warm.reads_exact("masked") == 3
    for bad in (-1, 1.5, "many", True, 2048):
        with pytest.raises(ConfigError, match="warm_exact_reads.*'auto' or an integer in \\[0, 1024\\]"):
            TieredKVConfig(warm_exact_reads=bad)


# ------------------------------------------------------------------ the decode op against the gathering path
WIDE = tiny_model(seed=5, head_dim=64, num_heads=6, num_kv_heads=2)  # head dim 64, 3 query heads per kv head


def decode_tail(cfg, tokens, monkeypatch, **cache_kw):
    """A tiered cache of ``cfg`` on WIDE: the first 370 ``tokens`` prefilled, the rest decoded one at a
    time -> (the cache, every decode logit, the step records the manager received); invariants checked."""
    cache = TieredKVCache(WIDE.kv_spec(), cfg, full_tokens=400, **cache_kw)
    sid = cache.add_sequence()
    prefill(WIDE, cache, sid, tokens[:370], chunk_size=128)
    records = []
    record = cache.mgr.record_step
    monkeypatch.setattr(cache.mgr, "record_step", lambda plan, rec: records.append(rec) or record(plan, rec))
    logits = prefill(WIDE, cache, sid, tokens[370:], start_pos=370, chunk_size=1, all_logits=True)
    cache.mgr.check_invariants()
    return cache, logits, records


def same_both_ways(setup, seed, tmp_path, monkeypatch, switch, flags):
    """:func:`decode_tail` of ``setup`` (int4 warm pool, 50 % device budget, 16-token pages; ``disk``:
    a disk tier in ``tmp_path``) run twice — after ``switch(True)``, then after ``switch(False)`` —
    asserting the same logits bit for bit, the same step records and the same link accounting (host
    pages read). ``flags``: a list the patched code appends a flag to per layer. Returns the setup as
    run and, per run, (flags set, flags appended)."""
    setup = dict(setup)
    if setup.pop("disk", False):
        setup["disk_path"] = str(tmp_path)
    tokens = torch.randint(0, 512, (400,), generator=torch.Generator().manual_seed(seed))
    runs = {}
    for variant in (True, False):
        switch(variant)
        flags.clear()
        cfg = TieredKVConfig(policy="lfu-importance", device_budget="50%", warm_fraction=0.5,
                             **{"warm_codec": "int4", **SMALL, "page_size": 16, **setup})
        cache, logits, records = decode_tail(cfg, tokens, monkeypatch)
        st = cache.mgr.transfers.stats
        runs[variant] = (logits, records, (st.h2d_copies, st.h2d_pages, st.h2d_bytes), (sum(flags), len(flags)))
    (got, got_rec, got_moved, got_flags), (want, want_rec, want_moved, want_flags) = runs[True], runs[False]
    assert torch.equal(got, want)
    assert got_moved == want_moved and want_moved[1] > 0  # host pages were read
    for a, b in zip(got_rec, want_rec, strict=True):
        for name in ("selected", "attended", "mass", "relevance", "importance", "exact"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or torch.equal(x, y), name
    return setup, got_flags, want_flags


@pytest.mark.parametrize("setup", [
    dict(),
    dict(warm_exact_reads=2),  # exact reads: host copies of warm pages
    dict(attention_budget="40%", selection_aggregate="kv-head"),
    dict(warm_codec="int2"),  # warm pages decoded into the op's scratch
    dict(warm_ladder="int2:0.5"),  # warm pages through the reader: every layer on the general path
    dict(host_budget="10%", disk=True),  # pages on disk: the layers that list one on the general path
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_step_sources_equal_the_per_layer_path(setup, monkeypatch, tmp_path):
    """The CPU op's page sources worked out once per step (``LayerStep.op_sources``) give what the
    per-layer path gives (each layer's attended pages resolved, host pages checked one by one):
    the same logits bit for bit, the same records and the same link accounting; where pages lie
    on the disk or warm pages go through the reader, the layers listing them take that path."""
    from tieredkv.models.cpu_attention import tiered_attention_op

    if tiered_attention_op() is None:
        pytest.skip("the CPU op could not be built here")
    monkeypatch.setattr(LayerStep, "fuse_layers", False)  # every layer through attend_in_place
    general = []  # per layer: whether it took the general path
    per_layer = LayerStep.attend_in_place
    monkeypatch.setattr(LayerStep, "attend_in_place", lambda self, layer, *a: (
        general.append(not (self.op_sources() and self.op_sources().whole[layer])) or per_layer(self, layer, *a)))

    def switch(sources: bool) -> None:
        if not sources:
            monkeypatch.setattr(LayerStep, "op_sources", lambda self: None)

    setup, (n_general, n), (_, n_want) = same_both_ways(setup, 12, tmp_path, monkeypatch, switch, general)
    assert n == n_want > 0
    if "warm_ladder" in setup:
        assert n_general == n  # warm pages the op cannot read: every layer through the general path
    elif "disk_path" in setup:
        assert n_general > 0  # the layers listing a page on the disk
    else:
        assert n_general == 0


@pytest.mark.parametrize("setup", [
    dict(),
    dict(warm_exact_reads=2),  # exact reads: the record's exact column written by the fused call
    dict(dense_layers=2),  # the first layers do not score: every page selected
    dict(warm_codec="int2"),  # warm pages decoded into the op's scratch
    dict(attention_budget="40%", selection_aggregate="kv-head"),  # a selection per kv head: stage by stage
    dict(host_budget="10%", disk=True),  # the layers that list a page on the disk: stage by stage
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_fused_layer_equals_the_stages(setup, monkeypatch, tmp_path):
    """A decode layer in one call (``LayerStep.attend_fused``: relevance, selection, the CPU op and
    the record in one op) gives what the stages give one by one (``rank``, ``select``,
    ``attend_in_place``): the same logits bit for bit, the same records and link accounting; it
    runs where the step's sources cover the layer and the ranking is the default one, and the
    stages run elsewhere."""
    from tieredkv.models.cpu_attention import layer_op

    if layer_op() is None:
        pytest.skip("the CPU op could not be built here")
    fused = []  # per decode layer: whether it ran fused
    inner = LayerStep.attend_fused
    monkeypatch.setattr(LayerStep, "attend_fused", lambda self, layer, q: (
        lambda out: (self.decode and fused.append(out is not None)) or out)(inner(self, layer, q)))
    setup, (n_fused, n), (n_off, _) = same_both_ways(
        setup, 13, tmp_path, monkeypatch, lambda fuse: monkeypatch.setattr(LayerStep, "fuse_layers", fuse), fused)
    assert n > 0 and n_off == 0
    if "selection_aggregate" in setup:
        assert n_fused == 0  # one selection per kv head: not the fused call's
    elif "disk_path" in setup:
        assert n_fused < n  # the layers listing a page on the disk take the stages
    else:
        assert n_fused == n


@pytest.mark.parametrize("setup", [
    dict(codec="int4", page_size=16),  # 4-bit codes read in place by the kernel (AVX-512)
    dict(codec="int2", page_size=16),  # decoded into the task's scratch
    dict(codec="int4", page_size=8),  # scratch: pages of 8 tokens
    dict(codec="int4", page_size=16, warm_exact_reads=2),
    dict(codec="int4", page_size=16, attention_budget="40%", selection_aggregate="kv-head"),
    dict(codec="int4", page_size=16, mode="masked"),
    dict(codec="int4", page_size=16, warm_ladder="int2:0.5"),  # a ladder: warm pages through the reader
    dict(codec="int4", page_size=16, keep_decoded_warm=True),  # decoded copies: through the reader
    dict(codec="fp8", page_size=16),  # a codec the op does not read encoded
    dict(codec="int4", page_size=16, host_budget="10%", disk=True),  # pages on disk: through the reader
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_decode_op_equals_the_gathering_path(setup, monkeypatch, tmp_path):
    """A bound budget's decode layers through the CPU op (``LayerStep.attend_in_place``: pages
    read where they are) give the logits, the selections and the page masses of the gathering
    path (``set_cpu_attention("torch")``: gather, decode, ``attend_pages``) to float32 rounding,
    with warm pages read encoded or through the reader, exact reads (host pages read where they
    lie), pages on disk, kv-head selection, masked mode; and the op is what ran."""
    import tieredkv.runtime.tiered.layer_step as layer_step
    from tieredkv.models.cpu_attention import set_cpu_attention, tiered_attention_op
    from tieredkv.runtime.tiered.moves import PageMoves

    if tiered_attention_op() is None:
        pytest.skip("the CPU op could not be built here")
    setup = dict(setup)
    codec, page_size, keep = setup.pop("codec"), setup.pop("page_size"), setup.pop("keep_decoded_warm", False)
    if setup.pop("disk", False):
        setup["disk_path"] = str(tmp_path)  # a directory: each cache makes its own file
    in_place, copied = [], []  # host pages read where they lie in the host pool; pages copied by the reader
    count_host, read_into = PageMoves.count_host_pages, PageMoves.read_pages_into
    monkeypatch.setattr(PageMoves, "count_host_pages",
                        lambda self, n, **k: in_place.append(n) or count_host(self, n, **k))
    monkeypatch.setattr(PageMoves, "read_pages_into", lambda self, layer, recs, *a, **k: (
        copied.append(len(recs)) or read_into(self, layer, recs, *a, **k)))
    small = {**SMALL, "page_size": page_size}
    tokens = torch.randint(0, 512, (400,), generator=torch.Generator().manual_seed(11))
    monkeypatch.setattr(LayerStep, "fuse_layers", False)  # the op called alone (the fused call: below)
    calls = []
    inner = layer_step.tiered_decode_attention
    monkeypatch.setattr(layer_step, "tiered_decode_attention", lambda *a, **k: calls.append(1) or inner(*a, **k))
    runs, moved = {}, {}
    for backend in ("paged", "torch"):
        set_cpu_attention(backend)
        in_place.clear()
        copied.clear()
        try:
            cfg = TieredKVConfig(policy="lfu-importance", device_budget="50%", warm_codec=codec, warm_fraction=0.5,
                                 **small, **setup)
            cache, logits, masses = decode_tail(cfg, tokens, monkeypatch, keep_decoded_warm=keep)
            runs[backend] = (logits, masses, len(calls))
            st = cache.mgr.transfers.stats
            moved[backend] = (st.h2d_copies, st.h2d_pages, st.h2d_bytes, sum(in_place), sum(copied))
        finally:
            set_cpu_attention("paged")
    (got, got_rec, n_op), (want, want_rec, n_after) = runs["paged"], runs["torch"]
    assert n_op > 0 and n_after == n_op  # the op ran on the op's backend only
    # the op's backend counts the link's copies the gathering path makes, whether it reads host pages
    # where they lie or copies them
    assert moved["paged"][:3] == moved["torch"][:3] and moved["torch"][3] == 0
    if "warm_exact_reads" in setup:  # exact reads of warm pages: their host copies, read where they lie
        assert moved["paged"][3] > 0
    if "disk_path" in setup:  # pages on disk: copied by the reader
        assert moved["paged"][4] > 0
    assert cache.metrics.pages_per_tier["T2w"] > 0 and cache.metrics.warm_reads > 0  # warm pages were attended
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(got_rec) == len(want_rec) == 30
    for a, b in zip(got_rec, want_rec):
        assert torch.equal(a.selected, b.selected) and torch.equal(a.attended, b.attended)
        if b.mass is not None:
            torch.testing.assert_close(a.mass, b.mass, rtol=1e-4, atol=1e-6)
