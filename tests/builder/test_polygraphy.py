"""The engine directory works with polygraphy: its kit (data-loader script, inputs, golden
outputs of the PyTorch reference) drives `polygraphy run --onnxrt --load-outputs`, a
perturbed graph fails that comparison, `polygraphy inspect model` shows the custom nodes
with their plugin attributes, `polygraphy surgeon sanitize` leaves the graph valid, and
trtexec.sh holds the builder's optimization profiles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("polygraphy")

from helpers import tiny_model, write_gguf  # noqa: E402
from tieredkv.builder import build_engine  # noqa: E402
from tieredkv.builder.export import onnx_session  # noqa: E402
from tieredkv.builder.polygraphy_kit import (  # noqa: E402
    GOLDEN_FILE,
    INPUTS_FILE,
    KIT_DIR,
    LOADER_FILE,
    TRTEXEC_FILE,
    compare_onnxruntime,
    load_kit,
)

POLYGRAPHY = Path(sys.executable).with_name("polygraphy")
CUSTOM_OPS = ("TieredAttention", "KVAppend", "ImportanceScore")


def polygraphy(*args, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", POLYGRAPHY_AUTOINSTALL_DEPS="0")
    return subprocess.run([str(POLYGRAPHY), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def run_debug_command(engine: Path, key: str) -> subprocess.CompletedProcess:
    """The command the engine's config.json gives under ``debug``, run from inside the engine."""
    command = json.loads((engine / "config.json").read_text())["debug"][key].split()
    assert command[0] == "polygraphy"
    return polygraphy(*command[1:], cwd=engine)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    """A tiny-model tiered engine with the int4 warm codec, page size 5 (float32: a perturbation of
    1 % in one layer's weights must fail the comparison at 1e-3)."""
    root = tmp_path_factory.mktemp("pg")
    gguf = write_gguf(root / "tiny.gguf", tiny_model(seed=11))
    out = root / "engine"
    assert build_engine.main(["--tiered-kv", "--warm-codec", "int4", "--page-size", "5", "--model", str(gguf),
                              "--output", str(out), "--precision", "fp32"]) == 0
    return out


def test_fp16_engine_kit_holds_float16_pools_and_goldens(tmp_path):
    """The default (float16) engine: the kit's pools and the goldens' new K/V are float16, the
    goldens are the model in float16, and ONNX Runtime meets them within the engine's tolerance
    (the fp16 default), selecting the same pages."""
    gguf = write_gguf(tmp_path / "tiny.gguf", tiny_model(seed=11))
    out = tmp_path / "engine"
    assert build_engine.main(["--tiered-kv", "--page-size", "5", "--model", str(gguf), "--output", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["build"]["precision"] == "fp16" and cfg["build"]["dtype"] == "float16"
    assert cfg["build"]["tolerance"] == build_engine.TOLERANCES["fp16"]
    feeds, golden = load_kit(out)
    (_, iterations), = golden
    for f, it in zip(feeds, iterations):
        assert f["k_pool_0"].dtype == f["v_pool_1"].dtype == np.float16 and f["key_min"].dtype == np.float32
        assert it["k_new"].dtype == np.float16 and it["logits"].dtype == np.float32
    result = compare_onnxruntime(out / "step.onnx", feeds, golden, tolerance=cfg["build"]["tolerance"])
    assert result.passed and result.errors["page_selected"] == 0, result.failures
    assert result.errors["logits"] == pytest.approx(cfg["build"]["verification_max_abs_error"]["logits"])


def test_kit_holds_valid_decode_and_prefill_steps_with_warm_pools(engine):
    kit = engine / KIT_DIR
    assert sorted(p.name for p in kit.iterdir()) == sorted([GOLDEN_FILE, INPUTS_FILE, LOADER_FILE])
    feeds, golden = load_kit(engine)
    assert [f["input_ids"].shape[1] for f in feeds] == [1, 3]  # a decode step and a prefill step
    sess_inputs = {i.name: i for i in onnx_session(engine / "step.onnx").get_inputs()}
    for f in feeds:
        assert set(f) == set(sess_inputs)  # every graph input, nothing else
        assert "warm_pool_0" in f and f["page_warm_row"].max() >= 0  # some pages are read from the warm pool
        assert (~f["page_mask"]).any()  # random residency: some listed pages are out of the pool
    (runner, iterations), = golden
    assert runner == "pytorch-reference" and len(iterations) == len(feeds)
    assert set(iterations[0]) == {"logits", "k_new", "v_new", "page_selected", "page_relevance", "page_mass"}
    # the goldens are the reference's outputs for these very inputs: ONNX Runtime agrees within tolerance
    result = compare_onnxruntime(engine / "step.onnx", feeds, golden, tolerance=1e-3)
    assert result.passed, result.failures
    cfg = json.loads((engine / "config.json").read_text())
    assert result.errors["page_selected"] == 0 and result.errors["logits"] < 1e-3
    assert cfg["build"]["verification_max_abs_error"] == pytest.approx(result.errors)


@pytest.mark.slow  # polygraphy's CLI in a subprocess
def test_polygraphy_run_onnxrt_against_the_goldens_passes(engine):
    proc = run_debug_command(engine, "polygraphy_onnxrt")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "vs. pytorch-reference | Passed: 2/2 iterations" in out and "PASSED" in out


def perturb(src: Path, dst: Path, how: str) -> None:
    """Copy the engine ``src`` to ``dst`` with its step graph changed: ``weights`` scales one
    layer's down-projection by 1.01; ``scale`` doubles layer 0's attention scale (an attribute of
    the TieredAttention node); ``selection`` negates layer 0's ImportanceScore scale (the least
    relevant pages are selected)."""
    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "step.onnx"))
    if how == "weights":
        init = next(i for i in model.graph.initializer if "down" in i.name)
        arr = onnx.numpy_helper.to_array(init) * np.float32(1.01)
        init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    else:
        op, factor = ("TieredAttention", 2.0) if how == "scale" else ("ImportanceScore", -1.0)
        node = next(n for n in model.graph.node if n.op_type == op)
        next(a for a in node.attribute if a.name == "scale").f *= factor
    onnx.save(model, str(dst / "step.onnx"))


@pytest.mark.slow  # polygraphy's CLI in a subprocess
@pytest.mark.parametrize("how, output", [("weights", "logits"), ("scale", "logits"), ("selection", "page_selected")])
def test_a_perturbed_graph_fails_the_comparison(engine, tmp_path, how, output):
    bad = tmp_path / "engine"
    perturb(engine, bad, how)
    feeds, golden = load_kit(bad)
    result = compare_onnxruntime(bad / "step.onnx", feeds, golden, tolerance=1e-3)
    assert not result.passed and any(f.startswith(f"{output} by") for f in result.failures), result.failures
    proc = run_debug_command(bad, "polygraphy_onnxrt")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "FAILED" in out and f"FAILED | Output: '{output}'" in out, out[-3000:]


@pytest.mark.slow  # polygraphy's CLI in a subprocess
def test_inspect_model_shows_the_custom_nodes_with_their_plugin_attributes(engine):
    proc = polygraphy("inspect", "model", "step.onnx", "--show", "layers", "attrs", cwd=engine)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for op in CUSTOM_OPS:
        block = out[out.index(f"[Op: {op}]"):]
        block = block[: block.index("Node ", 1)]
        assert "plugin_namespace = tieredkv" in block and "plugin_version = 1" in block, block
    assert "warm_codec = int4" in out


@pytest.mark.slow  # polygraphy's CLI in a subprocess
def test_surgeon_sanitize_leaves_the_graph_valid(engine, tmp_path):
    out = tmp_path / "engine"
    shutil.copytree(engine, out)
    proc = polygraphy("surgeon", "sanitize", "step.onnx", "-o", "sanitized.onnx", cwd=out)
    assert proc.returncode == 0, proc.stderr
    model = onnx.load(str(out / "sanitized.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert {f.name for f in model.functions} >= set(CUSTOM_OPS)  # the local-function bodies survive
    nodes = [n for n in model.graph.node if n.op_type in CUSTOM_OPS]
    assert nodes and all({"plugin_namespace", "plugin_version"} <= {a.name for a in n.attribute} for n in nodes)
    feeds, golden = load_kit(out)
    result = compare_onnxruntime(out / "sanitized.onnx", feeds, golden, tolerance=1e-3)
    assert result.passed, result.failures


def test_trtexec_script_builds_both_profiles_with_the_plugin_library(engine, tmp_path):
    """trtexec.sh passes the builder's two optimization profiles (every input, min/opt/max)
    and the plugin library (a path with a space, relative to the caller) to trtexec; run here
    with a stand-in ``trtexec`` on PATH that prints its arguments (TensorRT does not install
    here)."""
    script = engine / TRTEXEC_FILE
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    usage = subprocess.run([str(script)], capture_output=True, text=True)
    assert usage.returncode != 0 and "usage" in usage.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "trtexec").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$PWD" "$@"\n')
    (bin_dir / "trtexec").chmod(0o755)
    lib = tmp_path / "my plugins" / "libtieredkv_trt_plugins.so"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    proc = subprocess.run([str(script), "my plugins/libtieredkv_trt_plugins.so", "--verbose"], capture_output=True,
                          text=True, cwd=tmp_path, env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert proc.returncode == 0, proc.stderr
    cwd, *args = proc.stdout.splitlines()
    assert Path(cwd) == engine
    # strongly typed, as the builder builds it (no --fp16: the graph's own float16 types)
    assert args[:4] == ["--onnx=step.onnx", f"--dynamicPlugins={lib}", f"--setPluginsToSerialize={lib}", "--stronglyTyped"]
    assert args[-3:] == ["--saveEngine=step.plan", "--skipInference", "--verbose"]
    profiles = json.loads((engine / "config.json").read_text())["build"]["profiles"]
    for i, shapes in enumerate(profiles.values()):
        group = args[args.index(f"--profile={i}") + 1: args.index(f"--profile={i}") + 4]
        for flag, which in zip(("--minShapes=", "--optShapes=", "--maxShapes="), range(3)):
            spec = dict(s.split(":") for s in group[which].removeprefix(flag).split(","))
            assert group[which].startswith(flag)
            assert spec == {name: "x".join(map(str, dims[which])) for name, dims in shapes.items()}
