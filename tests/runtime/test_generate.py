"""Generation: greedy / sampled, batching, EOS, stop strings, streaming, cancellation."""

import dataclasses

import pytest
import torch

from helpers import tiny_model, write_gguf
from tieredkv.errors import ConfigError, ContextLengthError
from tieredkv.models.cache import ContiguousKVCache
from tieredkv.models.loading import load_checkpoint
from tieredkv.runtime.generate import generate
from tieredkv.runtime.llm import LLM
from tieredkv.runtime.paged import PagedCacheConfig
from tieredkv.runtime.sampling import SamplingParams, filter_logits


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    """A tiny random model with a real (tiny) byte-level BPE tokenizer, via GGUF."""
    path = write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", tiny_model(seed=21))
    loaded = load_checkpoint(path)
    return LLM.from_model(loaded.model, loaded.tokenizer, cache=PagedCacheConfig(page_size=4))


PROMPTS = [[5, 9, 200, 31], list(range(40, 77)), [300]]


def test_greedy_paged_equals_contiguous_oracle(tiny_llm):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    paged = tiny_llm.generate(PROMPTS, params)
    oracle = generate(tiny_llm.model, ContiguousKVCache(tiny_llm.model.kv_spec()), PROMPTS, params)
    assert [c.token_ids for c in paged] == [c.token_ids for c in oracle]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in paged)


def test_batch_equals_one_by_one(tiny_llm):
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=123, ignore_eos=True)
    batched = [c.token_ids for c in tiny_llm.generate(PROMPTS, params)]
    alone = [tiny_llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert batched == alone
    again = [c.token_ids for c in tiny_llm.generate(PROMPTS, params)]
    assert again == batched
    other = [c.token_ids for c in tiny_llm.generate(PROMPTS, SamplingParams(
        max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=124, ignore_eos=True))]
    assert other != batched


def test_top_k_one_is_greedy(tiny_llm):
    greedy = tiny_llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    k1 = tiny_llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.5, top_k=1, seed=0,
                                                   ignore_eos=True))
    assert [c.token_ids for c in greedy] == [c.token_ids for c in k1]


def test_filter_logits():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [False, False, True, True]
    probs = logits.softmax(-1)  # [0.644, 0.237, 0.087, 0.032]
    kept = ~torch.isinf(filter_logits(logits, 0, 0.7))
    assert kept.tolist() == [True, True, False, False]
    assert probs[0] < 0.7 <= probs[:2].sum()
    assert (~torch.isinf(filter_logits(logits, 0, 0.5))).tolist() == [True, False, False, False]


def test_eos_ends_a_sequence(tiny_llm):
    first = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1, ignore_eos=True))[0].token_ids[0]
    model = tiny_llm.model
    saved = model.config
    model.config = dataclasses.replace(saved, eos_token_ids=(first,))
    tiny_llm.close()  # the kept engine read the model's eos ids when it started
    try:
        out = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=5))[0]
    finally:
        model.config = saved
        tiny_llm.close()
    assert out.finish_reason == "eos" and out.token_ids == []


def test_stop_string_and_streaming(tiny_llm):
    full = tiny_llm.generate(["the"], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert len(full.text) >= 4
    stop = full.text[2:4]
    pieces = []
    out = tiny_llm.generate(["the"], SamplingParams(max_new_tokens=20, ignore_eos=True, stop=(stop,)),
                            on_token=lambda e: pieces.append(e.text))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == out.text


def test_cancel_mid_generation_frees_pages(tiny_llm):
    out = tiny_llm.generate(PROMPTS, SamplingParams(max_new_tokens=30, ignore_eos=True),
                            on_token=lambda e: False if e.index == 1 else None)
    assert out[1].finish_reason == "cancelled" and len(out[1].token_ids) == 1
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 30
    cache = tiny_llm.last_cache
    # every sequence freed; what stays is the prefix cache's (the full pages of the prompts and
    # outputs, kept for later calls), and closing the LLM lets those go too
    assert cache.sequences == [] and cache.pages_in_use() == cache.usage().indexed_pages > 0
    tiny_llm.close()
    assert cache.pages_in_use() == 0


def test_context_limit(tiny_llm):
    ctx = tiny_llm.config.max_position_embeddings
    with pytest.raises(ContextLengthError, match=f"context is {ctx}"):
        tiny_llm.generate([[1] * ctx])
    with pytest.raises(ContextLengthError, match="empty"):
        tiny_llm.generate([[]])
    out = tiny_llm.generate([[1] * (ctx - 3)], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_percentage_budgets_resolve_against_what_the_context_holds(tiny_llm):
    """A 25 % device budget is 25 % of prompt + new tokens — never of more tokens than the
    model's context holds, however large max_new_tokens is."""
    from tieredkv.runtime.tiered.config import TieredKVConfig

    ctx = tiny_llm.config.max_position_embeddings
    llm = LLM.from_model(tiny_llm.model, tiny_llm.tokenizer,
                         kv=TieredKVConfig(page_size=16, device_budget="25%", host_budget="100%"))
    out = llm.generate([[5] * (ctx - 40)], SamplingParams(max_new_tokens=100 * ctx, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    assert llm.last_cache.budgets == llm.new_cache(full_tokens=ctx).budgets
    assert llm.last_cache.budgets.device_pages <= ctx // 16 // 4 + 1


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2),
                                 dict(stop=("",))])
def test_bad_sampling_params(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_stats(tiny_llm):
    tiny_llm.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
    st = tiny_llm.last_stats
    assert st.prompt_tokens == sum(map(len, PROMPTS)) and st.generated_tokens == 18
    assert st.decode_tokens == 15 and st.decode_steps == 5
    assert st.kv_bytes_peak > 0 and st.prefill_tok_s > 0 and st.decode_tok_s > 0


@pytest.mark.slow
def test_smollm2_answers(smollm):
    llm = LLM.from_model(smollm.model, smollm.tokenizer)
    out = llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=4))[0]
    assert "Paris" in out.text
