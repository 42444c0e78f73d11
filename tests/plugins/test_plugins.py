"""The op references of tieredkv.plugins against naive computations, on awkward sizes."""

import math

import pytest
import torch

from tieredkv.plugins import (
    cosine_position_init,
    distance_bucket,
    importance_score,
    merge_attention,
    quest_upper_bound,
    relevance,
    tiered_attention,
)


def naive(q, keys, values, positions, past):
    """q [H, T, D]; keys/values [KVH, S, D]; positions [S]; causal by position."""
    h, t, d = q.shape
    g = h // keys.shape[0]
    k, v = keys.repeat_interleave(g, 0), values.repeat_interleave(g, 0)
    logits = q @ k.transpose(1, 2) / math.sqrt(d)
    allowed = positions.view(1, -1) <= (past + torch.arange(t)).view(-1, 1)
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, -1) @ v, torch.logsumexp(logits, -1)


@pytest.mark.parametrize("h,kvh,d,p,t", [(4, 2, 8, 4, 1), (6, 3, 12, 5, 3), (9, 3, 64, 16, 1), (2, 1, 6, 3, 7)])
def test_tiered_attention_equals_naive(h, kvh, d, p, t):
    gen = torch.Generator().manual_seed(h * 100 + d)
    n_pages, pool = 7, 11
    seq_len = n_pages * p - 2  # last page partly filled
    past = seq_len - t
    k_pool = torch.randn(pool, kvh, p, d, generator=gen)
    v_pool = torch.randn(pool, kvh, p, d, generator=gen)
    table = torch.randperm(pool, generator=gen)[:n_pages]
    mask = torch.tensor([True, False, True, True, False, True, True])  # pages 1 and 4 masked out
    q = torch.randn(1, h, t, d, generator=gen)
    out, lse, probs = tiered_attention(q, k_pool, v_pool, table[None], mask[None], torch.arange(n_pages)[None],
                                       torch.tensor([seq_len]), torch.tensor([past]))
    keep = mask.nonzero().flatten()
    keys = k_pool[table[keep]].permute(1, 0, 2, 3).reshape(kvh, -1, d)
    vals = v_pool[table[keep]].permute(1, 0, 2, 3).reshape(kvh, -1, d)
    pos = (keep.view(-1, 1) * p + torch.arange(p)).flatten()
    valid = pos < seq_len
    ref_out, ref_lse = naive(q[0], keys[:, valid], vals[:, valid], pos[valid], past)
    assert torch.allclose(out[0], ref_out, atol=1e-5)
    assert torch.allclose(lse[0], ref_lse, atol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(1, h, t), atol=1e-5)
    assert (probs[..., ~mask] == 0).all()


def test_merge_of_blocks_equals_one_call():
    gen = torch.Generator().manual_seed(0)
    h, kvh, d, p, n = 6, 2, 8, 4, 9
    k_pool, v_pool = torch.randn(n, kvh, p, d, generator=gen), torch.randn(n, kvh, p, d, generator=gen)
    q = torch.randn(1, h, 2, d, generator=gen)
    args = (torch.tensor([n * p]), torch.tensor([n * p - 2]))
    full_out, full_lse, full_probs = tiered_attention(q, k_pool, v_pool, torch.arange(n)[None],
                                                      torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None], *args)
    outs, lses, probs = [], [], []
    for block in torch.arange(n).split(4):
        o, l, pp = tiered_attention(q, k_pool, v_pool, block[None], torch.ones(1, len(block), dtype=torch.bool),
                                    block[None], *args)
        outs.append(o), lses.append(l), probs.append(pp)
    out, lse, weights = merge_attention(outs, lses)
    assert torch.allclose(out, full_out, atol=1e-5) and torch.allclose(lse, full_lse, atol=1e-5)
    merged = torch.cat([pp * w.unsqueeze(-1) for pp, w in zip(probs, weights)], dim=-1)
    assert torch.allclose(merged, full_probs, atol=1e-5)


def test_nothing_visible_gives_zeros():
    q = torch.randn(1, 2, 1, 4)
    pool = torch.randn(3, 1, 2, 4)
    out, lse, probs = tiered_attention(q, pool, pool, torch.tensor([[0, 1]]), torch.tensor([[False, False]]),
                                       torch.tensor([[0, 1]]), torch.tensor([4]), torch.tensor([3]))
    assert (out == 0).all() and torch.isinf(lse).all() and (probs == 0).all()


def test_quest_bound_is_an_upper_bound():
    gen = torch.Generator().manual_seed(1)
    h, kvh, d, m, p = 6, 3, 16, 5, 8
    keys = torch.randn(m, p, kvh, d, generator=gen)
    q = torch.randn(1, h, d, generator=gen)
    ub = quest_upper_bound(q, keys.amin(1)[None], keys.amax(1)[None])[0]  # [H, M]
    g = h // kvh
    exact = torch.einsum("hd,mphd->hmp", q[0], keys.repeat_interleave(g, 2)).amax(-1)
    assert (ub >= exact - 1e-5).all()
    # tight for single-token pages
    one = keys[:, :1]
    ub1 = quest_upper_bound(q, one.amin(1)[None], one.amax(1)[None])[0]
    assert torch.allclose(ub1, torch.einsum("hd,mhd->hm", q[0], one[:, 0].repeat_interleave(g, 1)), atol=1e-5)


def test_relevance_and_score_ranges():
    gen = torch.Generator().manual_seed(2)
    kmin = torch.randn(2, 10, 2, 8, generator=gen)
    kmax = kmin + torch.rand(2, 10, 2, 8, generator=gen)
    q = torch.randn(2, 4, 8, generator=gen)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    tokens = torch.full((2, 10), 16)
    rel = relevance(q, kmin, kmax, tokens, mask)
    assert torch.allclose(rel.amax(-1), torch.ones(2)) and (rel[1, 7:] == 0).all() and (rel >= 0).all()
    table = cosine_position_init(16)
    score = importance_score(q, kmin, kmax, tokens, torch.arange(10).expand(2, -1) * 100,
                             torch.rand(2, 10, generator=gen), mask, table, (0.4, 0.3, 0.3))
    assert (score >= 0).all() and (score <= 1).all() and (score[1, 7:] == 0).all()


@pytest.mark.parametrize("seed", range(6))
def test_head_rank_selection_is_the_union_of_every_heads_top_pages(seed):
    """Top k by head_rank_relevance = the union of each head's top j pages (by its bound)
    for the largest j whose union fits in k, topped up by the next ranks; masked pages 0."""
    gen = torch.Generator().manual_seed(seed)
    B, H, KVH, D, M = 2, 6, 3, 8, 23
    kmin = torch.randn(B, M, KVH, D, generator=gen)
    kmax = kmin + torch.rand(B, M, KVH, D, generator=gen)
    q = torch.randn(B, H, D, generator=gen)
    tokens = torch.randint(1, 17, (B, M), generator=gen)
    mask = torch.rand(B, M, generator=gen) > 0.2
    score = relevance(q, kmin, kmax, tokens, mask, aggregate="head-rank")
    assert (score[~mask] == 0).all() and (score[mask] > 0).all() and (score <= 1).all()
    ub = quest_upper_bound(q, kmin, kmax) / math.sqrt(D) + torch.log(tokens.float()).unsqueeze(1)
    for b in range(B):
        kept = mask[b].nonzero().flatten().tolist()
        per_head = [sorted(kept, key=lambda m: (-float(ub[b, h, m]), m)) for h in range(H)]
        assert all(float(score[b, ranked[0]]) == 1.0 for ranked in per_head)  # every head's best page
        for k in (1, 4, 9, len(kept)):
            top = set(torch.topk(score[b], k).indices.tolist())
            j = max(j for j in range(len(kept) + 1) if len({m for r in per_head for m in r[:j]}) <= k)
            assert {m for r in per_head for m in r[:j]} <= top


def test_head_rank_with_one_head_orders_by_the_bound():
    gen = torch.Generator().manual_seed(9)
    kmin = torch.randn(1, 12, 1, 4, generator=gen)
    kmax = kmin + torch.rand(1, 12, 1, 4, generator=gen)
    q = torch.randn(1, 1, 4, generator=gen)
    tokens = torch.full((1, 12), 4)
    mask = torch.ones(1, 12, dtype=torch.bool)
    by_rank = torch.argsort(relevance(q, kmin, kmax, tokens, mask, aggregate="head-rank")[0], descending=True)
    assert torch.equal(by_rank, torch.argsort(relevance(q, kmin, kmax, tokens, mask)[0], descending=True))


def test_distance_buckets():
    d = torch.tensor([0, 15, 16, 31, 32, 64, 10**9])
    b = distance_bucket(d, 16)
    assert b.tolist() == [0, 0, 1, 1, 2, 3, 15]
    t = cosine_position_init(16)
    assert t[0] == 1 and abs(float(t[-1])) < 1e-6 and (t[1:] <= t[:-1]).all()
