"""kvpress presses as EvalMethods (tools/eval/kvpress_methods.py) and the side-by-side
runner's report writing (tools/eval/kvpress_compare.py), on a tiny random Llama."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("kvpress")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "eval"))

import kvpress_compare as kc  # noqa: E402
from kvpress_methods import (  # noqa: E402
    KVPressMethod,
    attn_implementation_for,
    make_press,
    press_names,
    press_registry,
)

from tieredkv.models import ContiguousKVCache, Llama, init_random_weights, preset, prefill  # noqa: E402
from tieredkv.runtime.eval.harness import CacheMethod, token_logprobs  # noqa: E402
from tieredkv.runtime.eval.perplexity import perplexity  # noqa: E402
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache  # noqa: E402

pytestmark = pytest.mark.eval

CTX, CONT = 160, 24


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return init_random_weights(Llama(preset("tiny")), seed=0)


@pytest.fixture(scope="module")
def tokens() -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, preset("tiny").vocab_size, (CTX + CONT,), generator=g).tolist()
    return ids[:CTX], ids[CTX:]


@pytest.fixture(scope="module")
def full_reference(model, tokens):
    ctx, cont = tokens
    spec = model.kv_spec()
    method = CacheMethod(model, lambda _total_tokens=None: PagedKVCache(spec, PagedCacheConfig(page_size=16)), teacher_forcing_chunk=7)
    s = method.open(ctx)
    try:
        return s.logprobs(cont), s.greedy(cont[:5], 8)
    finally:
        s.close()


def test_registry_has_the_presses():
    reg = press_registry(0.5)
    for cls in ("StreamingLLMPress", "SnapKVPress", "TOVAPress", "ObservedAttentionPress", "KnormPress",
                "ExpectedAttentionPress"):
        assert cls in {type(p).__name__ for p in reg.values()}
    assert all(p.compression_ratio == 0.5 for p in reg.values())
    assert attn_implementation_for(reg["observed_attention"]) == "eager"
    assert attn_implementation_for(reg["knorm"]) == "sdpa"


@pytest.mark.parametrize("name", press_names())
def test_no_compression_matches_full_cache(model, tokens, full_reference, name):
    ctx, cont = tokens
    ref_lp, ref_greedy = full_reference
    method = KVPressMethod.from_registry(model, name, 1.0, teacher_forcing_chunk=5)
    s = method.open(ctx)
    assert s.kept_tokens == CTX
    lp = s.logprobs(cont)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    assert s.greedy(cont[:5], 8) == ref_greedy
    # the session is left as it was found: asking again gives the same answer
    torch.testing.assert_close(s.logprobs(cont), lp, atol=0, rtol=0)
    s.close()


@pytest.mark.parametrize("name", ["snapkv", "observed_attention"])
def test_chunked_teacher_forcing_equals_token_by_token(model, tokens, name):
    ctx, cont = tokens
    one = KVPressMethod.from_registry(model, name, 0.5, teacher_forcing_chunk=1).open(ctx)
    many = KVPressMethod.from_registry(model, name, 0.5, teacher_forcing_chunk=CONT).open(ctx)
    some = KVPressMethod.from_registry(model, name, 0.5, teacher_forcing_chunk=7).open(ctx)
    lp1 = one.logprobs(cont)
    torch.testing.assert_close(many.logprobs(cont), lp1, atol=1e-4, rtol=0)
    torch.testing.assert_close(some.logprobs(cont), lp1, atol=1e-4, rtol=0)
    assert one.greedy(cont[:5], 6) == many.greedy(cont[:5], 6)


@pytest.mark.parametrize("name", press_names())
def test_compression_shortens_the_cache_and_changes_logprobs(model, tokens, full_reference, name):
    ctx, cont = tokens
    method = KVPressMethod.from_registry(model, name, 0.25)
    s = method.open(ctx)
    assert abs(s.kept_tokens - 0.25 * CTX) <= 1
    assert all(n == s.layer_lens[0] for n in s.layer_lens)
    lp = s.logprobs(cont)
    assert s.cache.get_seq_length() == s.layer_lens[0]  # restored after scoring
    assert (lp - full_reference[0]).abs().max() > 1e-3
    stats = method.stats()
    assert stats["sessions"] == 1 and stats["kept_fraction"] == pytest.approx(0.25, abs=1 / CTX)
    assert method.describe()["budget"] == 0.25


def test_streaming_llm_matches_an_independent_reference(model, tokens):
    """StreamingLLM keeps the 4 sink tokens and the most recent ones. Dropping the same
    slots from our own contiguous cache and scoring with positions that continue at the
    context length must give the same log-probs: proves the explicit position_ids."""
    ctx, cont = tokens
    budget, n_sink = 0.25, 4
    s = KVPressMethod.from_registry(model, "streaming_llm", budget).open(ctx)
    n_kept = int(s.kept_tokens)
    keep = list(range(n_sink)) + list(range(CTX - (n_kept - n_sink), CTX))

    cache = ContiguousKVCache(model.kv_spec())
    sid = cache.add_sequence()
    last = prefill(model, cache, sid, torch.tensor(ctx))
    for layer in range(model.config.num_layers):
        cache._k[sid][layer] = cache._k[sid][layer][:, keep]
        cache._v[sid][layer] = cache._v[sid][layer][:, keep]
    cache._len[sid] = len(keep)
    logits = prefill(model, cache, sid, torch.tensor(cont), start_pos=CTX, all_logits=True)
    torch.testing.assert_close(s.logprobs(cont), token_logprobs(last, logits, cont), atol=1e-4, rtol=0)


def test_make_press_rejects_unknown_names():
    with pytest.raises(KeyError, match="unknown press"):
        make_press("nope", 0.5)


# ------------------------------------------------------------------------------ runner
def _synthetic_store() -> dict:
    store = {"schema": kc.SCHEMA, "meta": {
        "model": "tiny (random)", "created": "2025-01-01", "updated": "2025-01-02",
        "perplexity": {"window": 4096, "max_windows": 4, "windows_used": 4, "context_fraction": 0.75,
                       "text": "pg-essays"},
        "passkey": {"context": 4096, "trials": 10, "seed": 0}}, "results": {}}

    def add(row, budget, metric, result, *, reference=False, backend="kvpress"):
        store["results"][kc.result_key(row, budget, metric)] = {
            "row": row, "budget": budget, "metric": metric, "backend": backend, "reference": reference,
            "params": {}, "result": {"seconds": 1.0, "stats": {"kept_fraction": budget}, **result}}

    add("full", 1.0, "perplexity", {"perplexity": 10.0}, reference=True, backend="tieredkv")
    add("full", 1.0, "passkey", {"accuracy": 1.0, "mean_logprob": -0.5}, reference=True, backend="tieredkv")
    for i, b in enumerate((0.5, 0.25, 0.125)):
        add("knorm", b, "perplexity", {"perplexity": 11.0 + i})
        add("knorm", b, "passkey", {"accuracy": 0.9 - 0.3 * i, "mean_logprob": -1.0 - i})
        add("snapkv", b, "perplexity", {"perplexity": 10.5 + i})
    return store


def test_rows_from_a_module():
    rows = kc.load_rows_from("kvpress_compare:TIEREDKV_ROWS")
    assert rows[0].name == "full" and rows[0].reference and rows[0].budgets == (1.0,)


def test_table_and_plot_from_a_synthetic_store(tmp_path):
    store = _synthetic_store()
    summary = {(r["row"], r["budget"]): r for r in kc.summarize(store)}
    assert summary[("knorm", 0.25)]["delta_ppl"] == pytest.approx(2.0)
    assert summary[("snapkv", 0.5)]["passkey_accuracy"] is None

    table = kc.write_table(store, tmp_path).read_text()
    assert table.startswith("Protocol: question-agnostic")
    assert "4 window(s) of 4096 tokens" in table and "10 trial(s) at 4096-token context" in table
    assert "tiny (random)" in table and "2025-01-02" in table
    assert "| knorm | kvpress | 25 | 25.0 | 12.000 | +2.000 | 0.60 | -2.000 |" in table
    assert "| full | tieredkv | 100 |" in table
    png = kc.write_plot(store, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runner_records_and_resumes(model, tmp_path):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, preset("tiny").vocab_size, (2 * 96,), generator=g).tolist()
    rows = [kc.TIEREDKV_ROWS[0], kc.kvpress_row("knorm")]
    jobs = kc.plan(rows, [0.5], ["perplexity"])
    assert [(j.row.name, j.budget) for j in jobs] == [("full", 1.0), ("knorm", 0.5)]
    params = {"perplexity": {"window": 96, "max_windows": 2, "context_fraction": 0.75}}
    calls = []

    def ppl(method):
        calls.append(method.name)
        return perplexity(method, ids, window=96, max_windows=2, context_fraction=0.75, progress=False)

    store_path = tmp_path / kc.RESULTS_FILE
    store = kc.load_store(store_path)
    reports = []
    kc.run_jobs(jobs, model, store, store_path, params, {"perplexity": ppl}, log=lambda _: None,
                report=lambda s: reports.append(len(s["results"])))
    assert calls == ["full", "knorm"] and reports == [1, 2]
    saved = json.loads(store_path.read_text())
    assert set(saved["results"]) == {"full@1/perplexity", "knorm@0.5/perplexity"}
    assert saved["results"]["knorm@0.5/perplexity"]["result"]["stats"]["kept_fraction"] == pytest.approx(0.5, abs=0.02)

    kc.run_jobs(jobs, model, kc.load_store(store_path), store_path, params, {"perplexity": ppl}, log=lambda _: None)
    assert calls == ["full", "knorm"]  # both skipped on the rerun
    params["perplexity"]["max_windows"] = 1  # different parameters: not reused
    kc.run_jobs(jobs[:1], model, kc.load_store(store_path), store_path, params, {"perplexity": ppl},
                log=lambda _: None)
    assert calls == ["full", "knorm", "full"]
