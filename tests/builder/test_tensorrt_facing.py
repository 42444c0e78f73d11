"""What TensorRT needs from the step graph, checked without TensorRT: plugin nodes with no bool
/ uint8 tensors (plugin tensors cannot have those types; float16 graphs included), SelectPages'
TopK within TensorRT's K limit at any context, and the version floor. The builder's TensorRT
path itself: test_tensorrt_build.py."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch
from helpers import tiny_model
from onnx import TensorProto

from tieredkv.builder.tensorrt_build import check_tensorrt_version
from tieredkv.builder.export import StepGraphOptions, build_step_graph
from tieredkv.errors import EngineBuildError
from tieredkv.plugins.onnx_ops import IMPORTANCE_SCORE, KV_APPEND, TIERED_ATTENTION, TOPK_LIMIT, select_pages_model
from tieredkv.plugins.select_pages import ATTEND_ALL, select_pages

NOT_FOR_PLUGINS = {TensorProto.BOOL, TensorProto.UINT8}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.mark.parametrize("warm", [None, "int4"])
@pytest.mark.parametrize("weights", [(1.0, 0.0, 0.0), (0.5, 0.3, 0.2)], ids=["relevance", "mixed"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_plugin_nodes_take_and_give_no_bool_or_uint8(model, warm, weights, precision):
    proto = build_step_graph(model, StepGraphOptions(tiered_kv=True, page_size=5, warm_codec=warm,
                                                     selection_weights=weights, precision=precision))
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
    # the types the plugins are asked for are the ones they accept (plugins/csrc/trt, docs/plugins.md):
    # pools and new K/V in the graph's dtype, everything else float32 / int32 / int64 as declared
    f32, i32, i64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
    dt = TensorProto.FLOAT16 if precision == "fp16" else f32
    want = {TIERED_ATTENTION: ([f32, dt, dt, i64, i32, i64, i64, i64] + ([i32, i64] if warm else []), [f32] * 3),
            KV_APPEND: ([dt] * 4 + [i64, i64], [dt, dt]),
            IMPORTANCE_SCORE: ([f32, f32, f32, i64, i64, f32, i32, f32], [f32])}
    for nd in nodes:
        ins, outs = want[nd.op_type]
        assert [types[n] for n in nd.input] == ins, nd.name
        assert [types[n] for n in nd.output] == outs, nd.name


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
