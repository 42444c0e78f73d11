"""The batch API as a front door (``LLM.generate``): prompts that are not text or token ids,
or not valid Unicode, are reported per prompt (``errors="report"``) or raised as a typed
error; a percentage budget is a share of ``max_model_len`` tokens per sequence, so short
prompts run under it; the engine classes a server needs come from the top-level package."""

from __future__ import annotations

import asyncio

import pytest

from helpers import tiny_model, write_gguf
from tieredkv.errors import ConfigError, ContextLengthError, PromptError
from tieredkv.models.loading import load_checkpoint
from tieredkv.runtime.llm import LLM
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.config import TieredKVConfig

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("batch") / "tiny.gguf", tiny_model(seed=3))


@pytest.fixture(scope="module")
def loaded(gguf):
    return load_checkpoint(gguf)


def test_bad_prompts_are_reported_per_prompt_in_input_order(loaded):
    llm = LLM.from_model(loaded.model, loaded.tokenizer)
    prompts = ["the cat", "a\ud800b", None, 7, b"hi", [5, 6, 7], [1.5, 2], [10 ** 6], [True, 3], "the dog"]
    outs = llm.generate(prompts, GREEDY, errors="report")
    assert [o.index for o in outs] == list(range(len(prompts)))
    ok = {0, 5, 9}
    assert [o.finish_reason for o in outs] == ["length" if i in ok else "error" for i in range(len(prompts))]
    errors = [o.error for o in outs]
    assert errors[1].startswith("PromptError: prompt 1 contains a lone surrogate (U+D800) at character 1")
    assert "prompt 2 is None (NoneType)" in errors[2] and "prompt 3 is 7 (int)" in errors[3]
    assert "prompt 4 is bytes, not text" in errors[4] and ".decode('utf-8')" in errors[4]
    assert "prompt 6: element 0 is 1.5, not a token id" in errors[6]
    assert "prompt 7: token id 1000000 (element 0) is out of range; the vocabulary has" in errors[7]
    assert "prompt 8: element 0 is True" in errors[8]
    for i in ok:
        assert outs[i].token_ids == llm.generate([prompts[i]], GREEDY)[0].token_ids
    with pytest.raises(PromptError, match="prompt 1 contains a lone surrogate"):
        llm.generate(prompts, GREEDY)
    with pytest.raises(PromptError, match="bytes"):
        llm.generate(b"hi", GREEDY)
    with pytest.raises(PromptError, match="lone surrogate"):
        llm.generate(["\udfff"], GREEDY, chat=True)
    # an array of ids is ids; a nested one is not a prompt
    import numpy as np

    assert llm.generate([np.array([5, 6, 7])], GREEDY)[0].token_ids == outs[5].token_ids
    assert llm.generate([np.array([[5, 6]])], GREEDY, errors="report")[0].finish_reason == "error"


def test_a_percentage_budget_is_a_share_of_max_model_len_so_short_prompts_run(loaded):
    ctx = loaded.config.max_position_embeddings
    kv = TieredKVConfig(page_size=16, device_budget="25%", budget_reference="float32")  # the tiny model's float32 pages
    llm = LLM.from_model(loaded.model, loaded.tokenizer, kv=kv)
    out = llm.generate(["Hi"], SamplingParams(max_new_tokens=8))[0]
    assert out.finish_reason in ("length", "eos") and out.error is None
    assert llm.max_model_len == ctx and llm.last_cache.budgets == llm.new_cache(full_tokens=ctx).budgets
    # the same budget whatever the prompts' lengths; per sequence decoded at once
    llm.generate([[5] * 300], GREEDY)
    assert llm.last_cache.budgets == llm.new_cache(full_tokens=ctx).budgets
    llm.generate(["Hi", "there"], GREEDY)
    assert llm.last_cache.budgets == llm.new_cache(full_tokens=ctx, num_sequences=2).budgets
    # max_model_len: the base of the percentage and the longest sequence
    short = LLM.from_model(loaded.model, loaded.tokenizer, kv=kv, max_model_len=1024)
    out = short.generate([[5] * 1018], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert short.last_cache.budgets == short.new_cache(full_tokens=1024).budgets
    assert short.last_cache.budgets.device_pages < llm.new_cache(full_tokens=ctx).budgets.device_pages
    with pytest.raises(ContextLengthError, match="1024 tokens"):
        short.generate([[5] * 1024], GREEDY)
    assert short.generate([[5] * 1024], GREEDY, errors="report")[0].finish_reason == "error"
    for bad in (0, 1, ctx + 1, "512", True):
        with pytest.raises(ConfigError, match="max_model_len"):
            LLM.from_model(loaded.model, loaded.tokenizer, kv=kv, max_model_len=bad)


def test_async_engine_and_engine_args_come_from_the_top_level(gguf):
    from tieredkv import AsyncEngine, EngineArgs

    engine = EngineArgs(model=str(gguf), scheduler={"max_model_len": 128}).build().engine
    ids = [5, 6, 7, 8]

    async def main():
        async with AsyncEngine(engine) as served:
            return await served.complete(ids, GREEDY)

    out = asyncio.run(main())
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
