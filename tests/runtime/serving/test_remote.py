"""The remote KV tier on a real redis-server: a second replica reads the prefix pages the
first wrote and gives the same tokens; missing, evicted, corrupt and truncated entries fall
back to recompute (counted); an entry copied under another prompt's or another layout's key
is refused, and with a shared secret a writer without it cannot forge one; Redis down or
killed mid-run skips the tier and serving goes on; different layouts and salts never share;
the cache's invariants hold throughout."""

import pytest
import torch

from helpers import tiny_model
from servers import RedisServer, free_port
from tieredkv.errors import ConfigError
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving import Engine, PrefixConfig, SchedulerConfig
from tieredkv.runtime.serving.deploy import EngineArgs
from tieredkv.runtime.serving.remote import SECRET_ENV, RemoteConfig
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig

MODEL = tiny_model(seed=5)
SPEC = MODEL.kv_spec()
PAGE = 8
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def url(redis_server):
    redis_server.client.flushall()
    return redis_server.url


def engine(url: str | None, *, page=PAGE, device_tokens=160, warm_codec=None, kv_dtype=None, model=MODEL,
           **remote) -> Engine:
    token_bytes = SPEC.token_bytes_per_layer * SPEC.num_layers
    cfg = TieredKVConfig(page_size=page, device_budget=f"{device_tokens * token_bytes}B", attention_budget=10 ** 6,
                         sink_tokens=4, recent_tokens=16, staging_pages=2, warm_codec=warm_codec, kv_dtype=kv_dtype)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32)
    rc = RemoteConfig(url=url, **{"timeout": 0.3, **remote}) if url else None
    return Engine(model, TieredKVCache(SPEC, cfg), scheduler=sched, prefix=PrefixConfig(), remote=rc,
                  on_error="raise")


def serve(e: Engine, prompt, salt=None, params=GREEDY):
    req = e.add_request(prompt, params, salt=salt)
    while e.has_unfinished():
        e.step()
        e.cache.mgr.check_invariants()
        e.prefix.check()
    if e.remote is not None:
        assert e.remote.flush()
    return req


def prompt(n=77, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, MODEL.config.vocab_size, (n,), generator=g).tolist()


def keys_of(e: Engine, req) -> list[str]:
    return [e.remote.key(k) for k in req.chain.keys[: (len(req.prompt) - 1) // PAGE]]


def test_a_second_replica_reads_the_first_ones_pages_and_gives_the_same_tokens(url):
    p = prompt()
    usable = (len(p) - 1) // PAGE
    a, b, plain = engine(url), engine(url), engine(None)
    ra = serve(a, p)
    assert a.remote.stats.hit_pages == 0 and a.remote.stats.written_pages >= usable
    rb = serve(b, p)
    rp = serve(plain, p)
    assert ra.out.token_ids == rb.out.token_ids == rp.out.token_ids
    assert b.remote.stats.hit_pages == usable and b.remote.stats.corrupt_pages == 0
    assert rb.metrics.cached_tokens == usable * PAGE and rb.metrics.prefix_hit_pages == {"remote": usable}
    assert len(b.prefix) >= usable  # read pages are indexed locally: the next request hits them on the replica
    rb2 = serve(b, p)
    assert rb2.out.token_ids == rp.out.token_ids and b.remote.stats.queried_pages == usable
    assert sum(rb2.metrics.prefix_hit_pages.values()) == usable and "remote" not in rb2.metrics.prefix_hit_pages
    # B wrote only what A had not (its output pages)
    assert b.remote.stats.written_pages <= a.remote.stats.written_pages


def test_entries_carry_a_checksum_and_the_warm_codec_compresses_them(url, redis_server):
    p = prompt(seed=1)
    raw, packed = engine(url), engine(url, warm_codec="int4", namespace="packed")
    serve(raw, p)
    rq = serve(packed, p)
    key = keys_of(packed, rq)[0]
    assert len(redis_server.client.get(key)) == packed.remote.header_bytes(rq.chain.keys[0]) + packed.remote.entry_bytes
    assert packed.remote.entry_bytes * 2 < raw.remote.entry_bytes  # int4 with scales, on the tiny shape
    # a replica with the same codec reads the compressed pages
    other = engine(url, warm_codec="int4", namespace="packed")
    ro = serve(other, p)
    assert other.remote.stats.hit_pages == (len(p) - 1) // PAGE and len(ro.out.token_ids) == GREEDY.max_new_tokens


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "garbage"])
def test_damaged_or_missing_entries_are_recomputed_never_used(url, redis_server, damage):
    p = prompt(seed=2)
    a = engine(url)
    ra = serve(a, p)
    keys = keys_of(a, ra)
    victim = keys[3]
    value = redis_server.client.get(victim)
    if damage == "flip":
        value = value[:-5] + bytes([value[-5] ^ 0x40]) + value[-4:]
        redis_server.client.set(victim, value)
    elif damage == "truncate":
        redis_server.client.set(victim, value[: len(value) // 2])
    elif damage == "garbage":
        redis_server.client.set(victim, b"not a page")
    else:
        redis_server.client.delete(victim)
    b = engine(url)
    rb = serve(b, p)
    assert rb.out.token_ids == ra.out.token_ids
    assert b.remote.stats.hit_pages == 3
    assert (b.remote.stats.miss_pages if damage == "delete" else b.remote.stats.corrupt_pages) == 1


def test_evicted_entries_fall_back_to_recompute(tmp_path):
    server = RedisServer(tmp_path)
    try:  # room for about a third of what replica A writes
        room = int(server.client.info("memory")["used_memory"]) + 250_000
        server.client.config_set("maxmemory", room)
        server.client.config_set("maxmemory-policy", "allkeys-lru")
        a = engine(server.url)
        outs = [serve(a, prompt(n=150, seed=s)).out.token_ids for s in range(6)]
        assert server.client.info("stats")["evicted_keys"] > 0
        b = engine(server.url)
        for s in range(6):
            assert serve(b, prompt(n=150, seed=s)).out.token_ids == outs[s]
        assert b.remote.stats.miss_pages > 0 and b.remote.stats.corrupt_pages == 0
    finally:
        server.stop()


def test_redis_down_skips_the_tier_and_serving_goes_on():
    e = engine(f"redis://127.0.0.1:{free_port()}/0", backoff=60.0)
    ref = engine(None)
    for seed in range(3):
        p = prompt(seed=seed)
        assert serve(e, p).out.token_ids == serve(ref, p).out.token_ids
    s = e.remote.stats
    assert s.errors >= 1 and s.hit_pages == 0 and s.skipped >= 1 and s.written_pages == 0


def test_redis_killed_mid_run_then_back(tmp_path):
    server = RedisServer(tmp_path)
    try:
        e, ref = engine(server.url, backoff=0.05, max_backoff=0.05), engine(None)
        serve(e, prompt(seed=0))
        server.stop()
        for seed in (1, 2):
            assert serve(e, prompt(seed=seed)).out.token_ids == serve(ref, prompt(seed=seed)).out.token_ids
        assert e.remote.stats.errors >= 1
    finally:
        server.stop()


def test_layouts_and_salts_do_not_share(url):
    p = prompt(seed=4)
    serve(engine(url), p)
    other_page = engine(url, page=16)
    serve(other_page, p)
    assert other_page.remote.stats.hit_pages == 0
    other_dtype = engine(url, kv_dtype="float16")
    serve(other_dtype, p)
    assert other_dtype.remote.stats.hit_pages == 0
    salted = engine(url)
    serve(salted, p, salt="tenant-2")
    assert salted.remote.stats.hit_pages == 0
    assert engine(url).remote.layout != other_page.remote.layout != other_dtype.remote.layout


def test_ttl_is_set_on_entries(url, redis_server):
    e = engine(url, ttl_seconds=600)
    req = serve(e, prompt(seed=6))
    assert 0 < redis_server.client.ttl(keys_of(e, req)[0]) <= 600


def test_bad_remote_settings_are_typed_errors():
    for bad in ({"url": "http://x"}, {"url": "redis://h", "namespace": "a:b"}, {"url": "redis://h", "ttl_seconds": 0},
                {"url": "redis://h", "codec": "zip"}, {"url": "redis://h", "timeout": -1}, {"url": "redis://h", "x": 1},
                {"nope": 1}):
        with pytest.raises(ConfigError):
            RemoteConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="tiered"):
        EngineArgs(remote={"url": "redis://127.0.0.1:1/0"}).build_engine(MODEL, None)
    with pytest.raises(ConfigError, match="prefix"):
        EngineArgs(kv={}, prefix="off", remote={"url": "redis://127.0.0.1:1/0"}).build_engine(MODEL, None)


def payload_of(e: Engine, redis_server, chain_key: bytes) -> bytes:
    """The page bytes of a stored entry (what anyone who can read Redis sees)."""
    return redis_server.client.get(e.remote.key(chain_key))[e.remote.header_bytes(chain_key):]


def test_an_entry_copied_under_another_prompts_key_is_refused(url, redis_server):
    """A valid entry of prompt A stored under prompt B's chain key (same layout: a poisoning
    writer, or a key migration gone wrong) is corrupt; B is computed, never continued from A."""
    pa, pb = prompt(seed=7), prompt(seed=8)
    a = engine(url)
    ra, rb = serve(a, pa), serve(a, pb)
    key_a, key_b = ra.chain.keys[0], rb.chain.keys[0]
    redis_server.client.set(a.remote.key(key_b), redis_server.client.get(a.remote.key(key_a)))
    c = engine(url)
    assert serve(c, pb).out.token_ids == serve(engine(None), pb).out.token_ids
    assert c.remote.stats.corrupt_pages == 1 and c.remote.stats.hit_pages == 0


def test_an_entry_of_another_layout_copied_under_this_layouts_key_is_refused(url, redis_server):
    """Same shapes, other weights (another fingerprint, so another layout): the entry's bytes
    fit, but it names its own layout and is refused."""
    p = prompt(seed=11)
    other_model = tiny_model(seed=6)
    x, y = engine(url, model=other_model), engine(url)
    rx = serve(x, p)
    assert x.remote.layout != y.remote.layout and x.remote.entry_bytes == y.remote.entry_bytes
    for k in rx.chain.keys[: (len(p) - 1) // PAGE]:
        redis_server.client.set(y.remote.key(k), redis_server.client.get(x.remote.key(k)))
    ry = serve(y, p)
    assert ry.out.token_ids == serve(engine(None), p).out.token_ids
    assert y.remote.stats.corrupt_pages == 1 and y.remote.stats.hit_pages == 0


def test_with_a_shared_secret_a_writer_without_it_cannot_forge_entries(url, redis_server):
    secret, p, q = "k" * 32, prompt(seed=9), prompt(seed=10)
    usable = (len(p) - 1) // PAGE
    a = engine(url, secret=secret)
    rp, rq = serve(a, p), serve(a, q)
    b = engine(url, secret=secret)
    assert serve(b, p).out.token_ids == rp.out.token_ids and b.remote.stats.hit_pages == usable
    assert b.remote.stats.corrupt_pages == 0
    # a writer who can read and write Redis, knows the format but not the key: q's first page
    # signed with a key of its own (or a plain SHA-256), stored under p's first key
    forger = engine(None)
    forger_keyed = engine(url, secret="w" * 32)
    assert forger_keyed.remote.layout == a.remote.layout  # the key is no part of the layout
    stolen = payload_of(a, redis_server, rq.chain.keys[0])
    redis_server.client.set(a.remote.key(rp.chain.keys[0]), forger_keyed.remote.entry(rp.chain.keys[0], stolen))
    c = engine(url, secret=secret)
    assert serve(c, p).out.token_ids == serve(forger, p).out.token_ids
    assert c.remote.stats.corrupt_pages == 1 and c.remote.stats.hit_pages == 0
    # without a secret the checksum is integrity only: the same forgery, made with the public
    # format under an unkeyed replica's key, is accepted (docs/serving.md: the threat model)
    plain = engine(url)
    rq_plain = serve(plain, q)
    stolen = payload_of(plain, redis_server, rq_plain.chain.keys[0])
    serve(plain, p)
    redis_server.client.set(plain.remote.key(rp.chain.keys[0]), plain.remote.entry(rp.chain.keys[0], stolen))
    fooled = engine(url)
    serve(fooled, p)
    assert fooled.remote.stats.hit_pages == usable and fooled.remote.stats.corrupt_pages == 0


def test_the_secret_from_the_environment_and_its_checks(url, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "e" * 20)
    from_env = engine(url)
    monkeypatch.delenv(SECRET_ENV)
    explicit, unkeyed = engine(url, secret="e" * 20), engine(url)
    assert from_env.remote.layout == explicit.remote.layout != unkeyed.remote.layout
    p = prompt(seed=12)
    serve(from_env, p)
    serve(explicit, p)
    assert explicit.remote.stats.hit_pages == (len(p) - 1) // PAGE
    assert "e" * 20 not in repr(RemoteConfig(url=url, secret="e" * 20))
    for bad in ("short", 12345):
        with pytest.raises(ConfigError, match="at least 16 characters") as e:
            RemoteConfig(url=url, secret=bad)
        assert "short" not in str(e.value)
    monkeypatch.setenv(SECRET_ENV, "tooshort")
    with pytest.raises(ConfigError, match=SECRET_ENV):
        engine(url)
