"""The TensorRT plugin library exercised without TensorRT, through libtieredkv_trt_harness.so
(plugins/csrc/trt_harness, bound by tests/trt_harness.py): getCreators, then each plugin made by
its creator from the fields of the op's ONNX node, the build phase at the types a float32 and a
float16 engine give it, the runtime phase (serialized fields -> runtime plugin ->
attachToContext -> onShapeChange -> enqueue).

Here (no GPU; needs nvcc, cmake and ``$TRT_INCLUDE_DIR``, or ``$TIEREDKV_TRT_PLUGINS`` and
``$TIEREDKV_TRT_HARNESS``): the creators, the build phase (types, shapes, aliases, workspace,
refusals) and the runtime phase up to a kernel launch that fails cleanly, logged through the
logger the harness handed over. On a GPU (``cuda``; tools/gpu_check.sh): every plugin enqueued on
device buffers against the PyTorch reference — TieredAttention (float32 / float16 / bfloat16
pools, with an int4 warm pool), ImportanceScore, KVAppend in place (outputs aliasing the pools:
only the new rows written, no warning) and as a copy (with the plugin's warning)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from csrc_build import build_plugins, trt_include
from op_impls import TOLERANCE, assert_close, assert_close_lse
from trt_harness import Harness, node_fields

from tieredkv.plugins.codec import as_words
from tieredkv.plugins.importance_score import importance_score
from tieredkv.plugins.inputs import importance_score_inputs, kv_append_inputs, tiered_attention_inputs, warm_inputs
from tieredkv.plugins.kv_append import kv_append
from tieredkv.plugins.tiered_attention import tiered_attention

pytest.importorskip("onnx")

from tieredkv.plugins.onnx_ops import (IMPORTANCE_SCORE, KV_APPEND, TIERED_ATTENTION,  # noqa: E402
                                       importance_score_model, kv_append_model, tiered_attention_model)

ATTENTION = dict(B=2, H=6, KVH=2, T=3, D=64, P=16, M=9, pad=1, partial=True)
SCORE = dict(B=3, H=9, KVH=3, D=64, M=37, NB=12)
APPEND = dict(C=11, KVH=2, P=5, D=80, N=30)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> tuple[Path, Path]:
    """(plugin library, harness library): from the environment (the GPU check's build), else built here."""
    plugins, harness = os.environ.get("TIEREDKV_TRT_PLUGINS"), os.environ.get("TIEREDKV_TRT_HARNESS")
    if plugins and harness:
        return Path(plugins), Path(harness)
    if trt_include() is None or not (shutil.which("nvcc") and shutil.which("cmake")):
        pytest.skip("needs nvcc, cmake and TRT_INCLUDE_DIR (or TIEREDKV_TRT_PLUGINS and TIEREDKV_TRT_HARNESS)")
    build = build_plugins(tmp_path_factory)
    return build / "libtieredkv_trt_plugins.so", build / "libtieredkv_trt_harness.so"


@pytest.fixture(scope="module")
def harness(libraries) -> Harness:
    return Harness(libraries[1], libraries[0])


def _node(model):
    (node,) = model.graph.node
    return node


def attention_case(seed: int, dtype: torch.dtype, codec: str | None = None) -> tuple[list, dict, dict]:
    """(plugin fields, the plugin's inputs in order, the reference's arguments) of TieredAttention."""
    gen = torch.Generator().manual_seed(seed)
    ref = tiered_attention_inputs(gen, **ATTENTION)
    if codec is not None:
        ref = warm_inputs(gen, ref, codec)
    ref["k_pool"], ref["v_pool"] = ref["k_pool"].to(dtype), ref["v_pool"].to(dtype)
    scale = ATTENTION["D"] ** -0.5
    page_shape = tuple(ref["k_pool"].shape[1:]) if codec is not None else None
    node = _node(tiered_attention_model(scale, warm_codec=codec, page_shape=page_shape))
    ins = [ref["q"], ref["k_pool"], ref["v_pool"], ref["page_table"], ref["page_mask"].to(torch.int32),
           ref["page_index"], ref["seq_len"], ref["past"]]
    if codec is not None:
        ins += [as_words(ref["warm_pool"]), ref["warm_row"]]
    return node_fields(node), ins, dict(ref, scale=scale)


def score_case(seed: int) -> tuple[list, list, dict]:
    ref = importance_score_inputs(torch.Generator().manual_seed(seed), **SCORE)
    scale = SCORE["D"] ** -0.5
    node = _node(importance_score_model(ref["weights"], scale))
    ins = [ref["q"], ref["kmin"], ref["kmax"], ref["page_tokens"], ref["distance"], ref["saliency"],
           ref["page_mask"].to(torch.int32), ref["position_table"]]
    return node_fields(node), ins, dict(ref, scale=scale)


def append_case(seed: int, dtype: torch.dtype) -> tuple[list, list, dict]:
    ref = kv_append_inputs(torch.Generator().manual_seed(seed), **APPEND, dtype=dtype)
    return node_fields(_node(kv_append_model())), [ref[k] for k in ("k_pool", "v_pool", "k_new", "v_new", "slot",
                                                                    "offset")], ref


def specs(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    return [(t.dtype, tuple(t.shape)) for t in tensors]


# ------------------------------------------------------------------ no GPU: creators, build phase


def test_get_creators_are_the_onnx_nodes_ops(harness):
    """getCreators gives one IPluginCreatorV3One per plugin op, version 1, namespace tieredkv, with
    the fields the nodes carry (kFLOAT32 = 1, kCHAR = 6)."""
    assert sorted(harness.creators()) == sorted([
        f"{TIERED_ATTENTION} 1 tieredkv scale:1:1 warm_codec:6:0",
        f"{KV_APPEND} 1 tieredkv",
        f"{IMPORTANCE_SCORE} 1 tieredkv weights:1:3 scale:1:1",
    ])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-engine", "fp16-engine"])
def test_build_phase_at_the_engines_types(harness, libraries, dtype):
    """At the types a float32 and a float16 engine give (pools and new K/V in the engine's
    dtype, the rest as declared): every plugin accepts them, its outputs have the reference's
    dtypes and shapes, KVAppend's outputs alias the pools, TieredAttention asks for the kernels'
    workspace bound."""
    from tieredkv.plugins import cuda_ops

    fields, ins, ref = attention_case(1, dtype)
    built = harness.plugin(TIERED_ATTENTION, fields).build(specs(ins))
    want = tiered_attention(**ref)
    assert built.outputs == specs(list(want)) and built.aliases == [-1, -1, -1]
    kernels = cuda_ops.load_library(libraries[0].parent / "libtieredkv_kernels.so")
    b, h, t, d = ref["q"].shape
    assert built.workspace == cuda_ops.attention_workspace_bytes(b, h, t, d, ATTENTION["KVH"], ATTENTION["M"],
                                                                 lib=kernels) > 0
    fields, ins, ref = attention_case(2, dtype, "int4")
    assert harness.plugin(TIERED_ATTENTION, fields).build(specs(ins)).outputs == specs(list(tiered_attention(**ref)))

    fields, ins, ref = append_case(3, dtype)
    built = harness.plugin(KV_APPEND, fields).build(specs(ins))
    assert built.outputs == specs(ins[:2]) and built.aliases == [0, 1] and built.workspace == 0

    fields, ins, ref = score_case(4)
    built = harness.plugin(IMPORTANCE_SCORE, fields).build(specs(ins))
    assert built.outputs == [(torch.float32, (SCORE["B"], SCORE["M"]))] and built.aliases == [-1]
    assert harness.log() == ""  # nothing refused, nothing logged


def test_build_phase_refusals_name_what_is_wrong(harness):
    """A strongly typed network gives the plugins the graph's types: a type a plugin does not take
    fails the build at that position; a node without its fields, or with an unknown codec, is
    refused by the creator with a logged error."""
    fields, ins, _ = attention_case(5, torch.float32)
    plugin = harness.plugin(TIERED_ATTENTION, fields)
    with pytest.raises(RuntimeError, match="position 0 refuses type 1"):  # q in float16: the plugin takes float32
        plugin.build([(torch.float16, tuple(ins[0].shape))] + specs(ins[1:]))
    with pytest.raises(RuntimeError, match="position 2 refuses type 1"):  # pools of two types
        plugin.build(specs(ins[:2]) + [(torch.float16, tuple(ins[2].shape))] + specs(ins[3:]))
    with pytest.raises(RuntimeError, match="position 4 refuses type 4"):  # a bool mask
        plugin.build(specs(ins[:4]) + [(torch.bool, tuple(ins[4].shape))] + specs(ins[5:]))
    fields_a, ins_a, _ = append_case(6, torch.float16)
    with pytest.raises(RuntimeError, match="position 2 refuses type 0"):  # float32 rows into float16 pools
        harness.plugin(KV_APPEND, fields_a).build(specs(ins_a[:2]) + [(torch.float32, tuple(ins_a[2].shape))]
                                                  + specs(ins_a[3:]))
    with pytest.raises(RuntimeError, match="attribute 'scale' must be 1 float"):
        harness.plugin(TIERED_ATTENTION, [])
    codec = [("warm_codec", 6, b"int3", 4)] + fields
    with pytest.raises(RuntimeError, match="unknown warm_codec 'int3'"):
        harness.plugin(TIERED_ATTENTION, codec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure path of a machine without a GPU")
def test_runtime_phase_without_a_device_fails_cleanly(harness):
    """Serialize -> runtime plugin -> attachToContext -> onShapeChange -> enqueue runs here up to
    the kernel launch, which fails without a device: enqueue reports it, and the plugin's
    messages reach the logger the harness handed over with setLoggerFinder (KVAppend given
    outputs other than its pools first warns that it copies them)."""
    fields, ins, ref = append_case(7, torch.float32)
    plugin = harness.plugin(KV_APPEND, fields)
    plugin.build(specs(ins))
    with pytest.raises(RuntimeError, match=r"(?s)warning: \[tieredkv\] KVAppend: the outputs are not the input pools"
                                           r".*error: \[tieredkv\] KVAppend: kernel launch failed: .*"
                                           r"KVAppend: enqueue returned 1"):
        plugin.enqueue(ins, [torch.empty_like(ins[0]), torch.empty_like(ins[1])], None, 0)


# ------------------------------------------------------------------ on a GPU: enqueue vs the reference


def _run(harness, op, fields, ins, outputs=None, stream=None):
    """Build, allocate the outputs (unless given) and workspace, enqueue on the GPU, synchronize."""
    plugin = harness.plugin(op, fields)
    ins = [t.cuda().contiguous() for t in ins]
    built = plugin.build(specs(ins))
    outs = outputs(ins) if outputs is not None else [torch.empty(s, dtype=d, device="cuda") for d, s in built.outputs]
    ws = torch.empty(built.workspace, dtype=torch.uint8, device="cuda") if built.workspace else None
    plugin.enqueue(ins, outs, ws, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return ins, outs


@pytest.mark.cuda
@pytest.mark.parametrize("codec", [None, "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_tiered_attention_plugin_equals_the_reference(harness, dtype, codec):
    fields, ins, ref = attention_case(10, dtype, codec)
    _, (out, lse, probs) = _run(harness, TIERED_ATTENTION, fields, ins)
    want_out, want_lse, want_probs = tiered_attention(**ref)
    assert_close(out, want_out, TOLERANCE["cuda"], "out")
    assert_close(probs, want_probs, TOLERANCE["cuda"], "page_probs")
    assert_close_lse(lse, want_lse, TOLERANCE["cuda"])
    assert "error" not in harness.log()


@pytest.mark.cuda
def test_importance_score_plugin_equals_the_reference(harness):
    fields, ins, ref = score_case(11)
    _, (score,) = _run(harness, IMPORTANCE_SCORE, fields, ins)
    want = importance_score(**ref)
    assert_close(score, want, TOLERANCE["cuda"], "score")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_kv_append_plugin_in_place_and_as_a_copy(harness, dtype):
    """In place (the outputs are the pools, as TensorRT hands them with aliased plugin I/O): the
    pools hold the reference's result bit for bit and no warning is logged. As a copy (other
    output buffers): the outputs hold it, the pools are untouched, and the plugin warns once."""
    fields, ins, ref = append_case(12, dtype)
    want_k, want_v = kv_append(**ref)
    harness.log()
    dev, outs = _run(harness, KV_APPEND, fields, ins, outputs=lambda d: [d[0], d[1]])
    assert outs[0].data_ptr() == dev[0].data_ptr()
    assert torch.equal(dev[0].cpu(), want_k) and torch.equal(dev[1].cpu(), want_v)
    assert "not the input pools" not in harness.log()
    dev, outs = _run(harness, KV_APPEND, fields, ins)
    assert torch.equal(outs[0].cpu(), want_k) and torch.equal(outs[1].cpu(), want_v)
    assert torch.equal(dev[0].cpu(), ref["k_pool"]) and torch.equal(dev[1].cpu(), ref["v_pool"])
    assert harness.log().count("warning: [tieredkv] KVAppend: the outputs are not the input pools") == 1
