"""Engine backends under the tiered runtime: an engine directory built from a tiny random
Llama runs through ONNX Runtime (`OnnxRuntimeBackend`) and gives the torch backend's greedy
tokens *and* the same tier decisions (every TierMetrics counter) — unlimited budgets, exact
and masked mode under a budget, the warm compressed sub-tier, batches and chunked prefill;
`TensorRTBackend` fails clearly without TensorRT; bad engine directories and mismatched
cache configs give typed errors. SmolLM2: tests/test_integration_engine.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("onnxruntime")

from helpers import tiny_model, write_gguf  # noqa: E402
from tieredkv.builder import build_engine  # noqa: E402
from tieredkv.errors import ConfigError  # noqa: E402
from tieredkv.models.loading import load_checkpoint  # noqa: E402
from tieredkv.models.tokenizer import Tokenizer  # noqa: E402
from tieredkv.runtime.engine import (  # noqa: E402
    BackendUnavailableError,
    EngineError,
    OnnxRuntimeBackend,
    TensorRTBackend,
    load_backend,
    read_engine_dir,
)
from tieredkv.runtime.llm import LLM  # noqa: E402
from tieredkv.runtime.sampling import SamplingParams  # noqa: E402
from tieredkv.runtime.tiered.config import TieredKVConfig  # noqa: E402

PAGE = 4
TIGHT = dict(page_size=PAGE, sink_tokens=4, recent_tokens=8, device_budget=40, attention_budget=24)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(checkpoint, tiered engine dir, plain engine dir) of one tiny model (float32 engines: the
    torch backend's float32 tokens, exactly)."""
    root = tmp_path_factory.mktemp("engines")
    gguf = write_gguf(root / "tiny.gguf", tiny_model(seed=5))
    for flag, name in ((["--tiered-kv"], "tiered"), ([], "plain")):
        rc = build_engine.main([*flag, "--model", str(gguf), "--output", str(root / name), "--page-size", str(PAGE),
                                "--precision", "fp32"])
        assert rc == 0
    return gguf, root / "tiered", root / "plain"


@pytest.fixture(scope="module")
def torch_model(built):
    return load_checkpoint(built[0]).model


@pytest.fixture(scope="module")
def backend(built):
    return OnnxRuntimeBackend(built[1], threads=1)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def run(model, kv: TieredKVConfig, ids: list[list[int]], *, new_tokens: int = 20, chunk: int = 16):
    llm = LLM.from_model(model, None, kv=kv, prefill_chunk=chunk)
    out = llm.generate(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    metrics = {k: v for k, v in vars(llm.last_cache.metrics).items() if not k.endswith("seconds")}
    return [c.token_ids for c in out], metrics, llm.last_cache


@pytest.mark.parametrize("kv", [
    TieredKVConfig(page_size=PAGE),
    TieredKVConfig(**TIGHT, mode="exact"),  # the default warm tier, warm_exact_reads "auto" (4)
    TieredKVConfig(**TIGHT, mode="exact", warm_exact_reads=0),
    TieredKVConfig(**TIGHT, mode="masked", policy="lru"),
    TieredKVConfig(**TIGHT, mode="exact", warm_codec="int4", warm_fraction=0.5, warm_exact_reads=0),
    TieredKVConfig(**TIGHT, mode="exact", warm_codec="int4", warm_fraction=0.5, warm_exact_reads=2),
], ids=["unlimited", "exact-budget", "exact-budget-no-exact-reads", "masked-budget", "warm-int4", "warm-int4-reads-2"])
def test_greedy_tokens_and_tier_decisions_equal_the_torch_backend(torch_model, backend, kv):
    ids = prompts(70, 33)  # prefill in chunks of 16 under the budget, then decode past it
    want_tokens, want_metrics, _ = run(torch_model, kv, ids)
    got_tokens, got_metrics, cache = run(backend, kv, ids)
    assert got_tokens == want_tokens
    assert got_metrics == want_metrics
    if kv.budgets.device is not None:
        assert want_metrics["misses"] > 0 or want_metrics["masked"] > 0  # the budget is at work
    cache.mgr.check_invariants()


@pytest.fixture(scope="module")
def warm_backend(built, tmp_path_factory):
    """An engine whose TieredAttention reads int4 warm pages from their bytes (--warm-codec int4)."""
    out = tmp_path_factory.mktemp("warm_engine") / "warm"
    assert build_engine.main(["--tiered-kv", "--warm-codec", "int4", "--model", str(built[0]), "--output", str(out),
                              "--page-size", str(PAGE), "--precision", "fp32"]) == 0
    return OnnxRuntimeBackend(out, threads=1)


@pytest.mark.parametrize("kv", [
    TieredKVConfig(**TIGHT, mode="exact", warm_codec="int4", warm_fraction=0.5, warm_exact_reads=0),
    TieredKVConfig(**TIGHT, mode="exact", warm_codec="int4", warm_fraction=0.5),  # exact reads "auto": staged exact
    TieredKVConfig(**TIGHT, mode="masked", policy="lfu-importance", warm_codec="int4", warm_fraction=0.75),
    TieredKVConfig(**TIGHT, mode="exact", warm_codec="off"),  # no warm tier: the graph gets empty warm pools
], ids=["exact-warm", "exact-warm-exact-reads", "masked-warm", "no-warm-tier"])
def test_warm_engine_equals_the_torch_backend(torch_model, warm_backend, kv):
    """The graph decodes warm pages itself (no staging of decoded copies): same tokens and the
    same TierMetrics as the torch backend, which decodes them in Python."""
    ids = prompts(70, 33)
    want_tokens, want_metrics, _ = run(torch_model, kv, ids)
    got_tokens, got_metrics, cache = run(warm_backend, kv, ids)
    assert got_tokens == want_tokens
    assert got_metrics == want_metrics
    if kv.warm.codec is not None:
        assert want_metrics["warm_reads"] > 0  # warm pages were attended
    cache.mgr.check_invariants()


def test_warm_engine_feeds_read_the_encoded_pool(warm_backend):
    """The feeds carry the warm pool's own bytes and the warm rows; warm pages are not staged,
    but the decode step's exact reads (warm_exact_reads = 1 per layer): the pages of
    TierManager.exact_read_choice, staged after the pool from their exact copies."""
    from tieredkv.runtime.tiered.cache import TieredKVCache
    from tieredkv.runtime.tiered.engine_io import StepOutputs, finish_step, step_feeds

    kv = TieredKVConfig(**TIGHT, mode="exact", warm_codec="int4", warm_fraction=0.5, warm_exact_reads=1)
    cache = TieredKVCache(warm_backend.kv_spec(), kv, num_sequences=2)  # a budget with room for warm pages
    assert cache.budgets.warm_pages > 0
    sid = cache.add_sequence()

    def run_step(token: int):
        step = cache.begin_step([sid], 1)
        feeds = step_feeds(cache, tiered_graph=True, warm_codec="int4")
        feeds.input_ids, feeds.positions = torch.tensor([[token]]), torch.tensor([[step.past[0]]])
        outputs = StepOutputs.from_dict(warm_backend.run(feeds.as_dict()))
        return step, feeds, outputs

    for tok in prompts(60, seed=9)[0]:  # grow a sequence past the budget, one token per step
        finish_step(cache, *run_step(tok))
    step, feeds, outputs = run_step(1)
    rows, exact, mgr = feeds.page_warm_row, feeds.exact_reads, cache.mgr
    recs = cache.plan.row(0)
    assert (rows >= 0).any() and exact.any() and "exact_reads" not in feeds.as_dict()  # not a graph input
    for layer in range(mgr.L):
        assert feeds.warm_pool[layer].data_ptr() == mgr.warm.data[layer].data_ptr()
        chosen = mgr.exact_read_choice(layer, recs, 1)
        assert torch.equal(exact[layer, 0], chosen) and int(chosen.sum()) <= 1
        assert (mgr.table.warm_slot[layer, recs[chosen]] >= 0).all()
        # nothing else staged in exact mode: the chosen pages after the pool, read from their exact copy
        assert feeds.k_pool[layer].shape[0] == mgr.device.capacity + int(chosen.sum())
        assert (rows[layer, 0][chosen] == -1).all() and feeds.page_mask[layer, 0][chosen].all()
        slots = feeds.page_table[layer, 0][chosen]
        assert (slots >= mgr.device.capacity).all()
        if chosen.any():
            k_exact, v_exact = mgr.read_pages(layer, recs[chosen], torch.float32, exact=True)
            k_int4, _ = mgr.read_pages(layer, recs[chosen], torch.float32)
            assert torch.equal(feeds.k_pool[layer][slots], k_exact) and torch.equal(feeds.v_pool[layer][slots], v_exact)
            assert not torch.equal(k_exact, k_int4)
    assert feeds.page_mask[rows >= 0].all()
    streamed = mgr.metrics.streamed_pages
    finish_step(cache, step, feeds, outputs)
    attended = outputs.page_selected & feeds.page_mask
    assert mgr.metrics.streamed_pages - streamed == int((exact & attended).sum()) > 0  # accounted when attended
    mgr.check_invariants()


def test_fp16_engine_keeps_fp16_pools_and_follows_the_fp16_model(built, torch_model, tmp_path):
    """The default engine (--precision fp16): its graph takes float16 pools, so the tiered cache
    keeps its pools in float16 and binds them as they are (no converted copy per step); step by
    step (a chunked prefill, then decode steps fed the same tokens) its logits follow the torch
    backend running the model in float16 (export.model_at) within float16 rounding."""
    from tieredkv.builder.export import model_at
    from tieredkv.runtime.tiered.cache import TieredKVCache
    from tieredkv.runtime.tiered.engine_io import step_feeds

    out = tmp_path / "fp16"
    assert build_engine.main(["--tiered-kv", "--model", str(built[0]), "--output", str(out), "--page-size",
                              str(PAGE)]) == 0
    engine = OnnxRuntimeBackend(out, threads=1)
    assert engine.engine.kv_dtype == torch.float16 and engine.kv_spec().dtype == torch.float16
    reference = model_at(torch_model, torch.float16)
    kv = TieredKVConfig(page_size=PAGE)
    caches = {name: TieredKVCache(m.kv_spec(), kv, num_sequences=1) for name, m in (("engine", engine),
                                                                                   ("torch", reference))}
    sids = {name: cache.add_sequence() for name, cache in caches.items()}
    ids = torch.tensor(prompts(29, seed=4)[0])
    for start, n in ((0, 16), (16, 13)) + tuple((29 + i, 1) for i in range(6)):
        tokens = (ids[start:start + n] if start < 29 else ids[start - 29:start - 28]).view(1, -1)
        positions = torch.arange(start, start + n).view(1, -1)
        logits = {name: m(tokens, positions, caches[name], [sids[name]])
                  for name, m in (("engine", engine), ("torch", reference))}
        assert float((logits["engine"] - logits["torch"]).abs().max()) < 2e-3, (start, n)
    cache = caches["engine"]
    assert cache.mgr.device.k[0].dtype == torch.float16
    cache.begin_step([sids["engine"]], 1)
    feeds = step_feeds(cache, tiered_graph=True, kv_dtype=torch.float16)
    assert feeds.k_pool[0].data_ptr() == cache.mgr.device.k[0].data_ptr()  # bound in place, no copy


def test_in_place_append_check():
    """layers_not_appended_in_place (the TensorRT backend's check after a step, KVAppend's
    outputs aliasing its input pools): the bound pools must hold the step's new K/V at the
    written slots; a layer whose pools were left as they were is named."""
    from tieredkv.runtime.engine import layers_not_appended_in_place

    gen = torch.Generator().manual_seed(0)
    L, B, T, kvh, d, c, p = 3, 2, 2, 2, 4, 5, 4
    slot = torch.randint(0, c, (L, B, T), generator=gen)
    offset = torch.tensor([[0, 1], [2, 3]])
    k_new = torch.randn(L, B, kvh, T, d, generator=gen).half()
    v_new = torch.randn(L, B, kvh, T, d, generator=gen).half()
    bound = {"write_slot": slot, "write_offset": offset}
    for layer in range(L):
        for kind, new in (("k", k_new), ("v", v_new)):
            pool = torch.zeros(c, kvh, p, d, dtype=torch.float16)
            for b in range(B):
                for t in range(T):
                    pool[slot[layer, b, t], :, offset[b, t]] = new[layer, b, :, t]
            bound[f"{kind}_pool_{layer}"] = pool
    outputs = {"k_new": k_new, "v_new": v_new}
    assert layers_not_appended_in_place(bound, outputs) == []
    bound["v_pool_1"] = torch.zeros_like(bound["v_pool_1"])  # layer 1's values went to another buffer
    bound["k_pool_2"][slot[2, 1, 0], 0, offset[1, 0], 3] += 1
    assert layers_not_appended_in_place(bound, outputs) == [1, 2]


def test_warm_engine_refuses_another_codec(warm_backend):
    with pytest.raises(ConfigError, match="warm_codec 'fp8' .* engine's 'int4'"):
        run(warm_backend, TieredKVConfig(**TIGHT, warm_codec="fp8"), prompts(9))
    with pytest.raises(ConfigError, match="warm_ladder 'int2:0.5' runs in the PyTorch backend only"):
        run(warm_backend, TieredKVConfig(**TIGHT, warm_codec="int4", warm_ladder="int2:0.5"), prompts(9))


def test_backend_is_a_drop_in_for_the_model(backend, torch_model):
    assert backend.config == load_checkpoint(backend.engine.raw["source"]["path"]).config
    assert backend.kv_spec() == torch_model.kv_spec()
    assert backend.steps > 0 and backend.run_seconds > 0
    assert read_engine_dir(backend.engine.path).selection_weights == (1.0, 0.0, 0.0)


def test_plain_engine_runs_without_budgets_only(built, torch_model):
    plain = OnnxRuntimeBackend(built[2], threads=1)
    ids = prompts(21, 9, seed=3)
    assert run(plain, TieredKVConfig(page_size=PAGE), ids)[0] == run(torch_model, TieredKVConfig(page_size=PAGE), ids)[0]
    with pytest.raises(ConfigError, match="without --tiered-kv"):
        run(plain, TieredKVConfig(**TIGHT), ids)


def test_mismatched_cache_configs_are_refused(backend):
    ids = prompts(9)
    with pytest.raises(ConfigError, match="page_size 16 .* engine's 4"):
        run(backend, TieredKVConfig(), ids)
    with pytest.raises(ConfigError, match="selection_weights"):
        run(backend, TieredKVConfig(page_size=PAGE, selection_weights=(0.5, 0.5, 0.0)), ids)
    with pytest.raises(ConfigError, match="selection_aggregate 'head-rank' runs in the PyTorch backend only"):
        run(backend, TieredKVConfig(page_size=PAGE, selection_aggregate="head-rank"), ids)
    with pytest.raises(ConfigError, match="selection_aggregate 'kv-head' runs in the PyTorch backend only"):
        run(backend, TieredKVConfig(page_size=PAGE, selection_aggregate="kv-head"), ids)
    with pytest.raises(ConfigError, match="dense_layers = 2 runs in the PyTorch backend only"):
        run(backend, TieredKVConfig(page_size=PAGE, dense_layers=2), ids)
    with pytest.raises(ConfigError, match="tiered KV cache"):
        LLM.from_model(backend, None, prefill_chunk=16).generate(ids, SamplingParams(max_new_tokens=2))


def test_engine_dir_errors(built, tmp_path):
    with pytest.raises(EngineError, match="not found"):
        read_engine_dir(tmp_path / "nope")
    with pytest.raises(EngineError, match="config.json is missing"):
        read_engine_dir(tmp_path)
    bad = tmp_path / "old"
    shutil.copytree(built[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, format_version=1)))
    with pytest.raises(EngineError, match="version 1.*rebuild"):
        read_engine_dir(bad)
    (bad / "config.json").write_text(json.dumps(dict(cfg, build=dict(cfg["build"], precision="bf16"))))
    with pytest.raises(EngineError, match=r"build.precision 'bf16'; expected one of \['fp16', 'fp32'\]"):
        read_engine_dir(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "step.onnx").unlink()
    with pytest.raises(EngineError, match="step.onnx is missing"):
        read_engine_dir(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(EngineError, match="not a tieredkv engine config"):
        read_engine_dir(bad)


def test_tensorrt_backend_without_tensorrt_says_what_to_do(built):
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("TensorRT is installed here")
    with pytest.raises(BackendUnavailableError, match="TensorRT is not installed.*onnxruntime"):
        TensorRTBackend(built[1])
    assert isinstance(load_backend(built[1], threads=1), OnnxRuntimeBackend)  # auto falls back
    with pytest.raises(ConfigError, match="unknown engine backend"):
        load_backend(built[1], "tvm")


def test_engine_tokenizer_round_trips(built):
    original = load_checkpoint(built[0]).tokenizer
    saved = Tokenizer.from_hf_dir(built[1] / "tokenizer")
    text = "hello world, hello"
    assert saved.encode(text) == original.encode(text)
    assert (saved.bos_token_id, saved.eos_token_ids, saved.add_bos) == \
        (original.bos_token_id, original.eos_token_ids, original.add_bos)
    assert saved.chat_template == original.chat_template


@pytest.mark.slow  # the CLI end to end on an engine
def test_llm_from_engine_and_cli_generate_with_engine(built, torch_model, tmp_path):
    import subprocess
    import sys

    llm = LLM.from_engine(str(built[1]), backend="onnxruntime", threads=1, prefill_chunk=16)
    assert llm.kv_config.page_size == PAGE and llm.tokenizer is not None
    ids = prompts(25)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert llm.generate(ids, params)[0].token_ids == run(torch_model, TieredKVConfig(page_size=PAGE), ids,
                                                         new_tokens=8)[0][0]
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tieredkv.cli", "generate", "--prompt", "hello world", "--max-new-tokens", "6",
           "--json", "--no-stream"]
    outs = []
    for extra in (["--engine", str(built[1]), "--backend", "onnxruntime"], ["--model", str(built[0]), "--page-size",
                                                                             str(PAGE)]):
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1])["completions"][0]["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) > 0
    proc = subprocess.run(cmd + ["--engine", str(built[1]), "--model", str(built[0])], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode != 0 and "--engine" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # the CLI end to end on an engine
def test_cli_eval_perplexity_with_engine_equals_the_model(built, tmp_path, capsys):
    from tieredkv.cli import main

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    common = ["eval", "perplexity", "--text-file", str(text), "--window", "256", "--max-windows", "2", "--json"]
    values = []
    budget = ["--kv-budget", "50%", "--budget-reference", "float32", "--mode", "exact"]  # 50 % of the float32 pages
    for extra in (["--engine", str(built[1]), *budget], ["--model", str(built[0]), "--page-size", str(PAGE), *budget]):
        assert main(common + extra) == 0
        values.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"])
    assert values[0] == pytest.approx(values[1], rel=1e-5)


def test_cli_eval_passkey_with_engine_equals_the_model(built, tmp_path, capsys):
    """`eval passkey --engine` under a budget: the same answers and key log-probs as the model;
    a --kv-config file without page_size runs at the engine's page size."""
    from tieredkv.cli import main

    text = tmp_path / "hay.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    kv = tmp_path / "kv.toml"
    kv.write_text('mode = "exact"\ndevice_budget = "50%"\nbudget_reference = "float32"\n')  # default warm tier, exact reads
    common = ["eval", "passkey", "--haystack-file", str(text), "--context", "300", "--trials", "2", "--json"]
    results = []
    for extra in (["--engine", str(built[1]), "--kv-config", str(kv)],
                  ["--model", str(built[0]), "--page-size", str(PAGE), "--kv-config", str(kv)]):
        assert main(common + extra) == 0
        d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        results.append(([r["answer"] for r in d["results"]], [r["logprob"] for r in d["results"]], d["stats"]))
    assert results[0][0] == results[1][0]
    assert results[0][1] == pytest.approx(results[1][1], abs=1e-3)
    assert results[0][2]["misses"] == results[1][2]["misses"] > 0


def test_an_engine_directory_names_nothing_outside_itself(built, tmp_path):
    """config.json may not point the graph, the TensorRT engine or the tokenizer outside the
    directory (an absolute path, ../, a link out); EngineError before anything is read."""
    for key, value in ((("graphs", "step", "file"), "/etc/passwd"), (("graphs", "step", "file"), "../outside.onnx"),
                       (("build", "tensorrt_engine"), "/tmp/x.plan"), (("tokenizer",), "../../tok"),
                       (("graphs", "step", "file"), 7)):
        eng = tmp_path / f"eng{abs(hash((key, str(value)))) % 10**6}"
        shutil.copytree(built[1], eng)
        cfg = json.loads((eng / "config.json").read_text())
        node = cfg
        for k in key[:-1]:
            node = node[k]
        node[key[-1]] = value
        (eng / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(EngineError, match="relative path inside|leaves the engine directory"):
            read_engine_dir(eng)
    eng = tmp_path / "linked"
    shutil.copytree(built[1], eng)
    (tmp_path / "other.onnx").write_bytes((eng / "step.onnx").read_bytes())
    (eng / "step.onnx").unlink()
    (eng / "step.onnx").symlink_to(tmp_path / "other.onnx")
    with pytest.raises(EngineError, match="leaves the engine directory"):
        read_engine_dir(eng)


@pytest.mark.parametrize("damage,match", [
    (lambda eng: (eng / "step.onnx").write_bytes((eng / "step.onnx").read_bytes()[:5000]), "cannot load the step graph"),
    (lambda eng: (eng / "step.onnx").write_bytes(b"not a protobuf at all"), "cannot load the step graph"),
    (lambda eng: _edit(eng, lambda c: c["model"].update(num_kv_heads=1, num_heads=4)), "k_pool_0 has dimensions"),
    (lambda eng: _edit(eng, lambda c: c["model"].update(num_layers=3)), "are not those of the engine"),
    (lambda eng: _edit(eng, lambda c: c["build"].update(page_size=8)), "k_pool_0 has dimensions"),
    (lambda eng: _edit(eng, lambda c: c.update(tiered_kv=False)), "are not those of the engine"),
    (lambda eng: _edit(eng, lambda c: c["build"].update(warm_codec="zstd")), "not a codec an engine reads"),
    (lambda eng: _edit(eng, lambda c: c["build"].update(warm_codec="int4")), "are not those of the engine"),
    (lambda eng: _edit(eng, lambda c: c["ops"]["versions"].update(KVAppend="7")), "op versions"),
])
def test_an_engine_must_match_its_config(built, tmp_path, damage, match):
    eng = tmp_path / "eng"
    shutil.copytree(built[1], eng)
    damage(eng)
    with pytest.raises(EngineError, match=match):
        OnnxRuntimeBackend(eng, threads=1)


def _edit(eng, change) -> None:
    cfg = json.loads((eng / "config.json").read_text())
    change(cfg)
    (eng / "config.json").write_text(json.dumps(cfg))
