"""builder: the step ONNX graph (`tieredkv.builder.export`) runs in ONNX Runtime CPU and
matches the PyTorch reference — decode and prefill steps on awkward sizes (per-layer page
tables, residency, T0, budgets, partial pages, padding), the selection rule, the K/V write
against the real paged cache — and `builder/build_engine.py` writes engine directories
atomically with clear errors. Running engines under the tiered runtime: test_engine_backend.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from helpers import tiny_model, write_gguf  # noqa: E402
from tieredkv.builder.export import (  # noqa: E402
    PAD_INDEX,
    StepGraphOptions,
    build_step_graph,
    model_at,
    random_step_inputs,
    reference_step,
    onnx_session,
    run_onnx,
    save_step_graph,
)
from tieredkv.models.config import LlamaConfig, RopeScaling  # noqa: E402
from tieredkv.models.llama import decode_one_token, prefill, rope_inv_freq  # noqa: E402
from tieredkv.plugins.onnx_ops import DOMAIN, OPSET, PLUGIN_VERSION  # noqa: E402
from tieredkv.runtime.tiered.engine_io import StepFeeds, StepOutputs  # noqa: E402
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache  # noqa: E402
from tieredkv.builder.tensorrt_build import tensorrt_profiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGE = 5  # awkward on purpose
LOGITS_ATOL = 1e-4
#: float16 graphs against the model in float16 (export.model_at): the same rounding points, sums
#: in another order (measured: logits 4e-4, new K/V one float16 ulp)
FP16_ATOL = {"logits": 2e-3, "other": 2e-3}
BUILD_SCRIPT = ROOT / "builder" / "build_engine.py"
MIXED = (0.5, 0.3, 0.2)


def session(path: Path) -> ort.InferenceSession:
    return onnx_session(path, threads=1)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module", params=["tiered", "tiered-mixed", "tiered-warm-int4", "tiered-warm-fp8-r2", "plain",
                                        "fp16-tiered-warm-int4", "fp16-plain"])
def graph(request, model, tmp_path_factory):
    """(options, path, session) of the tiny model's step graph."""
    name = request.param.removeprefix("fp16-")
    warm = name.removeprefix("tiered-warm-") if name.startswith("tiered-warm") else None
    options = StepGraphOptions(tiered_kv=name != "plain", page_size=PAGE,
                               selection_weights=MIXED if name == "tiered-mixed" else (1.0, 0.0, 0.0),
                               warm_codec=warm, precision="fp16" if request.param.startswith("fp16") else "fp32")
    path = tmp_path_factory.mktemp("graph") / "step.onnx"
    save_step_graph(build_step_graph(model, options), path)
    return options, path, session(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("ckpt") / "tiny.gguf", tiny_model(seed=5))


def max_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# ---------------------------------------------------------------------------- the graph


def test_graph_passes_full_check_and_declares_the_interface(graph, model):
    options, path, _ = graph
    tiered = options.tiered_kv
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path))
    n = model.config.num_layers
    warm = options.warm_codec is not None
    assert [i.name for i in proto.graph.input] == StepFeeds.names(n, tiered_kv=tiered, warm=warm)
    assert [o.name for o in proto.graph.output] == StepOutputs.names(n, tiered_kv=tiered)
    custom_nodes = [nd for nd in proto.graph.node if nd.domain == DOMAIN]
    scorers = (2 if options.selection_weights == MIXED else 1) if tiered else 0
    assert sorted(nd.op_type for nd in custom_nodes) == sorted(
        ["KVAppend", "TieredAttention"] * n + ["ImportanceScore"] * scorers * n + ["SelectPages"] * tiered * n)
    plugin_nodes = [nd for nd in custom_nodes if nd.op_type != "SelectPages"]
    for nd in custom_nodes:  # SelectPages has no plugin: TensorRT inlines its body
        attrs = {a.name: a for a in nd.attribute}
        assert (attrs["plugin_version"].s.decode() if nd in plugin_nodes else attrs.get("plugin_version")) == \
            (PLUGIN_VERSION if nd in plugin_nodes else None)
    want_fns = {"KVAppend", "TieredAttention"} | ({"ImportanceScore", "SelectPages"} if tiered else set())
    if warm:  # TieredAttention reads the warm pool through the page decoder; the node names its codec
        want_fns.add(f"KVDecodePages_{options.warm_codec.replace('-', '_')}")
        for nd in plugin_nodes:
            if nd.op_type == "TieredAttention":
                assert len(nd.input) == 10
                assert next(a for a in nd.attribute if a.name == "warm_codec").s.decode() == options.warm_codec
    assert {f.name for f in proto.functions} == want_fns
    assert {(o.domain, o.version) for o in proto.opset_import} == {("", OPSET), (DOMAIN, 1)}
    # B, T, M and each layer's pool size are dynamic; P, KVH, D are the model's / the build's
    inputs = {i.name: i.type.tensor_type.shape.dim for i in proto.graph.input}
    assert inputs["k_pool_1"][0].dim_param == "C1"
    assert [d.dim_value for d in inputs["k_pool_1"][1:]] == [model.config.num_kv_heads, PAGE, model.config.head_dim]
    assert [d.dim_param for d in inputs["input_ids"]] == ["B", "T"]
    assert inputs["page_table"][0].dim_value == n
    # the precision's dtype: weights, pools and new K/V; float32 logits, summaries, relevance and mass
    dt = onnx.TensorProto.FLOAT16 if options.precision == "fp16" else onnx.TensorProto.FLOAT
    types = {v.name: v.type.tensor_type.elem_type for v in list(proto.graph.input) + list(proto.graph.output)}
    assert types["k_pool_0"] == types["v_pool_1"] == types["k_new"] == types["v_new"] == dt
    assert types["logits"] == onnx.TensorProto.FLOAT
    if tiered:
        assert types["key_min"] == types["page_relevance"] == types["page_mass"] == onnx.TensorProto.FLOAT
    weights = {t.name: t.data_type for t in proto.graph.initializer}
    assert weights["layers.0.self_attn.q_proj.weight"] == weights["embed_tokens.weight"] == dt
    assert weights["rope.inv_freq"] == onnx.TensorProto.FLOAT  # RoPE in float32 whatever the precision


@pytest.mark.parametrize("new_tokens,seq_lens", [(1, [13, 4, 31]), (3, [13, 4, 9])], ids=["decode", "prefill"])
@pytest.mark.parametrize("model_kv", [False, True], ids=["random_kv", "model_kv"])
def test_step_matches_reference(graph, model, new_tokens, seq_lens, model_kv):
    options, _, sess = graph
    feeds = random_step_inputs(model, page_size=PAGE, seq_lens=seq_lens, new_tokens=new_tokens,
                               tiered_kv=options.tiered_kv, seed=11, model_kv=model_kv, warm_codec=options.warm_codec,
                               kv_dtype=options.dtype)
    assert (feeds["page_index"][1, 1:] == PAD_INDEX).all()  # padding of the shorter sequence
    got = run_onnx(sess, feeds)
    want = reference_step(model_at(model, options.dtype), feeds, tiered_kv=options.tiered_kv,
                          selection_weights=options.selection_weights, warm_codec=options.warm_codec)
    assert set(got) == set(want) == set(StepOutputs.names(model.config.num_layers, tiered_kv=options.tiered_kv))
    assert got["logits"].shape == (len(seq_lens), new_tokens, model.config.vocab_size)
    fp16 = options.precision == "fp16"
    assert max_err(got["logits"], want["logits"]) < (FP16_ATOL["logits"] if fp16 else LOGITS_ATOL)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert max_err(got[name], want[name]) < (FP16_ATOL["other"] if fp16 else 1e-5), name
    if options.tiered_kv:
        np.testing.assert_array_equal(got["page_selected"], want["page_selected"])
        attended = got["page_selected"] & feeds["page_mask"]
        assert np.all(got["page_mass"][~attended] == 0)
        np.testing.assert_allclose(got["page_mass"].sum(-1), new_tokens, atol=1e-5)  # one per query
        assert not np.array_equal(attended, feeds["page_mask"])  # selection is at work
    if options.warm_codec is not None and new_tokens == 1:  # attended warm pages (their page_table points elsewhere)
        assert (attended & (feeds["page_warm_row"] >= 0)).any()


def test_selection_rule(graph, model):
    """T0 always; the top pages by relevance up to the budget; every page when the budget
    covers them; a selected page outside the pool is not attended."""
    options, _, sess = graph
    if not options.tiered_kv:
        pytest.skip("plain graphs do not select")
    feeds = random_step_inputs(model, page_size=PAGE, seq_lens=[48, 26], tiered_kv=True, seed=5, model_kv=True,
                               warm_codec=options.warm_codec, kv_dtype=options.dtype)
    valid = feeds["page_index"] < PAD_INDEX
    pinned = feeds["page_pinned"]
    everything = run_onnx(sess, dict(feeds, attend_pages=np.array([PAD_INDEX, 6], np.int64)))["page_selected"]
    assert (everything[:, 0] == valid[0]).all() and (everything[:, 1] == valid[1]).all()  # 6 >= 6 pages of seq 1
    only_t0 = run_onnx(sess, dict(feeds, attend_pages=np.array([2, 1], np.int64)))["page_selected"]
    assert (only_t0 == (pinned & valid)[None]).all()
    out = run_onnx(sess, dict(feeds, attend_pages=np.array([5, 4], np.int64)))
    sel = out["page_selected"]
    assert (sel.sum(-1) == np.array([5, 4])[None]).all()
    if options.selection_weights == (1.0, 0.0, 0.0):  # the extra pages are the most relevant candidates
        for layer in range(sel.shape[0]):
            for b in range(2):
                cand = valid[b] & ~pinned[b]
                rel = out["page_relevance"][layer, b]
                picked, rest = rel[sel[layer, b] & cand], rel[~sel[layer, b] & cand]
                assert picked.min() >= rest.max()
    off = sel & ~feeds["page_mask"]
    assert off.any() and np.all(out["page_mass"][off] == 0)


def _page_feeds(cache: PagedKVCache, seq_ids: list[int], lengths: list[int]) -> dict[str, np.ndarray]:
    """Plain-graph inputs for sequences holding ``lengths`` tokens (the new one included) in
    ``cache``, each layer's own page table, every page in the pool."""
    L = cache.spec.num_layers
    m = max(len(cache.tables[s]) for s in seq_ids)
    table = np.zeros((L, len(seq_ids), m), np.int64)
    for layer in range(L):
        for b, s in enumerate(seq_ids):
            t = cache.tables[s]
            table[layer, b, : len(t)] = t
    index = np.array([[j if j * PAGE < n else PAD_INDEX for j in range(m)] for n in lengths], np.int64)
    seq_len = np.array(lengths, np.int64)
    pos = seq_len - 1
    write = np.array([[[cache.tables[s][p // PAGE]] for s, p in zip(seq_ids, pos)] for layer in range(L)])
    feeds = {"page_table": table, "page_mask": np.broadcast_to(index < PAD_INDEX, table.shape).copy(),
             "page_index": index, "seq_len": seq_len, "positions": pos[:, None], "write_slot": write.astype(np.int64),
             "write_offset": (pos % PAGE)[:, None]}
    for layer in range(L):
        feeds[f"k_pool_{layer}"] = cache.pool.k[layer].numpy().copy()
        feeds[f"v_pool_{layer}"] = cache.pool.v[layer].numpy().copy()
    return feeds


def test_plain_step_equals_paged_cache_step_and_its_write(graph, model):
    """Against the reference model (in the graph's dtype) on the real PagedKVCache: prefill two
    sequences, decode one token each; the plain graph fed the cache's pools before the step
    gives the same logits, and its new K/V are what the cache wrote."""
    options, _, sess = graph
    if options.tiered_kv:
        pytest.skip("the plain graph")
    model = model_at(model, options.dtype)
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=PAGE, initial_pages=16, max_pages=16))
    seqs = [cache.add_sequence(), cache.add_sequence()]
    gen = torch.Generator().manual_seed(1)
    for sid, n in zip(seqs, (10, 3)):  # sequence 0 crosses into a new page on the decode step
        prefill(model, cache, sid, torch.randint(0, model.config.vocab_size, (n,), generator=gen))
    tokens, positions = torch.tensor([7, 300]), torch.tensor([10, 3])
    before = {k: v.copy() for k, v in _page_feeds(cache, seqs, [10, 3]).items() if "_pool_" in k}
    want = decode_one_token(model, cache, seqs, tokens, positions)
    feeds = dict(_page_feeds(cache, seqs, [11, 4]), **before, input_ids=tokens.numpy()[:, None])
    got = run_onnx(sess, feeds)
    fp16 = options.precision == "fp16"
    assert max_err(got["logits"][:, 0], want.numpy()) < (FP16_ATOL["logits"] if fp16 else LOGITS_ATOL)
    for layer in range(model.config.num_layers):
        k, v, _ = cache.gather(layer, seqs)  # [B, KVH, S, D]
        for b, p in enumerate((10, 3)):
            assert max_err(got["k_new"][layer, b, :, 0], k[b, :, p]) < (FP16_ATOL["other"] if fp16 else 1e-6)
            assert max_err(got["v_new"][layer, b, :, 0], v[b, :, p]) < (FP16_ATOL["other"] if fp16 else 1e-6)


def test_rope_scaling_and_tied_embeddings(tmp_path):
    """llama3 RoPE scaling at long positions (all three frequency bands in play) and a tied
    LM head that reuses the embedding initializer."""
    scaling = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=256)
    m = tiny_model(seed=7, rope_scaling=scaling, tie_word_embeddings=True)
    proto = build_step_graph(m, StepGraphOptions(tiered_kv=True, page_size=64))
    inits = {t.name: t for t in proto.graph.initializer}
    assert "lm_head.weight" not in inits
    inv_freq = onnx.numpy_helper.to_array(inits["rope.inv_freq"])
    np.testing.assert_array_equal(inv_freq, rope_inv_freq(m.config).numpy())
    assert not np.allclose(inv_freq, rope_inv_freq(dataclasses.replace(m.config, rope_scaling=None)))
    path = tmp_path / "step.onnx"
    save_step_graph(proto, path)
    feeds = random_step_inputs(m, page_size=64, seq_lens=[700, 131], tiered_kv=True, seed=2)
    got = run_onnx(session(path), feeds)
    assert max_err(got["logits"], reference_step(m, feeds)["logits"]) < LOGITS_ATOL


def test_external_data_switch(model, tmp_path):
    inline, external = tmp_path / "a" / "step.onnx", tmp_path / "b" / "step.onnx"
    inline.parent.mkdir()
    external.parent.mkdir()
    options = StepGraphOptions(tiered_kv=True, page_size=PAGE)
    assert save_step_graph(build_step_graph(model, options), inline) is False  # tiny: inline by default
    assert save_step_graph(build_step_graph(model, options), external, external_data=True) is True
    assert (external.parent / "step.onnx.data").stat().st_size > external.stat().st_size
    onnx.checker.check_model(str(external), full_check=True)
    feeds = random_step_inputs(model, page_size=PAGE, seq_lens=[6], tiered_kv=True, seed=4)
    assert max_err(run_onnx(session(external), feeds)["logits"], run_onnx(session(inline), feeds)["logits"]) == 0


def test_options_reject_bad_values():
    with pytest.raises(ValueError, match="page_size"):
        StepGraphOptions(page_size=0)
    with pytest.raises(ValueError, match="selection_weights"):
        StepGraphOptions(selection_weights=(1.0, -0.5, 0.0))
    with pytest.raises(ValueError, match="tiered graph"):
        StepGraphOptions(tiered_kv=False, warm_codec="int4")
    with pytest.raises(ValueError, match="no ONNX form"):
        StepGraphOptions(warm_codec="fp8-r2-delta")
    with pytest.raises(ValueError, match="expected one of"):
        StepGraphOptions(warm_codec="zip")


def test_tensorrt_profiles_cover_decode_and_prefill(model):
    c = model.config
    profiles = tensorrt_profiles(c, page_size=16, max_batch=4, max_context=1000, prefill_chunk=128, tiered_kv=True)
    assert set(profiles) == {"decode", "prefill"}
    names = set(StepFeeds.names(c.num_layers, tiered_kv=True))
    for prof in profiles.values():
        assert set(prof) == names
        for lo, opt, hi in prof.values():
            assert len(lo) == len(opt) == len(hi) and all(a <= b <= z for a, b, z in zip(lo, opt, hi))
    assert profiles["decode"]["input_ids"] == [[1, 1], [2, 1], [4, 1]]
    assert profiles["prefill"]["input_ids"][2] == [4, 128]
    assert profiles["decode"]["page_table"][2] == [c.num_layers, 4, 63]  # ceil(1000 / 16) pages
    assert profiles["decode"]["k_pool_0"][2] == [2 * 4 * 63, c.num_kv_heads, 16, c.head_dim]
    warm = tensorrt_profiles(c, page_size=16, max_batch=4, max_context=1000, prefill_chunk=128, tiered_kv=True,
                             warm_codec="int4")["decode"]
    assert set(warm) == set(StepFeeds.names(c.num_layers, tiered_kv=True, warm=True))
    from tieredkv.plugins.codec import CODECS, page_bytes
    assert warm["warm_pool_0"] == [[1, page_bytes(CODECS["int4"], c.num_kv_heads, 16, c.head_dim) // 4],  # int32 words
                                   [126, warm["warm_pool_0"][1][1]], [4 * 63, warm["warm_pool_0"][1][1]]]


# ---------------------------------------------------------------------------- the CLI


def run_build(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    return subprocess.run([sys.executable, str(BUILD_SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.slow  # a whole build in a subprocess
def test_cli_builds_engine_dir_replacing_with_force(tiny_gguf, tmp_path):
    out = tmp_path / "engines" / "tiny"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"format": "tieredkv-engine", "format_version": 1}))  # an old engine
    (out / "step.onnx").write_text("old graph")
    proc = run_build("--tiered-kv", "--model", str(tiny_gguf), "--output", str(out), "--force", "--page-size", "8")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "max |logits error|" in proc.stderr and "TensorRT" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "polygraphy", "step.onnx", "tokenizer", "trtexec.sh"]
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no temporary siblings left
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tiered_kv"] is True and cfg["opset"] == OPSET
    assert set(cfg["ops"]["versions"].values()) == {PLUGIN_VERSION}
    assert cfg["build"]["page_size"] == 8
    assert cfg["build"]["verification_max_abs_error"]["logits"] < 1e-3
    config = LlamaConfig.from_dict(cfg["model"])
    assert (config.num_layers, config.vocab_size, config.num_kv_heads) == (2, 512, 2)
    onnx.checker.check_model(str(out / "step.onnx"), full_check=True)


@pytest.mark.slow  # a whole build in a subprocess
def test_cli_force_replaces_engine_directories_only(tiny_gguf, tmp_path):
    """--force never deletes what is not an engine: a directory of user files, a file, a link,
    the current directory; each is refused before anything is loaded or written."""
    users = tmp_path / "work"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    (tmp_path / "file.txt").write_text("data")
    (tmp_path / "link").symlink_to(users)
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "config.json").write_text('{"format": "something-else"}')
    mixed = tmp_path / "mixed"  # an engine with the user's notes in it
    mixed.mkdir()
    (mixed / "config.json").write_text('{"format": "tieredkv-engine"}')
    (mixed / "notes.md").write_text("mine")
    for output, match in ((users, "not an engine directory"), (tmp_path / "file.txt", "not a directory"),
                          (tmp_path / "link", "not a directory"), (fake, "not an engine directory"),
                          (mixed, "also holds ['notes.md']")):
        proc = run_build("--model", str(tiny_gguf), "--output", str(output), "--force")
        assert proc.returncode == 2 and match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BUILD_SCRIPT), "--model", str(tiny_gguf), "--output", ".", "--force"],
                          capture_output=True, text=True, env=env, cwd=users, timeout=600)
    assert proc.returncode == 2 and "not an engine directory" in proc.stderr
    assert (users / "thesis.tex").read_text() == "years of work" and (tmp_path / "file.txt").read_text() == "data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake", "file.txt", "link", "mixed", "work"]
    assert (mixed / "notes.md").read_text() == "mine"


@pytest.mark.slow  # a whole build in a subprocess
def test_cli_sigterm_and_a_killed_build_leave_nothing(tiny_gguf, tmp_path):
    """SIGTERM during a build removes the half-built directory (exit 143); a work directory a
    killed build left (its process gone) is removed by the next build there."""
    import os
    import signal
    import time

    out = tmp_path / "eng"
    stale = tmp_path / ".eng.building-999999999-abcd"  # no such process
    stale.mkdir()
    (stale / "step.onnx").write_bytes(b"half")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(BUILD_SCRIPT), "--tiered-kv", "--model", str(tiny_gguf), "--output",
                             str(out), "--page-size", "8"], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and not any(p.name.startswith(f".eng.building-{proc.pid}-") for p in tmp_path.iterdir()):
        time.sleep(0.05)
    assert not stale.exists()  # the stale one went first
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, proc.stderr.read()
    assert "terminated; nothing was written" in proc.stderr.read()
    assert list(tmp_path.iterdir()) == []


def test_sigterm_inside_an_import_is_still_a_termination(monkeypatch, capsys):
    """A SIGTERM that lands inside a C extension's initialisation (importing ONNX Runtime)
    reaches the build as ``ImportError: initialization failed``, not as the handler's
    SystemExit: the build still reports a termination (143), not a failure."""
    import signal
    import time

    from tieredkv.builder import build_engine

    def build(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except SystemExit:
            raise ImportError("initialization failed") from None  # what the interpreter turns it into

    monkeypatch.setattr(build_engine, "build", build)
    assert build_engine.main(["--model", "x.gguf", "--output", "out"]) == 143
    assert "terminated; nothing was written" in capsys.readouterr().err


def test_cli_existing_dir_without_force_is_left_alone(tiny_gguf, tmp_path):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_build("--model", str(tiny_gguf), "--output", str(out))
    assert proc.returncode == 2
    assert str(out) in proc.stderr and "--force" in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]


def test_cli_missing_checkpoint_leaves_nothing(tmp_path):
    out = tmp_path / "new" / "engine"
    proc = run_build("--tiered-kv", "--model", str(tmp_path / "missing.gguf"), "--output", str(out))
    assert proc.returncode == 2
    assert "missing.gguf" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a whole build in a subprocess
def test_cli_failed_verification_keeps_the_old_engine(tiny_gguf, tmp_path):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "config.json").write_text('{"format": "tieredkv-engine"}')
    (out / "step.onnx").write_text("the old graph")
    proc = run_build("--model", str(tiny_gguf), "--output", str(out), "--force", "--tolerance", "0")
    assert proc.returncode == 1
    assert "differ from the PyTorch reference" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "step.onnx"]
    assert (out / "step.onnx").read_text() == "the old graph"
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]


@pytest.mark.slow  # a whole build in a subprocess
def test_cli_warm_codec_engine_and_its_errors(tiny_gguf, tmp_path):
    out = tmp_path / "warm"
    proc = run_build("--tiered-kv", "--warm-codec", "fp8-r2", "--model", str(tiny_gguf), "--output", str(out),
                     "--page-size", "8")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["build"]["warm_codec"] == "fp8-r2"
    assert "page_warm_row" in cfg["graphs"]["step"]["inputs"] and "warm_pool_1" in cfg["graphs"]["step"]["inputs"]
    for args, says in ((["--warm-codec", "int4"], "needs --tiered-kv"),
                       (["--tiered-kv", "--warm-codec", "fp8-r2-delta"], "no ONNX form")):
        bad = tmp_path / "bad"
        proc = run_build(*args, "--model", str(tiny_gguf), "--output", str(bad))
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr
        assert not bad.exists()


@pytest.mark.slow  # a whole build in a subprocess
def test_cli_unwritable_output_and_unsupported_model_leave_nothing(tiny_gguf, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # an output under a regular file cannot be created, even as root
    proc = run_build("--tiered-kv", "--model", str(tiny_gguf), "--output", str(blocker / "engines" / "e"))
    assert proc.returncode == 2 and "cannot create" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and blocker.read_text() == "not a directory"
    # a readable checkpoint of another architecture: typed error naming it, nothing written
    other = write_gguf(tmp_path / "other.gguf", tiny_model(seed=2), arch="gpt2")
    out = tmp_path / "engine"
    proc = run_build("--tiered-kv", "--model", str(other), "--output", str(out))
    assert proc.returncode == 2 and "gpt2" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
    # a selection mix the runtime could never run with
    proc = run_build("--tiered-kv", "--model", str(tiny_gguf), "--output", str(out), "--selection-weights", "1", "1", "0")
    assert proc.returncode == 2 and "summing to 1" in proc.stderr and not out.exists()


def test_rebuild_command_carries_every_option():
    from tieredkv.builder.build_engine import parse_args, rebuild_command

    args = parse_args(["--tiered-kv", "--warm-codec", "int4", "--output", "e", "--page-size", "8", "--selection-weights",
                       "0.5", "0.25", "0.25", "--tolerance", "0.01", "--external-data", "--max-batch", "4",
                       "--max-context", "4096", "--prefill-chunk", "256", "--precision", "fp32",
                       "--max-attention-pages", "200"])
    cmd = rebuild_command(args)
    for part in ("--tiered-kv", "--warm-codec int4", "--page-size 8", "--selection-weights 0.5 0.25 0.25",
                 "--tolerance 0.01", "--external-data", "--max-batch 4", "--max-context 4096", "--prefill-chunk 256",
                 "--precision fp32", "--max-attention-pages 200",
                 "--plugin-library build/plugins/libtieredkv_trt_plugins.so", "--model <checkpoint>"):
        assert part in cmd, part
    assert parse_args(cmd.split()[2:]).selection_weights == [0.5, 0.25, 0.25]  # the command parses back


def test_bare_warm_codec_selects_the_default_codec():
    from tieredkv.builder.build_engine import parse_args
    from tieredkv.plugins.codec import DEFAULT_CODEC

    assert parse_args(["--tiered-kv", "--warm-codec", "--output", "e"]).warm_codec == DEFAULT_CODEC == "int4"
    assert parse_args(["--tiered-kv", "--output", "e"]).warm_codec is None
