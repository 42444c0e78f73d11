"""Prefix caching in the batch API (``LLM.generate``): prompts that share a prefix prefill it
once — within a call and across calls — with the same greedy tokens as without reuse, the
hits reported per tier in ``last_stats``; a call whose percentage budgets resolve differently
starts a new cache; ``close`` frees what the index held."""

from __future__ import annotations

import pytest

from helpers import tiny_model
from tieredkv.errors import ConfigError
from tieredkv.runtime.llm import LLM
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.config import TieredKVConfig

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
PAGE = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


def _prompts(n: int, shared: int = 5 * PAGE) -> list[list[int]]:
    doc = [(7 * i + 3) % 200 + 1 for i in range(shared)]  # a shared 'document' of whole pages
    return [doc + [(11 * j + 5 * i) % 200 + 1 for i in range(9)] for j in range(n)]


@pytest.mark.parametrize("kv", [None, TieredKVConfig(page_size=PAGE)], ids=["paged", "tiered"])
def test_a_shared_prefix_is_prefilled_once_with_the_same_tokens(model, kv):
    prompts = _prompts(6)
    plain = LLM.from_model(model, kv=kv, prefix_caching=False)
    want = [c.token_ids for c in plain.generate(prompts, GREEDY)]
    assert plain.last_stats.cached_tokens == 0 and plain.last_stats.prefix_hit_pages == {}

    llm = LLM.from_model(model, kv=kv)
    got = llm.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == want
    # the batch is admitted at once: the document's pages are indexed once the first sequence
    # finishes them, so later calls hit; within this call the sequences may overlap in prefill
    first = llm.last_stats.cached_tokens
    again = llm.generate(prompts, GREEDY)
    assert [c.token_ids for c in again] == want
    s = llm.last_stats
    assert s.cached_tokens >= 6 * 5 * PAGE > first
    assert sum(s.prefix_hit_pages.values()) == s.cached_tokens // PAGE
    assert set(s.prefix_hit_pages) <= {"device", "host", "disk"}
    assert s.prompt_tokens == sum(len(p) for p in prompts)
    llm.close()
    assert llm.last_cache.usage().device_pages == 0


def test_a_later_call_finds_the_pages_an_earlier_one_computed(model):
    prompts = _prompts(4)
    llm = LLM.from_model(model)
    llm.generate(prompts[:1], GREEDY)
    llm.generate(prompts[1:], GREEDY)
    assert llm.last_stats.cached_tokens == 3 * 5 * PAGE


def test_a_call_with_other_percent_budgets_starts_a_new_cache(model):
    kv = TieredKVConfig(page_size=PAGE, device_budget="50%")
    llm = LLM.from_model(model, kv=kv, max_model_len=1024)
    prompts = _prompts(2)
    llm.generate(prompts, GREEDY)
    first = llm.last_cache
    llm.generate(prompts, GREEDY)
    assert llm.last_cache is first and llm.last_stats.cached_tokens > 0
    llm.generate(prompts[:1], GREEDY)  # 50 % of one sequence's max_model_len: another budget
    assert llm.last_cache is not first and llm.last_stats.cached_tokens == 0
    # bytes budgets do not depend on the call: the cache stays
    llm = LLM.from_model(model, kv=TieredKVConfig(page_size=PAGE, device_budget="4MiB"))
    llm.generate(prompts, GREEDY)
    kept = llm.last_cache
    llm.generate(prompts[:1], GREEDY)
    assert llm.last_cache is kept and llm.last_stats.cached_tokens >= 5 * PAGE


def test_the_prefix_cache_is_bounded_and_checked(model):
    llm = LLM.from_model(model, prefix_cache_tokens=2 * PAGE)
    llm.generate(_prompts(3), GREEDY)
    assert llm.last_cache.usage().indexed_pages == 2  # unlisted pages kept: the 2 most recently used
    unbounded = LLM.from_model(model)
    unbounded.generate(_prompts(3), GREEDY)
    assert unbounded.last_cache.usage().indexed_pages > 2
    with pytest.raises(ConfigError, match="prefix_caching must be True or False"):
        LLM.from_model(model, prefix_caching="yes")
    with pytest.raises(ConfigError, match="prefix_cache_tokens must be a non-negative integer"):
        LLM.from_model(model, prefix_cache_tokens=-1)


def test_a_failed_call_leaves_the_next_one_a_clean_engine(model):
    llm = LLM.from_model(model)
    llm.generate(_prompts(2), GREEDY)
    with pytest.raises(Exception):
        llm.generate(_prompts(2), GREEDY, on_token=lambda e: 1 / 0)
    out = llm.generate(_prompts(2), GREEDY)
    assert all(c.finish_reason == "length" for c in out)
    assert llm.last_cache.sequences == []
