"""The equal-bytes peers (tools/eval/quantized_cache.py): transformers' QuantizedCache with
HQQ at int8 / int4 / int2, alone and with a kvpress press sized to a budget, on a tiny random
Llama — real quantization, real presses, bytes counted from the cache's tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("kvpress")
pytest.importorskip("hqq")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "eval"))

import quantized_cache as Q  # noqa: E402
from helpers import tiny_model  # noqa: E402
from tieredkv.models import Llama, preset  # noqa: E402
from tieredkv.runtime.eval.harness import CacheMethod  # noqa: E402
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache  # noqa: E402

from tieredkv.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.eval

CTX, CONT = 200, 40
GROUP = 16  # the tiny model's head dim: one group per token and kv head with axis 1


@pytest.fixture(scope="module")
def model() -> Llama:
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def tokens() -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, preset("tiny").vocab_size, (CTX + CONT,), generator=g).tolist()
    return ids[:CTX], ids[CTX:]


@pytest.fixture(scope="module")
def full_logprobs(model, tokens):
    ctx, cont = tokens
    method = CacheMethod(model, lambda _t=None: PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=16)))
    s = method.open(ctx)
    try:
        return s.logprobs(cont)
    finally:
        s.close()


def run(method, tokens):
    ctx, cont = tokens
    s = method.open(ctx, total_tokens=CTX + CONT)
    try:
        first, again = s.logprobs(cont), s.logprobs(cont)
        answer, answer_again = s.greedy(cont[:5], 6), s.greedy(cont[:5], 6)
    finally:
        s.close()
    assert torch.equal(first, again) and answer == answer_again  # every call leaves the session as it found it
    return first


def test_nominal_bytes_count_codes_scales_and_zero_points():
    assert Q.nominal_fraction(8, 64) == pytest.approx((1 + 4 / 64) / 2) == pytest.approx(0.53125)
    assert Q.nominal_fraction(4, 64) == pytest.approx(0.28125)
    assert Q.nominal_fraction(2, 64) == pytest.approx(0.15625)


@pytest.mark.parametrize("axis", [1, 0])
def test_the_error_grows_as_the_bits_fall(model, tokens, full_logprobs, axis):
    """A quantized full cache is close to the full cache at int8 and moves further at int4 and
    int2 (the outside quantizer really runs); no press: every context token kept."""
    err = {}
    for bits in Q.QUANT_BITS:
        m = Q.QuantizedCacheMethod(model, bits=bits, budget=Q.nominal_fraction(bits, GROUP), group=GROUP,
                                   residual=16, axis=axis)
        err[bits] = (run(m, tokens) - full_logprobs).abs().mean().item()
        assert m.stats()["kept_context_tokens"] == [CTX] and m.describe()["quantizer"] == "hqq"
    assert 0 < err[8] < err[4] < err[2], err
    assert err[8] < 0.02


def test_the_measured_bytes_are_the_packed_codes_scales_zero_points_and_residual(model, tokens):
    """After the prefill every context token is quantized (codes at bits / 8 bytes a value, an
    fp16 scale and zero per group); fed tokens wait in the residual at 2 bytes a value."""
    spec = model.kv_spec()
    values = spec.num_kv_heads * spec.head_dim  # per token, layer and K or V
    for axis in (0, 1):
        m = Q.QuantizedCacheMethod(model, bits=4, budget=0.3, group=GROUP, residual=16, axis=axis)
        s = m.open(tokens[0], total_tokens=CTX + CONT)
        per_token = values * (4 / 8 + 4 / GROUP)
        assert Q.cache_bytes(s.cache) == 2 * spec.num_layers * CTX * per_token
        s._feed(tokens[1][:3], start_pos=CTX, chunk=1)
        assert Q.cache_bytes(s.cache) == 2 * spec.num_layers * (CTX * per_token + 3 * values * 2)
        s.close()


@pytest.mark.parametrize("budget", [0.25, 0.125])
@pytest.mark.parametrize("bits", [4, 2])
def test_a_press_on_the_quantized_cache_holds_the_budget(model, tokens, full_logprobs, budget, bits):
    """With a press the peer's measured peak stays within the budget of the full cache's fp16
    bytes for the whole session (the continuation and the residual included), and uses most
    of it; the kept context is what kept_context says."""
    m = Q.QuantizedCacheMethod(model, bits=bits, budget=budget, press_name="snapkv", group=GROUP, residual=16)
    run(m, tokens)
    st = m.stats()
    keep = Q.kept_context(budget, context=CTX, total=CTX + CONT, bits=bits, group=GROUP, residual=16)
    assert st["kept_context_tokens"] == [keep] and st["kept_tokens"] <= keep < CTX
    assert budget - 0.03 < st["kv_fp16_fraction_peak"] <= budget
    assert m.describe()["press"] == "SnapKVPress"


def test_no_press_runs_where_the_quantized_cache_fits(model, tokens):
    m = Q.QuantizedCacheMethod(model, bits=2, budget=0.5, press_name="snapkv", group=GROUP, residual=16)
    run(m, tokens)
    assert m.stats()["kept_context_tokens"] == [CTX] and m.stats()["kv_fp16_fraction_peak"] < 0.5


def test_kept_context_bounds():
    kw = dict(context=1536, total=2048, bits=4, group=64, residual=128)
    assert Q.kept_context(1.0, **kw) == 1536
    assert Q.kept_context(0.25, **kw) == 983  # (512 - 0.28125 * 512 - 0.71875 * 127) / 0.28125
    assert Q.kept_context(0.01, **kw) == 1  # cannot fit: keeps one token, the measured peak says so


@pytest.mark.parametrize("bad,match", [
    ("int3", "expected int8, int4 or int2"), ("fp8", "expected int8"), ("int4,press=nope", "unknown press"),
    ("int4,group=x", "group must be an integer"), ("int4,axis=2", "axis 0 or 1"), ("int4,speed=1", "is not one of"),
    ("int4,press=snapkv,budget=0.2", "budget must be a percentage"), ("int4,budget=25%", "pins the budget of a press"),
])
def test_bad_specs_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        Q.parse_settings(bad)
    assert Q.parse_settings("int2,press=snapkv,residual=32")["name"] == "quantized-int2+snapkv"
    assert Q.parse_settings("int2,press=snapkv,budget=12.5%")["budget"] == 0.125


@pytest.mark.slow
def test_smollm2_quantized_cache_perplexity_orders_by_bits(smollm, pg_ids):
    """The real model, one 1k window of the essays (its last quarter scored): the int8 cache is
    within 0.5 % of the full cache's perplexity, int4 within 5 %, int2 worse than int4; a press
    on the int4 cache at 25 % of the fp16 bytes holds it."""
    from tieredkv.runtime.eval.perplexity import perplexity

    ids = pg_ids[:1024]
    full = CacheMethod(smollm.model, lambda _t=None: PagedKVCache(smollm.model.kv_spec()))
    ref = perplexity(full, ids, window=1024, context_fraction=0.75, progress=False).perplexity
    ppl = {}
    for bits in Q.QUANT_BITS:
        m = Q.QuantizedCacheMethod(smollm.model, bits=bits, budget=Q.nominal_fraction(bits, 64))
        ppl[bits] = perplexity(m, ids, window=1024, context_fraction=0.75, progress=False).perplexity
    assert abs(ppl[8] / ref - 1) < 0.005 and abs(ppl[4] / ref - 1) < 0.05 and ppl[2] > ppl[4], (ref, ppl)
    pressed = Q.QuantizedCacheMethod(smollm.model, bits=4, budget=0.25, press_name="snapkv")
    perplexity(pressed, ids, window=1024, context_fraction=0.75, progress=False)
    assert pressed.stats()["kv_fp16_fraction_peak"] <= 0.25
