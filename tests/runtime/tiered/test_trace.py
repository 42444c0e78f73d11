"""Recorded access traces: replaying a live run's trace through the TierManager gives the live
run's decisions and accounting for every policy and mode; Belady's MIN bounds every policy."""

import pytest

from helpers import SMALL_KV as SMALL, tiny_model
from tieredkv.runtime.generate import generate
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.policies import POLICIES
from tieredkv.runtime.tiered.trace import AccessTrace, TraceRecorder, replay

LIVE_POLICIES = sorted(n for n, p in POLICIES.items() if not p.needs_trace)
MODEL = tiny_model(seed=3)


def recorded(cfg: TieredKVConfig, prompt: list[int], n: int, full_tokens: int):
    rec = TraceRecorder()
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=full_tokens, recorder=rec)
    generate(MODEL, cache, [prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
    return rec.trace, cache.metrics


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@pytest.mark.parametrize("mode", ["exact", "masked"])
def test_trace_replay_equals_live_run(policy, mode, tmp_path):
    cfg = TieredKVConfig(policy=policy, mode=mode, device_budget="30%", attention_budget="20%", **SMALL)
    trace, live = recorded(cfg, list(range(7, 237)), 30, 260)
    trace.save(tmp_path / "trace.pt")
    sim = replay(AccessTrace.load(tmp_path / "trace.pt"), cfg,
                 token_bytes_per_layer=MODEL.kv_spec().token_bytes_per_layer, dtype=MODEL.kv_spec().dtype, full_tokens=260)
    for key in ("hits", "misses", "masked", "streamed_pages", "staging_rounds", "fetched_pages", "evicted_pages",
                "writebacks", "bytes_h2d", "bytes_d2h", "demotions", "promotions", "decode_steps", "prefill_steps"):
        assert getattr(sim, key) == getattr(live, key), key


def test_belady_is_an_upper_bound():
    cfg = TieredKVConfig(device_budget="30%", attention_budget="25%", **SMALL)
    trace, _ = recorded(cfg, list(range(7, 257)), 40, 300)
    rates = {p: replay(trace, cfg.replace(policy=p), token_bytes_per_layer=64, dtype=MODEL.kv_spec().dtype, full_tokens=300).hit_rate
             for p in sorted(POLICIES) if p != "full"}
    assert all(rates["belady"] >= r - 1e-9 for r in rates.values()), rates


def test_a_recorder_takes_one_sequence():
    rec = TraceRecorder()
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL), recorder=rec)
    with pytest.raises(ValueError, match="one sequence"):
        generate(MODEL, cache, [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=2, ignore_eos=True))
