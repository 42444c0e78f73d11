"""Predictive prefetch: access logs, predictors, the prefetcher and the step-time model.

Exact mode stays exact under any predictor (the same tokens and logits, however wrong the
predictions); a replayed log gives the live run's prefetch counters; the oracle bounds every
predictor; every prefetched page ends up used or counted as wasted."""

import math

import pytest
import torch

from helpers import SMALL_KV as SMALL, tiny_model
from tieredkv.errors import ConfigError, DataFileError
from tieredkv.models.llama import prefill
from tieredkv.runtime.generate import generate
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.prefetch import PREDICTORS, Predictor, PredictorInput, Prefetcher
from tieredkv.runtime.tiered.prefetch.gru import AccessGRU, GRUPredictor, features, load, save
from tieredkv.runtime.tiered.step import TIER_CODES
from tieredkv.runtime.tiered.step_time import GPUS, prefetch_distance, step_time, weight_bytes
from tieredkv.runtime.tiered.trace import AccessLogger, AccessTrace, TraceRecorder, replay

MODEL = tiny_model(seed=3)
PROMPT = list(range(7, 237))
LIVE = sorted(n for n, p in PREDICTORS.items() if not p.offline)


def run(cfg: TieredKVConfig, *, n: int = 24, recorder=None, logits: bool = False):
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=len(PROMPT) + n, recorder=recorder)
    out = generate(MODEL, cache, [PROMPT], SamplingParams(max_new_tokens=n, ignore_eos=True))
    return out[0].token_ids, cache


class Everything(Predictor):
    """Predicts every page, with random scores (a predictor as wrong and as greedy as can be)."""

    name = "everything"

    def scores(self, x: PredictorInput) -> torch.Tensor:
        return torch.rand(x.hist.shape) + 0.01


def config(mode="exact", **kw):
    return TieredKVConfig(mode=mode, device_budget="30%", attention_budget="20%", **SMALL, **kw)


@pytest.mark.parametrize("predictor", LIVE)
def test_exact_mode_is_exact_under_any_predictor(predictor):
    ref, ref_cache = run(config())
    got, cache = run(config(prefetch_predictor=predictor))
    assert got == ref
    cache.mgr.check_invariants()
    m = cache.metrics
    assert m.decode_steps == ref_cache.metrics.decode_steps
    if predictor != "last":  # demand admission already keeps the last step's pages when they fit
        assert m.prefetched_pages > 0
    cache.close()
    assert m.prefetched_pages == m.prefetch_hits + m.prefetch_wasted


def test_exact_mode_logits_equal_with_a_wrong_greedy_predictor():
    """Every page predicted at random: residency churns, logits stay bit-identical."""
    def logits(prefetcher):
        cache = TieredKVCache(MODEL.kv_spec(), config(), full_tokens=300)
        cache.mgr.prefetcher = prefetcher
        sid = cache.add_sequence()
        ids = torch.tensor(PROMPT)
        out = [prefill(MODEL, cache, sid, ids, chunk_size=32).view(1, -1)]
        for i in range(20):
            tok = out[-1].argmax(-1).view(1, 1)
            out.append(MODEL(tok, torch.tensor([[len(ids) + i]]), cache, [sid])[:, -1])
            cache.mgr.check_invariants()
        return torch.cat(out), cache.metrics

    ref, _ = logits(None)
    got, m = logits(Prefetcher(Everything(), distance=3))
    assert torch.equal(got, ref)
    assert m.prefetched_pages > 0 and m.prefetch_wasted > 0


@pytest.mark.parametrize("predictor", ["vote", "recency", "quest-next-layer"])
def test_replay_of_an_access_log_gives_the_live_prefetch_counters(predictor, tmp_path):
    rec = TraceRecorder(speculate=True)
    _, live_cache = run(config(prefetch_predictor=predictor, prefetch_distance=2), recorder=rec)
    live = live_cache.metrics
    rec.trace.save(tmp_path / "log.pt")
    sim = replay(AccessTrace.load(tmp_path / "log.pt"), config(), token_bytes_per_layer=MODEL.kv_spec().token_bytes_per_layer, dtype=MODEL.kv_spec().dtype,
                 full_tokens=len(PROMPT) + 24, predictor=predictor, prefetch_distance=2)
    for key in ("hits", "misses", "prefetched_pages", "prefetch_hits", "prefetch_layer_ahead_pages", "fetched_pages",
                "evicted_pages", "bytes_h2d", "bytes_prefetch"):
        assert getattr(sim, key) == getattr(live, key), key


def test_the_oracle_bounds_the_predictors_and_prefetch_cuts_stalls():
    rec = TraceRecorder(speculate=True)
    run(config(), n=40, recorder=rec)
    args = dict(token_bytes_per_layer=64, dtype=MODEL.kv_spec().dtype, full_tokens=len(PROMPT) + 40)
    base = replay(rec.trace, config(), **args)
    results = {p: replay(rec.trace, config(), predictor=p, prefetch_distance=1, **args)
               for p in ("oracle", "last", "vote", "recency", "quest-next-layer")}
    oracle = results["oracle"]
    assert oracle.misses < 0.6 * base.misses  # stall bytes well under demand paging's
    assert oracle.prefetch_precision > 0.9
    for name, m in results.items():
        assert m.hits + m.misses == base.hits + base.misses, name  # the same needed pages
        assert oracle.prefetch_recall >= m.prefetch_recall - 1e-9, name


def test_masked_mode_attends_the_pages_prefetch_brought_in():
    rec = TraceRecorder()
    run(config(), n=40, recorder=rec)
    args = dict(token_bytes_per_layer=64, dtype=MODEL.kv_spec().dtype, full_tokens=len(PROMPT) + 40)
    none = replay(rec.trace, config("masked"), **args)
    oracle = replay(rec.trace, config("masked"), predictor="oracle", prefetch_distance=1, **args)
    assert oracle.masked < none.masked


def test_access_log_writes_one_file_per_sequence(tmp_path):
    logdir = tmp_path / "logs"
    cfg = config(access_log=str(logdir))
    cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=600, num_sequences=2)
    generate(MODEL, cache, [PROMPT, PROMPT[:100]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    cache.close()
    files = sorted(logdir.glob("seq-*.pt"))
    assert len(files) == 2
    for f in files:
        t = AccessTrace.load(f)
        dec = [s for s in t.steps if s.decode]
        assert len(dec) == 5 and t.meta["config"]
        s = dec[-1]
        L, M = s.needed.shape
        assert s.tier.shape == (L, M) and s.tier.dtype == torch.int8
        assert set(s.tier.unique().tolist()) <= set(TIER_CODES.values())
        assert bool((s.tier[:, s.t0] == TIER_CODES["device"]).all())  # T0 is always resident
        assert s.spec.shape == (L, M) and torch.isnan(s.spec[0]).all() and not torch.isnan(s.spec[1:]).any()
        assert not (s.needed & s.t0.unsqueeze(0)).any()


def test_access_log_errors(tmp_path):
    with pytest.raises(DataFileError, match="not found"):
        AccessTrace.load(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a log")
    with pytest.raises(DataFileError, match="not a readable access log"):
        AccessTrace.load(bad)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="access_log"):
        AccessLogger(blocker / "sub")


def test_prefetch_settings_are_checked():
    assert TieredKVConfig(prefetch_predictor="vote", prefetch_distance=3).prefetch.distance == 3
    with pytest.raises(ConfigError, match="prefetch_predictor"):
        TieredKVConfig(prefetch_predictor="oracle")  # needs the future: replay only
    with pytest.raises(ConfigError, match="prefetch_distance"):
        TieredKVConfig(prefetch_distance=0)
    with pytest.raises(ConfigError, match="prefetch_max_pages"):
        TieredKVConfig(prefetch_max_pages=-1)
    with pytest.raises(ConfigError, match="prefetch_gpu"):
        TieredKVConfig(prefetch_gpu="tpu")
    with pytest.raises(ConfigError, match="prefetch_weights"):
        run(config(prefetch_predictor="gru", prefetch_weights="/nonexistent/gru.safetensors"))


def test_prefetch_distance_adapts_to_the_step_time():
    assert prefetch_distance(1e-3, 1e-2) == 2  # copies are quick: the shortest distance
    assert prefetch_distance(3.5e-3, 1e-3) == 4
    assert prefetch_distance(1.0, 1e-3) == 5  # capped
    assert prefetch_distance(1e-3, 0.0) == 5

    clock = iter(i * 1e-8 for i in range(1000))  # a 10 ns step: generation faster than the copies
    pf = Prefetcher(Everything(), distance="auto", clock=lambda: next(clock))
    cache = TieredKVCache(MODEL.kv_spec(), config(), full_tokens=300)
    cache.mgr.prefetcher = pf
    generate(MODEL, cache, [PROMPT], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert pf.distances[0] == 2 and max(pf.distances) > 2


def test_step_time_model():
    h200 = GPUS["h200"]
    st = step_time("h200", weight_bytes=4.8e9, kv_read_bytes=0)
    assert math.isclose(st.total_s, 1e-3)
    stalled = step_time(h200, weight_bytes=4.8e9, kv_read_bytes=0, stall_bytes=55e6)
    assert math.isclose(stalled.total_s, 2e-3)  # a demand fetch is on the critical path
    hidden = step_time(h200, weight_bytes=4.8e9, kv_read_bytes=0, prefetch_bytes=27.5e6)
    assert math.isclose(hidden.total_s, 1e-3)  # a prefetch overlaps the compute
    bound = step_time(h200, weight_bytes=4.8e9, kv_read_bytes=0, prefetch_bytes=110e6)
    assert math.isclose(bound.total_s, 2e-3)  # ... until the link is the bottleneck
    from tieredkv.models.config import PRESETS

    assert weight_bytes(PRESETS["smollm2-135m"]) == 2 * 134_515_008  # SmolLM2-135M's parameter count


def _synthetic_log(steps: int = 80, pages: int = 24, layers: int = 2) -> AccessTrace:
    """Pages needed periodically: page i every (i % 3 + 2)-th step — learnable from the history."""
    from tieredkv.runtime.tiered.trace import TraceStep

    t = AccessTrace(layers, 8, meta={"kind": "window", "context": pages * 8})
    flags = lambda m: torch.zeros(layers, m, dtype=torch.bool)  # noqa: E731
    t.steps.append(TraceStep(pages * 8, False, flags(pages), torch.zeros(layers, pages), torch.ones(layers, pages),
                             ~flags(pages)))
    for k in range(steps):
        m = -(-(pages * 8 + k + 1) // 8)
        need = flags(m)
        need[:, : pages - 3] = torch.tensor([(k % (i % 3 + 2)) == 0 for i in range(pages - 3)])  # T0 never needed
        t.steps.append(TraceStep(1, True, need, need.float(), need.float(), ~flags(m)))
    return t


def test_the_trainer_learns_a_periodic_access_pattern(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, "tools")
    import train_prefetcher

    for i in range(2):
        _synthetic_log().save(tmp_path / f"window_{i}.pt")
    out = tmp_path / "gru.safetensors"
    monkeypatch.setattr(sys, "argv", ["train_prefetcher.py", "--logs", str(tmp_path), "--out", str(out), "--every", "1",
                                      "--epochs", "12", "--batch", "128", "--hidden", "8", "--history", "8"])
    assert train_prefetcher.main() == 0
    model, meta = load(out)
    assert meta["validation"]["f1"] > 0.9, meta["validation"]
    pred = GRUPredictor(out)
    assert pred.threshold == meta["threshold"]


def test_gru_weights_round_trip_and_errors(tmp_path):
    model = AccessGRU(history=8, hidden=4)
    save(model, tmp_path / "w.safetensors", {"threshold": 0.3})
    again, meta = load(tmp_path / "w.safetensors")
    assert meta["threshold"] == 0.3 and again.history == 8
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(DataFileError, match="not a readable access predictor"):
        load(tmp_path / "bad.safetensors")
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "none.safetensors")


def test_gru_features_cover_the_candidate_pages():
    cache = TieredKVCache(MODEL.kv_spec(), config(), full_tokens=300)
    sid = cache.add_sequence()
    prefill(MODEL, cache, sid, torch.tensor(PROMPT), chunk_size=32)
    x = PredictorInput.from_manager(cache.mgr, 2)
    seq, layers, recs = features(x, 16)
    cand = int((x.alive & ~x.t0).sum())
    assert cand > 0 and seq.shape == (cache.mgr.L * cand, 16, 6) and len(layers) == len(recs) == cache.mgr.L * cand
    assert torch.isfinite(seq).all()


def test_pages_predicted_on_disk_are_read_ahead_on_a_worker_thread(tmp_path):
    """A small host budget spills pages to the disk tier; predicted pages there are read into
    the host on the reader thread while steps compute: the same logits, no thread or pending
    read left after close."""
    import threading

    def logits(prefetcher):
        cfg = config(host_budget=48, disk_path=str(tmp_path / "t4.bin"))
        cache = TieredKVCache(MODEL.kv_spec(), cfg, full_tokens=300)
        cache.mgr.prefetcher = prefetcher
        sid = cache.add_sequence()
        out = [prefill(MODEL, cache, sid, torch.tensor(PROMPT), chunk_size=32).view(1, -1)]
        for i in range(16):
            tok = out[-1].argmax(-1).view(1, 1)
            out.append(MODEL(tok, torch.tensor([[len(PROMPT) + i]]), cache, [sid])[:, -1])
            cache.mgr.check_invariants()
        m = cache.metrics
        cache.close()
        return torch.cat(out), m, cache.mgr

    ref, base, _ = logits(None)
    got, m, mgr = logits(Prefetcher(Everything(), max_pages=3, distance=2))
    assert torch.equal(got, ref)
    assert base.spilled_pages > 0 and m.disk_read_ahead_pages > 0
    assert mgr._reader is None and not mgr._pending
    assert not any(t.name.startswith("tieredkv-t4-read") for t in threading.enumerate())
