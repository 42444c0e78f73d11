"""What TensorRT needs from the step graph and the builder, checked without TensorRT: plugin
nodes with no bool / uint8 tensors (plugin tensors cannot have those types), SelectPages' TopK
within TensorRT's K limit at any context, the version floor, and the check after parsing that
the network really holds the plugin layers (on a mocked network: TensorRT is not installable
here)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch
from helpers import tiny_model
from onnx import TensorProto

from tieredkv.builder.build_engine import check_plugin_layers, check_tensorrt_version, plugin_nodes
from tieredkv.builder.export import StepGraphOptions, build_step_graph
from tieredkv.errors import EngineBuildError
from tieredkv.plugins.onnx_ops import (DOMAIN, IMPORTANCE_SCORE, KV_APPEND, TIERED_ATTENTION, TOPK_LIMIT,
                                       select_pages_model)
from tieredkv.plugins.select_pages import ATTEND_ALL, select_pages

NOT_FOR_PLUGINS = {TensorProto.BOOL, TensorProto.UINT8}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.mark.parametrize("warm", [None, "int4"])
@pytest.mark.parametrize("weights", [(1.0, 0.0, 0.0), (0.5, 0.3, 0.2)], ids=["relevance", "mixed"])
def test_plugin_nodes_take_and_give_no_bool_or_uint8(model, warm, weights):
    proto = build_step_graph(model, StepGraphOptions(tiered_kv=True, page_size=5, warm_codec=warm,
                                                     selection_weights=weights))
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output)}
    nodes = [nd for nd in proto.graph.node if any(a.name == "plugin_namespace" for a in nd.attribute)]
    assert {nd.op_type for nd in nodes} == {TIERED_ATTENTION, KV_APPEND, IMPORTANCE_SCORE}
    for nd in nodes:
        for name in list(nd.input) + list(nd.output):
            if name in types:  # every input is typed (graph inputs or standard ops' outputs)
                assert types[name] not in NOT_FOR_PLUGINS, (nd.name, name, TensorProto.DataType.Name(types[name]))
        for name in nd.input:
            assert name in types, (nd.name, name)
    if warm:
        pool = next(i for i in proto.graph.input if i.name == "warm_pool_0")
        assert pool.type.tensor_type.elem_type == TensorProto.INT32


def _topk_k_model():
    """The SelectPages model with its function inlined and the TopK's K exposed as an output."""
    inlined = onnx.inliner.inline_local_functions(select_pages_model())
    (topk,) = [nd for nd in inlined.graph.node if nd.op_type == "TopK"]
    inlined.graph.output.append(onnx.helper.make_tensor_value_info(topk.input[1], TensorProto.INT64, [1]))
    return inlined, topk.input[1]


@pytest.mark.parametrize("budget", [[40, 70], [ATTEND_ALL, ATTEND_ALL], [ATTEND_ALL, 12], [3, 2]],
                         ids=["budget", "all", "mixed", "below-t0"])
def test_select_pages_topk_k_follows_the_budget_not_the_context(budget):
    """M = 5,000 pages (80k tokens at page 16) is over TensorRT's TopK limit; K stays the budget."""
    model, k_name = _topk_k_model()
    m = 5000
    gen = torch.Generator().manual_seed(0)
    score = torch.rand(2, m, generator=gen)
    score[:, ::7] = 0.5  # ties
    valid = torch.ones(2, m, dtype=torch.bool)
    valid[1, 4000:] = False
    pinned = torch.zeros(2, m, dtype=torch.bool)
    pinned[:, :4] = True
    pinned[:, -3:] = True
    attend = torch.tensor(budget, dtype=torch.int64)
    feeds = {"score": score.numpy(), "valid": valid.numpy(), "pinned": pinned.numpy(), "attend_pages": attend.numpy()}
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    selected, k = sess.run(["selected", k_name], feeds)
    assert np.array_equal(selected, select_pages(score, valid, pinned, attend).numpy())
    n_pinned = (pinned & valid).sum(-1)
    need = [int(a - p) for a, p, v in zip(attend, n_pinned, valid.sum(-1)) if a < v]
    assert int(k[0]) == max(1, max(need, default=1)) <= TOPK_LIMIT


def test_tensorrt_version_floor():
    for ok in ("10.7.0", "10.16.0.72", "11.1.0"):
        check_tensorrt_version(ok)
    for old in ("10.6.0", "10.0.1", "8.6.1"):
        with pytest.raises(EngineBuildError, match=r"TensorRT >= 10\.7"):
            check_tensorrt_version(old)


# ------------------------------------------------- the plugin-presence check on a mocked network

FAKE_TRT = SimpleNamespace(LayerType=SimpleNamespace(PLUGIN_V3="plugin_v3", MATRIX_MULTIPLY="matmul",
                                                     ELEMENTWISE="elementwise"),
                           PluginCapabilityType=SimpleNamespace(CORE="core"))


class _Plugin:
    def __init__(self, name):
        self.name = name

    def get_capability_interface(self, kind):
        assert kind == "core"
        return SimpleNamespace(plugin_name=self.name)


class _Network:
    def __init__(self, layers):
        self.layers = layers

    @property
    def num_layers(self):
        return len(self.layers)

    def get_layer(self, i):
        return self.layers[i]


def _plugin_layer(name):
    return SimpleNamespace(type="plugin_v3", get_plugin=lambda: _Plugin(name))


def _standard(kind="matmul"):
    return SimpleNamespace(type=kind)


def test_plugin_nodes_counts_the_step_graph(model):
    proto = build_step_graph(model, StepGraphOptions(tiered_kv=True, page_size=5, selection_weights=(0.5, 0.3, 0.2)))
    n = model.config.num_layers
    assert plugin_nodes(proto) == {KV_APPEND: n, IMPORTANCE_SCORE: 2 * n, TIERED_ATTENTION: n}
    assert all(nd.domain == DOMAIN for nd in proto.graph.node if nd.op_type == "SelectPages")
    assert "SelectPages" not in plugin_nodes(proto)  # inlined by design


def test_check_plugin_layers_accepts_a_network_with_every_plugin():
    expected = {TIERED_ATTENTION: 2, KV_APPEND: 2}
    layers = [_standard(), _plugin_layer(KV_APPEND), _plugin_layer(TIERED_ATTENTION), _standard("elementwise"),
              _plugin_layer(KV_APPEND), _plugin_layer(TIERED_ATTENTION)]
    check_plugin_layers(_Network(layers), FAKE_TRT, expected)


def test_check_plugin_layers_rejects_inlined_bodies():
    """A parser that inlined the function bodies leaves only standard layers: a build error that
    names the missing plugins and the fix."""
    expected = {TIERED_ATTENTION: 2, KV_APPEND: 2}
    with pytest.raises(EngineBuildError, match=r"lacks plugin layers.*TieredAttention.*--plugin-library"):
        check_plugin_layers(_Network([_standard()] * 40), FAKE_TRT, expected)
    partial = [_plugin_layer(KV_APPEND), _plugin_layer(KV_APPEND), _plugin_layer(TIERED_ATTENTION)] + [_standard()] * 9
    with pytest.raises(EngineBuildError, match="TieredAttention"):
        check_plugin_layers(_Network(partial), FAKE_TRT, expected)


def test_check_plugin_layers_counts_unnamed_plugin_layers():
    """Where TensorRT's Python API does not expose a plugin's name, plugin layers count by number."""
    unnamed = SimpleNamespace(type="plugin_v3")  # no get_plugin / plugin
    check_plugin_layers(_Network([unnamed] * 3), FAKE_TRT, {TIERED_ATTENTION: 2, KV_APPEND: 1})
    with pytest.raises(EngineBuildError):
        check_plugin_layers(_Network([unnamed] * 2), FAKE_TRT, {TIERED_ATTENTION: 2, KV_APPEND: 1})
