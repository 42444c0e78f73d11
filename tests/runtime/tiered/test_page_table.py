"""The PageTable: records handed out and returned, reference counts of shared pages, T0 over the
sequences sharing a page, snapshots, and the invariant check catching each kind of damage."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tieredkv.runtime.tiered.page_table import PageTable

P = 4


def table_with(*lengths: int) -> PageTable:
    """A table with one sequence per length, its pages handed out in order."""
    t = PageTable(num_layers=2, kv_heads=1, head_dim=3, page_size=P)
    for seq, n in enumerate(lengths):
        t.add_sequence(seq)
        for i in range(-(-n // P)):
            r = t.new_record(i, step=0)
            t.seq_pages[seq].append(r)
            t.tokens[r] = min(P, n - i * P)
        t.seq_len[seq] = n
    return t


def test_columns_are_declared_once_and_grow_together():
    t = PageTable(num_layers=3, kv_heads=2, head_dim=5, page_size=P)
    names = [name for name, _ in t.columns()]
    assert {"refs", "device_slot", "kmin", "importance"} <= set(names)
    assert t.capacity == 64 and len(t.free) == 64
    t.grow(10)
    for name, meta in t.columns():
        col = getattr(t, name)
        assert col.shape[1 if meta["per_layer"] else 0] == 74, name
    assert t.kmin.shape == (3, 74, 2, 5) and float(t.kmin[0, 70, 1, 4]) == float("inf")


def test_records_are_reused_lowest_first_and_reset():
    t = table_with(9)
    recs = t.records_of(0)
    assert recs.tolist() == [0, 1, 2]
    t.importance[:, 1] = 0.1
    t.device_slot[:, 1] = 5
    freed = t.unref(recs[1:2])
    assert freed.tolist() == [1]
    t.device_slot[:, 1] = -1  # the manager releases the slots of freed records
    t.release(freed)
    r = t.new_record(7, step=3)
    assert r == 1 and float(t.importance[0, r]) == 1.0 and int(t.last_access[1, r]) == 3 and int(t.index[r]) == 7


def test_shared_pages_are_counted_and_freed_with_their_last_sequence():
    t = table_with(8, 3)
    shared = t.records_of(0).tolist()  # two full pages
    t.add_sequence(5, shared)
    assert t.seq_len[5] == 8 and t.refs[shared].tolist() == [2, 2]
    t.check()
    assert len(t.unref(torch.tensor(shared))) == 0  # sequence 0 lets go: still listed by 5
    del t.seq_pages[0], t.seq_len[0]
    t.check()
    freed = t.unref(torch.tensor(shared))
    del t.seq_pages[5], t.seq_len[5]
    t.release(freed)
    t.check()
    assert sorted(freed.tolist()) == sorted(shared)
    with pytest.raises(ValueError, match="full pages"):
        t.add_sequence(9, t.records_of(1).tolist())  # a partial page cannot be shared


def test_t0_of_a_shared_page_is_the_or_of_its_sequences():
    t = table_with(40)
    t.add_sequence(1, t.records_of(0)[:8].tolist())  # 8 of the 10 pages
    t.seq_pages[1].append(t.new_record(8, 0))
    t.seq_len[1] = 33
    t.update_t0(sink_tokens=4, recent_tokens=8)
    # sequence 0: sink page 0, recent pages 8, 9; sequence 1 (33 tokens): page 0, recent pages 6, 7 (shared)
    # and 8 (its own)
    assert t.t0[t.records_of(0)].tolist() == [True] + [False] * 5 + [True] * 4
    assert bool(t.t0[t.seq_pages[1][-1]])


def test_snapshot_and_restore():
    t = table_with(10, 5)
    state = t.snapshot()
    t.add_sequence(2, t.records_of(0)[:2].tolist())
    t.importance[:, 0] = 0.5
    t.unref(t.records_of(1))
    t.restore(state)
    t.check()
    assert 2 not in t.seq_pages and float(t.importance[0, 0]) == 1.0 and int(t.refs[t.seq_pages[1][0]]) == 1


@pytest.mark.parametrize("damage,message", [
    (lambda t: t.refs.__setitem__(0, 2), "reference counts"),
    (lambda t: t.free.append(t.free[-1]), "free list twice"),
    (lambda t: t.free.pop(), "not the unlisted records"),
    (lambda t: t.seq_pages[0].reverse(), "out of order"),
    (lambda t: t.seq_len.__setitem__(0, 30), "pages and length"),
    (lambda t: t.add_sequence(3, t.records_of(0)[:2].tolist()) or t.seq_len.__setitem__(3, 7), "being written"),
])
def test_the_check_catches_damage(damage, message):
    t = table_with(10, 5)
    t.check()
    damage(t)
    with pytest.raises(AssertionError, match=message):
        t.check()


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "share", "free"]), st.integers(0, 30)), max_size=30))
def test_random_sharing_keeps_the_counts(ops):
    t = PageTable(num_layers=1, kv_heads=1, head_dim=1, page_size=P)
    next_id = 0
    for op, n in ops:
        live = list(t.seq_pages)
        if op == "add" or not live:
            t.add_sequence(next_id)
            for i in range(-(-n // P)):
                t.seq_pages[next_id].append(t.new_record(i, 0))
                t.tokens[t.seq_pages[next_id][-1]] = min(P, n - i * P)
            t.seq_len[next_id] = n
        elif op == "share":
            src = live[n % len(live)]
            t.add_sequence(next_id, t.seq_pages[src][: t.seq_len[src] // P])
        else:
            seq = live[n % len(live)]
            t.release(t.unref(t.records_of(seq)))
            del t.seq_pages[seq], t.seq_len[seq]
        next_id += 1
        t.check()


def test_hot_page_count_counts_the_hot_pages():
    from tieredkv.runtime.tiered.page_table import hot_page_count, hot_pages, hot_records

    for P, sink, recent in ((1, 0, 0), (8, 4, 16), (16, 4, 64), (16, 40, 8)):
        for n in range(0, 200):
            assert hot_page_count(n, P, sink, recent) == int(hot_pages(n, P, sink, recent).sum()), (n, P, sink, recent)
            pages = [100 + i for i in range(-(-n // P))]  # the records hot_records picks from, and a shorter list
            want = [p for p, h in zip(pages, hot_pages(n, P, sink, recent).tolist()) if h]
            assert hot_records(pages, n, P, sink, recent) == want, (n, P, sink, recent)
            assert hot_records(pages[:-1], n, P, sink, recent) == [p for p in want if p in pages[:-1]]


def test_reserve_grows_by_an_eighth_not_by_doubling():
    """The table grows by what is missing and at least an eighth of its capacity: a long sequence
    crossing a power of two does not double every per-step column op."""
    t = PageTable(num_layers=2, kv_heads=1, head_dim=2, page_size=4)
    assert t.capacity == 64 and len(t.free) == 64
    t.reserve(10)
    assert t.capacity == 64  # room already
    t.reserve(100)
    assert t.capacity == 128 and len(t.free) == 128  # 36 missing, grown by at least 64
    t.reserve(300)
    assert t.capacity == 300 and len(t.free) == 300  # 172 missing
    for i in range(300):
        t.new_record(i, 0)
    t.new_record(300, 0)  # full: grows by max(1, 300 // 8, 64)
    assert t.capacity == 364
    for i in range(301, 1100):
        t.new_record(i, 0)
    assert 1100 <= t.capacity <= 1100 * 9 // 8 + 64
    assert sorted(t.free + [r for r in range(t.capacity) if int(t.refs[r]) > 0]) == list(range(t.capacity))
