"""The tier manager's page moves through the CPU extension (models/csrc: ``pick_pages`` in
tier_step.cpp, ``evict_pages`` / ``admit_pages`` in tier_moves.cpp) against its torch code
(runtime/tiered/moves.py), the reference: the same picks on random priorities with ties, NaN and
infinities; and two managers driven through the same decode steps under binding budgets — one on
the ops, one on the torch code — hold the same page table, the same pools (owners and page
bytes), the same metrics and transfer counts after every step, with and without a warm tier, a
bounded host tier and a disk tier."""

import contextlib
import dataclasses
import tempfile
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tieredkv.models.cpu_attention import cpu_attention_status, set_cpu_manager, tier_step_ops
from tieredkv.plugins.codec import CODECS, page_bytes as codec_page_bytes
from tieredkv.runtime.tiered.budgets import resolve_budgets
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.manager import TierManager
from tieredkv.runtime.tiered.moves import pick_lowest
from tieredkv.runtime.tiered.policies import make_policy
from tieredkv.runtime.tiered.prefetch import make_prefetcher
from tieredkv.runtime.tiered.step import StepRecord
from tieredkv.runtime.tiered.step_fold import StepFold
from tieredkv.runtime.tiered.store import TierPool

needs_op = pytest.mark.skipif(tier_step_ops() is None,
                              reason=f"the CPU ops could not be built here: {cpu_attention_status()['error']}")

COLUMNS = ("device_slot", "warm_slot", "host_slot", "disk_slot", "t1", "prefetched", "staged", "last_access",
           "frequency", "win_access", "hist", "idle_windows", "importance", "acc_mass", "last_relevance")


def _priorities(gen: torch.Generator, shape) -> torch.Tensor:
    """Few distinct values (ties everywhere), some NaN, +-inf and -0.0."""
    p = torch.randint(-2, 3, shape, generator=gen).float()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    pick = torch.randint(0, 12, shape, generator=gen)
    return torch.where(pick < 4, special[pick.clamp(max=3)], p)


@needs_op
@settings(max_examples=80, deadline=None)
@given(layers=st.integers(1, 5), records=st.integers(1, 600), share=st.floats(0, 1), largest=st.booleans(),
       inputs=st.lists(st.booleans(), min_size=4, max_size=4), seed=st.integers(0, 9999))
def test_pick_pages_equals_the_torch_reference(layers, records, share, largest, inputs, seed):
    """Candidates from any of the optional inputs (a mask, the residency, T0, a protected set)."""
    gen = torch.Generator().manual_seed(seed)
    prio = _priorities(gen, (layers, records))
    few = torch.randint(-1, 4, (layers,), generator=gen)  # (few picks among many: the heap path)
    counts = torch.randint(-1, records + 2, (layers,), generator=gen)
    counts = torch.where(torch.rand(layers, generator=gen) < 0.5, few, counts)
    with_cand, with_resident, with_t0, with_protect = inputs
    cand = (torch.rand(layers, records, generator=gen) < share) if with_cand else None
    resident = torch.where(torch.rand(layers, records, generator=gen) < 0.6,
                           torch.randint(0, 50, (layers, records), generator=gen), -1) if with_resident else None
    t0 = (torch.rand(records, generator=gen) < 0.2) if with_t0 else None
    protect = (torch.rand(layers, records, generator=gen) < 0.2) if with_protect else None
    got = tier_step_ops().pick_pages(prio, counts, largest, cand, resident, t0, protect)
    mask = torch.ones(layers, records, dtype=torch.bool) if cand is None else cand.clone()
    if resident is not None:
        mask &= resident >= 0
    if t0 is not None:
        mask &= ~t0
    if protect is not None:
        mask &= ~protect
    want = pick_lowest(mask, -prio if largest else prio, counts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_op
def test_pick_pages_ranks_ties_by_record_and_nan_as_inf():
    prio = torch.tensor([[1.0, float("nan"), 0.0, 1.0, -0.0, float("inf")]])
    ops = tier_step_ops()
    layers, recs = ops.pick_pages(prio, torch.tensor([6]), False, torch.ones(1, 6, dtype=torch.bool), None, None, None)
    assert recs.tolist() == [2, 4, 0, 3, 1, 5] and layers.tolist() == [0] * 6
    _, recs = ops.pick_pages(prio, torch.tensor([3]), True, torch.ones(1, 6, dtype=torch.bool), None, None, None)
    assert recs.tolist() == [5, 0, 3]


def _manager(warm: str, host_budget: str | None, disk: bool, batch: int, prefetch: bool = False) -> TierManager:
    L, P, context = 3, 4, 88  # 64 prefilled tokens and 24 decoded per sequence
    cfg = TieredKVConfig(page_size=P, sink_tokens=4, recent_tokens=8, device_budget="50%", host_budget=host_budget,
                         policy="lfu-importance", mode="exact", warm_codec=warm, staging_pages=2, window_steps=4,
                         disk_path=(tempfile.mkdtemp() + "/t4.bin") if disk else None,
                         prefetch_predictor="last" if prefetch else None,
                         **({} if warm == "off" else {"warm_fraction": 0.5}))
    warm_bytes = None if warm == "off" else (codec_page_bytes(CODECS[warm], 2, P, 8),)
    budgets = resolve_budgets(cfg, num_layers=L, token_bytes_per_layer=2 * 2 * 8 * 2, full_tokens=context,
                              num_sequences=batch, dtype=torch.float16, warm_page_bytes=warm_bytes)
    return TierManager(num_layers=L, kv_heads=2, head_dim=8, dtype=torch.float16, config=cfg, budgets=budgets,
                       policy=make_policy(cfg.migration.policy), prefetcher=make_prefetcher(cfg))


def _drive(backend: str, warm: str, host_budget: str | None, disk: bool, batch: int, seed: int,
           prefetch: bool = False, one_op: bool = False, runs: list | None = None,
           unmeasured: bool = False, records: int | None = None) -> list[dict]:
    """Prefill ``batch`` sequences in chunks, then decode steps that need random pages (the
    overhead benchmark's pattern: a recent stretch, recurring pages, a few at random); the state
    after every step. ``one_op``: each decode step closed by ``close_step`` (its one op where it
    applies), else by ``record_step`` and ``end_step``; ``runs`` gets the manager; ``unmeasured``:
    every fifth decode step records no attention mass (the needed pages only, as the cache's steps
    that ran the paged path); ``records``: the page table grown to that many records first (the
    native ops split the layers between threads when a layer's columns are long enough)."""
    set_cpu_manager(backend)
    try:
        mgr = _manager(warm, host_budget, disk, batch, prefetch)
        if records is not None:
            mgr.table.grow(records - mgr.table.capacity)
        mgr.close_in_one_op = one_op
        if runs is not None:
            runs.append(mgr)
        gen = torch.Generator().manual_seed(seed)
        seqs = tuple(range(batch))
        for b in seqs:
            mgr.add_sequence(b)
        states = []

        def write(plan, n):
            for layer in range(mgr.L):
                k, v = torch.randn(2, batch * n, 2, 8, generator=gen).half()
                mgr.write_tokens(layer, plan, k, v, torch.rand(batch * n, generator=gen))

        for _ in range(4):
            plan = mgr.begin_step(seqs, 16)
            write(plan, 16)
            mgr.end_step(decode=False)
            states.append(_state(mgr))
        hot = torch.randint(1, 12, (mgr.L, batch, 4), generator=gen)
        rows, cols = torch.arange(mgr.L).view(-1, 1, 1), torch.arange(batch).view(1, -1, 1)
        for i in range(24):
            plan = mgr.begin_step(seqs, 1)
            write(plan, 1)
            m = plan.width
            needed = torch.zeros(mgr.L, batch, m, dtype=torch.bool)
            needed[:, :, max(1, m - 8): m - 3] = True
            needed[rows, cols, hot.clamp(max=m - 4)] = True
            needed[rows, cols, torch.randint(1, max(2, m - 4), (mgr.L, batch, 3), generator=gen)] = True
            selected = (needed | plan.t0.unsqueeze(0)) & plan.valid.unsqueeze(0)
            importance, mass = torch.rand(mgr.L, batch, m, generator=gen), torch.rand(mgr.L, batch, m, generator=gen)
            if unmeasured and i % 5 == 4:
                importance = mass = None
            mgr.close_step(plan, StepRecord(selected=selected, attended=selected, relevance=None,
                                            importance=importance, mass=None if mass is None else mass * selected),
                           decode=True)
            mgr.check_invariants()
            states.append(_state(mgr))
        if mgr.warm is not None:  # every warm page promoted (as a window's promotion would): warm copies released
            t = mgr.table
            warm = t.warm_slot >= 0
            room = mgr._make_room(warm.sum(1), protect=warm)
            mgr.admit(*mgr._highest(warm, t.importance, room))
            mgr.check_invariants()
            states.append(_state(mgr))
        mgr.close()
        return states
    finally:
        set_cpu_manager("native")


def _state(mgr: TierManager) -> dict:
    t = mgr.table
    out = {f"table.{c}": getattr(t, c).clone() for c in COLUMNS}
    for pool, _ in mgr._pools():
        if pool is not None and hasattr(pool, "owner"):
            out[f"{pool.name}.owner"] = pool.owner.clone()
            out[f"{pool.name}.used"] = pool.used()
    for pool in (mgr.device, mgr.host):  # the pages in every owned slot
        own = pool.owner >= 0
        out[f"{pool.name}.k"], out[f"{pool.name}.v"] = pool.k[own].clone(), pool.v[own].clone()
    metrics = dataclasses.asdict(mgr.metrics)
    out["metrics"] = {k: v for k, v in metrics.items() if not k.endswith("_seconds")}  # (timings differ)
    out["transfers"] = dataclasses.asdict(mgr.transfers.stats)
    return out


@needs_op
@settings(max_examples=16, deadline=None)
@given(warm=st.sampled_from(["off", "int4"]), host_budget=st.sampled_from([None, "25%"]), batch=st.integers(1, 3),
       prefetch=st.booleans(), seed=st.integers(0, 999))
def test_moves_through_the_ops_equal_the_torch_moves(warm, host_budget, batch, prefetch, seed):
    disk = host_budget is not None  # a bounded host tier spills to disk: the ops leave those moves to torch
    native = _drive("native", warm, host_budget, disk, batch, seed, prefetch)
    ref = _drive("torch", warm, host_budget, disk, batch, seed, prefetch)
    last = ref[-1]["metrics"]
    assert last["fetched_pages"] > 0 and last["writebacks"] > 0  # the budget binds: pages moved both ways
    if warm != "off" and last["compressed_pages"]:
        assert last["warm_promotions"] > 0
    if prefetch:
        assert last["prefetched_pages"] > 0
    _same_states(native, ref)


def _same_states(got: list[dict], want: list[dict]) -> None:
    """Two runs' states (``_state`` after every step) equal, step for step and key for key."""
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        for key, value in b.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(a[key], value), f"step {step}: {key}"
            else:
                assert a[key] == value, f"step {step}: {key}"


@contextlib.contextmanager
def _growth_in_one_op(grown: list):
    """Record the pools grown while ``close_step``'s one op runs (its resumed calls)."""
    inside = [False]
    close, reserve = StepFold._close_native, TierPool.reserve

    def closing(self, plan, rec):
        inside[0] = True
        try:
            return close(self, plan, rec)
        finally:
            inside[0] = False

    def growing(pool, pages):
        if inside[0] and pages > pool.capacity:
            grown.append(pool.name)
        return reserve(pool, pages)

    with mock.patch.object(StepFold, "_close_native", closing), mock.patch.object(TierPool, "reserve", growing):
        yield


@needs_op
@settings(max_examples=16, deadline=None)
@given(batch=st.integers(1, 3), unmeasured=st.booleans(), seed=st.integers(0, 999))
def test_a_step_closed_in_one_op_equals_the_two_calls(batch, unmeasured, seed):
    """``close_step`` through ``close_decode_step`` (models/csrc/tier_close.cpp) against ``record_step``
    then ``end_step`` (each through its own ops) under a binding budget: the same page table, pools
    (owners, used counts, page bytes), metrics and transfer counts after every step, with steps that
    measured no attention mass among them; every decode step but the migration windows' last
    closed in one op."""
    runs = []
    one = _drive("native", "off", None, False, batch, seed, one_op=True, runs=runs, unmeasured=unmeasured)
    two = _drive("native", "off", None, False, batch, seed, one_op=False, runs=runs, unmeasured=unmeasured)
    assert runs[0].warm is None and runs[0].closed_in_one_op == 24 - 24 // 4 and runs[1].closed_in_one_op == 0
    assert two[-1]["metrics"]["fetched_pages"] > 0 and two[-1]["metrics"]["writebacks"] > 0
    _same_states(one, two)


@needs_op
@pytest.mark.parametrize("batch,seed", [(1, 0), (3, 1)])
def test_a_step_closed_in_one_op_on_two_threads_equals_the_two_calls(batch, seed):
    """Tables long enough that the ops split their layers between two threads (a task takes ~32k
    entries: 3 layers of 16,384 records run as two tasks): the one op and the separate ops, each
    split, leave the same states as the torch moves on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        one = _drive("native", "off", None, False, batch, seed, one_op=True, runs=runs, records=16384)
        two = _drive("native", "off", None, False, batch, seed, one_op=False, records=16384)
    finally:
        torch.set_num_threads(threads)
    ref = _drive("torch", "off", None, False, batch, seed, records=16384)
    assert runs[0].table.capacity == 16384 and runs[0].closed_in_one_op == 24 - 24 // 4
    assert ref[-1]["metrics"]["fetched_pages"] > 0 and ref[-1]["metrics"]["writebacks"] > 0
    _same_states(one, ref)
    _same_states(two, ref)


@needs_op
@settings(max_examples=8, deadline=None)
@given(case=st.sampled_from(["warm", "host-budget", "prefetch"]), batch=st.integers(1, 3), seed=st.integers(0, 999))
def test_close_step_is_the_two_calls_where_the_op_does_not_apply(case, batch, seed):
    """A warm tier, a bounded host tier (with a disk tier), a prefetcher: ``close_step`` is
    ``record_step`` then ``end_step`` — no step closed in one op, the same states."""
    args = {"warm": ("int4", None, False, False), "host-budget": ("off", "25%", True, False),
            "prefetch": ("off", None, False, True)}[case]
    warm, host_budget, disk, prefetch = args
    runs = []
    one = _drive("native", warm, host_budget, disk, batch, seed, prefetch, one_op=True, runs=runs)
    two = _drive("native", warm, host_budget, disk, batch, seed, prefetch, one_op=False, runs=runs)
    if case == "warm":
        assert runs[0].warm is not None or runs[0].closed_in_one_op > 0  # (a budget with no warm room: no warm tier)
    if runs[0].warm is not None or case != "warm":
        assert runs[0].closed_in_one_op == 0
    _same_states(one, two)


def _two_sequences(one_op: bool, *, recent_tokens: int, device_budget: str, seed: int):
    """A manager of sequences 0 and 1 (3 layers, pages of 4 tokens, no warm tier) and its step:
    ``step(seqs, n, decode)`` writes n random tokens per sequence, records every listed page as
    selected and attended, closes the step (through the one op where it applies, if ``one_op``),
    checks the invariants and returns the state."""
    L, P = 3, 4
    cfg = TieredKVConfig(page_size=P, sink_tokens=4, recent_tokens=recent_tokens, device_budget=device_budget,
                         policy="lfu-importance", mode="exact", warm_codec="off", staging_pages=2, window_steps=64)
    budgets = resolve_budgets(cfg, num_layers=L, token_bytes_per_layer=2 * 2 * 8 * 2, full_tokens=200,
                              num_sequences=2, dtype=torch.float16)
    mgr = TierManager(num_layers=L, kv_heads=2, head_dim=8, dtype=torch.float16, config=cfg, budgets=budgets,
                      policy=make_policy(cfg.migration.policy))
    mgr.close_in_one_op = one_op
    gen = torch.Generator().manual_seed(seed)

    def step(seqs, n, decode):
        plan = mgr.begin_step(seqs, n)
        for layer in range(L):
            k, v = torch.randn(2, len(seqs) * n, 2, 8, generator=gen).half()
            mgr.write_tokens(layer, plan, k, v, torch.rand(len(seqs) * n, generator=gen))
        sel = plan.valid.unsqueeze(0).expand(L, -1, -1).clone()
        rec = StepRecord(selected=sel, attended=sel, relevance=None, importance=torch.rand(sel.shape, generator=gen),
                         mass=torch.rand(sel.shape, generator=gen) * sel)
        mgr.close_step(plan, rec, decode=decode)
        mgr.check_invariants()
        return _state(mgr)

    mgr.add_sequence(0)
    mgr.add_sequence(1)
    return mgr, step


def _pause_resume(one_op: bool) -> list[dict]:
    """Two sequences under a device budget that holds them: one paused (its pages leave the device)
    while the other decodes 98 tokens, then resumed and every page of both needed: the resumed
    sequence's pages come back through the step's admissions."""
    mgr, step = _two_sequences(one_op, recent_tokens=8, device_budget="48KiB", seed=3)
    states = [step((0,), 62, False), step((1,), 16, False)]  # (last pages partial: no new page when resumed)
    mgr.pause(0)
    states += [step((1,), 1, True) for _ in range(98)]
    mgr.resume(0)
    states += [step((0, 1), 1, True) for _ in range(3)]
    states.append(mgr.closed_in_one_op)
    mgr.close()
    return states


@needs_op
def test_a_step_closed_in_one_op_grows_the_pools_as_the_moves_do():
    """The op's resumed calls: a host pool short of slots for the dirty victims inside the one op is
    grown and the step goes on where it stopped — the same states as the two calls, which grow it in
    their own moves; and a paused sequence resumed, its pages admitted back in one op. (The device
    pool's growth inside the op, for admissions: the next test.)"""
    grown = []
    with _growth_in_one_op(grown):
        one = _pause_resume(True)
        runs = []
        one_drive = [_drive("native", "off", None, False, b, seed, one_op=True, runs=runs) for b, seed in
                     ((2, 0), (3, 1), (3, 2))]
    assert "host" in grown, grown
    assert one[-1] > 0 and one[-2]["metrics"]["fetched_pages"] > one[-5]["metrics"]["fetched_pages"]
    two = _pause_resume(False)
    assert two[-1] == 0
    _same_states(one[:-1], two[:-1])
    for (b, seed), got in zip(((2, 0), (3, 1), (3, 2)), one_drive):
        _same_states(got, _drive("native", "off", None, False, b, seed, one_op=False))


def _resume_into_a_full_pool(one_op: bool) -> list:
    """A device pool whose allocated slots are all taken when a resumed sequence's pages are
    wanted again, its budget far above: the step's admissions need slots the pool has not
    allocated yet (no page of the step is new, so nothing grew it before its close)."""
    mgr, step = _two_sequences(one_op, recent_tokens=4, device_budget="64KiB", seed=5)
    states = [step((0,), 62, False)]  # 16 pages: the pool's first 16 slots
    mgr.pause(0)  # 13 pages leave (3 hot stay)
    states.append(step((1,), 50, False))  # 13 pages: 16 used again (no page of either ends full)
    mgr.resume(0)
    assert mgr.resident_cap >= 29 and int(mgr.device.used().max()) == mgr.device.capacity == 16
    states += [step((0, 1), 1, True) for _ in range(2)]  # seq 0's 13 pages wanted: admitted
    states.append(mgr.closed_in_one_op)
    mgr.close()
    return states


@needs_op
def test_a_step_closed_in_one_op_grows_the_device_pool_for_its_admissions():
    """The op stops before any admission when the device pool lacks allocated slots for them
    (status 2), the manager grows the pool, the op goes on: the same states as the two calls."""
    grown = []
    with _growth_in_one_op(grown):
        one = _resume_into_a_full_pool(True)
    assert "device" in grown, grown
    two = _resume_into_a_full_pool(False)
    assert one[-1] == 2 and two[-1] == 0
    assert one[-2]["metrics"]["fetched_pages"] >= 3 * 13
    _same_states(one[:-1], two[:-1])


@needs_op
def test_move_ops_refuse_bad_pages():
    """A page outside the table, an eviction of a page not resident, an admission of a resident one:
    refused with what is wrong, nothing moved."""
    mgr = _manager("off", None, False, 1)
    mgr.add_sequence(0)
    plan = mgr.begin_step((0,), 16)
    mgr.end_step(decode=False)
    del plan
    t, dev, host = mgr.table, mgr.device, mgr.host
    ops = tier_step_ops()
    before = t.device_slot.clone()

    def evict(layers, recs):
        return ops.evict_pages(torch.tensor(layers), torch.tensor(recs), t.device_slot, t.host_slot, t.disk_slot,
                               t.t1, t.prefetched, t.staged, dev.k, dev.v, dev.owner, dev.used(), host.k, host.v,
                               host.owner, host.used())

    with pytest.raises(RuntimeError, match="outside the"):
        evict([0], [t.capacity])
    with pytest.raises(RuntimeError, match="is not resident"):
        evict([0], [t.capacity - 1])
    with pytest.raises(RuntimeError, match="is resident already"):
        ops.admit_pages(torch.tensor([0]), torch.tensor([0]), None, t.device_slot, t.host_slot, t.warm_slot,
                        dev.k, dev.v, dev.owner, dev.used(), host.k, host.v, host.owner, None, None)
    assert torch.equal(t.device_slot, before)


@needs_op
def test_move_ops_move_a_page_listed_twice_once():
    """A pair listed twice is moved once (no second slot taken, nothing written outside the pools)."""
    mgr = _manager("off", None, False, 1)
    mgr.add_sequence(0)
    mgr.begin_step((0,), 16)
    mgr.end_step(decode=False)
    t, dev, host = mgr.table, mgr.device, mgr.host
    rec = int(mgr.records_of(0)[1])
    mgr.evict(torch.tensor([0, 0]), torch.tensor([rec, rec]))
    assert int(t.device_slot[0, rec]) < 0 and int(t.host_slot[0, rec]) >= 0
    assert int((host.owner[0] == rec).sum()) == 1 and int((dev.owner[0] == rec).sum()) == 0
    assert mgr.metrics.evicted_pages == 1 and mgr.metrics.writebacks == 1
    mgr.admit(torch.tensor([0, 0]), torch.tensor([rec, rec]))
    assert int(t.device_slot[0, rec]) >= 0 and int((dev.owner[0] == rec).sum()) == 1
    assert mgr.metrics.fetched_pages == 1 and mgr.transfers.stats.h2d_pages == 1
    mgr.check_invariants()

