"""Perplexity and passkey harness: protocol arithmetic, teacher forcing, prompt synthesis."""

import math

import pytest
import torch

from helpers import logits_of, tiny_model, write_gguf
from tieredkv.errors import ConfigError, DataFileError
from tieredkv.models.cache import ContiguousKVCache
from tieredkv.models.loading import load_checkpoint
from tieredkv.runtime.eval.data import load_text
from tieredkv.runtime.eval.harness import CacheMethod
from tieredkv.runtime.eval.passkey import INSTRUCTION, NEEDLE, build_prompt, depths, passkey, run_trial, trial_prompts
from tieredkv.runtime.eval.perplexity import perplexity
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_checkpoint(write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", tiny_model(seed=31)))


def method(model, chunk=256, name="full"):
    spec = model.kv_spec()
    return CacheMethod(model, lambda total: PagedKVCache(spec, PagedCacheConfig(page_size=8)), name=name,
                       prefill_chunk=32, teacher_forcing_chunk=chunk)


def test_plain_perplexity_equals_direct_computation(tiny):
    ids = torch.randint(0, 512, (3 * 64 + 10,), generator=torch.Generator().manual_seed(0)).tolist()
    res = perplexity(method(tiny.model), ids, window=64, progress=False)
    nll = []
    for w in range(3):
        t = torch.tensor(ids[w * 64 : (w + 1) * 64])
        logits = logits_of(tiny.model, t)
        nll.append(torch.nn.functional.cross_entropy(logits[:-1].double(), t[1:], reduction="sum").item())
    assert res.windows == 3 and res.tokens_scored == 3 * 63
    assert math.isclose(res.perplexity, math.exp(sum(nll) / (3 * 63)), rel_tol=1e-6)


def test_budget_protocol_scores_the_last_quarter(tiny):
    ids = list(range(100, 100 + 128))
    res = perplexity(method(tiny.model), ids, window=64, context_fraction=0.75, max_windows=2, progress=False)
    assert res.tokens_scored == 2 * 16 and res.windows == 2


def test_teacher_forcing_chunks_equal_token_by_token(tiny):
    ids = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = method(tiny.model, chunk=1).open(ids[:50]).logprobs(ids[50:])
    for chunk in (7, 64):
        got = method(tiny.model, chunk=chunk).open(ids[:50]).logprobs(ids[50:])
        assert torch.allclose(got, ref, atol=1e-5)


def test_session_calls_leave_the_cache_as_found(tiny):
    ids = list(range(60))
    s = method(tiny.model).open(ids[:40])
    a = s.logprobs(ids[40:])
    g1 = s.greedy(ids[40:45], 6)
    b = s.logprobs(ids[40:])
    g2 = s.greedy(ids[40:45], 6)
    assert torch.equal(a, b) and g1 == g2 and len(g1) <= 6
    assert s.cache.length(s.sid) == 40
    s.close()
    assert s.cache.pages_in_use() == 0


def test_greedy_matches_generate(tiny):
    from tieredkv.runtime.generate import generate
    from tieredkv.runtime.sampling import SamplingParams

    ids = list(range(30, 70))
    g = method(tiny.model).open(ids[:30]).greedy(ids[30:], 8)
    out = generate(tiny.model, ContiguousKVCache(tiny.model.kv_spec()), [ids], SamplingParams(max_new_tokens=8))
    assert g == out[0].token_ids


def test_passkey_prompt_is_exact_length_with_needle_at_depth(tiny):
    tok = tiny.tokenizer
    hay = tok.encode("the sun rose. the cat sat on the mat. " * 200)
    for depth in depths(5):
        p = build_prompt(tok, hay, context=700, depth=depth, key="12345", offset=3)
        assert len(p.context) + len(p.question) == 700
        assert "The pass key is 12345" in tok.decode(p.context)
        prefix = len(tok.encode(INSTRUCTION))
        filler = len(p.context) - prefix - len(tok.encode(NEEDLE.format(key="12345")))
        pos = p.needle_at - prefix
        assert depth * filler - 1 <= pos <= depth * filler + 64  # at depth, or the next sentence end
        assert tok.decode(p.answer).strip() == "12345"
    with pytest.raises(ConfigError, match="too short"):
        build_prompt(tok, hay, context=20, depth=0.5, key="12345", offset=0)


def test_passkey_runs_and_scores(tiny):
    tok = tiny.tokenizer
    hay = tok.encode("the sun rose. the cat sat on the mat. " * 100)
    res = passkey(method(tiny.model), tok, hay, context=300, trials=3, seed=1, progress=False)
    assert res.trials == 3 and len(res.results) == 3
    assert [r.depth for r in res.results] == [0.0, 0.5, 1.0]
    assert all(r.logprob < 0 for r in res.results)
    assert res.accuracy == sum(r.correct for r in res.results) / 3
    # a trial re-run alone (tools/eval/passkey_trial.py) is the same trial, scored the same way
    prompts = list(trial_prompts(tok, hay, context=300, trials=3, seed=1))
    assert [p.key for p in prompts] == [r.key for r in res.results]
    again = run_trial(method(tiny.model), tok, prompts[1], context=300)
    assert again == res.results[1]


def test_missing_text_file(tmp_path):
    with pytest.raises(DataFileError, match="nope.txt"):
        load_text(tmp_path / "nope.txt")


@pytest.mark.slow
def test_smollm2_passkey_and_ppl(smollm, pg_ids):
    assert 150_000 < len(pg_ids) < 160_000
    m = method(smollm.model)
    m.prefill_chunk = 512
    res = passkey(m, smollm.tokenizer, pg_ids, context=1024, trials=2, seed=0, progress=False)
    assert res.accuracy == 1.0 and res.mean_logprob > -3.0
    ppl = perplexity(m, pg_ids, window=512, max_windows=1, progress=False)
    assert 10 < ppl.perplexity < 40
