"""builder: the decode-step ONNX graph (`builder/export.py`) runs in ONNX Runtime CPU and
matches the PyTorch reference model — one step on awkward sizes (masked pages, partial
pages, different lengths), the K/V write, a greedy loop against the paged cache — and
`builder/build_engine.py` writes engine directories atomically with clear errors."""

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from builder.export import (  # noqa: E402
    DecodeGraphOptions,
    build_decode_graph,
    decode_input_names,
    decode_output_names,
    random_decode_inputs,
    reference_decode_step,
    run_onnx,
    save_decode_graph,
)
from helpers import tiny_model, write_gguf  # noqa: E402
from tieredkv.models.config import LlamaConfig, RopeScaling  # noqa: E402
from tieredkv.models.llama import decode_one_token, prefill, rope_inv_freq  # noqa: E402
from tieredkv.plugins.onnx_ops import DOMAIN, OPSET, PLUGIN_VERSION  # noqa: E402
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache  # noqa: E402

PAGE = 5  # awkward on purpose
LOGITS_ATOL = 1e-4
BUILD_SCRIPT = ROOT / "builder" / "build_engine.py"


def session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module", params=[True, False], ids=["tiered", "plain"])
def graph(request, model, tmp_path_factory):
    """(tiered flag, path, session) of the tiny model's decode graph."""
    tiered = request.param
    path = tmp_path_factory.mktemp("graph") / "decode.onnx"
    save_decode_graph(build_decode_graph(model, DecodeGraphOptions(tiered_kv=tiered, page_size=PAGE)), path)
    return tiered, path, session(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("ckpt") / "tiny.gguf", tiny_model(seed=5))


def max_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


# ---------------------------------------------------------------------------- the graph


def test_graph_passes_full_check_and_declares_the_interface(graph, model):
    tiered, path, sess = graph
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path))
    n = model.config.num_layers
    assert [i.name for i in proto.graph.input] == decode_input_names(n)
    assert [o.name for o in proto.graph.output] == decode_output_names(n, tiered_kv=tiered)
    assert any(o.name.startswith("page_mass") for o in proto.graph.output) == tiered
    plugin_nodes = [nd for nd in proto.graph.node if nd.domain == DOMAIN]
    assert sorted(nd.op_type for nd in plugin_nodes) == sorted(["KVAppend", "TieredAttention"] * n)
    for nd in plugin_nodes:
        attrs = {a.name: a for a in nd.attribute}
        assert attrs["plugin_version"].s.decode() == PLUGIN_VERSION
    assert {f.name for f in proto.functions} == {"KVAppend", "TieredAttention"}
    assert {(o.domain, o.version) for o in proto.opset_import} == {("", OPSET), (DOMAIN, 1)}
    # B, M and C are dynamic; P, KVH, D are the model's / the build's
    pool = proto.graph.input[decode_input_names(n).index("k_pool_0")].type.tensor_type.shape.dim
    assert pool[0].dim_param == "C"
    assert [d.dim_value for d in pool[1:]] == [model.config.num_kv_heads, PAGE, model.config.head_dim]


@pytest.mark.parametrize("model_kv", [False, True], ids=["random_kv", "model_kv"])
def test_decode_step_matches_reference_with_masked_and_partial_pages(graph, model, model_kv):
    tiered, _, sess = graph
    feeds = random_decode_inputs(model, page_size=PAGE, seq_lens=[13, 4], tiered_kv=tiered, seed=11,
                                 model_kv=model_kv)
    if tiered:
        assert not feeds["page_mask"][0, : -(-13 // PAGE)].all()  # a real page is masked out
    assert not feeds["page_mask"][1, 1:].any()  # padding of the shorter sequence
    got = run_onnx(sess, feeds)
    want = reference_decode_step(model, feeds, tiered_kv=tiered)
    assert set(got) == set(want)
    assert got["logits"].shape == (2, model.config.vocab_size)
    assert max_err(got["logits"], want["logits"]) < LOGITS_ATOL
    for name in want:
        assert max_err(got[name], want[name]) < 1e-5, name
    if tiered:
        mass = got["page_mass_0"]
        assert mass.shape == feeds["page_mask"].shape
        assert np.all(mass[~feeds["page_mask"]] == 0)
        np.testing.assert_allclose(mass.sum(-1), 1.0, atol=1e-5)
        # the mask changes the result: attending every page gives other logits
        valid = np.arange(feeds["page_mask"].shape[1]) < np.array([[3], [1]])  # 13 and 4 tokens on pages of 5
        full = dict(feeds, page_mask=valid)
        assert max_err(run_onnx(sess, full)["logits"], got["logits"]) > 1e-4


def _tables(cache: PagedKVCache, seq_ids: list[int]) -> list[list[int]]:
    """Per-sequence page tables (the graph takes one table for all layers: check they agree)."""
    tables = [cache.tables[s][0] for s in seq_ids]
    for s, t in zip(seq_ids, tables):
        assert all(cache.tables[s][layer] == t for layer in range(cache.spec.num_layers))
    return tables


def _pools(cache: PagedKVCache) -> dict[str, np.ndarray]:
    feeds = {}
    for layer, pool in enumerate(cache.pools):
        feeds[f"k_pool_{layer}"] = pool.k.numpy().copy()
        feeds[f"v_pool_{layer}"] = pool.v.numpy().copy()
    return feeds


def _page_inputs(tables: list[list[int]], lengths: list[int]) -> dict[str, np.ndarray]:
    """Graph page inputs for sequences holding ``lengths`` tokens (the new one included) on
    ``tables`` (column j = logical page j), every page attended."""
    m = max(len(t) for t in tables)
    table = np.array([t + [t[0]] * (m - len(t)) for t in tables], np.int64)
    mask = np.array([[j < len(t) for j in range(m)] for t in tables])
    seq_len = np.array(lengths, np.int64)
    pos = seq_len - 1
    return {"page_table": table, "page_mask": mask, "page_index": np.tile(np.arange(m, dtype=np.int64), (len(tables), 1)),
            "seq_len": seq_len, "positions": pos,
            "write_slot": np.array([t[p // PAGE] for t, p in zip(tables, pos)], np.int64),
            "write_offset": pos % PAGE}


def test_decode_step_equals_paged_cache_step_and_its_write(graph, model):
    """Against the reference model on the real PagedKVCache: prefill two sequences, snapshot
    the pools, decode one token each; the graph fed the snapshot gives the same logits and
    the same pools as the cache holds after its step."""
    _, _, sess = graph
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=PAGE, initial_pages=16, max_pages=16))
    seqs = [cache.add_sequence(), cache.add_sequence()]
    gen = torch.Generator().manual_seed(1)
    for sid, n in zip(seqs, (10, 3)):  # sequence 0 crosses into a new page on the decode step
        prefill(model, cache, sid, torch.randint(0, model.config.vocab_size, (n,), generator=gen))
    before = _pools(cache)
    tokens, positions = torch.tensor([7, 300]), torch.tensor([10, 3])
    want = decode_one_token(model, cache, seqs, tokens, positions)
    feeds = dict(before, input_ids=tokens.numpy(), **_page_inputs(_tables(cache, seqs), [11, 4]))
    got = run_onnx(sess, feeds)
    assert max_err(got["logits"], want.numpy()) < LOGITS_ATOL
    for name, value in _pools(cache).items():
        assert max_err(got[name.replace("_pool_", "_pool_out_")], value) < 1e-6, name


def test_rope_scaling_and_tied_embeddings(tmp_path):
    """llama3 RoPE scaling at long positions (all three frequency bands in play) and a tied
    LM head that reuses the embedding initializer."""
    scaling = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=256)
    m = tiny_model(seed=7, rope_scaling=scaling, tie_word_embeddings=True)
    proto = build_decode_graph(m, DecodeGraphOptions(tiered_kv=True, page_size=64))
    inits = {t.name: t for t in proto.graph.initializer}
    assert "lm_head.weight" not in inits
    inv_freq = onnx.numpy_helper.to_array(inits["rope.inv_freq"])
    np.testing.assert_array_equal(inv_freq, rope_inv_freq(m.config).numpy())
    assert not np.allclose(inv_freq, rope_inv_freq(dataclasses.replace(m.config, rope_scaling=None)))
    path = tmp_path / "decode.onnx"
    save_decode_graph(proto, path)
    feeds = random_decode_inputs(m, page_size=64, seq_lens=[700, 131], tiered_kv=True, seed=2)
    got = run_onnx(session(path), feeds)
    assert max_err(got["logits"], reference_decode_step(m, feeds)["logits"]) < LOGITS_ATOL


def test_external_data_switch(model, tmp_path):
    inline, external = tmp_path / "a" / "decode.onnx", tmp_path / "b" / "decode.onnx"
    inline.parent.mkdir()
    external.parent.mkdir()
    options = DecodeGraphOptions(tiered_kv=True, page_size=PAGE)
    assert save_decode_graph(build_decode_graph(model, options), inline) is False  # tiny: inline by default
    assert save_decode_graph(build_decode_graph(model, options), external, external_data=True) is True
    assert (external.parent / "decode.onnx.data").stat().st_size > external.stat().st_size
    onnx.checker.check_model(str(external), full_check=True)
    feeds = random_decode_inputs(model, page_size=PAGE, seq_lens=[6], tiered_kv=True, seed=4)
    assert max_err(run_onnx(session(external), feeds)["logits"], run_onnx(session(inline), feeds)["logits"]) == 0


def test_greedy_loop_matches_reference_model(graph, model):
    """8 greedy steps for two sequences: the reference model decodes on a PagedKVCache; the
    graph runs on numpy pools copied after the prefill, with its own page allocation."""
    _, _, sess = graph
    steps, capacity = 8, 16
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=PAGE, initial_pages=capacity, max_pages=capacity))
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (7, 12)]
    seqs = [cache.add_sequence() for _ in prompts]
    first = torch.stack([prefill(model, cache, s, p) for s, p in zip(seqs, prompts)]).argmax(-1)

    # the graph side: pools copied once, then its own page tables, allocating from the top of the pool
    pools = _pools(cache)
    tables = [list(t) for t in _tables(cache, seqs)]
    free = sorted(set(range(capacity)) - {p for t in tables for p in t})
    lengths = [len(p) for p in prompts]
    ref_tokens, onnx_tokens = [first], [first.numpy()]
    for _ in range(steps):
        tok = ref_tokens[-1]
        ref_logits = decode_one_token(model, cache, seqs, tok, torch.tensor(lengths))
        ref_tokens.append(ref_logits.argmax(-1))

        cur = onnx_tokens[-1]
        for b, n in enumerate(lengths):
            if n % PAGE == 0:  # the new token starts a page
                tables[b].append(free.pop())
        lengths = [n + 1 for n in lengths]
        out = run_onnx(sess, dict(pools, input_ids=cur.astype(np.int64), **_page_inputs(tables, lengths)))
        pools = {k: out[k.replace("_pool_", "_pool_out_")] for k in pools}
        onnx_tokens.append(out["logits"].argmax(-1))
        assert max_err(out["logits"], ref_logits.numpy()) < LOGITS_ATOL
    assert np.array_equal(np.stack(onnx_tokens), torch.stack(ref_tokens).numpy())


# ---------------------------------------------------------------------------- the CLI


def run_build(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    return subprocess.run([sys.executable, str(BUILD_SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_builds_engine_dir_replacing_with_force(tiny_gguf, tmp_path):
    out = tmp_path / "engines" / "tiny"
    out.mkdir(parents=True)
    (out / "stale.txt").write_text("old engine")
    proc = run_build("--tiered-kv", "--model", str(tiny_gguf), "--output", str(out), "--force", "--page-size", "8")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "max |logits error|" in proc.stderr and "TensorRT" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "decode.onnx"]
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no temporary siblings left
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tiered_kv"] is True and cfg["opset"] == OPSET
    assert set(cfg["ops"]["versions"].values()) == {PLUGIN_VERSION}
    assert cfg["build"]["page_size"] == 8
    assert cfg["build"]["verification_max_abs_error"]["logits"] < 1e-3
    config = LlamaConfig.from_dict(cfg["model"])
    assert (config.num_layers, config.vocab_size, config.num_kv_heads) == (2, 512, 2)
    onnx.checker.check_model(str(out / "decode.onnx"), full_check=True)


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


def test_cli_failed_verification_keeps_the_old_engine(tiny_gguf, tmp_path):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_build("--model", str(tiny_gguf), "--output", str(out), "--force", "--tolerance", "0")
    assert proc.returncode == 1
    assert "differ from the PyTorch reference" in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]
