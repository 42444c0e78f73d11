"""The tiered KV cache: equality with the paged cache when nothing is limited, exactness
when only residency is limited, budgets and accounting invariants under random work,
bit-exact moves between tiers, trace replay, configuration errors."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import tiny_model
from tieredkv.errors import ConfigError, DataFileError, KVCacheFullError
from tieredkv.models.llama import prefill
from tieredkv.runtime.generate import generate
from tieredkv.runtime.paged import PagedKVCache
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import Budget, TieredKVConfig, resolve_budgets
from tieredkv.runtime.tiered.policies import POLICIES
from tieredkv.runtime.tiered.trace import TraceRecorder, replay

LIVE_POLICIES = sorted(n for n, p in POLICIES.items() if not p.needs_trace)
SMALL = dict(page_size=8, sink_tokens=4, recent_tokens=16, staging_pages=2)
MODEL = tiny_model(seed=3)
PROMPTS = [list(range(5, 205)), list(range(300, 333))]


def run(cache, prompts=PROMPTS, n=24):
    return generate(MODEL, cache, prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))


REF = [c.token_ids for c in run(PagedKVCache(MODEL.kv_spec()))]


@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_unlimited_budget_equals_paged_cache(policy):
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(policy=policy, **SMALL))
    assert [c.token_ids for c in run(cache)] == REF
    assert cache.metrics.misses == 0 and cache.metrics.bytes_h2d == 0


def test_unlimited_budget_logits_match_paged():
    tokens = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(2))
    paged, tiered = PagedKVCache(MODEL.kv_spec()), TieredKVCache(MODEL.kv_spec(), TieredKVConfig(**SMALL))
    a = prefill(MODEL, paged, paged.add_sequence(), tokens, chunk_size=40, all_logits=True)
    b = prefill(MODEL, tiered, tiered.add_sequence(), tokens, chunk_size=40, all_logits=True)
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@pytest.mark.parametrize("budget", ["25%", "40%"])
def test_exact_mode_loses_nothing(policy, budget):
    """Residency limited, attention unlimited, exact mode: demoted pages are streamed back
    when needed, so the output equals the full cache while residency stays in budget."""
    cfg = TieredKVConfig(policy=policy, device_budget=budget, attention_budget=10**6, **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=224, num_sequences=2)
    assert [c.token_ids for c in run(cache)] == REF
    m = cache.metrics
    if policy != "full":
        cap_bytes = cache.budgets.resident_pages * cache.mgr.page_bytes * MODEL.config.num_layers
        assert 0 < m.resident_bytes_max <= cap_bytes
        assert m.streamed_pages > 0 and m.bytes_h2d > 0 and m.writebacks > 0
    cache.mgr.check_invariants()


def test_masked_mode_counts_skips():
    cfg = TieredKVConfig(policy="streaming", mode="masked", device_budget="30%", **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=224)
    run(cache, PROMPTS[:1])
    m = cache.metrics
    assert m.masked == m.misses > 0 and m.streamed_pages > 0  # prefill streams, decode skips


def test_chunked_prefill_stays_within_the_budget():
    cfg = TieredKVConfig(policy="lru", device_budget=96, **SMALL)  # 96 tokens = 12 pages per layer
    cache = TieredKVCache(MODEL.kv_spec(), cfg)
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, torch.arange(400) % 500, chunk_size=512)
    cap = cache.budgets.resident_pages * cache.mgr.page_bytes * MODEL.config.num_layers
    assert cache.metrics.prefill_steps > 1  # the cache limited the chunk size
    assert max(cache.metrics.resident_bytes_trace) <= cap
    assert cache.length(sid) == 400
    cache.mgr.check_invariants()


def test_tier_moves_are_bit_exact(tmp_path):
    """Pages written on the device, evicted to host, spilled to disk and fetched back
    come back bit-identical. Layer 0's keys and values do not depend on attention, so the
    paged cache's copy of the same prompt is the reference."""
    cfg = TieredKVConfig(policy="lru", device_budget=96, host_budget=64, disk_path=str(tmp_path / "t4.bin"),
                         **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg)
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, torch.arange(300) % 500, chunk_size=64)
    paged = PagedKVCache(MODEL.kv_spec())
    pid = paged.add_sequence()
    prefill(MODEL, paged, pid, torch.arange(300) % 500, chunk_size=64)
    mgr = cache.mgr
    assert mgr.metrics.spilled_pages > 0 and mgr.tier_counts()["T4"] > 0
    for layer in [0]:
        recs = mgr.records_of(sid)
        full_pages = recs[:-1]
        k, v = [], []
        for r in full_pages.tolist():
            lr = torch.tensor([layer]), torch.tensor([r])
            if mgr.dev_slot[layer, r] >= 0:
                kk, vv = mgr.device.read(lr[0], mgr.dev_slot[lr])
            else:
                kk, vv = mgr._source_read(*lr)
            k.append(kk[0]), v.append(vv[0])
        pk, pv, _ = paged.gather(layer, [pid])
        n = len(full_pages) * cfg.page_size
        assert torch.equal(torch.stack(k).permute(1, 0, 2, 3).reshape(pk.shape[1], n, -1), pk[0, :, :n])
        assert torch.equal(torch.stack(v).permute(1, 0, 2, 3).reshape(pv.shape[1], n, -1), pv[0, :, :n])
    mgr.check_invariants()
    cache.free_sequence(sid)
    assert mgr.device.used().sum() == 0 and mgr.host.used().sum() == 0 and mgr.disk.used().sum() == 0


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), page=st.sampled_from([3, 8]),
       layers=st.integers(1, 3), kvh=st.integers(1, 2), head_dim=st.sampled_from([4, 5]),
       pages=st.integers(4, 24), device=st.integers(8, 12), host=st.integers(1, 6), seed=st.integers(0, 99))
def test_tier_moves_are_bit_exact_property(dtype, page, layers, kvh, head_dim, pages, device, host, seed):
    """Random pages (random bit patterns of the storage dtype, NaN payloads aside) written into the
    device pool move device -> host -> disk under small budgets, some come back to the device, and
    every page of every layer reads back bit-identical from wherever it lives."""
    import tempfile

    from tieredkv.runtime.tiered.config import ResolvedBudgets
    from tieredkv.runtime.tiered.manager import StepAccess, TierManager
    from tieredkv.runtime.tiered.policies import make_policy

    cfg = TieredKVConfig(page_size=page, sink_tokens=1, recent_tokens=1, staging_pages=1, policy="lru",
                         disk_path=tempfile.mkdtemp() + "/t4.bin")
    budgets = ResolvedBudgets(device_pages=device, host_pages=host, attention_pages=None, hot_key_pages=0,
                              staging_pages=1)
    mgr = TierManager(num_layers=layers, kv_heads=kvh, head_dim=head_dim, dtype=dtype, config=cfg, budgets=budgets,
                      policy=make_policy("lru"))
    gen = torch.Generator().manual_seed(seed)
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(bits)

    def random_page():
        x = torch.randint(info.min, info.max, (2, kvh, page, head_dim), generator=gen, dtype=torch.int64)
        x = x.to(bits).view(dtype)
        return torch.where(torch.isnan(x), torch.zeros_like(x), x)  # NaN payloads need not survive casts

    mgr.add_sequence(0)
    want = {}
    for i in range(pages):
        mgr.begin_step((0,), page)  # one full page per step
        rec = mgr.seq_pages[0][-1]
        for layer in range(layers):
            x = random_page()
            slot = mgr.dev_slot[layer, rec]
            mgr.device.k[layer, slot], mgr.device.v[layer, slot] = x[0], x[1]
            want[layer, rec] = x
        R = mgr.R
        z = torch.zeros(layers, R, dtype=torch.bool)
        mgr.end_step(StepAccess(z, z.clone(), z.clone(), torch.zeros(layers, R), torch.rand(layers, R, generator=gen),
                                z.clone()), decode=False)
        mgr.check_invariants()
    recs = torch.tensor(mgr.seq_pages[0])
    assert mgr.metrics.spilled_pages > 0 or pages <= device - 1 + host  # the disk tier was used when it had to be
    # bring a few pages back: admit into room made by the policy (exact copies from host or disk)
    back = (mgr.dev_slot[:, recs] < 0)
    if back.any():
        room = mgr._make_room(back.sum(1).clamp(max=2), protect=None)
        layers_b, cols = mgr._highest(back, torch.rand(layers, len(recs), generator=gen), room)  # cols index recs
        mgr.admit(layers_b, recs[cols])
        mgr.check_invariants()
        assert len(cols) > 0
    for (layer, rec), x in want.items():
        lr = torch.tensor([layer]), torch.tensor([rec])
        if mgr.dev_slot[layer, rec] >= 0:
            k, v = mgr.device.read(lr[0], mgr.dev_slot[lr])
        else:
            k, v = mgr._source_read(*lr)
        assert torch.equal(k[0].view(bits), x[0].view(bits)) and torch.equal(v[0].view(bits), x[1].view(bits))


def test_host_overflow_without_disk_is_a_typed_error():
    with pytest.raises(ConfigError, match="disk_path"):
        resolve_budgets(TieredKVConfig(device_budget=96, host_budget=64, **SMALL), num_layers=2,
                        token_bytes_per_layer=64, full_tokens=400)


@pytest.mark.parametrize("policy", LIVE_POLICIES)
@pytest.mark.parametrize("mode", ["exact", "masked"])
def test_trace_replay_equals_live_run(policy, mode):
    cfg = TieredKVConfig(policy=policy, mode=mode, device_budget="30%", attention_budget="20%", **SMALL)
    rec = TraceRecorder()
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=260, recorder=rec)
    run(cache, [list(range(7, 237))], n=30)
    sim = replay(rec.trace, cfg, token_bytes_per_layer=MODEL.kv_spec().token_bytes_per_layer, full_tokens=260)
    for key in ("hits", "misses", "masked", "streamed_pages", "fetched_pages", "evicted_pages", "writebacks",
                "bytes_h2d", "bytes_d2h", "demotions", "promotions"):
        assert getattr(sim, key) == getattr(cache.metrics, key), key


def test_belady_is_an_upper_bound():
    cfg = TieredKVConfig(device_budget="30%", attention_budget="25%", **SMALL)
    rec = TraceRecorder()
    run(TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=300, recorder=rec), [list(range(7, 257))], n=40)
    rates = {p: replay(rec.trace, cfg.replace(policy=p), token_bytes_per_layer=64, full_tokens=300).hit_rate
             for p in sorted(POLICIES) if p != "full"}
    assert all(rates["belady"] >= r - 1e-9 for r in rates.values()), rates


# ----------------------------------------------------------------------------- invariants under random work
work = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 90)),
    st.tuples(st.just("decode"), st.integers(1, 6)),
    st.tuples(st.just("free"), st.integers(0, 5)),
    st.tuples(st.just("cancel"), st.integers(0, 5)),
), min_size=1, max_size=10)


@settings(max_examples=40, deadline=None)
@given(ops=work, policy=st.sampled_from(LIVE_POLICIES), mode=st.sampled_from(["exact", "masked"]),
       budget=st.sampled_from([None, 48, 96, 240]), attention=st.sampled_from([None, 48, 10**6]),
       warm=st.sampled_from([None, "int4", "fp8-r2"]), host=st.sampled_from([None, 12]))
def test_property_invariants(ops, policy, mode, budget, attention, warm, host):
    """Random add / decode / free / cancel: after every step no page is lost or duplicated,
    capacities hold (the warm sub-tier's encoded bytes included), accounting balances (tier
    counts cover the live pages, counted moves balance the pools); freed sequences return
    every slot and record. ``host``: a host budget of 12 pages per sequence with a T4 file."""
    import tempfile

    disk = tempfile.mkdtemp() + "/t4.bin" if host else None
    cfg = TieredKVConfig(policy=policy, mode=mode, device_budget=budget, attention_budget=attention,
                         warm_codec=warm, host_budget=host and host * SMALL["page_size"], disk_path=disk, **SMALL)
    try:
        cache = TieredKVCache(MODEL.kv_spec(), cfg, num_sequences=2)
    except ConfigError:
        return  # attention budget below T0, device budget below the hot window: rejected up front
    live: list[tuple[int, int]] = []  # (seq id, next position)
    gen = torch.Generator().manual_seed(0)
    for op in ops:
        if op[0] == "add" and len(live) < 2:
            sid = cache.add_sequence()
            try:
                prefill(MODEL, cache, sid, torch.randint(0, 512, (op[1],), generator=gen), chunk_size=32)
            except KVCacheFullError:
                cache.free_sequence(sid)
                continue
            live.append((sid, op[1]))
        elif op[0] == "decode" and live:
            for _ in range(op[1]):
                ids = [s for s, _ in live]
                pos = torch.tensor([p for _, p in live])
                try:
                    MODEL(torch.randint(0, 512, (len(ids), 1), generator=gen), pos.view(-1, 1), cache, ids)
                except KVCacheFullError:
                    break
                live = [(s, p + 1) for s, p in live]
                cache.mgr.check_invariants()
        elif op[0] in ("free", "cancel") and live:
            sid, _ = live.pop(op[1] % len(live))
            cache.free_sequence(sid)
        cache.mgr.check_invariants()
        m = cache.metrics
        if cache.mgr.resident_cap is not None:
            b = cache.budgets
            cap = (b.device_pages - b.staging_pages) * cache.mgr.page_bytes * MODEL.config.num_layers
            assert m.resident_bytes_max <= cap
    for sid, _ in live:
        cache.free_sequence(sid)
    mgr = cache.mgr
    assert int(mgr.device.used().sum()) == 0 and int(mgr.host.used().sum()) == 0
    assert mgr.warm is None or int(mgr.warm.used().sum()) == 0
    assert mgr.disk is None or int(mgr.disk.used().sum()) == 0
    assert len(mgr.free_records) == mgr.R and not mgr.alive.any()


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("text,kind,value", [("25%", "percent", 0.25), ("64MiB", "bytes", 64 * 2**20),
                                              ("1.5GB", "bytes", 1.5e9), ("2048", "tokens", 2048),
                                              (2048, "tokens", 2048), ("512tok", "tokens", 512)])
def test_budget_parsing(text, kind, value):
    b = Budget.parse(text)
    assert (b.kind, b.value) == (kind, value)


@pytest.mark.parametrize("bad", ["-5%", "abc", "150%", "0", "12 parsecs"])
def test_bad_budgets(bad):
    with pytest.raises(ConfigError, match="device_budget"):
        TieredKVConfig(device_budget=bad)


@pytest.mark.parametrize("bad,match", [
    (dict(policy="fifo"), "unknown policy 'fifo'"),
    (dict(mode="lazy"), "mode must be one of"),
    (dict(selection_aggregate="mean"), "selection_aggregate must be one of"),
    (dict(promote_score=1.5), "promote_score"),
    (dict(demote_score=0.8, promote_score=0.7), "demote_score"),
    (dict(score_weights=(0.5, 0.5, 0.5)), "score_weights"),
    (dict(page_size=0), "page_size"),
    (dict(recent_tokens=-1), "recent_tokens"),
    (dict(warm_codec="zstd"), "unknown warm_codec 'zstd'"),
    (dict(warm_codec=""), "unknown warm_codec ''"),
    (dict(warm_fraction=0.0), "warm_fraction"),
    (dict(kv_dtype="int8"), "kv_dtype"),
    (dict(score_weights=0.5), "score_weights must be a list of 3 numbers"),
    (dict(selection_weights=(1.0, 0.0)), "selection_weights must be a list of 3 numbers"),
    (dict(policy=["lru"]), "policy must be a string"),
    (dict(warm_fraction="half"), "warm_fraction must be a number"),
    (dict(disk_path=3), "disk_path must be a string"),
])
def test_bad_config_values(bad, match):
    with pytest.raises(ConfigError, match=match):
        TieredKVConfig(**bad)


def test_offline_policies_are_refused_by_a_live_cache():
    with pytest.raises(ConfigError, match="offline oracle"):
        TieredKVCache(MODEL.kv_spec(), TieredKVConfig(policy="belady", device_budget=96, **SMALL))


def test_tier_figures_survive_freeing_the_sequences():
    """Pages per tier, bytes per tier and bytes saved are the figures at the end of the last
    step, not zeros after generation freed the sequences."""
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget=96, warm_codec="int4", warm_fraction=0.5,
                                                          **SMALL), num_sequences=2)
    run(cache)
    m = cache.metrics
    assert not cache.mgr.alive.any()
    assert sum(m.pages_per_tier.values()) > 0 and m.pages_per_tier["T2w"] > 0 and m.warm_bytes_saved > 0
    assert m.bytes_per_tier["T3"] == m.pages_per_tier["T3"] * cache.mgr.page_bytes


def test_budget_too_small_for_the_hot_window():
    with pytest.raises(ConfigError, match="too small to hold the hot window"):
        TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget="5%", **SMALL), full_tokens=400)
    with pytest.raises(ConfigError, match="needs the size of the full cache"):
        TieredKVCache(MODEL.kv_spec(), TieredKVConfig(device_budget="25%", **SMALL))


def test_config_files(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text('[tiered_kv]\ndevice_budget = "25%"\npolicy = "h2o"\nscore_weights = [0.5, 0.25, 0.25]\n')
    cfg = TieredKVConfig.from_file(toml)
    assert cfg.policy == "h2o" and cfg.score_weights == (0.5, 0.25, 0.25)
    toml.write_text('warm_codec = "default"\n')
    assert TieredKVConfig.from_file(toml).warm_codec == "int4"  # codec.DEFAULT_CODEC
    yml = tmp_path / "kv.yaml"
    yml.write_text("mode: masked\nattention_budget: 1024\n")
    assert TieredKVConfig.from_file(yml).mode == "masked"
    yml.write_text("mode: masked\nbudget: 3\n")
    with pytest.raises(ConfigError, match="unknown keys \\['budget'\\]"):
        TieredKVConfig.from_file(yml)
    yml.write_text("policy: nope\n")
    with pytest.raises(ConfigError, match=str(yml)):
        TieredKVConfig.from_file(yml)
    with pytest.raises(DataFileError):
        TieredKVConfig.from_file(tmp_path / "missing.toml")
    toml.write_text("tiered_kv = 3\n")
    with pytest.raises(ConfigError, match="tiered_kv must be a table"):
        TieredKVConfig.from_file(toml)
    toml.write_text('policy = ["lru"]\n')
    with pytest.raises(ConfigError, match=f"{toml}: policy must be a string"):
        TieredKVConfig.from_file(toml)


def test_head_rank_selection():
    """selection_aggregate = "head-rank": unlimited budgets equal the paged cache; under an
    attention budget it attends other pages than "share" (same count), and the cache keeps
    its invariants; engines refuse it (test_engine_backend)."""
    cache = TieredKVCache(MODEL.kv_spec(), TieredKVConfig(selection_aggregate="head-rank", **SMALL))
    assert [c.token_ids for c in run(cache)] == REF
    tokens = torch.randint(0, 512, (180,), generator=torch.Generator().manual_seed(4))
    attended = {}
    for agg in ("share", "head-rank"):
        cfg = TieredKVConfig(device_budget="30%", attention_budget="20%", selection_aggregate=agg, **SMALL)
        steps = []

        class Recorder:  # the cache hands every step's access record to its recorder
            def record(self, cache, step, access, *, decode):
                if decode:
                    steps.append({tuple(x) for x in access.needed.nonzero().tolist()})  # (layer, page) attended

        cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=200, recorder=Recorder())
        sid = cache.add_sequence()
        prefill(MODEL, cache, sid, tokens[:150], chunk_size=64)
        for i in range(150, 160):
            prefill(MODEL, cache, sid, tokens[i : i + 1], start_pos=i, chunk_size=1)
        cache.mgr.check_invariants()
        assert len(steps) == 10
        attended[agg] = steps
    assert [len(x) for x in attended["share"]] == [len(x) for x in attended["head-rank"]]  # the same budget...
    assert attended["share"] != attended["head-rank"]  # ... spent on other pages


def test_exact_mode_output_does_not_depend_on_the_policy():
    """Selection reads scores only, so with a limited attention budget every policy attends
    the same pages in exact mode: identical logits; only the bytes moved differ."""
    tokens = torch.randint(0, 512, (180,), generator=torch.Generator().manual_seed(4))
    outs, moved = {}, {}
    for policy in LIVE_POLICIES:
        if policy == "full":
            continue
        cfg = TieredKVConfig(policy=policy, device_budget="30%", attention_budget="20%", **SMALL)
        cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=200)
        sid = cache.add_sequence()
        prefill(MODEL, cache, sid, tokens[:150], chunk_size=64)
        outs[policy] = prefill(MODEL, cache, sid, tokens[150:], start_pos=150, chunk_size=1, all_logits=True)
        moved[policy] = cache.metrics.bytes_h2d
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values())
    assert len(set(moved.values())) > 1  # ... while the policies do move different pages


@pytest.mark.parametrize("mode", ["exact", "masked"])
def test_accounting_balances_after_eos_and_cancel(mode):
    """A batch where one sequence ends on EOS and one is cancelled mid-generation: every
    page and record comes back, the cache is empty and consistent afterwards."""
    from tieredkv.runtime.generate import generate as run_generate

    cfg = TieredKVConfig(policy="lfu-importance", mode=mode, device_budget="60%", **SMALL)
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=240, num_sequences=3)
    first = run(PagedKVCache(MODEL.kv_spec()), [PROMPTS[1]], n=3)[0].token_ids
    model = MODEL
    saved = model.config
    import dataclasses

    model.config = dataclasses.replace(saved, eos_token_ids=(first[2],))  # prompt 1 stops at its 3rd token
    checks = []

    def on_token(event):
        cache.mgr.check_invariants()
        checks.append(event.index)
        return False if event.index == 2 and len([i for i in checks if i == 2]) == 4 else None

    try:
        out = run_generate(model, cache, [PROMPTS[0], PROMPTS[1], list(range(50, 120))],
                           SamplingParams(max_new_tokens=12), on_token=on_token)
    finally:
        model.config = saved
    assert [o.finish_reason for o in out] == ["length", "eos", "cancelled"]
    cache.mgr.check_invariants()
    assert cache.mgr.tier_counts() == {"T0": 0, "T1": 0, "T2": 0, "T2w": 0, "T3": 0, "T4": 0}
    assert int(cache.mgr.device.used().sum()) == 0 and int(cache.mgr.host.used().sum()) == 0
