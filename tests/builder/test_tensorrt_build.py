"""The builder's TensorRT path (``builder/tensorrt_build.py``) on TensorRT 10.16 and 11.1, run
against the stand-in ``tensorrt`` of tests/fake_tensorrt.py (TensorRT does not install here):
a strongly typed network (the flag on 10, nothing on 11, no precision flag, no deprecated enum
member), KVAppend's aliasing enabled, both profiles for every input, the plugin-layer check
naming each node that did not become its plugin, TopK's limit checked before anything is built,
and the stand-in's enums equal to the headers' (``$TRT_INCLUDE_DIR``, when set)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fake_tensorrt import HEADER_ENUMS, PARTIAL, header_version, make_tensorrt, members, parse_header_enums
from helpers import tiny_model

from tieredkv.builder.export import StepGraphOptions, build_step_graph, save_step_graph
from tieredkv.builder.tensorrt_build import (build_tensorrt, check_plugin_layers, check_topk_limit, network_flags,
                                             plugin_nodes, tensorrt_profiles)
from tieredkv.errors import EngineBuildError, TopKLimitError
from tieredkv.plugins.onnx_ops import IMPORTANCE_SCORE, KV_APPEND, TIERED_ATTENTION, TOPK_LIMIT

VERSIONS = sorted(HEADER_ENUMS)
OPS = (TIERED_ATTENTION, KV_APPEND, IMPORTANCE_SCORE)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def step_graph(model, tmp_path_factory) -> tuple[Path, dict]:
    """A float16 tiered step graph with a warm codec and a mixed selection (two ImportanceScore
    nodes per layer), and its TensorRT profiles."""
    path = tmp_path_factory.mktemp("trt") / "step.onnx"
    options = StepGraphOptions(tiered_kv=True, page_size=5, warm_codec="int4", selection_weights=(0.5, 0.3, 0.2),
                               precision="fp16")
    save_step_graph(build_step_graph(model, options), path)
    profiles = tensorrt_profiles(model.config, page_size=5, max_batch=4, max_context=300, prefill_chunk=32,
                                 tiered_kv=True, warm_codec="int4")
    return path, profiles


def _build(trt, step_graph, tmp_path, *, library: bool = True):
    path, profiles = step_graph
    lib = tmp_path / "libtieredkv_trt_plugins.so"
    lib.write_bytes(b"")
    logs = []
    size = build_tensorrt(trt, path, tmp_path / "step.plan", profiles=profiles, plugin_library=lib if library else None,
                          tiered_kv=True, log=logs.append)
    return size, logs


@pytest.mark.parametrize("version", VERSIONS)
def test_strongly_typed_build_on_each_version(version, step_graph, tmp_path, monkeypatch):
    trt = make_tensorrt(version, library_creators=OPS)
    networks, configs = [], []
    builder_cls = trt.Builder

    class Recording(builder_cls):
        def create_network(self, flags=0):
            networks.append(super().create_network(flags))
            return networks[-1]

        def create_builder_config(self):
            configs.append(super().create_builder_config())
            return configs[-1]

    trt.Builder = Recording
    size, logs = _build(trt, step_graph, tmp_path)
    assert size == len(b"stand-in plan") and (tmp_path / "step.plan").read_bytes() == b"stand-in plan"
    (network,), (config,) = networks, configs
    strongly_typed = members(version, "NetworkDefinitionCreationFlag")["STRONGLY_TYPED"][0]
    # TensorRT 10: the STRONGLY_TYPED flag; TensorRT 11: no flag (every network is; the flag is deprecated)
    assert network.flags == ((1 << strongly_typed) if version.startswith("10.") else 0)
    assert network.strongly_typed and network_flags(trt) == network.flags
    assert not config.flags  # no precision flag (FP16 / BF16: deprecated in 10, gone in 11)
    aliased = members(version, "PreviewFeature")["ALIASED_PLUGIN_IO_10_03"][0]
    assert config.preview == {aliased: True}  # KVAppend writes the pools in place
    assert [set(p.shapes) for p in config.profiles] == [set(step_graph[1]["decode"]), set(step_graph[1]["prefill"])]
    assert not [u for u in trt.used if u[2]], trt.used  # no deprecated enum member
    assert not [u for u in trt.used if u[0] == "BuilderFlag"]
    assert "strongly typed" in logs[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_precision_flag_on_a_strongly_typed_network_fails_in_the_stand_in(version):
    """The stand-in refuses what TensorRT refuses, so the test above means something: a precision
    flag on a strongly typed network does not build (on 11.1 the flag does not even exist)."""
    trt = make_tensorrt(version)
    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    network = builder.create_network(network_flags(trt))
    config = builder.create_builder_config()
    if version.startswith("11."):
        with pytest.raises(AttributeError, match="FP16"):
            trt.BuilderFlag.FP16
        return
    config.set_flag(trt.BuilderFlag.FP16)
    assert builder.build_serialized_network(network, config) is None


def test_missing_plugin_library_or_creator_is_a_build_error(step_graph, tmp_path):
    trt = make_tensorrt("10.16", library_creators=OPS)
    with pytest.raises(EngineBuildError, match=r"no plugin creator for \['TieredAttention', 'KVAppend', "
                                               r"'ImportanceScore'\].*--plugin-library"):
        _build(trt, step_graph, tmp_path, library=False)
    trt = make_tensorrt("11.1", library_creators=OPS)
    with pytest.raises(EngineBuildError, match="plugin library not found"):
        build_tensorrt(trt, step_graph[0], tmp_path / "p", profiles=step_graph[1],
                       plugin_library=tmp_path / "missing.so", tiered_kv=True, log=print)
    old = make_tensorrt("10.16", library_creators=OPS)
    old.__version__ = "10.6.0"
    with pytest.raises(EngineBuildError, match=r"TensorRT >= 10\.7"):
        _build(old, step_graph, tmp_path)


def test_a_node_that_did_not_become_its_plugin_is_named(step_graph, tmp_path, model):
    """A parser that inlines a node's function body (here: ImportanceScore's creator is not in the
    library) leaves the network without those plugin layers: the build fails naming each node."""
    trt = make_tensorrt("11.1", library_creators=(TIERED_ATTENTION, KV_APPEND))
    with pytest.raises(EngineBuildError) as err:
        _build(trt, step_graph, tmp_path)
    assert "no plugin creator for ['ImportanceScore']" in str(err.value)
    # the check itself, on a network where one layer's ImportanceScore nodes were inlined
    trt = make_tensorrt("10.16", library_creators=OPS)
    assert trt.get_plugin_registry().load_library(str(step_graph[0])) is not None  # any file: the stand-in's library
    parser = trt.OnnxParser(trt.Builder(None).create_network(0), None)
    parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    import onnx

    proto = onnx.load(str(step_graph[0]))
    expected = plugin_nodes(proto)
    n = model.config.num_layers
    assert sorted(expected.values()) == sorted([TIERED_ATTENTION, KV_APPEND] * n + [IMPORTANCE_SCORE] * 2 * n)
    assert "layers.1.relevance" in expected and "layers.1.select" not in expected  # SelectPages is inlined by design
    for node in proto.graph.node:  # layer 1's scorers lose their plugin attributes: the parser inlines them
        if node.name.startswith("layers.1.") and node.op_type == IMPORTANCE_SCORE:
            del node.attribute[:]
    onnx.save(proto, str(tmp_path / "inlined.onnx"))
    parser.parse_from_file(str(tmp_path / "inlined.onnx"))
    with pytest.raises(EngineBuildError, match=r"no plugin layer for 2 of the \d+ plugin nodes: ImportanceScore x2: "
                                               r"layers\.1\.relevance, layers\.1\.selection_score: TensorRT inlined"):
        check_plugin_layers(parser.network, trt, expected)


def test_another_plugin_in_a_nodes_place_is_an_error():
    """A plugin layer named after a node but running another op does not count for it."""
    trt = make_tensorrt("10.16")
    network = trt.Builder(None).create_network(0)
    network.layers = [trt.IPluginV3Layer("layers.0.kv_append", KV_APPEND),
                      trt.IPluginV3Layer("layers.0.attention", "SomeoneElsesAttention")]
    with pytest.raises(EngineBuildError, match=r"layers\.0\.attention \(TieredAttention\) runs SomeoneElsesAttention"):
        check_plugin_layers(network, trt, {"layers.0.kv_append": KV_APPEND, "layers.0.attention": TIERED_ATTENTION})
    network.layers[1] = trt.IPluginV3Layer("layers.0.attention", TIERED_ATTENTION)
    check_plugin_layers(network, trt, {"layers.0.kv_append": KV_APPEND, "layers.0.attention": TIERED_ATTENTION})


def test_topk_limit_is_checked_before_the_build():
    assert check_topk_limit(max_context=8192, page_size=16, max_attention_pages=None) == 512
    assert check_topk_limit(max_context=131072, page_size=16, max_attention_pages=2048) == 2048
    assert check_topk_limit(max_context=1000, page_size=16, max_attention_pages=3000) == 63  # at most every page
    assert check_topk_limit(max_context=TOPK_LIMIT * 16, page_size=16, max_attention_pages=None) == TOPK_LIMIT
    with pytest.raises(TopKLimitError, match=r"--max-context 131072 at --page-size 16 \(8192 pages.*at most 3840.*"
                                             r"--max-attention-pages <= 3840"):
        check_topk_limit(max_context=131072, page_size=16, max_attention_pages=None)
    with pytest.raises(TopKLimitError, match="--max-attention-pages 4000"):
        check_topk_limit(max_context=131072, page_size=16, max_attention_pages=4000)
    assert issubclass(TopKLimitError, EngineBuildError)


def test_cli_refuses_a_topk_over_the_limit_before_loading_anything(tmp_path, capsys):
    from tieredkv.builder import build_engine

    rc = build_engine.main(["--tiered-kv", "--model", str(tmp_path / "absent.gguf"), "--output", str(tmp_path / "e"),
                            "--max-context", "65536", "--page-size", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and "TensorRT TopK" in err and "--max-attention-pages" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------- the stand-in against the TensorRT headers

def _include_dir() -> Path | None:
    value = os.environ.get("TRT_INCLUDE_DIR")
    return Path(value) if value and (Path(value) / "NvInfer.h").is_file() else None


@pytest.mark.skipif(_include_dir() is None, reason="set TRT_INCLUDE_DIR to a TensorRT include directory")
def test_stand_in_enums_are_the_headers_enums():
    """Every enum of the stand-in for the headers' version holds exactly the headers' members
    (names, values, deprecation), but LayerType, which holds a subset. Run it with
    TRT_INCLUDE_DIR at the 10.16 and at the 11.1 headers."""
    include = _include_dir()
    version = header_version(include)
    assert version in HEADER_ENUMS, f"TensorRT {version}: add its enums to tests/fake_tensorrt.py HEADER_ENUMS"
    headers = parse_header_enums(include)
    for enum in HEADER_ENUMS[version]:
        ours = members(version, enum)
        theirs = headers[enum]
        if enum in PARTIAL:
            assert all(theirs.get(name) == value for name, value in ours.items()), enum
        else:
            assert ours == theirs, enum
