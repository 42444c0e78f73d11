"""Prefix reuse: keys (chained, typed extra keys), token-identical outputs with reuse on and
off over random shared prefixes and interleavings, tier-aware hits (device, host, disk),
the index's bounds, partial pages never shared."""

import random

import pytest

from helpers import SMALL_KV as SMALL, tiny_model
from tieredkv.errors import ConfigError
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving import Engine, PrefixConfig, SchedulerConfig
from tieredkv.runtime.serving.prefix import HashChain, root_key
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig

MODEL = tiny_model(seed=3)
SPEC = MODEL.kv_spec()
PAGE = SMALL["page_size"]
TOKEN_BYTES = SPEC.token_bytes_per_layer * SPEC.num_layers
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def cache(device_tokens=None, **kw) -> TieredKVCache:
    budget = None if device_tokens is None else f"{device_tokens * TOKEN_BYTES}B"
    return TieredKVCache(SPEC, TieredKVConfig(device_budget=budget, attention_budget=10 ** 6, **{**SMALL, **kw}))


def engine(c, prefix=PrefixConfig(), **sched) -> Engine:
    cfg = SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk": 32, **sched})
    return Engine(MODEL, c, scheduler=cfg, prefix=prefix, on_error="raise")


def run(e: Engine, prompts, params=GREEDY, arrivals=None, salts=None) -> list[list[int]]:
    reqs = []
    for i, p in enumerate(prompts):
        for _ in range((arrivals or [0] * len(prompts))[i]):
            e.step()
            invariants(e)
        reqs.append(e.add_request(p, params, salt=(salts or [None] * len(prompts))[i]))
    while e.has_unfinished():
        e.step()
        invariants(e)
    return [r.out.token_ids for r in reqs]


def invariants(e: Engine) -> None:
    e.cache.mgr.check_invariants()
    if e.prefix is not None:
        e.prefix.check()
    if e.scheduler.capacity is not None:
        assert int(e.cache.mgr.device.used().max()) <= e.scheduler.capacity


def shared_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts drawn from a few shared system prompts (lengths on and off page boundaries),
    each with its own tail; some repeat whole."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 500) for _ in range(rng.choice([PAGE * 3, PAGE * 5 + 3, 21]))] for _ in range(3)]
    out = []
    for _ in range(n):
        if out and rng.random() < 0.2:
            out.append(list(rng.choice(out)))
            continue
        out.append(rng.choice(systems) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))])
    return out


def test_root_key_types_its_extra_keys():
    k = lambda **kw: root_key(**{"model_id": "m", "salt": None, **kw})  # noqa: E731
    assert k() == k() and k() != k(salt="") and k(salt="a") != k(salt="b") and k() != k(model_id="n")
    # a salt cannot pose as another key: each value is written with its own tag
    assert k(model_id='m", "salt", "x') != k(salt="x")
    assert k(model_id="m", salt="x") != k(model_id="mx", salt="")
    with pytest.raises(ConfigError, match="salt"):
        k(salt=3)
    with pytest.raises(ConfigError, match="hash"):
        PrefixConfig(hash="nope")
    with pytest.raises(ConfigError, match="tiers"):
        PrefixConfig(tiers="cloud")


def test_hash_chain_keys_full_pages_and_chains_the_parent():
    root = root_key(model_id="m", salt=None)
    tokens = list(range(50))
    a = HashChain(root, PAGE).extend(tokens)
    assert len(a) == 50 // PAGE
    grown = HashChain(root, PAGE)
    grown.extend(tokens[:13])
    assert grown.extend(tokens) == a  # extended as the sequence grows == keyed at once
    changed = list(tokens)
    changed[10] = 999  # page 1 differs: its key and every later key differ, page 0 is the same
    b = HashChain(root, PAGE).extend(changed)
    assert b[0] == a[0] and all(x != y for x, y in zip(a[1:], b[1:]))
    assert HashChain(root_key(model_id="m", salt="s"), PAGE).extend(tokens)[0] != a[0]


@pytest.mark.parametrize("seed", range(4))
def test_reuse_on_equals_reuse_off(seed):
    """Greedy outputs are token-identical with reuse on and off, over random shared prefixes
    and arrival interleavings, under a device budget that forces demotion."""
    rng = random.Random(100 + seed)
    prompts = shared_prompts(10, seed)
    arrivals = [rng.randrange(0, 5) for _ in prompts]
    budget = rng.choice([None, 24 * PAGE])
    off = run(engine(cache(budget), prefix=None), prompts, arrivals=arrivals)
    e = engine(cache(budget))
    on = run(e, prompts, arrivals=arrivals)
    assert on == off
    s = e.summary()
    assert s["prefix"]["hit_rate"] > 0 and s["cached_prompt_tokens"] > 0
    assert sum(m.cached_tokens for m in e.metrics.requests) == s["cached_prompt_tokens"]


def test_partial_pages_are_never_shared_and_the_last_prompt_token_is_computed():
    e = engine(cache())
    base = list(range(10, 10 + 2 * PAGE + 3))  # two full pages + 3 tokens
    run(e, [base])
    r = e.add_request(base, GREEDY)  # the same prompt again: 2 pages reused, the partial one computed
    e.run()
    assert r.metrics.cached_tokens == 2 * PAGE
    r = e.add_request(base[: 2 * PAGE], GREEDY)  # exactly two pages: its last token must be computed
    e.run()
    assert r.metrics.cached_tokens == PAGE
    r = e.add_request(base, GREEDY, salt="tenant-b")  # another salt: nothing shared
    e.run()
    assert r.metrics.cached_tokens == 0


def test_unlisted_prefix_pages_are_demoted_still_indexed_and_hit_from_the_host():
    """A finished request's prefix pages stay indexed; other work pushes them off the device;
    the same prefix later hits them on the host tier and the output is unchanged."""
    rng = random.Random(7)
    system = [rng.randrange(3, 500) for _ in range(6 * PAGE)]
    first, later = system + [7, 8, 9], system + [11, 12]
    filler = [[rng.randrange(3, 500) for _ in range(120)] for _ in range(3)]
    want = run(engine(cache(), prefix=None), [first, *filler, later])
    e = engine(cache(20 * PAGE), max_num_seqs=1)
    got = run(e, [first, *filler, later])
    assert got == want
    last = e.metrics.requests[-1]
    assert last.cached_tokens == 6 * PAGE and last.prefix_hit_pages.get("host", 0) > 0
    assert e.prefix.stats.hit_pages["host"] > 0


def test_prefix_on_the_disk_tier(tmp_path):
    rng = random.Random(8)
    system = [rng.randrange(3, 500) for _ in range(6 * PAGE)]
    filler = [[rng.randrange(3, 500) for _ in range(150)] for _ in range(3)]
    prompts = [system + [7], *filler, system + [9]]
    want = run(engine(cache(), prefix=None), prompts)
    c = cache(20 * PAGE, host_budget=14 * PAGE, disk_path=str(tmp_path / "t4.bin"))
    e = engine(c, max_num_seqs=1)
    assert run(e, prompts) == want
    assert e.metrics.requests[-1].prefix_hit_pages.get("disk", 0) > 0
    c.close()


def test_the_index_bounds_its_tiers_and_size():
    rng = random.Random(9)
    system = [rng.randrange(3, 500) for _ in range(6 * PAGE)]
    filler = [[rng.randrange(3, 500) for _ in range(120)] for _ in range(3)]
    prompts = [system + [7], *filler, system + [9]]
    # device only: pages that leave the device are forgotten
    e = engine(cache(20 * PAGE), prefix=PrefixConfig(tiers="device"), max_num_seqs=1)
    run(e, prompts)
    assert e.metrics.requests[-1].cached_tokens < 6 * PAGE and e.prefix.stats.hit_pages["host"] == 0
    # nothing kept once no request lists it
    e = engine(cache(), prefix=PrefixConfig(max_cached_pages=0), max_num_seqs=1)
    run(e, [system + [1], system + [2]])
    assert e.metrics.requests[-1].cached_tokens == 0 and len(e.prefix) == 0
    # ... but a running request's pages are shared while it runs
    e = engine(cache(), prefix=PrefixConfig(max_cached_pages=0), max_num_seqs=2, max_num_batched_tokens=None,
               prefill_chunk=64)
    a = e.add_request(system + [1], SamplingParams(max_new_tokens=30, ignore_eos=True))
    e.step()
    b = e.add_request(system + [2], GREEDY)
    e.run()
    assert b.metrics.cached_tokens == 6 * PAGE and a.finished
    e.prefix.clear()
    assert int(e.cache.mgr.table.refs.sum()) == 0 and int(e.cache.mgr.device.used().sum()) == 0


def test_prefix_reuse_needs_a_cache_that_shares_pages():
    from tieredkv.models.cache import ContiguousKVCache

    with pytest.raises(ConfigError, match="share pages"):
        Engine(MODEL, ContiguousKVCache(SPEC), prefix=PrefixConfig())


@pytest.mark.parametrize("oversubscribe", [False, True])
def test_questions_admitted_together_prefill_their_document_once(oversubscribe):
    """Three questions on one document, submitted at once and admitted in the same step: the
    later ones wait while the first prefills the document's pages, then start from them (reuse
    at scheduling, not only at admission) — the document is prefilled once, outputs unchanged."""
    rng = random.Random(21)
    doc = [rng.randrange(3, 500) for _ in range(PAGE * 12 + 5)]
    qs = [doc + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
    want = run(engine(cache(), prefix=None), qs)
    e = engine(cache(), oversubscribe=oversubscribe)
    reqs = [e.add_request(q, GREEDY) for q in qs]
    e.step()
    assert len(e.scheduler.running) == 3, "all three admitted in one step"
    while e.has_unfinished():
        e.step()
        invariants(e)
    assert [r.out.token_ids for r in reqs] == want
    full = len(doc) // PAGE * PAGE
    assert reqs[0].metrics.cached_tokens == 0
    assert [r.metrics.cached_tokens for r in reqs[1:]] == [full, full], "the later questions reuse the document"
    assert e.prefix.stats.hit_pages["device"] == 2 * (len(doc) // PAGE)
