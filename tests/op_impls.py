"""How the op tests run each implementation of an op (tests/plugins/test_<op>.py): the PyTorch
reference is called directly; ``onnx`` runs the op's one-node ONNX model in ONNX Runtime CPU;
``cuda`` runs the CUDA kernel through ``tieredkv.plugins.cuda_ops`` on a GPU (the ``cuda``
marker: skipped without a CUDA device; the library comes from ``$TIEREDKV_KERNELS``, the
default build path, or a CMake build here when nvcc is on PATH).

Each op's test module parametrizes its comparisons over :data:`IMPLEMENTATIONS`, so a new
implementation is one more entry here and one more branch in each module's ``run``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

IMPLEMENTATIONS = ["onnx", pytest.param("cuda", marks=pytest.mark.cuda)]
#: max abs error of float32 outputs against the reference
TOLERANCE = {"onnx": 1e-5, "cuda": 1e-4}


def run_onnx(model, feeds: dict[str, torch.Tensor], *, evaluator: str = "onnxruntime") -> dict[str, torch.Tensor]:
    """Every output of ``model`` for ``feeds`` (torch tensors by input name), as torch tensors:
    in ONNX Runtime CPU, or in onnx.reference (``evaluator="reference"``, the spec's own)."""
    arrays = {k: v.cpu().numpy() for k, v in feeds.items()}
    names = [o.name for o in model.graph.output]
    if evaluator == "reference":
        from onnx.reference import ReferenceEvaluator

        outs = ReferenceEvaluator(model).run(None, arrays)
    else:
        ort = pytest.importorskip("onnxruntime")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        outs = sess.run(names, arrays)
    return {n: torch.from_numpy(np.asarray(o)) for n, o in zip(names, outs)}


def on_cuda(inputs: dict) -> dict:
    """The tensors of ``inputs`` on the GPU (other values as they are)."""
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).abs().max()) if a.numel() else 0.0


def assert_close_lse(got: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    """-inf in the same places (queries that see nothing), no NaN, finite values within atol."""
    got, ref = got.cpu(), ref.cpu()
    assert not torch.isnan(got).any()
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert max_err(got[finite], ref[finite]) <= atol


def assert_close(got: torch.Tensor, ref: torch.Tensor, atol: float, what: str = "") -> None:
    got = got.cpu()
    assert got.shape == ref.shape, what
    assert not torch.isnan(got).any(), what
    err = max_err(got, ref)
    assert err <= atol or math.isclose(err, atol), f"{what}: max abs error {err:.3e} > {atol:.1e}"


def check_node(model, op_type: str):
    """A one-node model of a tieredkv op: passes the full ONNX check, its node is in the tieredkv
    domain with the plugin attributes (none for SelectPages), its function declares the
    attribute names and takes the values from the node; returns the node."""
    import onnx

    from tieredkv.plugins.onnx_ops import DOMAIN, OPSET, node_attributes

    onnx.checker.check_model(model, full_check=True)
    (node,) = model.graph.node
    assert node.domain == DOMAIN and node.op_type == op_type
    attrs = {a.name: a.s.decode() for a in node.attribute if a.name.startswith("plugin_")}
    assert attrs == node_attributes(op_type)
    fn = model.functions[0]
    assert fn.domain == DOMAIN and fn.name == op_type and not fn.attribute_proto  # values live on the node
    assert [o.version for o in fn.opset_import if o.domain == ""] == [OPSET]
    return node
