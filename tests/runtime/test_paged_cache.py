"""The paged cache equals the contiguous oracle, and its page accounting never breaks."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import tiny_model
from tieredkv.errors import ConfigError, KVCacheFullError
from tieredkv.models.cache import ContiguousKVCache, KVSpec
from tieredkv.models.llama import decode_one_token, prefill
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache


def check_invariants(cache: PagedKVCache) -> None:
    ps = cache.page_size
    for layer, pool in enumerate(cache.pools):
        held = [p for sid in cache.tables for p in cache.tables[sid][layer]]
        free = pool.free_pages()
        assert len(held) == len(set(held)), "page held twice"
        assert not set(held) & set(free), "page both held and free"
        assert sorted(held + free) == list(range(pool.capacity)), "page lost"
        for sid in cache.tables:
            assert len(cache.tables[sid][layer]) == -(-cache._len[sid][layer] // ps)
    assert cache.kv_bytes() == cache.pages_in_use() * cache.pools[0].page_bytes
    assert cache.kv_bytes() <= cache.reserved_bytes()


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_single_sequence_bit_exact(page_size):
    model = tiny_model(seed=7)
    tokens = torch.randint(0, 512, (83,), generator=torch.Generator().manual_seed(0))
    paged = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=page_size, initial_pages=2))
    contig = ContiguousKVCache(model.kv_spec())
    a, b = paged.add_sequence(), contig.add_sequence()
    la = prefill(model, paged, a, tokens, chunk_size=19, all_logits=True)
    lb = prefill(model, contig, b, tokens, chunk_size=19, all_logits=True)
    assert torch.equal(la, lb)
    for step in range(9):
        tok = torch.tensor([int(la[-1].argmax())])
        pos = torch.tensor([83 + step])
        la = decode_one_token(model, paged, [a], tok, pos)
        lb = decode_one_token(model, contig, [b], tok, pos)
        assert torch.equal(la, lb)
    check_invariants(paged)


def test_batched_decode_matches_contiguous():
    model = tiny_model(seed=8)
    lens = [5, 33, 17, 1]
    paged = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=4))
    contig = ContiguousKVCache(model.kv_spec())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen) for n in lens]
    ps, cs = [], []
    for p in prompts:
        ps.append(paged.add_sequence())
        cs.append(contig.add_sequence())
        prefill(model, paged, ps[-1], p)
        prefill(model, contig, cs[-1], p)
    tokens = torch.tensor([3, 4, 5, 6])
    for step in range(6):
        pos = torch.tensor(lens) + step
        la = decode_one_token(model, paged, ps, tokens, pos)
        lb = decode_one_token(model, contig, cs, tokens, pos)
        assert (la - lb).abs().max().item() <= 1e-5
        assert torch.equal(la.argmax(-1), lb.argmax(-1))
        tokens = la.argmax(-1)
    check_invariants(paged)


def test_free_list_reuse_and_truncate():
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4)
    cache = PagedKVCache(spec, PagedCacheConfig(page_size=4, initial_pages=4))
    model = tiny_model(num_kv_heads=1, num_heads=2, head_dim=4, hidden_size=8, intermediate_size=16)
    a = cache.add_sequence()
    prefill(model, cache, a, torch.arange(10))
    pages_a = list(cache.tables[a][0])
    cache.free_sequence(a)
    b = cache.add_sequence()
    prefill(model, cache, b, torch.arange(3))
    assert cache.tables[b][0][0] == pages_a[0]  # LIFO reuse
    prefill(model, cache, b, torch.arange(9), start_pos=3)
    cache.truncate(b, 5)
    assert cache.length(b) == 5 and len(cache.tables[b][0]) == 2
    check_invariants(cache)


def test_fixed_capacity_runs_out_with_a_typed_error():
    model = tiny_model()
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=4, max_pages=3, initial_pages=2))
    sid = cache.add_sequence()
    prefill(model, cache, sid, torch.arange(12))
    assert cache.pools[0].allocate() is None  # "no room" is a return value at the pool
    with pytest.raises(KVCacheFullError, match="max_pages"):
        prefill(model, cache, sid, torch.arange(1), start_pos=12)


@pytest.mark.parametrize("bad", [dict(page_size=0), dict(max_pages=-1), dict(initial_pages=0)])
def test_bad_config(bad):
    with pytest.raises(ConfigError):
        PagedCacheConfig(**bad)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40)),
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 9)),
        st.tuples(st.just("truncate"), st.integers(0, 7), st.integers(0, 30)),
        st.tuples(st.just("free"), st.integers(0, 7)),
    ),
    max_size=25,
)

_MODEL = tiny_model(seed=11, num_layers=2, hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32)


@settings(max_examples=60, deadline=None)
@given(ops=ops, page_size=st.integers(1, 8), max_pages=st.one_of(st.none(), st.integers(4, 40)))
def test_property_accounting_and_equivalence(ops, page_size, max_pages):
    """Random add / grow / truncate / free sequences: invariants after every op, and the
    paged cache's logits equal the contiguous oracle's for every sequence."""
    model = _MODEL
    paged = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=page_size, max_pages=max_pages,
                                                           initial_pages=2))
    oracle = ContiguousKVCache(model.kv_spec())
    live: list[tuple[int, int]] = []
    gen = torch.Generator().manual_seed(0)
    for op in ops:
        if op[0] == "add":
            live.append((paged.add_sequence(), oracle.add_sequence()))
            target, n_new = len(live) - 1, op[1]
        elif not live:
            continue
        else:
            target, n_new = op[1] % len(live), (op[2] if op[0] != "free" else 0)
        p, o = live[target]
        if op[0] in ("add", "grow"):
            tokens = torch.randint(0, 512, (n_new,), generator=gen)
            start, before = paged.length(p), [list(t) for t in paged.tables[p]]
            try:
                la = prefill(model, paged, p, tokens, start_pos=start, chunk_size=64)  # one step
            except KVCacheFullError:
                # all or nothing: a step that does not fit leaves the sequence untouched
                assert paged.length(p) == start and paged.tables[p] == before
                check_invariants(paged)
                continue
            assert torch.equal(la, prefill(model, oracle, o, tokens, start_pos=start, chunk_size=64))
        elif op[0] == "truncate":
            n = min(op[2], paged.length(p))
            paged.truncate(p, n)
            oracle.truncate(o, n)
        else:
            live.pop(target)
            paged.free_sequence(p)
            oracle.free_sequence(o)
        check_invariants(paged)
        if max_pages is not None:
            assert all(pool.capacity <= max_pages for pool in paged.pools)
    for p, o in live:
        paged.free_sequence(p)
    assert paged.pages_in_use() == 0 and paged.kv_bytes() == 0
