"""The serving benchmark's parts on a tiny model: workloads, every arm at one budget, closed
and open loop, agreement between arms, rejections counted apart from errors, the tables."""

import dataclasses

import pytest

from helpers import tiny_model
from tieredkv.errors import ConfigError
from tieredkv.runtime.serving.bench import (ARMS, BenchConfig, agreement, drive, long_tailed_sessions, make_engine,
                                            make_sessions, markdown, row)

MODEL = tiny_model(seed=3)
IDS = [(i * 7919) % 500 + 3 for i in range(5000)]
CFG = BenchConfig(budget_tokens=512, max_model_len=256, page_size=8, max_num_batched_tokens=64, prefill_chunk=32,
                  recent_tokens=16)


def chat(n=4):
    return make_sessions("chat", IDS, sessions=n, system_tokens=40, turns=2, user_tokens=(5, 12), max_new_tokens=6)


def test_workloads():
    c = chat()
    assert len(c) == 4 and all(s.prefix == c[0].prefix and len(s.turns) == 2 and s.conversation for s in c)
    d = make_sessions("docs", IDS, sessions=5, doc_tokens=(100, 120), questions=2, max_new_tokens=4)
    assert len(d) == 5 and d[0].prefix == d[3].prefix != d[1].prefix and not d[0].conversation
    assert [x.key for x in d] == ["d0q0", "d1q0", "d2q0", "d0q1", "d1q1"]
    u = make_sessions("unique", IDS, sessions=3, system_tokens=40, user_tokens=(5, 12))
    assert all(s.prefix == [] for s in u) and len({tuple(s.turns[0]) for s in u}) == 3
    r = long_tailed_sessions(IDS, 200, seed=1, median=30, sigma=1.2, max_len=256, max_new_tokens=8)
    lens = [len(s.turns[0]) for s in r]
    assert max(lens) <= 256 - 9 and min(lens) >= 8 and len(set(lens)) > 20
    with pytest.raises(ConfigError, match="workload"):
        make_sessions("poems", IDS, sessions=1)


def test_every_arm_serves_the_chat_workload_with_the_same_tokens():
    sessions = chat()
    results = {}
    for arm in ARMS:
        engine = make_engine(arm, MODEL, None, CFG)
        res = drive(engine, sessions, arm=arm, workload="chat", clients=3)
        assert res.crashed is None and res.errors == 0 and res.sessions_done == 4 and len(res.outputs) == 8
        results[arm] = res
    ref = results["paged-recompute"].outputs
    for arm in ("contiguous", "paged-reserve", "tiered-exact", "tiered-exact-oversubscribe"):
        assert agreement(results[arm].outputs, ref) == {"compared": 8, "identical": 1.0, "token_agreement": 1.0}
    # the contiguous arm reserves the served length: 512 / 256 = 2 requests at once
    assert results["contiguous"].summary["kv"]["running_max"] == 2
    assert results["tiered-exact"].summary["kv"]["running_max"] == 3
    assert results["tiered-exact"].summary["prefix"]["hit_rate"] > 0
    r = row(results["tiered-exact"], slo_tpot=100.0)
    assert r["within_slo"] and r["requests"] == 8
    table = markdown([r], [("arm", "arm"), ("ttft_p99", "TTFT p99"), ("prefix_hits_by_tier", "hits")])
    assert table.splitlines()[2].startswith("| tiered-exact |")


def test_open_loop_and_rejections():
    sessions = chat(3)
    res = drive(make_engine("tiered-exact", MODEL, None, CFG), sessions, arm="tiered-exact", workload="chat",
                rate=50.0)
    assert res.sessions_done == 3 and res.rate == 50.0
    too_long = dataclasses.replace(sessions[0], key="long", prefix=IDS[:300])
    res = drive(make_engine("paged-recompute", MODEL, None, CFG), [too_long, sessions[1]], arm="paged-recompute",
                workload="chat", clients=1)
    assert res.rejected == 1 and res.errors == 0 and res.sessions_done == 1
    with pytest.raises(ConfigError, match="either"):
        drive(make_engine("paged-recompute", MODEL, None, CFG), sessions, arm="x", workload="chat")
    with pytest.raises(ConfigError, match="arm"):
        make_engine("vllm", MODEL, None, CFG)
