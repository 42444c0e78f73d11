"""The tier manager's step accounting through the CPU extension (models/csrc/tier_step.cpp:
``fold_record``, ``fold_end``) against its torch code (runtime/tiered/step_fold.py), the
reference: the same access record, page-table statistics and metrics, bit for bit, on random
records of awkward sizes — padded rows, records several sequences list, every optional input
present or absent, decode and prefill steps, steps that measured nothing."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tieredkv.models.cpu_attention import cpu_attention_status, set_cpu_manager, tier_step_ops
from tieredkv.runtime.tiered.budgets import ResolvedBudgets
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.manager import TierManager
from tieredkv.runtime.tiered.page_table import HIST_MASK
from tieredkv.runtime.tiered.policies import make_policy
from tieredkv.runtime.tiered.step import StepAccess, StepRecord
from tieredkv.runtime.tiered.step_fold import wanted_pages

needs_op = pytest.mark.skipif(tier_step_ops() is None,
                              reason=f"the CPU ops could not be built here: {cpu_attention_status()['error']}")

STATS = ("last_access", "frequency", "win_access", "hist", "acc_mass", "last_relevance", "importance")
COUNTERS = ("masked", "warm_reads", "streamed_pages", "staging_rounds", "bytes_h2d", "bytes_disk_read")


def _manager(layers: int, records: int, staging: int) -> TierManager:
    cfg = TieredKVConfig(page_size=4, sink_tokens=4, recent_tokens=4, staging_pages=1, policy="lru")
    budgets = ResolvedBudgets(device_pages=None, host_pages=None, attention_pages=None, hot_key_pages=0,
                              staging_pages=1)
    mgr = TierManager(num_layers=layers, kv_heads=1, head_dim=2, dtype=torch.float32, config=cfg, budgets=budgets,
                      policy=make_policy("lru"))
    mgr.add_sequence(0)
    mgr.begin_step((0,), 4 * records)  # records enough to list
    mgr.end_step(decode=False)
    mgr.staging_pages = staging  # (0: an unlimited budget's)
    return mgr


def _random_table(mgr: TierManager, gen: torch.Generator) -> None:
    """Residency and statistics columns set at random (record_step and fold_statistics only read
    and update them; nothing here needs to be a reachable state)."""
    t = mgr.table
    shape = t.device_slot.shape
    for name in ("device_slot", "warm_slot", "host_slot"):
        setattr(t, name, torch.randint(-1, 3, shape, generator=gen))
    t.staged = torch.rand(shape, generator=gen) < 0.2
    t.last_access = torch.randint(0, 50, shape, generator=gen)
    t.frequency = torch.randint(0, 50, shape, generator=gen)
    t.win_access = torch.randint(0, 5, shape, generator=gen)
    t.hist = torch.randint(0, HIST_MASK + 1, shape, generator=gen)  # the top bit set too: it must fall off
    t.acc_mass = torch.rand(shape, generator=gen) * 3
    t.last_relevance = torch.rand(shape, generator=gen)
    t.importance = torch.rand(shape, generator=gen)


def _run(mgr: TierManager, backend: str, plan, rec, table_state, decode: bool):
    mgr.table.restore(table_state)
    mgr.metrics = type(mgr.metrics)()
    mgr._access = StepAccess.empty(mgr.L, mgr.table.capacity)
    set_cpu_manager(backend)
    try:
        mgr.record_step(plan, rec)
        access = {k: v.clone() for k, v in vars(mgr._access).items() if v is not None}
        mgr.step_no += decode
        counts = mgr.fold_statistics(decode)
        mgr.step_no -= decode
    finally:
        set_cpu_manager("native")
    stats = {k: getattr(mgr.table, k).clone() for k in STATS}
    return access, stats, counts, {k: getattr(mgr.metrics, k) for k in COUNTERS}


@needs_op
@settings(max_examples=80, deadline=None)
@given(layers=st.integers(1, 4), batch=st.integers(1, 4), width=st.integers(1, 40), records=st.integers(3, 13),
       staging=st.integers(0, 3), decode=st.booleans(), measured=st.booleans(),
       optional=st.lists(st.booleans(), min_size=6, max_size=6), shared_layers=st.booleans(), runs=st.booleans(),
       seed=st.integers(0, 999))
def test_fold_ops_equal_the_torch_reference(layers, batch, width, records, staging, decode, measured, optional,
                                            shared_layers, runs, seed):
    gen = torch.Generator().manual_seed(seed)
    mgr = _manager(layers, records, staging)
    _random_table(mgr, gen)
    cap = mgr.table.capacity
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    recs = torch.randint(0, cap, (batch, width), generator=gen)  # repeats: records several rows list
    if runs:  # rows of consecutive records (a sequence's pages recorded in order), broken here and there
        start = torch.randint(0, cap, (batch, 1), generator=gen)
        ordered = (start + torch.arange(width)) % cap
        recs = torch.where(torch.rand(batch, width, generator=gen) < 0.85, ordered, recs)
    recs = torch.where(valid, recs, recs[:, :1])  # padding lists the row's first record
    t0 = (torch.rand(batch, width, generator=gen) < 0.3) & valid
    plan = mgr.begin_step((0,), 1)
    plan = dataclasses.replace(plan, num_new=1 if decode else 2, recs=recs, valid=valid, t0=t0)
    shape = (layers, batch, width)
    flags = lambda p: torch.rand(shape, generator=gen) < p  # noqa: E731
    selected = flags(0.5)
    if shared_layers:  # one [B, M] mask expanded over the layers, as a step that scores nothing passes it
        selected = selected[0].expand(layers, -1, -1)
    rec = StepRecord(selected=selected, attended=selected & flags(0.8), relevance=None, mass=None)
    if measured:
        # masses with float rounding to get wrong when summed out of order; some exact zeros
        mass = torch.rand(shape, generator=gen) * torch.tensor([1.0, 1e-3, 1e3])[torch.randint(0, 3, shape, generator=gen)]
        rec.mass = torch.where(flags(0.2), 0.0, mass)
        rec.importance = torch.rand(shape, generator=gen) if optional[0] else None
        rec.relevance = torch.rand(shape, generator=gen) if optional[1] else None
        rec.exact = flags(0.3) if optional[2] else None
        rec.full = flags(0.5) if optional[3] else None
        rec.warm = flags(0.3) if optional[4] else None
        rec.staged = flags(0.2) if optional[5] else None
    state = mgr.table.snapshot()
    got = _run(mgr, "native", plan, rec, state, decode)
    want = _run(mgr, "torch", plan, rec, state, decode)
    for k in want[0]:
        assert torch.equal(got[0][k], want[0][k]), f"access record column {k}"
    for k in STATS:
        assert torch.equal(got[1][k], want[1][k]), f"page-table column {k}"
    if decode:
        assert got[2] == want[2]  # pages needed, missed
    else:
        assert got[2][1] == want[2][1]
    assert got[3] == want[3]


@needs_op
@pytest.mark.parametrize("records", [1, 63, 255, 256, 257, 700])
@pytest.mark.parametrize("decode", [True, False])
def test_fold_end_and_wanted_pages_equal_the_reference_across_chunks(records, decode):
    """The statistics fold and the wanted pages run in chunks of 256 records: tables of awkward
    widths, across chunk edges, give the torch code's columns exactly."""
    gen = torch.Generator().manual_seed(records + decode)
    mgr = _manager(3, records, 1)
    _random_table(mgr, gen)
    L, C = mgr.L, mgr.table.capacity
    access = StepAccess.empty(L, C)
    access.needed.copy_(torch.rand(L, C, generator=gen) < 0.4)
    access.missing.copy_(access.needed & (torch.rand(L, C, generator=gen) < 0.5))
    access.scored.copy_(torch.rand(L, C, generator=gen) < 0.7)
    for name in ("mass", "relevance", "importance"):
        getattr(access, name).copy_(torch.rand(L, C, generator=gen) * access.scored)
    mgr.table.refs[torch.rand(C, generator=gen) < 0.2] = 0  # some records free: not alive
    state, results = mgr.table.snapshot(), {}
    for backend in ("native", "torch"):
        mgr.table.restore(state)
        mgr._access = dataclasses.replace(access, **{k: v.clone() for k, v in vars(access).items() if v is not None})
        set_cpu_manager(backend)
        try:
            counts = mgr.fold_statistics(decode)
            wanted = mgr.wanted()
        finally:
            set_cpu_manager("native")
        results[backend] = counts, wanted, {k: getattr(mgr.table, k).clone() for k in STATS}
    got, ref = results["native"], results["torch"]
    assert got[0] == ref[0]
    for a, b, name in zip(got[1], ref[1], ("want", "protect", "need")):
        assert torch.equal(a, b), name
    for k in STATS:
        assert torch.equal(got[2][k], ref[2][k]), f"page-table column {k}"
    t = mgr.table  # and the reference is what its docstring says
    want, protect, need = wanted_pages(access.missing, access.needed, t.staged, t.device_slot, t.alive)
    assert torch.equal(want, (access.missing | (access.needed & t.staged)) & (t.device_slot < 0) & t.alive)
    assert bool(want.any()) or records < 64
    assert torch.equal(need, want.sum(1)) and torch.equal(protect, access.needed | want)


@needs_op
@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), records=st.integers(1, 600), top=st.sampled_from([0, 1, 7, 1000, 2**23, 2**40]),
       weights=st.sampled_from([(0.6, 0.4), (0.3, 0.7), (1 / 3, 2 / 3), (1.0, 0.0)]), seed=st.integers(0, 9999))
def test_lfu_priority_equals_the_policy_reference(layers, records, top, weights, seed):
    """The lfu-importance priority in one op, bit for bit the policy's torch code (every operation
    rounded as torch rounds it: no fused multiply-add, no reciprocal), rows of all-zero counts too."""
    from tieredkv.runtime.tiered.policies.base import PageStats
    from tieredkv.runtime.tiered.policies.lfu_importance import LFUImportancePolicy

    gen = torch.Generator().manual_seed(seed)
    freq = torch.randint(0, top + 1, (layers, records), generator=gen)
    if layers > 1:
        freq[0] = 0
    imp = torch.rand(layers, records, generator=gen) * torch.tensor([1.0, 1e-3, 1e3])[
        torch.randint(0, 3, (layers, records), generator=gen)]
    stats = PageStats(last_access=freq, frequency=freq, importance=imp, acc_mass=imp, position=freq)
    policy = LFUImportancePolicy(weights)
    got, want = tier_step_ops().lfu_priority(freq, imp, *weights), policy.reference(stats)
    assert torch.equal(got, want)
    assert torch.equal(policy.priority(stats), want)  # (the policy calls the op on the CPU)
    imp[..., :1] = float("nan")
    got, want = tier_step_ops().lfu_priority(freq, imp, *weights), policy.reference(stats)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@needs_op
def test_fold_record_rejects_bad_inputs():
    """A record of the wrong shape or a record index out of range is refused with what was expected."""
    ops = tier_step_ops()
    L, B, M, C = 2, 1, 3, 5
    cols = lambda dt: torch.zeros(L, C, dtype=dt)  # noqa: E731
    args = [torch.tensor([[0, 1, 2]]), torch.ones(B, M, dtype=torch.bool), torch.zeros(B, M, dtype=torch.bool),
            torch.ones(L, B, M, dtype=torch.bool), torch.ones(L, B, M, dtype=torch.bool), torch.rand(L, B, M),
            None, None, None, None, None, None, cols(torch.long), cols(torch.long), cols(torch.long),
            cols(torch.bool), cols(torch.bool), cols(torch.bool), cols(torch.bool), cols(torch.bool),
            cols(torch.float32), cols(torch.float32), cols(torch.float32), True, 1]
    ops.fold_record(*args)
    bad = list(args)
    bad[0] = torch.tensor([[0, 1, 5]])
    with pytest.raises(RuntimeError, match=r"recs must lie in \[0, 5\)"):
        ops.fold_record(*bad)
    bad = list(args)
    bad[3] = torch.ones(L, B, M + 1, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="selected must be"):
        ops.fold_record(*bad)
    bad = list(args)
    bad[20] = torch.zeros(L, C, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="acc_mass must be Float"):
        ops.fold_record(*bad)


def test_set_cpu_manager_names_the_backends():
    from tieredkv.errors import ConfigError

    with pytest.raises(ConfigError, match="native"):
        set_cpu_manager("fast")


def test_access_record_reused_cleared():
    """A step's access record is the last step's tensors zeroed in place (no [L, R] allocation per
    step): every column zero, the optional logs dropped; a table that grew gets new tensors."""
    mgr = _manager(3, 6, 1)
    plan = mgr.begin_step((0,), 1)
    first = mgr._access
    for v in vars(first).values():
        if v is not None:
            v.fill_(1)
    first.spec = torch.ones(1)
    selected = torch.ones(3, 1, plan.width, dtype=torch.bool)
    mgr.record_step(plan, StepRecord(selected=selected, attended=selected, relevance=None,
                                     importance=torch.rand(3, 1, plan.width), mass=torch.rand(3, 1, plan.width)))
    mgr.end_step(decode=True)
    mgr.begin_step((0,), 1)
    again = mgr._access
    assert again.needed is first.needed and again.spec is None and again.tier is None
    assert all(not bool(v.any()) for v in vars(again).values() if v is not None)
    mgr.end_step(decode=True)
    assert StepAccess.reuse(again, 3, mgr.table.capacity + 1).needed is not again.needed
