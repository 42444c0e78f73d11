"""The CPU decode-attention op (models/csrc/paged_attention.cpp) against the torch path it
replaces: the pages gathered, then ``models.cache.attention``."""

import math

import pytest
import torch

from tieredkv.errors import ConfigError
from tieredkv.models.cache import (attention, gather_pages, pool_decode_attention, tiered_decode_attention,
                                  warm_codec_args)
from tieredkv.models.cpu_attention import cpu_attention_status, decode_attention_op, set_cpu_attention

OP = decode_attention_op()
needs_op = pytest.mark.skipif(OP is None, reason=f"the op could not be built here: {cpu_attention_status()['error']}")


def reference(q, pool_k, pool_v, pages, allowed):
    b, h, _, d = q.shape
    kvh, p, m = pool_k.shape[1], pool_k.shape[2], pages.shape[1]
    k = gather_pages(pool_k, pages).view(b, kvh, m * p, d)
    v = gather_pages(pool_v, pages).view(b, kvh, m * p, d)
    return attention(q, k, v, allowed.view(b, 1, 1, m * p))


def case(b, kvh, g, d, p, m, seed):
    gen = torch.Generator().manual_seed(seed)
    c = b * m + 3
    pool_k, pool_v = torch.randn(c, kvh, p, d, generator=gen), torch.randn(c, kvh, p, d, generator=gen)
    pages = torch.randint(0, c, (b, m), generator=gen)  # repeats too: the padding of a short table
    q = torch.randn(b, kvh * g, 1, d, generator=gen)
    return q, pool_k, pool_v, pages


# (sequences, kv heads, query heads per kv head, head dim, page size, pages): the specialized
# shapes (head dim 64 / 128 with 1, 2, 3, 4, 8 query heads per kv head) and generic ones
SHAPES = [(1, 1, 1, 64, 16, 1), (3, 3, 3, 64, 16, 7), (2, 2, 4, 128, 16, 5), (5, 1, 8, 64, 4, 9),
          (2, 3, 2, 128, 3, 11), (2, 3, 5, 48, 5, 3), (4, 2, 3, 80, 7, 6), (1, 8, 1, 128, 1, 33), (17, 3, 3, 64, 16, 2)]


@needs_op
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-kvh{}-g{}-d{}-p{}-m{}".format(*s))
def test_random_masks_match_the_torch_path(shape):
    q, pool_k, pool_v, pages = case(*shape, seed=sum(shape))
    b, m, p = shape[0], shape[5], shape[4]
    allowed = torch.rand(b, m * p, generator=torch.Generator().manual_seed(1)) < 0.7
    allowed[:, 0] = True
    if b > 1:
        allowed[-1] = False  # a query that may see no key: zeros
    got = pool_decode_attention(q, pool_k, pool_v, pages, allowed)
    torch.testing.assert_close(got, reference(q, pool_k, pool_v, pages, allowed), rtol=1e-5, atol=2e-6)
    if b > 1:
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))


@needs_op
@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "b{}-kvh{}-g{}-d{}-p{}-m{}".format(*s))
def test_causal_lengths_match_the_torch_path(shape):
    """The paged cache's mask: every key below each sequence's length, ragged lengths."""
    q, pool_k, pool_v, pages = case(*shape, seed=3)
    b, m, p = shape[0], shape[5], shape[4]
    lengths = torch.randint(1, m * p + 1, (b,), generator=torch.Generator().manual_seed(2))
    allowed = torch.arange(m * p).view(1, -1) < lengths.view(-1, 1)
    got = pool_decode_attention(q, pool_k, pool_v, pages, allowed)
    torch.testing.assert_close(got, reference(q, pool_k, pool_v, pages, allowed), rtol=1e-5, atol=2e-6)


@needs_op
def test_bad_arguments_are_refused():
    q, pool_k, pool_v, pages = case(2, 3, 3, 64, 16, 4, seed=0)
    allowed = torch.ones(2, 64, dtype=torch.bool)
    qv = q.view(2, 9, 64)
    with pytest.raises(RuntimeError, match="outside the pool"):
        OP(qv, pool_k, pool_v, pages + pool_k.shape[0], allowed, 0.125)
    with pytest.raises(RuntimeError, match="columns"):
        OP(qv, pool_k, pool_v, pages, allowed[:, :63].contiguous(), 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        OP(qv[:, :8].contiguous(), pool_k, pool_v, pages, allowed, 0.125)
    with pytest.raises(RuntimeError, match="must be Float"):
        OP(qv.double(), pool_k, pool_v, pages, allowed, 0.125)


def test_where_the_op_does_not_apply_the_caller_gets_none():
    q, pool_k, pool_v, pages = case(2, 1, 2, 16, 4, 3, seed=0)
    allowed = torch.ones(2, 12, dtype=torch.bool)
    assert pool_decode_attention(q.double(), pool_k.double(), pool_v.double(), pages, allowed) is None
    assert pool_decode_attention(q.repeat(1, 1, 2, 1), pool_k, pool_v, pages, allowed) is None  # two queries
    assert pool_decode_attention(q.requires_grad_(), pool_k, pool_v, pages, allowed) is None  # autograd
    try:
        set_cpu_attention("torch")
        assert pool_decode_attention(q.detach(), pool_k, pool_v, pages, allowed) is None
    finally:
        set_cpu_attention("paged")
    with pytest.raises(ConfigError, match="paged"):
        set_cpu_attention("flash")


def test_prepare_builds_only_for_float32_on_the_cpu():
    from tieredkv.models import cpu_attention

    said = []
    cpu_attention.prepare("cpu", torch.float32, log=said.append)  # built already, or built now
    assert cpu_attention_status()["built"] == (OP is not None)
    cpu_attention.prepare("cpu", torch.float16, log=said.append)  # nothing to build: no word
    cpu_attention.prepare("meta", torch.float32, log=said.append)
    assert all("decode-attention op" in line for line in said)


# ------------------------------------------------------------------ the tiered cache's variant
def tiered_case(b, kvh, g, d, p, m, codec, seed, heads_mask=False):
    """Pages in all three places (the pool, the warm pool encoded with ``codec``, extra pages),
    a random mask with unattended pages, per kv head when ``heads_mask``; and the oracle: every
    page decoded (``decode_pages``) and gathered, attended with the measuring path's formula."""
    from tieredkv.plugins.codec import CODECS, decode_pages, encode_pages
    from tieredkv.runtime.tiered.layer_step import _attend

    q, pool_k, pool_v, _ = case(b, kvh, g, d, p, m, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    spec = CODECS[codec]
    cw, x = b * m + 2, b * m + 1
    wk, wv = torch.randn(cw, kvh, p, d, generator=gen), torch.randn(cw, kvh, p, d, generator=gen)
    warm = encode_pages(wk, wv, spec)
    dk, dv = decode_pages(warm, spec, (kvh, p, d))
    ek, ev = torch.randn(x, kvh, p, d, generator=gen), torch.randn(x, kvh, p, d, generator=gen)
    kind = torch.randint(0, 3, (b, m), generator=gen)
    counts = torch.tensor([pool_k.shape[0], cw, x])
    slot = (torch.rand(b, m, generator=gen) * counts[kind]).long()
    pages_on = torch.rand(b, kvh if heads_mask else 1, m, generator=gen) < 0.75
    pages_on[..., 0] = True
    keys_on = torch.rand(b, 1, m * p, generator=gen) < 0.9
    allowed = pages_on.repeat_interleave(p, -1) & keys_on
    if b > 1:
        allowed[-1, -1] = False  # the last sequence's last kv head (every head: a mask per sequence) sees no key
    srcs = [(pool_k, pool_v), (dk, dv), (ek, ev)]
    k = torch.stack([torch.stack([srcs[kind[i, j]][0][slot[i, j]] for j in range(m)]) for i in range(b)])
    v = torch.stack([torch.stack([srcs[kind[i, j]][1][slot[i, j]] for j in range(m)]) for i in range(b)])
    k, v = (x.view(b, m, kvh, p, d).transpose(1, 2).reshape(b, kvh, m * p, d) for x in (k, v))
    out, probs = _attend(q, k, v, allowed.view(b, allowed.shape[1], 1, 1, m * p))
    mass = probs.view(b, kvh * g, 1, m, p).sum(-1).mean(1).sum(1)
    args = dict(warm=warm, warm_codec=warm_codec_args(spec, kvh, p, d), extra_k=ek, extra_v=ev)
    return (q, pool_k, pool_v, kind, slot, allowed), args, (out, mass)


TIERED_SHAPES = [(3, 3, 3, 64, 16, 7, "int4"), (2, 2, 4, 128, 16, 5, "int4-g16"), (2, 3, 2, 64, 16, 9, "int2"),
                 (2, 1, 8, 64, 4, 6, "int4"), (3, 2, 5, 48, 16, 4, "int4"), (1, 3, 3, 64, 16, 40, "int4")]


@needs_op
@pytest.mark.parametrize("heads_mask", [False, True], ids=["mask-per-sequence", "mask-per-kv-head"])
@pytest.mark.parametrize("shape", TIERED_SHAPES, ids=lambda s: "b{}-kvh{}-g{}-d{}-p{}-m{}-{}".format(*s))
def test_tiered_variant_matches_decode_gather_attend(shape, heads_mask):
    """Pool, warm (read encoded: in place for 4-bit codes in 16-token pages, decoded in the task
    otherwise) and extra pages mixed in every row; the output and the per-page mass as the
    measuring path's (warm pages decoded by ``decode_pages``, all gathered, ``_attend``)."""
    b, kvh, g, d, p, m, codec = shape
    args, kw, (want, want_mass) = tiered_case(b, kvh, g, d, p, m, codec, seed=b * m + d, heads_mask=heads_mask)
    got, mass = tiered_decode_attention(*args, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass, want_mass, rtol=1e-5, atol=1e-6)
    not_attended = ~args[5].view(b, -1, m, p).any(-1).any(1)
    assert torch.equal(mass[not_attended], torch.zeros_like(mass[not_attended]))
    if b > 1:  # no key seen: zeros out
        blind = got[-1, -g:] if heads_mask else got[-1]
        assert torch.equal(blind, torch.zeros_like(blind))


@needs_op
def test_tiered_variant_without_warm_pages_equals_the_paged_op():
    q, pool_k, pool_v, pages = case(4, 3, 3, 64, 16, 6, seed=5)
    allowed = torch.rand(4, 96, generator=torch.Generator().manual_seed(0)) < 0.8
    got, mass = tiered_decode_attention(q, pool_k, pool_v, torch.zeros_like(pages), pages, allowed.unsqueeze(1))
    assert torch.equal(got, pool_decode_attention(q, pool_k, pool_v, pages, allowed))
    torch.testing.assert_close(mass.sum(1), torch.ones(4))


@pytest.fixture
def one_thread():
    """One torch thread: a batch of four or more sequences then runs each sequence's kv heads as
    one task, read page by page (paged_attention.cpp's ``by_sequence``); one sequence alone runs a
    task per kv head."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@needs_op
@pytest.mark.parametrize("shape", [(5, 3, 3, 64, 16, 7), (4, 2, 4, 128, 16, 5), (6, 3, 5, 48, 5, 3),
                                   (4, 4, 2, 64, 3, 9)], ids=lambda s: "b{}-kvh{}-g{}-d{}-p{}-m{}".format(*s))
def test_heads_read_together_equal_heads_read_alone(shape, one_thread):
    """A batch's sequences read page by page across their kv heads give each sequence's result
    alone (a task per kv head) bit for bit, and the torch path's to rounding."""
    q, pool_k, pool_v, pages = case(*shape, seed=11)
    b, m, p = shape[0], shape[5], shape[4]
    allowed = torch.rand(b, m * p, generator=torch.Generator().manual_seed(4)) < 0.7
    allowed[:, 0] = True
    allowed[1] = False
    got = pool_decode_attention(q, pool_k, pool_v, pages, allowed)
    for i in range(b):
        alone = pool_decode_attention(q[i:i + 1], pool_k, pool_v, pages[i:i + 1], allowed[i:i + 1])
        assert torch.equal(got[i:i + 1], alone)
    torch.testing.assert_close(got, reference(q, pool_k, pool_v, pages, allowed), rtol=1e-5, atol=2e-6)


@needs_op
@pytest.mark.parametrize("heads_mask", [False, True], ids=["mask-per-sequence", "mask-per-kv-head"])
@pytest.mark.parametrize("shape", [(5, 3, 3, 64, 16, 7, "int4"), (4, 3, 2, 64, 16, 9, "int2"),
                                   (4, 2, 5, 48, 16, 4, "int4")],
                         ids=lambda s: "b{}-kvh{}-g{}-d{}-p{}-m{}-{}".format(*s))
def test_tiered_heads_read_together_equal_heads_read_alone(shape, heads_mask, one_thread):
    """The tiered variant (a task per kv head at any batch: grouping the heads was slower there)
    gives each sequence's result alone too, warm pages read in place (4-bit) or decoded (2-bit),
    and the per-page mass."""
    b, kvh, g, d, p, m, codec = shape
    args, kw, (want, want_mass) = tiered_case(b, kvh, g, d, p, m, codec, seed=7, heads_mask=heads_mask)
    got, mass = tiered_decode_attention(*args, **kw)
    q, pool_k, pool_v, kind, slot, allowed = args
    for i in range(b):
        one = (q[i:i + 1], pool_k, pool_v, kind[i:i + 1], slot[i:i + 1], allowed[i:i + 1])
        alone, alone_mass = tiered_decode_attention(*one, **kw)
        assert torch.equal(got[i:i + 1], alone) and torch.equal(mass[i:i + 1], alone_mass)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass, want_mass, rtol=1e-5, atol=1e-6)


@needs_op
def test_tiered_variant_refuses_bad_pages():
    (q, pool_k, pool_v, kind, slot, allowed), kw, _ = tiered_case(2, 3, 3, 64, 16, 4, "int4", seed=0)
    with pytest.raises(RuntimeError, match="outside its source"):
        tiered_decode_attention(q, pool_k, pool_v, kind, slot + 1000, allowed, **kw)
    with pytest.raises(RuntimeError, match="is not 0"):
        tiered_decode_attention(q, pool_k, pool_v, kind + 3, slot, allowed, **kw)
    with pytest.raises(RuntimeError, match="reach byte"):
        tiered_decode_attention(q, pool_k, pool_v, torch.ones_like(kind), slot.clamp(max=0), allowed,
                                **{**kw, "warm": kw["warm"][:, :1000].contiguous()})
    assert warm_codec_args(__import__("tieredkv.plugins.codec", fromlist=["CODECS"]).CODECS["fp8"], 3, 16, 64) is None


# (sequences, query heads, kv heads, head dim, listed pages, summary rows): awkward sizes
RELEVANCE_SHAPES = [(1, 1, 1, 5, 1, 3), (3, 6, 2, 7, 13, 40), (16, 9, 3, 64, 34, 200), (2, 4, 4, 128, 5, 9),
                    (5, 8, 1, 48, 17, 20)]


@needs_op
@pytest.mark.parametrize("shape", RELEVANCE_SHAPES, ids=lambda s: "b{}-h{}-kvh{}-d{}-m{}-r{}".format(*s))
def test_page_relevance_matches_importance_score(shape):
    """The selection's default ranking (relevance by share) computed from a layer's summaries read
    by record equals ImportanceScore with RELEVANCE_ONLY over the gathered summaries, including
    rows where no page competes, pages with no token and repeated records."""
    from tieredkv.models.cpu_attention import relevance_op
    from tieredkv.plugins.importance_score import RELEVANCE_ONLY, importance_score

    b, h, kvh, d, m, r = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(b, h, d, generator=gen) * 3
    x, y = torch.randn(r, kvh, d, generator=gen), torch.randn(r, kvh, d, generator=gen)
    kmin, kmax = torch.minimum(x, y), torch.maximum(x, y)
    recs = torch.randint(0, r, (b, m), generator=gen)
    tokens = torch.randint(0, 17, (b, m), generator=gen)
    mask = torch.rand(b, m, generator=gen) > 0.3
    if b > 1:
        mask[-1] = False  # a row with no competing page: all zeros
    got = relevance_op()(q, kmin, kmax, recs, tokens.float(), mask, d ** -0.5)
    zeros = torch.zeros(b, m)
    want = importance_score(q, kmin[recs], kmax[recs], tokens, zeros.long(), zeros, mask, torch.ones(4), RELEVANCE_ONLY)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[~mask], torch.zeros(int((~mask).sum())))


@needs_op
def test_page_relevance_refuses_bad_arguments():
    from tieredkv.models.cpu_attention import relevance_op

    op, q = relevance_op(), torch.randn(2, 4, 8)
    kmin = torch.zeros(5, 2, 8)
    ok = (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool))
    op(q, kmin, kmin, *ok, 0.5)
    with pytest.raises(RuntimeError, match="outside the summaries"):
        op(q, kmin, kmin, torch.full((2, 3), 5), *ok[1:], 0.5)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(torch.randn(2, 3, 8), kmin, kmin, *ok, 0.5)
    with pytest.raises(RuntimeError, match="recs, tokens and mask"):
        op(q, kmin, kmin, ok[0], torch.ones(2, 4), ok[2], 0.5)


@needs_op
@pytest.mark.parametrize("rows,m", [(1, 1), (3, 7), (16, 34), (48, 130), (5, 257)])
@pytest.mark.parametrize("scores", ["random", "ties", "special"])
def test_select_pages_op_equals_the_reference(rows, m, scores):
    """SelectPages as one op equals plugins/select_pages.py bit for bit: budgets below T0, between,
    covering every page and ATTEND_ALL; ties (broken by column), NaN and infinite scores; padding."""
    from tieredkv.models.cpu_attention import select_op
    from tieredkv.plugins.select_pages import ATTEND_ALL, select_pages

    gen = torch.Generator().manual_seed(rows * 1000 + m)
    score = torch.randn(rows, m, generator=gen)
    if scores == "ties":
        score = torch.randint(0, 3, (rows, m), generator=gen).float()
    elif scores == "special":
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
        pick = torch.rand(rows, m, generator=gen) < 0.4
        score[pick] = special[torch.randint(0, 5, (int(pick.sum()),), generator=gen)]
    valid = torch.rand(rows, m, generator=gen) < 0.85
    pinned = torch.rand(rows, m, generator=gen) < 0.2
    attend = torch.randint(0, m + 3, (rows,), generator=gen)
    attend[::4] = ATTEND_ALL
    got = select_op()(score, valid, pinned, attend)
    assert torch.equal(got, select_pages(score, valid, pinned, attend))


@needs_op
def test_select_pages_op_refuses_bad_arguments():
    from tieredkv.models.cpu_attention import select_op

    op, s = select_op(), torch.zeros(2, 3)
    b = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="valid and pinned"):
        op(s, b, torch.ones(2, 4, dtype=torch.bool), torch.ones(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="attend"):
        op(s, b, b, torch.ones(2))


def _awkward_pages(n, kvh, p, d, seed):
    """K, V [n, kvh, p, d] with the groups an encoder gets wrong: constant (scale 0), all zero with
    -0.0, tiny (bfloat16 scales near underflow), huge (zero points past float16's range), and values
    on a code's rounding boundary."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, kvh, p, d, generator=gen) * 3, torch.randn(n, kvh, p, d, generator=gen)
    k[0, 0, :, 0] = 1.25  # a constant channel
    k[0, -1, :, 1] = -0.0
    v[0, 0, 0, : d // 2] = torch.tensor([0.0, -0.0]).repeat(d // 4)
    if n > 1:
        k[1] *= 1e-30
        v[1, :, :1] *= 1e5
        k[1, 0, :, 2] = -1e5
    # a group whose codes fall on .5: lo = 0, hi = 15 -> scale 1, values at half steps
    v[-1, -1, -1, :16] = torch.arange(16) * 1.0
    v[-1, -1, -1, 1:15] += 0.5
    return k, v


@needs_op
@pytest.mark.parametrize("codec_name", ["int4", "int4-g16", "int2"])
@pytest.mark.parametrize("shape", [(1, 1, 16, 64), (3, 3, 16, 64), (5, 2, 8, 32), (2, 3, 7, 48), (2, 2, 8, 40)])
def test_encode_op_writes_the_reference_bytes(codec_name, shape):
    """The warm tier's CPU encoder (models/csrc/kv_codec.cpp, through ``encode_warm_pages``) writes
    plugins.codec.encode_pages' bytes, byte for byte, on awkward groups and shapes (a page size and a
    head dim off the kernels' fast paths, an odd page size; a head dim not a multiple of 16: the scalar loops)."""
    from tieredkv.models.cache import encode_warm_pages
    from tieredkv.models.cpu_attention import encode_op
    from tieredkv.plugins.codec import CODECS, encode_pages, page_bytes

    spec = CODECS[codec_name]
    n, kvh, p, d = shape
    if d % math.gcd(spec.group, d):
        pytest.skip("value groups must divide the head dim")
    k, v = _awkward_pages(n, kvh, p, d, seed=sum(shape))
    args = warm_codec_args(spec, kvh, p, d)
    assert args is not None
    got = encode_op()(k, v, args, page_bytes(spec, kvh, p, d))
    want = encode_pages(k, v, spec)
    assert got.dtype == torch.uint8 and torch.equal(got, want)
    assert torch.equal(encode_warm_pages(k, v, spec), want)
    k[0, 0, 0, 0] = float("nan")  # non-finite input: the reference (sanitize) takes it
    assert torch.equal(encode_warm_pages(k, v, spec), encode_pages(k, v, spec))


@needs_op
def test_encode_op_refuses_bad_arguments():
    from tieredkv.models.cpu_attention import encode_op
    from tieredkv.plugins.codec import CODECS, page_bytes

    k = v = torch.randn(2, 3, 16, 64)
    args, nb = warm_codec_args(CODECS["int4"], 3, 16, 64), page_bytes(CODECS["int4"], 3, 16, 64)
    op = encode_op()
    with pytest.raises(RuntimeError, match="float32"):
        op(k.double(), v.double(), args, nb)
    with pytest.raises(RuntimeError, match="shape"):
        op(k, v[:1], args, nb)
    with pytest.raises(RuntimeError, match="bits"):
        op(k, v, [3] + args[1:], nb)
    with pytest.raises(RuntimeError, match="inside"):
        op(k, v, args, nb // 2)


@needs_op
def test_layer_op_refuses_bad_arguments():
    """The fused decode layer (``tiered_decode_layer``) names what is wrong: a layer outside the step's
    tensors, record tensors of another shape, an exact column without its choice. (That it equals the
    stages it fuses: tests/runtime/tiered/test_warm.py.)"""
    from tieredkv.models.cpu_attention import layer_op

    L, B, M, P, D, H, KVH = 2, 2, 3, 4, 8, 4, 2
    kmin = torch.zeros(L, 5, KVH, D)
    pools = [torch.zeros(L, 6, KVH, P, D) for _ in range(4)]
    bm = lambda dtype=torch.bool: torch.zeros(B, M, dtype=dtype)  # noqa: E731
    lbm = lambda dtype=torch.bool: torch.zeros(L, B, M, dtype=dtype)  # noqa: E731
    rec = [lbm(), lbm(), lbm(torch.float32), lbm(torch.float32)]
    args = lambda layer, record, exact=(None, None): (  # noqa: E731
        torch.randn(B, H, D), layer, True, kmin, kmin, bm(torch.long), bm(torch.float32), bm(), bm(), bm(),
        torch.full((B,), 2), *pools, torch.zeros(0, 0, 0, dtype=torch.uint8), [0] * 8, lbm(torch.int8),
        lbm(torch.long), torch.zeros(B, M * P, dtype=torch.bool), exact[0], *record, exact[1], D ** -0.5)
    out = layer_op()(*args(1, rec))
    assert out.shape == (B, H, D) and torch.equal(out, torch.zeros(B, H, D))  # no page valid: zeros
    with pytest.raises(RuntimeError, match="layer 2 outside the step's tensors"):
        layer_op()(*args(2, rec))
    with pytest.raises(RuntimeError, match="record's tensors must be"):
        layer_op()(*args(0, [rec[0][:, :1], *rec[1:]]))
    with pytest.raises(RuntimeError, match="exact_choice and exact come together"):
        layer_op()(*args(0, rec, (lbm(), None)))


def test_every_extension_source_is_in_the_wheel():
    """The extension is built from its sources where the package is installed: every file of
    models/csrc it compiles or includes is package data (a header left out breaks the build in an
    installed wheel, which then falls back to the torch paths)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from tieredkv.models.cpu_attention import CSRC, SOURCES

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "tieredkv.models.csrc"]
    needed = {p.name for p in SOURCES}
    for src in SOURCES:  # the local headers each source includes
        needed |= {line.split('"')[1] for line in src.read_text().splitlines() if line.startswith('#include "')}
    assert needed and all((CSRC / name).exists() for name in needed)
    missing = [name for name in sorted(needed) if not any(fnmatch.fnmatch(name, g) for g in globs)]
    assert not missing, f"models/csrc files not in the wheel's package data: {missing}"
