"""The batched layer step: its attention equals the TieredAttention reference on awkward inputs,
a step with nothing to decide does no tiering work, and one step over many sequences gives
each sequence what it gets alone."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import SMALL_KV as SMALL, tiny_model
from tieredkv.models.llama import decode_one_token, prefill
from tieredkv.plugins.tiered_attention import PAD_PAGE_INDEX, attention_over_pages
from tieredkv.runtime.tiered import layer_step
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.layer_step import attend_pages

MODEL = tiny_model(seed=5)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), kvh=st.sampled_from([1, 2]), g=st.sampled_from([1, 3]), t=st.sampled_from([1, 4]),
       m=st.integers(1, 6), p=st.sampled_from([1, 4, 5]), per_head=st.booleans(), seed=st.integers(0, 10**6))
def test_attend_pages_equals_the_reference(b, kvh, g, t, m, p, per_head, seed):
    """Output and per-page mass equal ``attention_over_pages`` (out; page_probs mean over heads,
    summed over queries) for random pools, page orders, masks (rows with nothing kept), padding
    columns, partial last pages and causal prefixes."""
    gen = torch.Generator().manual_seed(seed)
    d = 8
    q = torch.randn(b, kvh * g, t, d, generator=gen)
    k, v = torch.randn(b, m, kvh, p, d, generator=gen), torch.randn(b, m, kvh, p, d, generator=gen)
    index = torch.stack([torch.randperm(m + 2, generator=gen)[:m] for _ in range(b)])
    index[torch.rand(b, m, generator=gen) < 0.2] = PAD_PAGE_INDEX
    seq_len = torch.randint(1, (m + 2) * p + 1, (b,), generator=gen)
    past = (seq_len - t).clamp(min=0)
    shape = (b, kvh, m) if per_head else (b, m)
    mask = torch.rand(shape, generator=gen) < 0.7
    want, _, probs = attention_over_pages(q, k, v, mask, index, seq_len, past, with_lse=False)
    got, mass = attend_pages(q, k.transpose(1, 2), v.transpose(1, 2), mask, index, seq_len, past)  # head-major
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(mass, probs.mean(1).sum(1), atol=1e-5)


def _decode(cache, steps=6, prompt=70):
    tokens = torch.randint(0, 512, (prompt + steps,), generator=torch.Generator().manual_seed(1))
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, tokens[:prompt], chunk_size=32)
    logits = []
    for i in range(steps):
        logits.append(decode_one_token(MODEL, cache, [sid], tokens[prompt + i : prompt + i + 1],
                                       torch.tensor([prompt + i])))
    return torch.cat(logits)


def test_nothing_to_decide_costs_no_tiering_work(monkeypatch):
    """A device budget that holds the work and no attention budget: no layer scores, selects or
    reads a page through the manager's reader — a gather by slot and an attention, as the paged
    cache does. With an attention budget that binds, the same step scores and selects."""
    calls = {"rank": 0, "read": 0}
    rank = layer_step.LayerStep.rank

    def counting_rank(self, layer, q):
        calls["rank"] += 1
        return rank(self, layer, q)

    monkeypatch.setattr(layer_step.LayerStep, "rank", counting_rank)
    fused = layer_step.LayerStep.attend_fused

    def counting_fused(self, layer, q):  # a layer in one call ranks inside it
        out = fused(self, layer, q)
        calls["rank"] += out is not None and self.scores(layer)
        return out

    monkeypatch.setattr(layer_step.LayerStep, "attend_fused", counting_fused)
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget="10MiB", **SMALL), full_tokens=80)
    reader = cache.mgr.read_pages

    def counting_read(*a, **kw):
        calls["read"] += 1
        return reader(*a, **kw)

    cache.mgr.read_pages = counting_read
    _decode(cache)
    assert calls == {"rank": 0, "read": 0} and cache.metrics.evicted_pages == 0
    bound = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(attention_budget=40, **SMALL), full_tokens=80)
    _decode(bound)
    assert calls["rank"] == 6 * MODEL.config.num_layers


@pytest.mark.parametrize("budget", [None, "40%"])
def test_a_step_of_many_sequences_gives_each_what_it_gets_alone(budget):
    """Sequences of different lengths decoded in one step (padded rows, per-row selection under a
    binding attention budget, exact misses read from the host) get the logits each gets alone."""
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (90, 33, 61)]
    kw = {} if budget is None else dict(device_budget="60%", attention_budget=budget)

    def run(group):
        cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**kw, **SMALL), full_tokens=100,
                              num_sequences=len(group))
        sids = [cache.add_sequence() for _ in group]
        last = [int(prefill(MODEL, cache, s, prompts[i], chunk_size=40).argmax()) for s, i in zip(sids, group)]
        out = []
        for step in range(5):
            pos = torch.tensor([len(prompts[i]) + step for i in group])
            logits = decode_one_token(MODEL, cache, sids, torch.tensor(last), pos)
            last = logits.argmax(-1).tolist()
            out.append(logits)
        cache.mgr.check_invariants()
        return torch.stack(out, 1), cache.metrics

    together, m = run([0, 1, 2])
    for row, i in enumerate((0, 1, 2)):
        alone, _ = run([i])
        assert (together[row] - alone[0]).abs().max().item() <= 1e-5
    if budget is not None:
        assert m.streamed_pages > 0 and m.evicted_pages > 0  # the budgets bind


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), kvh=st.sampled_from([1, 3]), g=st.integers(1, 3), t=st.integers(1, 70),
       extra=st.integers(0, 90), block=st.integers(1, 4000), per_head=st.booleans(), seed=st.integers(0, 99))
def test_attend_out_in_query_blocks_equals_attend(b, kvh, g, t, extra, block, per_head, seed):
    """A prefill chunk's attention is computed over blocks of queries (their logits fit
    ATTEND_BLOCK): the output equals the one-piece formula's to float32 rounding, whatever the
    block (the BLAS picks its kernel by the row count: one-row blocks and a single head group
    may sum in another order), and bit for bit at SmolLM2's grouping (3 kv heads of 3 query
    heads, head dim 64) below."""
    gen = torch.Generator().manual_seed(seed)
    s, d = t + extra, 8
    q, k, v = (torch.randn(b, kvh * g, t, d, generator=gen), torch.randn(b, kvh, s, d, generator=gen),
               torch.randn(b, kvh, s, d, generator=gen))
    allowed = torch.rand(b, kvh if per_head else 1, 1, t, s, generator=gen) < 0.7
    allowed[..., 0] = False  # and some queries that see no key at all
    saved, layer_step.ATTEND_BLOCK = layer_step.ATTEND_BLOCK, block
    try:
        torch.testing.assert_close(layer_step.attend_out(q, k, v, allowed), layer_step._attend(q, k, v, allowed)[0],
                                   rtol=1e-5, atol=1e-6)
    finally:
        layer_step.ATTEND_BLOCK = saved


@pytest.mark.parametrize("t, s", [(512, 4096), (512, 700), (37, 2000)])
def test_attend_out_equals_attend_bitwise_at_the_models_grouping(t, s):
    gen = torch.Generator().manual_seed(t + s)
    q, k, v = torch.randn(1, 9, t, 64, generator=gen), torch.randn(1, 3, s, 64, generator=gen), torch.randn(
        1, 3, s, 64, generator=gen)
    allowed = (torch.arange(s).view(1, s) <= s - t + torch.arange(t).view(t, 1)).view(1, 1, 1, t, s)
    saved, layer_step.ATTEND_BLOCK = layer_step.ATTEND_BLOCK, 9 * s * 20  # blocks of 20 queries and a tail
    try:
        assert torch.equal(layer_step.attend_out(q, k, v, allowed), layer_step._attend(q, k, v, allowed)[0])
    finally:
        layer_step.ATTEND_BLOCK = saved


def test_a_step_that_measures_nothing_folds_the_summaries_of_every_layer_at_its_end(monkeypatch):
    """A decode step whose budgets hold the work writes its keys' summaries (key min / max and
    saliency) once, for every layer at the step's end: the page table ends where the
    layer-by-layer writes leave it (min / max exact, saliency to float32 rounding), and the
    scorer's batched saliency equals its per-layer one for any subset of layers."""
    def run(per_layer: bool):
        cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget="10MiB", **SMALL), full_tokens=80)
        if per_layer:
            init = layer_step.LayerStep.__init__

            def no_deferral(self, *a, **kw):
                init(self, *a, **kw)
                self.new_keys = None

            monkeypatch.setattr(layer_step.LayerStep, "__init__", no_deferral)
        deferred = []
        fold = cache.mgr.fold_summaries
        cache.mgr.fold_summaries = lambda *a, **kw: (deferred.append(1), fold(*a, **kw))
        logits = _decode(cache)
        monkeypatch.undo()
        return cache.mgr.table, logits, len(deferred)

    (batched, out, folds), (layered, ref, none) = run(False), run(True)
    assert folds == 6 and none == 0
    assert torch.equal(out, ref)
    assert torch.equal(batched.kmin, layered.kmin) and torch.equal(batched.kmax, layered.kmax)
    torch.testing.assert_close(batched.sal_sum, layered.sal_sum, rtol=1e-6, atol=1e-6)
    assert not torch.equal(layered.sal_sum, torch.zeros_like(layered.sal_sum))

    scorer = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL)).scorer
    with torch.no_grad():  # a trained-looking scorer: the output layer is not zero
        scorer.w2.normal_(generator=torch.Generator().manual_seed(3))
        scorer.b2.normal_(generator=torch.Generator().manual_seed(4))
    L, gen = scorer.num_layers, torch.Generator().manual_seed(5)
    k = torch.randn(L, 7, MODEL.config.num_kv_heads, scorer.head_dim, generator=gen)
    want = torch.stack([scorer.token_saliency(i, k[i]) for i in range(L)])
    torch.testing.assert_close(scorer.token_saliency_all(k).detach(), want.detach(), rtol=1e-6, atol=1e-6)
    some = torch.tensor([L - 1, 0])
    torch.testing.assert_close(scorer.token_saliency_all(k[some], some).detach(), want[some].detach(),
                               rtol=1e-6, atol=1e-6)
