"""The warm ladder (``warm.ladder``): the warm sub-tier as rungs of falling precision, each
page's rung chosen by its priority — the budget split by the rungs' shares of the warm bytes,
every page decoded by its rung's codec from its exact copy, the rungs ordered by priority
after every placement, every byte accounted, and the same cache as before without a ladder."""

import pytest
import torch

from helpers import tiny_model
from tieredkv.errors import ConfigError
from tieredkv.models.llama import prefill
from tieredkv.plugins.codec import CODECS, decode_pages, encode_pages, page_bytes
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig

#: head dim 32, pages of 16 tokens: the codecs' pages differ in bytes (fp8 2304, int4 1536, int2 1024 B)
MODEL = tiny_model(seed=5, hidden_size=128, num_heads=4)
SPEC = MODEL.kv_spec()
SMALL = dict(page_size=16, sink_tokens=4, recent_tokens=32, staging_pages=2, budget_reference="float32")
LADDER = dict(warm_codec="fp8", warm_ladder="int4:0.3,int2:0.4")


def cache_with(budget="30%", full_tokens=480, **kw):
    cfg = TieredKVConfig(policy="lfu-importance", device_budget=budget, attention_budget=10**6, warm_fraction=0.8,
                         **SMALL, **kw)
    return TieredKVCache(SPEC, cfg, full_tokens=full_tokens)


def run(cache, n_prompt=400, n_decode=40, check=True):
    gen = torch.Generator().manual_seed(2)
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, torch.randint(0, 512, (n_prompt,), generator=gen), chunk_size=48)
    logits = []
    for i in range(n_decode):
        logits.append(MODEL(torch.randint(0, 512, (1, 1), generator=gen), torch.tensor([[n_prompt + i]]), cache,
                            [sid]))
        if check:
            cache.mgr.check_invariants()
    return sid, torch.cat(logits)


def test_config_parses_and_refuses():
    cfg = TieredKVConfig(**LADDER)
    assert cfg.warm.rungs() == (("fp8", pytest.approx(0.3)), ("int4", 0.3), ("int2", 0.4))
    assert TieredKVConfig(warm_ladder="int4:0.3+int2:0.4").warm.ladder == "int4:0.3,int2:0.4"
    assert TieredKVConfig(warm_ladder="off").warm.ladder is None and TieredKVConfig().warm.rungs() == (("int4", 1.0),)
    for bad, words in (("int2", "codec:share"), ("int2:0", "(0, 1)"), ("zip:0.5", "codec:share"),
                       ("int4:0.6,int2:0.5", "sum to 1.1")):
        with pytest.raises(ConfigError, match="warm_ladder") as exc:
            TieredKVConfig(warm_ladder=bad)
        assert words in str(exc.value)
    with pytest.raises(ConfigError, match="needs a warm codec"):
        TieredKVConfig(warm_codec="off", warm_ladder="int2:0.5")


def test_budget_splits_the_warm_bytes_by_share():
    """Each rung holds the pages its share of the given bytes pays for, never more; with its
    cheaper rungs the ladder holds more pages than its top codec alone in the same bytes."""
    ladder, top = cache_with(**LADDER).budgets, cache_with(warm_codec="fp8").budgets
    given = ladder.warm_given * SPEC.token_bytes_per_layer * SMALL["page_size"]
    assert ladder.warm_given == top.warm_given > 0 and len(ladder.warm_rungs) == 3
    for pages, (codec, share) in zip(ladder.warm_rungs, TieredKVConfig(**LADDER).warm.rungs()):
        per = page_bytes(CODECS[codec], SPEC.num_kv_heads, SMALL["page_size"], SPEC.head_dim)
        assert pages * per <= share * given < (pages + 1) * per
    assert ladder.warm_pages == sum(ladder.warm_rungs) > top.warm_pages
    assert ladder.attention_pages is not None and "rungs of the ladder" in ladder.describe()
    assert ladder.to_dict()["warm_rungs"] == list(ladder.warm_rungs)


def test_pages_decode_by_their_rung_and_rungs_follow_priority():
    cache = cache_with(**LADDER)
    run(cache)
    mgr, t, m = cache.mgr, cache.mgr.table, cache.metrics
    warm = mgr.warm
    assert warm.num_rungs == 3 and m.compressed_pages > 0 and m.regraded_pages > 0
    # every rung in use, within its capacity
    for r, pool in enumerate(warm.rungs):
        assert 0 < int(pool.used().max()) <= pool.max_capacity
    # what attention reads of a warm page == its rung's codec applied to its exact copy
    for layer in range(SPEC.num_layers):
        recs = mgr.warm_only(layer, torch.arange(t.capacity)).nonzero().flatten()
        rungs = warm.rung_of(t.warm_slot[layer, recs])
        assert set(rungs.tolist()) == {0, 1, 2}
        k, v = mgr.read_pages(layer, recs, torch.float32)
        ek, ev = mgr.read_pages(layer, recs, torch.float32, exact=True)
        for r, pool in enumerate(warm.rungs):
            at = rungs == r
            rk, rv = decode_pages(encode_pages(ek[at], ev[at], pool.codec), pool.codec, warm.shape)
            assert torch.equal(k[at], rk) and torch.equal(v[at], rv)
        assert not torch.equal(k, ek)
    # a placement with given priorities: every page of a higher rung outranks every page below
    prio = torch.rand(t.device_slot.shape, generator=torch.Generator().manual_seed(0))
    h2d = m.bytes_h2d
    mgr._grade(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), None, prio)
    assert m.bytes_h2d > h2d  # re-encoded from the host copies
    mgr.check_invariants()
    for layer in range(SPEC.num_layers):
        held = (t.warm_slot[layer] >= 0).nonzero().flatten()
        rungs = warm.rung_of(t.warm_slot[layer, held])
        p = prio[layer, held]
        for r in range(warm.num_rungs - 1):
            if (rungs == r).any() and (rungs > r).any():
                assert p[rungs == r].min() > p[rungs > r].max()
        # ranked pages fill the rungs from the top
        used = [int((rungs == r).sum()) for r in range(warm.num_rungs)]
        caps = warm.capacities.tolist()
        assert all(used[r] == caps[r] for r in range(warm.num_rungs) if sum(used[r + 1:]))


def test_accounting_counts_each_rung_at_its_bytes():
    cache = cache_with(**LADDER)
    sid, _ = run(cache, check=False)
    mgr, m = cache.mgr, cache.metrics  # the figures at the end of the last step
    by_rung = sum(int(p.used().sum()) * p.page_bytes for p in mgr.warm.rungs)
    assert m.bytes_per_tier["T2w"] == by_rung == mgr.warm.bytes_used() > 0
    assert m.warm_bytes_saved == m.pages_per_tier["T2w"] * mgr.page_bytes - by_rung
    b = cache.budgets
    assert m.resident_bytes_max <= (b.device_pages - b.staging_pages) * mgr.page_bytes * SPEC.num_layers
    cache.free_sequence(sid)
    assert int(mgr.warm.used().sum()) == 0
    mgr.check_invariants()


def test_rollback_restores_every_rung():
    cache = cache_with(**LADDER)
    sid, _ = run(cache, n_decode=4, check=False)
    mgr = cache.mgr
    state = mgr.checkpoint()
    before = [p.data.clone() for p in mgr.warm.rungs], mgr.table.warm_slot.clone()
    MODEL(torch.tensor([[7]]), torch.tensor([[404]]), cache, [sid])
    mgr.rollback(state)
    assert all(torch.equal(p.data, d) for p, d in zip(mgr.warm.rungs, before[0]))
    assert torch.equal(mgr.table.warm_slot, before[1])
    mgr.check_invariants()


def test_a_ladder_of_one_codec_is_the_single_pool_exactly():
    """Rungs of the same codec whose capacities add up to the single pool's: the placement moves
    pages between rungs (re-encoded from their exact copies, deterministically) but the same
    pages are warm and decode to the same values, so every logit equals the single pool's."""
    single, ladder = cache_with(warm_codec="int4"), cache_with(warm_codec="int4", warm_ladder="int4:0.5")
    assert type(single.mgr.warm).__name__ == "WarmPool" and ladder.mgr.warm.num_rungs == 2
    assert sum(ladder.budgets.warm_rungs) == single.budgets.warm_pages
    _, a = run(single, check=False)
    _, b = run(ladder, check=False)
    assert ladder.metrics.regraded_pages > 0 and single.metrics.regraded_pages == 0
    assert torch.equal(a, b)
    assert torch.equal(single.mgr.table.warm_slot >= 0, ladder.mgr.table.warm_slot >= 0)


def test_ladder_changes_the_output_but_stays_close():
    """The ladder is a different cache (its cheap rungs err more, it holds more pages), but the
    logits stay near the full cache's."""
    full = TieredKVCache(SPEC, TieredKVConfig(**SMALL))
    _, ref = run(full, check=False)
    _, lad = run(cache_with(**LADDER), check=False)
    assert not torch.equal(ref, lad)
    assert (lad.softmax(-1) - ref.softmax(-1)).abs().sum(-1).max() < 0.5
