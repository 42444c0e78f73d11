"""The TierManager on its own: pages of any dtype and bit pattern move device -> host -> disk
and back under tiny budgets and come back bit-identical, with the invariants checked after
every step."""

import tempfile

import torch
from hypothesis import given, settings, strategies as st

from tieredkv.runtime.tiered.budgets import ResolvedBudgets
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.manager import TierManager
from tieredkv.runtime.tiered.policies import make_policy


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), page=st.sampled_from([3, 8]),
       layers=st.integers(1, 3), kvh=st.integers(1, 2), head_dim=st.sampled_from([4, 5]),
       pages=st.integers(4, 24), device=st.integers(8, 12), host=st.integers(1, 6), seed=st.integers(0, 99))
def test_tier_moves_are_bit_exact_property(dtype, page, layers, kvh, head_dim, pages, device, host, seed):
    """Random pages (random bit patterns of the storage dtype, NaN payloads aside) written into the
    device pool move device -> host -> disk under small budgets, some come back to the device, and
    every page of every layer reads back bit-identical from wherever it lives."""
    cfg = TieredKVConfig(page_size=page, sink_tokens=1, recent_tokens=1, staging_pages=1, policy="lru",
                         disk_path=tempfile.mkdtemp() + "/t4.bin")
    budgets = ResolvedBudgets(device_pages=device, host_pages=host, attention_pages=None, hot_key_pages=0,
                              staging_pages=1)
    mgr = TierManager(num_layers=layers, kv_heads=kvh, head_dim=head_dim, dtype=dtype, config=cfg, budgets=budgets,
                      policy=make_policy("lru"))
    gen = torch.Generator().manual_seed(seed)
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(bits)

    def random_page():
        x = torch.randint(info.min, info.max, (2, kvh, page, head_dim), generator=gen, dtype=torch.int64)
        x = x.to(bits).view(dtype)
        return torch.where(torch.isnan(x), torch.zeros_like(x), x)  # NaN payloads need not survive casts

    mgr.add_sequence(0)
    want = {}
    for _ in range(pages):
        plan = mgr.begin_step((0,), page)  # one full page per step
        rec = int(mgr.records_of(0)[-1])
        for layer in range(layers):
            x = random_page()
            mgr.write_tokens(layer, plan, x[0].transpose(0, 1), x[1].transpose(0, 1), torch.zeros(page))
            want[layer, rec] = x
        mgr.end_step(decode=False)
        mgr.check_invariants()
    recs = mgr.records_of(0)
    assert mgr.metrics.spilled_pages > 0 or pages <= device - 1 + host  # the disk tier was used when it had to be
    # bring a few pages back: admit into room made by the policy (exact copies from host or disk)
    back = mgr.table.device_slot[:, recs] < 0
    if back.any():
        room = mgr._make_room(back.sum(1).clamp(max=2), protect=None)
        layers_b, cols = mgr._highest(back, torch.rand(layers, len(recs), generator=gen), room)  # cols index recs
        mgr.admit(layers_b, recs[cols])
        mgr.check_invariants()
        assert len(cols) > 0
    for (layer, rec), x in want.items():
        k, v = mgr.read_pages(torch.tensor([layer]), torch.tensor([rec]), dtype)
        assert torch.equal(k[0].view(bits), x[0].view(bits)) and torch.equal(v[0].view(bits), x[1].view(bits))


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 5), records=st.integers(1, 300), share=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
       seed=st.integers(0, 999))
def test_lowest_picks_each_layers_lowest_priority_candidates(layers, records, share, seed):
    """``_lowest`` (packed top-k over few candidates, dense top-k over many) returns, per layer, the
    ``counts[l]`` candidates of lowest priority (distinct priorities: one right answer), never a
    non-candidate, and ``_lowest_resident`` ranks the device pool's pages the same way."""
    gen = torch.Generator().manual_seed(seed)
    cfg = TieredKVConfig(page_size=4, sink_tokens=0, recent_tokens=4, staging_pages=1)
    budgets = ResolvedBudgets(device_pages=None, host_pages=None, attention_pages=None, hot_key_pages=0,
                              staging_pages=1)
    mgr = TierManager(num_layers=layers, kv_heads=1, head_dim=1, dtype=torch.float32, config=cfg, budgets=budgets,
                      policy=make_policy("lru"))
    cand = torch.rand(layers, records, generator=gen) < share
    prio = torch.randperm(layers * records, generator=gen).view(layers, records).float()  # distinct
    counts = torch.randint(0, records + 2, (layers,), generator=gen)
    got_l, got_r = mgr._lowest(cand, prio, counts)
    assert bool(cand[got_l, got_r].all())
    for layer in range(layers):
        mine = got_r[got_l == layer]
        want = torch.nonzero(cand[layer]).flatten()
        want = want[torch.argsort(prio[layer, want])][: int(counts[layer])]
        assert sorted(mine.tolist()) == sorted(want.tolist())
    hl, hr = mgr._highest(cand, prio, counts)  # the highest: the lowest of the negated priorities
    for layer in range(layers):
        want = torch.nonzero(cand[layer]).flatten()
        want = want[torch.argsort(-prio[layer, want])][: int(counts[layer])]
        assert sorted(hr[hl == layer].tolist()) == sorted(want.tolist())


def test_lowest_resident_ranks_the_device_pools_pages():
    """Eviction candidates (the residency, T0 and the protected set read by the ranking itself): the
    same pages a top-k over every record picks — resident, not T0, not protected."""
    cfg = TieredKVConfig(page_size=4, sink_tokens=4, recent_tokens=4, staging_pages=1, policy="lru")
    budgets = ResolvedBudgets(device_pages=None, host_pages=None, attention_pages=None, hot_key_pages=0,
                              staging_pages=1)
    mgr = TierManager(num_layers=2, kv_heads=1, head_dim=1, dtype=torch.float32, config=cfg, budgets=budgets,
                      policy=make_policy("lru"))
    mgr.add_sequence(0)
    mgr.begin_step((0,), 40)  # 10 pages per layer, the sink page and the last two in T0
    mgr.end_step(decode=False)
    t = mgr.table
    recs = mgr.records_of(0)
    mgr.evict(torch.tensor([0, 1]), recs[torch.tensor([4, 5])])  # page 4 leaves layer 0, page 5 layer 1
    gen = torch.Generator().manual_seed(3)
    prio = torch.randperm(2 * t.capacity, generator=gen).view(2, t.capacity).float()
    protect = torch.zeros(2, t.capacity, dtype=torch.bool)
    protect[:, recs[3]] = True
    counts = torch.tensor([3, 20])
    got_l, got_r = mgr._lowest_resident(prio, counts, protect)
    want_l, want_r = mgr._lowest(mgr._candidates(protect), prio, counts)
    for layer in range(2):
        assert sorted(got_r[got_l == layer].tolist()) == sorted(want_r[want_l == layer].tolist())
    assert int((got_l == 1).sum()) == 6  # 10 pages, 3 in T0, one protected, one evicted
