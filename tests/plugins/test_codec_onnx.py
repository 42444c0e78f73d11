"""The codec's ONNX nodes (custom domain + function bodies) equal the PyTorch reference
bit for bit in ONNX Runtime CPU."""

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402

from tieredkv.plugins.codec import CODECS, dequantize, dequantize_residual, quantize, quantize_residual, sanitize  # noqa: E402
from tieredkv.plugins.onnx_codec import DOMAIN, codec_model, encode_function  # noqa: E402

ONNX_CODECS = sorted(n for n, s in CODECS.items() if not s.keyframe)


def groups(kind: str, n: int, g: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n * 1000 + g)
    x = torch.randn(n, g, generator=gen) * 3
    if kind == "edge":
        x[0] = 0.0  # a zero group
        x[1] *= 1e-6  # tiny (bfloat16 scales keep them)
        x[2] = 6e4 * torch.sign(x[2])  # near fp16 max
        x[7] = x[7] * 1e5  # beyond fp16: zero points saturate
        x[3, 1], x[4, 2], x[4, 3] = float("nan"), float("inf"), float("-inf")
        x[5] = 1e-40  # float32 subnormals
        x[6] = 0.0
        x[6, ::2] = -0.0  # zeros of both signs: the zero point is +0 whatever the reduction order
    return x


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds))), sess


@pytest.mark.parametrize("name", ONNX_CODECS)
@pytest.mark.parametrize("n,g,kind", [(37, 48, "random"), (9, 16, "edge"), (5, 7, "random"), (64, 64, "edge")])
def test_onnx_codec_bit_exact(name, n, g, kind):
    spec = CODECS[name]
    x = groups(kind, n, g)
    enc, dec = codec_model("encode", spec), codec_model("decode", spec)
    onnx.checker.check_model(enc, full_check=True)
    onnx.checker.check_model(dec, full_check=True)
    node = enc.graph.node[0]
    assert node.domain == DOMAIN and {a.name for a in node.attribute} == {"plugin_namespace", "plugin_version"}
    out, _ = run(enc, {"x": x.numpy()})
    xs = sanitize(x)
    ref = quantize(xs, spec)
    assert np.array_equal(out["codes"].view(np.uint8), ref["codes"].numpy())
    assert np.array_equal(out["scale"], ref["scale"].float().numpy())
    x_hat = dequantize(ref, spec)
    if spec.asym:
        assert np.array_equal(out["zero"], ref["zero"].float().numpy())
    if spec.residual_bits:
        rr = quantize_residual(xs - x_hat)
        assert np.array_equal(out["rcodes"], rr["rcodes"].numpy())
        assert np.array_equal(out["rscale"], rr["rscale"].float().numpy())
        x_hat = x_hat + dequantize_residual(rr)
    sess = ort.InferenceSession(dec.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        if i.type == "tensor(float8e4m3fn)":
            feeds[i.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                out[i.name], onnx_element_type=TensorProto.FLOAT8E4M3FN)
        else:
            feeds[i.name] = out[i.name]
    decoded = sess.run(None, feeds)[0]
    assert np.array_equal(decoded, x_hat.numpy())
    assert np.isfinite(decoded).all()


def test_onnx_reference_runtime_agrees():
    """onnx.reference (the spec's own evaluator) runs the function bodies too."""
    from onnx.reference import ReferenceEvaluator

    spec = CODECS["int4"]
    x = groups("random", 6, 32)
    got = ReferenceEvaluator(codec_model("encode", spec)).run(None, {"x": x.numpy()})
    ref = quantize(sanitize(x), spec)
    assert np.array_equal(np.asarray(got[0]).astype(np.uint8), ref["codes"].numpy())


def test_delta_codec_has_no_onnx_form():
    with pytest.raises(ValueError, match="delta coding"):
        encode_function(CODECS["fp8-r2-delta"])


@pytest.mark.parametrize("name", ONNX_CODECS)
@pytest.mark.parametrize("shape", [(3, 16, 64), (2, 7, 12), (1, 5, 3)])
def test_onnx_page_decode_bit_exact(name, shape):
    """KVDecodePages_<codec> reads the byte layout of codec.encode_pages (packed codes, bfloat16
    scales, float16 zero points) and equals codec.decode_pages bit for bit."""
    from tieredkv.plugins.codec import decode_pages, encode_pages
    from tieredkv.plugins.onnx_codec import decode_pages_model

    gen = torch.Generator().manual_seed(sum(shape))
    k, v = torch.randn(5, *shape, generator=gen) * 3, torch.randn(5, *shape, generator=gen)
    k[0], v[1, 0, 0, 0], k[2, 0, -1, -1], v[3] = 0.0, float("nan"), float("inf"), 1e-40
    data = encode_pages(k, v, CODECS[name])
    model = decode_pages_model(CODECS[name], shape)
    onnx.checker.check_model(model, full_check=True)
    got_k, got_v = run(model, {"data": data.numpy()})[0].values()
    want_k, want_v = decode_pages(data, CODECS[name], shape)
    assert np.array_equal(got_k, want_k.numpy()) and np.array_equal(got_v, want_v.numpy())
