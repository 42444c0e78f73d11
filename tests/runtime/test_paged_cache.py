"""The paged cache equals the contiguous oracle, and its page accounting never breaks."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import tiny_model
from tieredkv.errors import ConfigError, KVCacheFullError
from tieredkv.models.cache import ContiguousKVCache, KVSpec, attention
from tieredkv.models.cpu_attention import set_cpu_attention
from tieredkv.models.llama import decode_one_token, prefill
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache


@pytest.fixture
def torch_attention():
    """Decode attention on torch's path (the pages gathered, then ``models.cache.attention``),
    which equals the contiguous oracle bit for bit; the CPU op agrees with it to float32
    rounding (tests/models/test_cpu_attention.py)."""
    set_cpu_attention("torch")
    yield
    set_cpu_attention("paged")


def check_invariants(cache: PagedKVCache) -> None:
    """The cache's own check, and the same invariants written out plainly for unshared pages."""
    cache.check()
    ps, pool = cache.page_size, cache.pool
    held = [p for sid in cache.tables for p in cache.tables[sid]]
    free = pool.free_pages()
    assert len(held) == len(set(held)), "page held twice"
    assert not set(held) & set(free), "page both held and free"
    assert sorted(held + free) == list(range(pool.capacity)), "page lost"
    for sid in cache.tables:
        assert len(cache.tables[sid]) == -(-cache.length(sid) // ps)
    assert cache.kv_bytes() == cache.pages_in_use() * pool.page_bytes * cache.spec.num_layers
    assert cache.kv_bytes() <= cache.reserved_bytes()


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("backend", ["torch", "paged"])
def test_single_sequence_bit_exact(page_size, backend):
    """Prefill bit for bit; decode bit for bit on torch's path, within float32 rounding (the
    same argmax) with the CPU op."""
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
        set_cpu_attention(backend)
        try:
            la = decode_one_token(model, paged, [a], tok, pos)
        finally:
            set_cpu_attention("paged")
        lb = decode_one_token(model, contig, [b], tok, pos)
        if backend == "torch":
            assert torch.equal(la, lb)
        else:
            assert (la - lb).abs().max().item() <= 1e-5 and torch.equal(la.argmax(-1), lb.argmax(-1))
    check_invariants(paged)


@pytest.mark.parametrize("backend", ["paged", "torch"])
def test_batched_decode_matches_contiguous(backend):
    """Batched decode, with the CPU op and on torch's path: within float32 rounding of the
    contiguous oracle, the same argmax."""
    set_cpu_attention(backend)
    try:
        _batched_decode_matches_contiguous()
    finally:
        set_cpu_attention("paged")


def _batched_decode_matches_contiguous():
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
    pages_a = list(cache.tables[a])
    cache.free_sequence(a)
    b = cache.add_sequence()
    prefill(model, cache, b, torch.arange(3))
    assert cache.tables[b][0] == pages_a[0]  # LIFO reuse
    prefill(model, cache, b, torch.arange(9), start_pos=3)
    cache.truncate(b, 5)
    assert cache.length(b) == 5 and len(cache.tables[b]) == 2
    check_invariants(cache)


def test_fixed_capacity_runs_out_with_a_typed_error():
    model = tiny_model()
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=4, max_pages=3, initial_pages=2))
    sid = cache.add_sequence()
    prefill(model, cache, sid, torch.arange(12))
    assert cache.pool.allocate() is None  # "no room" is a return value at the pool
    assert not cache.allocate_slots([sid], 1)  # ... and at the cache: nothing taken
    assert cache.length(sid) == 12 and len(cache.tables[sid]) == 3
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


@pytest.mark.usefixtures("torch_attention")
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
            start, before = paged.length(p), list(paged.tables[p])
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
            assert paged.pool.capacity <= max_pages
    for p, o in live:
        paged.free_sequence(p)
    assert paged.pages_in_use() == 0 and paged.kv_bytes() == 0


def test_shared_prefix_pages_are_counted_and_copied_on_write():
    """Full pages shared with a second sequence (prefix reuse) and held by the index: reference
    counts balance, logits equal an unshared sequence's, a truncation into a shared page copies
    it first, and every page comes back when the last reference goes."""
    model = tiny_model(seed=9)
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=4, initial_pages=2))
    oracle = ContiguousKVCache(model.kv_spec())
    tokens = torch.randint(0, 512, (14,), generator=torch.Generator().manual_seed(3))
    a = cache.add_sequence()
    prefill(model, cache, a, tokens[:10])
    shared = cache.pages_of(a)[:2]  # two full pages
    cache.hold_pages(shared)
    b = cache.add_sequence(shared=shared)
    assert cache.length(b) == 8 and cache.page_refs(shared) == [3, 3] and cache.pages_indexed(shared) == [True] * 2
    got = prefill(model, cache, b, tokens[8:14], start_pos=8, all_logits=True)
    want = prefill(model, oracle, oracle.add_sequence(), tokens[:14], all_logits=True)[8:]
    assert (got - want).abs().max().item() <= 1e-5  # (the shared pages were written by another chunking)
    cache.check()
    usage = cache.usage()
    assert usage.indexed_pages == 2 and usage.sequence_refs == len(cache.pages_of(a)) + len(cache.pages_of(b))
    assert usage.token_bytes == (10 + 14 - 8) * cache.spec.token_bytes_per_layer * cache.spec.num_layers
    before = cache.read_pages(shared)
    cache.truncate(b, 6)  # inside the second shared page: b gets a private copy
    assert cache.pages_of(b)[1] != shared[1] and cache.page_refs(shared) == [3, 2]
    assert all(torch.equal(x, y) for x, y in zip(cache.read_pages(shared), before))
    cache.check()
    for sid in (a, b):
        cache.free_sequence(sid)
    assert cache.page_refs(shared) == [1, 1] and cache.pages_in_use() == 2
    cache.drop_pages(shared)
    assert cache.pages_in_use() == 0
    cache.check()


@pytest.mark.parametrize("b,m,kvh,p,d", [(1, 1, 1, 1, 1), (3, 5, 3, 16, 8), (2, 7, 2, 5, 3)])
def test_gather_pages_is_the_pages_head_major(b, m, kvh, p, d):
    """One copy per (page, kv head) row gives what indexing then moving the heads in front gives."""
    from tieredkv.models.cache import gather_pages

    gen = torch.Generator().manual_seed(b * 100 + m)
    pool = torch.randn(m * b + 3, kvh, p, d, generator=gen)
    pages = torch.randint(0, pool.shape[0], (b, m), generator=gen)
    want = pool[pages].permute(0, 2, 1, 3, 4)  # [B, KVH, M, P, D]
    assert torch.equal(gather_pages(pool, pages), want)


@pytest.mark.usefixtures("torch_attention")
def test_expect_grows_the_pool_before_the_steps():
    """``expect`` (the serving engine's hint at admission) grows the pool for every live
    sequence's expected pages at once, within ``max_pages``; the steps then take pages without
    growing it, and the outputs do not change."""
    model = tiny_model(seed=8)
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=4, initial_pages=2))
    contig = ContiguousKVCache(model.kv_spec())
    a, b = cache.add_sequence(), contig.add_sequence()
    cache.expect(a, 61)
    assert cache.pool.capacity >= 16  # ceil(61 / 4), doubling from 2
    cap = cache.pool.capacity
    tokens = torch.randint(0, 512, (41,), generator=torch.Generator().manual_seed(3))
    la, lb = prefill(model, cache, a, tokens, chunk_size=7), prefill(model, contig, b, tokens, chunk_size=7)
    for step in range(20):
        tok = torch.tensor([int(la[-1].argmax())])
        la = decode_one_token(model, cache, [a], tok, torch.tensor([41 + step]))
        lb = decode_one_token(model, contig, [b], tok, torch.tensor([41 + step]))
        assert torch.equal(la, lb)
    assert cache.pool.capacity == cap
    check_invariants(cache)
    capped = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=4, initial_pages=2, max_pages=5))
    capped.expect(capped.add_sequence(), 400)
    assert capped.pool.capacity == 5
    cache.free_sequence(a)
    assert cache._expected == {}


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 5), kvh=st.sampled_from([1, 3]), g=st.sampled_from([1, 3]), t=st.sampled_from([1, 1, 3]),
       s=st.integers(1, 70), seed=st.integers(0, 10**6))
def test_attention_equals_sdpa_whichever_kernel_runs(b, kvh, g, t, s, seed):
    """``attention`` runs a decode step of several sequences as batched matmuls and everything
    else through ``scaled_dot_product_attention``: the output is that kernel's to float32
    rounding on awkward shapes, and zeros for a query that sees no key."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, kvh * g, t, 8, generator=gen), torch.randn(b, kvh, s, 8, generator=gen),
               torch.randn(b, kvh, s, 8, generator=gen))
    mask = torch.rand(b, 1, t, s, generator=gen) < 0.7
    mask[..., 0] = True  # every query sees a key ...
    blind = b > 1 and t == 1
    if blind:
        mask[-1] = False  # ... but one, in the batched-matmul case
    got = attention(q, k, v, mask)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=g > 1)
    if blind:
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))
        got, want = got[:-1], want[:-1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
