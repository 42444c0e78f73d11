"""The KV page codecs — KVEncodePages / KVDecodePages (``tieredkv.plugins.codec``): the
reference's round trips, error bounds, byte layout and edge cases; the ONNX functions in ONNX
Runtime (group encode/decode and the page decoder) bit for bit; the CUDA library's codec
descriptor and host encoder/decoder (the very element functions the kernels run; built with
nvcc, no GPU) bit for bit; and, on a GPU, the encode/decode kernels bit for bit."""

import ctypes
import math
import shutil
import zlib

import numpy as np
import pytest
import torch
from op_impls import run_onnx

from tieredkv.plugins import codec, cuda_ops
from tieredkv.plugins.codec import (
    CODECS,
    FP8_MAX,
    CodecSpec,
    bits_per_value,
    decode,
    decode_pages,
    dequantize,
    dequantize_residual,
    encode,
    encode_pages,
    pack,
    page_layout,
    quantize,
    quantize_residual,
    sanitize,
    unpack,
)
from tieredkv.plugins.inputs import CODEC_DATA, codec_pages


# ----------------------------------------------------------------------------- the reference

SHAPES = [(3, 16, 64), (2, 5, 12), (1, 7, 18), (4, 16, 128)]  # odd page sizes and head dims included
# relative error bounds on N(0, 1) data (measured values are well below these)
BOUNDS = {"fp8": 0.035, "fp8-r2": 0.025, "int6-r2": 0.04, "int4": 0.15, "int4-g16": 0.12, "int2": 0.6, "fp8-r2-delta": 0.05}


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("role", ["k", "v"])
def test_round_trip_error(name, shape, role):
    spec = CODECS[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    y = decode(encode(x, spec, role=role), spec, shape, role=role)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert rel_err(y, x) < BOUNDS[name], (name, rel_err(y, x))


def test_residual_reduces_the_error():
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(1)) * 3
    base, r2 = CODECS["fp8"], CODECS["fp8-r2"]
    e0 = rel_err(decode(encode(x, base), base, x.shape), x)
    e2 = rel_err(decode(encode(x, r2), r2, x.shape), x)
    assert e2 < 0.8 * e0


def test_kivi_key_channels_handle_outlier_channels():
    """Per-channel key groups keep an outlier channel from flattening the others."""
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    x[:, :, 3] *= 50
    per_channel = CODECS["int4"]
    per_token = CodecSpec("int4-token", "int", 4, asym=True, key_axis="token", group=64)
    e_ch = rel_err(decode(encode(x, per_channel, role="k"), per_channel, x.shape, role="k")[:, :, 4:], x[:, :, 4:])
    e_tok = rel_err(decode(encode(x, per_token, role="k"), per_token, x.shape, role="k")[:, :, 4:], x[:, :, 4:])
    assert e_ch < 0.5 * e_tok


@pytest.mark.parametrize("name", sorted(CODECS))
def test_zeros_and_max_magnitude(name):
    spec = CODECS[name]
    z = torch.zeros(2, 16, 64)
    assert torch.equal(decode(encode(z, spec), spec, z.shape), z)
    big = torch.full((2, 16, 64), 6.0e4)  # near fp16 max
    big[:, ::2] *= -1
    assert rel_err(decode(encode(big, spec), spec, big.shape), big) < 0.05


@pytest.mark.parametrize("name", sorted(CODECS))
def test_values_beyond_float16_decode_finite(name):
    """Zero points and keyframes are float16: beyond ±65504 they saturate (documented) instead of
    becoming Inf, so a float32 cache holding such values still decodes to finite numbers; the
    scales (bfloat16) keep the symmetric codecs accurate there."""
    spec = CODECS[name]
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5)) * 1e5
    y = decode(encode(x, spec), spec, x.shape)
    assert torch.isfinite(y).all()
    if not spec.asym and not spec.keyframe:
        assert rel_err(y, x) < 0.05


def test_subnormal_and_tiny_values():
    spec = CODECS["fp8"]
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(3)) * 1e-6
    y = decode(encode(x, spec), spec, x.shape)
    assert rel_err(y, x) < 0.035  # the per-group (bfloat16) scale brings them into FP8's normal range
    sub = torch.full((1, 16, 64), 1e-40)  # float32 subnormal
    assert torch.isfinite(decode(encode(sub, spec), spec, sub.shape)).all()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_non_finite_inputs_are_sanitized(name):
    """NaN encodes as 0, ±Inf as ± the group's largest finite magnitude (documented)."""
    spec = CODECS[name]
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(4))
    x[0, 3, 7], x[0, 5, 9], x[0, 6, 10] = float("nan"), float("inf"), float("-inf")
    y = decode(encode(x, spec), spec, x.shape)
    assert torch.isfinite(y).all()
    finite = x.clone()
    finite[0, 3, 7] = 0.0
    assert abs(float(y[0, 3, 7])) < 0.5 * float(finite.abs().max())


def test_fp8_codes_saturate_like_onnx():
    spec = CODECS["fp8"]
    x = torch.tensor([[[FP8_MAX * 1.0001] + [1.0] * 63]])
    e = encode(x, spec)
    assert torch.isfinite(e["codes"].view(torch.float8_e4m3fn).float()).all()


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_pack_unpack(bits):
    codes = torch.randint(0, 2 ** bits, (3 * 16 * 64,), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.numel() == codes.numel() * bits // 8
    assert torch.equal(unpack(packed, bits, codes.numel()), codes)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_layout_is_aligned_and_complete(name):
    spec = CODECS[name]
    lay = page_layout(spec, 3, 16, 64)
    total = lay.pop("total")["bytes"]
    offsets = sorted(v["offset"] for v in lay.values())
    assert all(o % 128 == 0 for o in offsets) and total % 128 == 0
    assert sum(v["bytes"] for v in lay.values()) <= total
    bpv = bits_per_value(spec, 3, 16, 64)
    assert bpv >= spec.bits + spec.residual_bits and math.isclose(bpv, 8 * total / (2 * 3 * 16 * 64))


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("shape", SHAPES + [(1, 3, 5)])
def test_page_bytes_round_trip_equals_reference(name, shape):
    """encode_pages serializes exactly what encode produces (the documented layout, one row
    of page_bytes per page); decode_pages gives back decode() bit for bit."""
    spec = CODECS[name]
    g = torch.Generator().manual_seed(zlib.crc32(repr((name, shape)).encode()))
    n = 3
    k = torch.randn((n, *shape), generator=g) * 3
    v = torch.randn((n, *shape), generator=g)
    data = encode_pages(k, v, spec)
    assert data.dtype == torch.uint8 and data.shape == (n, page_layout(spec, *shape)["total"]["bytes"])
    kh, vh = decode_pages(data, spec, shape)
    for i in range(n):
        assert torch.equal(kh[i], decode(encode(k[i], spec, role="k"), spec, shape, role="k"))
        assert torch.equal(vh[i], decode(encode(v[i], spec, role="v"), spec, shape, role="v"))
    # pages are independent: page 1 alone serializes to the same bytes
    assert torch.equal(encode_pages(k[1:2], v[1:2], spec)[0], data[1])

# ----------------------------------------------------------------------------- ONNX (ONNX Runtime CPU)

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


def onnx_codec_models(spec):
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_codec import codec_model

    return codec_model("encode", spec), codec_model("decode", spec)


@pytest.mark.parametrize("name", ONNX_CODECS)
@pytest.mark.parametrize("n,g,kind", [(37, 48, "random"), (9, 16, "edge"), (5, 7, "random"), (64, 64, "edge")])
def test_onnx_codec_bit_exact(name, n, g, kind):
    """The group encoder's outputs equal quantize (and quantize_residual) and the group decoder
    equals dequantize (+ the residual) bit for bit."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto

    from tieredkv.plugins.onnx_codec import DOMAIN

    spec = CODECS[name]
    x = groups(kind, n, g)
    enc, dec = onnx_codec_models(spec)
    onnx.checker.check_model(enc, full_check=True)
    onnx.checker.check_model(dec, full_check=True)
    node = enc.graph.node[0]
    assert node.domain == DOMAIN and {a.name for a in node.attribute} == {"plugin_namespace", "plugin_version"}
    out = {k: v.numpy() for k, v in run_onnx(enc, {"x": x}).items()}
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
    for i in sess.get_inputs():  # FP8 codes go in as float8e4m3fn OrtValues (numpy has no FP8)
        if i.type == "tensor(float8e4m3fn)":
            feeds[i.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                out[i.name], onnx_element_type=TensorProto.FLOAT8E4M3FN)
        else:
            feeds[i.name] = out[i.name]
    decoded = sess.run(None, feeds)[0]
    assert np.array_equal(decoded, x_hat.numpy())
    assert np.isfinite(decoded).all()


def test_onnx_reference_evaluator_agrees():
    """onnx.reference (the spec's own evaluator) runs the function bodies too."""
    spec = CODECS["int4"]
    x = groups("random", 6, 32)
    enc, _ = onnx_codec_models(spec)
    got = run_onnx(enc, {"x": x}, evaluator="reference")["codes"]
    assert torch.equal(got.to(torch.uint8), quantize(sanitize(x), spec)["codes"])


def test_delta_codec_has_no_onnx_form():
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_codec import encode_function

    with pytest.raises(ValueError, match="delta coding"):
        encode_function(CODECS["fp8-r2-delta"])


# ----------------------------------------------------------------------------- pages: every implementation

#: (page shape [KVH, P, D], pages N): SmolLM2 and 70B-like pages, odd page sizes (codes padded to
#: whole units of 4, groups not starting on byte boundaries), D not a multiple of the group, P = 1
PAGE_SHAPES = [((3, 16, 64), 7), ((2, 7, 12), 5), ((1, 5, 3), 3), ((8, 16, 128), 4), ((2, 13, 80), 2),
               ((4, 1, 256), 3)]
PAGE_IMPLEMENTATIONS = ["onnx", "cuda-host", pytest.param("cuda", marks=pytest.mark.cuda)]


def run_pages(impl: str, name: str, k: torch.Tensor, v: torch.Tensor, data: torch.Tensor, request):
    """(encoded pages of k, v or None where the implementation has no page encoder, decoded K, V
    of ``data``) by ``impl``: the ONNX page decoder; the library's host loops; the kernels."""
    shape = tuple(k.shape[1:])
    if impl == "onnx":
        pytest.importorskip("onnx")
        from tieredkv.plugins.onnx_codec import decode_pages_model

        if CODECS[name].keyframe:
            pytest.skip(f"{name}: the delta codec has no ONNX form")
        got = run_onnx(decode_pages_model(CODECS[name], shape), {"data": data})
        return None, *got.values()
    lib = request.getfixturevalue("lib" if impl == "cuda-host" else "kernels")
    desc = cuda_ops.codec_desc(name, *shape, lib=lib)
    if impl == "cuda-host":
        return (cuda_ops.encode_pages_host(k, v, desc, lib=lib), *cuda_ops.decode_pages_host(data, desc, lib=lib))
    enc = cuda_ops.encode_pages(k.cuda(), v.cuda(), desc, lib=lib)
    dec = cuda_ops.decode_pages(data.cuda(), desc, lib=lib)
    torch.cuda.synchronize()
    return enc.cpu(), *(x.cpu() for x in dec)


@pytest.mark.parametrize("impl", PAGE_IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", CODEC_DATA)
@pytest.mark.parametrize("shape,n", PAGE_SHAPES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("name", sorted(CODECS))
def test_page_implementation_is_bit_exact(impl, name, shape, n, kind, request):
    """encode_pages / decode_pages of every implementation equal the reference bit for bit, on
    random pages and on the edge data of codec_pages (zeros, tiny, near float16's max, beyond it,
    subnormals, NaN, ±Inf, zeros of both signs)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, shape, kind)).encode()))
    k, v = codec_pages(gen, n, shape, kind), codec_pages(gen, n, shape, kind)
    data = encode_pages(k, v, CODECS[name])
    want_k, want_v = decode_pages(data, CODECS[name], shape)
    enc, got_k, got_v = run_pages(impl, name, k, v, data, request)
    if enc is not None:
        assert torch.equal(enc, data), f"{int((enc != data).sum())} of {data.numel()} bytes differ"
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


# ----------------------------------------------------------------------------- the CUDA library, on the host

LIB_SHAPES = [(3, 16, 64), (2, 7, 12), (1, 5, 3), (4, 16, 128), (8, 16, 128)]
INVALID = 1  # cudaErrorInvalidValue


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    """The kernels library built here with CMake (needs nvcc and cmake, no GPU)."""
    if not (shutil.which("nvcc") and shutil.which("cmake")):
        pytest.skip("needs nvcc and cmake on PATH")
    from csrc_build import load_kernels

    return load_kernels(tmp_path_factory)


@pytest.mark.parametrize("shape", LIB_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(codec.CODECS))
def test_descriptor_is_the_page_layout(lib, name, shape):
    spec = codec.CODECS[name]
    desc = cuda_ops.codec_desc(name, *shape, lib=lib)
    layout = codec.page_layout(spec, *shape)
    kvh, p, d = shape
    assert desc.page_bytes == layout["total"]["bytes"] == codec.page_bytes(spec, *shape)
    for r, role in enumerate(("k", "v")):
        for s, section in enumerate(cuda_ops.CODEC_SECTIONS):
            sec = layout.get(f"{role}.{section}")
            got = (desc.offset[r][s], desc.bytes[r][s])
            assert got == ((sec["offset"], sec["bytes"]) if sec else (-1, 0)), (role, section)
        per_head, size = codec._group_shape(spec, role, kvh, p, d)
        assert (desc.groups[r], desc.group_size[r]) == (kvh * per_head, size), role
        axis = spec.key_axis if role == "k" else spec.value_axis
        assert desc.axis[r] == ("token", "channel").index(axis)
    assert (desc.codec, desc.base, desc.bits, desc.asym, desc.residual_bits, desc.group, desc.keyframe) == (
        list(codec.CODECS).index(name), ("fp8", "int").index(spec.base), spec.bits, int(spec.asym),
        spec.residual_bits, spec.group, spec.keyframe)
    assert (desc.kvh, desc.p, desc.d, desc.values) == (kvh, p, d, kvh * p * d)
    assert desc.keyframes_per_page == (-(-p // spec.keyframe) if spec.keyframe else 0)


def test_descriptor_refuses_unknown_codecs_and_bad_shapes(lib):
    desc = cuda_ops.CodecDesc()
    assert lib.tkv_codec_desc(b"int4", 3, 16, 64, ctypes.byref(desc)) == 0
    for name, shape in ((b"int3", (3, 16, 64)), (b"", (3, 16, 64)), (b"INT4", (3, 16, 64)), (b"int4", (0, 16, 64)),
                        (b"int4", (3, -1, 64)), (b"fp8", (3, 16, 0))):
        assert lib.tkv_codec_desc(name, *shape, ctypes.byref(desc)) == INVALID, (name, shape)
    assert lib.tkv_codec_desc(None, 3, 16, 64, ctypes.byref(desc)) == INVALID
    assert lib.tkv_codec_desc(b"int4", 3, 16, 64, None) == INVALID


def _assert_bit_exact(lib, name, k, v):
    spec = codec.CODECS[name]
    shape = tuple(k.shape[1:])
    desc = cuda_ops.codec_desc(name, *shape, lib=lib)
    ref = codec.encode_pages(k, v, spec)
    got = cuda_ops.encode_pages_host(k, v, desc, lib=lib)
    assert torch.equal(got, ref), f"{int((got != ref).sum())} of {ref.numel()} bytes differ"
    ref_k, ref_v = codec.decode_pages(ref, spec, shape)
    assert not (ref_k.isnan().any() or ref_v.isnan().any())
    dec_k, dec_v = cuda_ops.decode_pages_host(ref, desc, lib=lib)
    assert torch.equal(dec_k, ref_k) and torch.equal(dec_v, ref_v)
    own_k, own_v = cuda_ops.decode_pages_host(got, desc, lib=lib)  # the library's bytes decode the same
    assert torch.equal(own_k, ref_k) and torch.equal(own_v, ref_v)


@pytest.mark.parametrize("name", ["int4", "int4-g16", "int2"])
def test_signed_zero_groups_store_a_positive_zero_point(lib, name):
    """A group of an asymmetric codec whose sanitized values are zeros of both signs (-0.0, or a
    -Inf among zeros) has a minimum of +-0, whose sign torch leaves to its reduction order (group
    length, CPU vector width); the reference, the ONNX body and the library all store +0 as its
    fp16 zero point, so the bytes are equal everywhere."""
    spec = codec.CODECS[name]
    gen = torch.Generator().manual_seed(7)
    shape = (3, 16, 64)
    k, v = (codec_pages(gen, 5, shape, "signed zeros") for _ in range(2))
    assert bool((k == 0).logical_and(torch.signbit(k)).any())
    _assert_bit_exact(lib, name, k, v)
    got = cuda_ops.encode_pages_host(k, v, cuda_ops.codec_desc(name, *shape, lib=lib), lib=lib)
    for role, x in (("k", k), ("v", v)):
        axis = spec.key_axis if role == "k" else spec.value_axis
        xg = codec.sanitize(codec._to_groups(x.reshape(-1, *shape[1:]), axis, spec.group))
        xg = xg.reshape(5, -1, xg.shape[-1])  # [pages, groups per page, group size]
        signed_zero_min = (xg.amin(-1) == 0) & ((xg == 0) & torch.signbit(xg)).any(-1)
        assert bool(signed_zero_min.any()), role  # the data has such groups
        sec = codec.page_layout(spec, *shape)[f"{role}.zero"]
        zeros = got[:, sec["offset"] : sec["offset"] + sec["bytes"]].contiguous().view(torch.int16)
        assert bool((zeros[signed_zero_min] == 0).all()), role  # +0 (0x0000), never -0 (0x8000)


def test_delta_decode_sums_in_double_like_torch_cumsum(lib):
    """fp8-r2-delta decodes with torch.cumsum, which on float32 CPU tensors accumulates in double
    and rounds each prefix: on these pages (large keyframes, small steps) a float32 running sum of
    the same keyframes and decoded differences differs, and the library matches torch."""
    spec = codec.CODECS["fp8-r2-delta"]
    gen = torch.Generator().manual_seed(3)
    shape = (2, 16, 64)
    base = torch.randn(1, shape[0], 1, shape[2], generator=gen) * 3e4  # per channel, the same for every token
    k = base + torch.randn(1, *shape, generator=gen).cumsum(2) * 1e-2
    data = codec.encode_pages(k, k, spec)
    ref_k, _ = codec.decode_pages(data, spec, shape)
    dec_k, _ = cuda_ops.decode_pages_host(data, cuda_ops.codec_desc("fp8-r2-delta", *shape, lib=lib), lib=lib)
    assert torch.equal(dec_k, ref_k)
    enc = codec.encode(k[0], spec, role="k")
    diffs = codec._from_groups(codec.dequantize(enc, spec) + codec.dequantize_residual(enc), "token", shape)
    f32 = torch.empty(shape)
    for t in range(shape[1]):
        if t % spec.keyframe == 0:
            f32[:, t] = enc["keyframes"][:, t // spec.keyframe].float()
        else:
            f32[:, t] = f32[:, t - 1] + diffs[:, t]
    assert not torch.equal(f32, ref_k[0])


def test_host_codec_refuses_bad_arguments(lib):
    desc = cuda_ops.codec_desc("fp8-r2", 3, 16, 64, lib=lib)
    k = torch.randn(2, 3, 16, 64)
    out = torch.empty(2, desc.page_bytes, dtype=torch.uint8)
    ok = lib.tkv_encode_pages_host(k.data_ptr(), k.data_ptr(), out.data_ptr(), 2, ctypes.byref(desc))
    assert ok == 0
    assert lib.tkv_encode_pages_host(None, None, None, 0, ctypes.byref(desc)) == 0  # no pages: nothing to do
    assert lib.tkv_decode_pages_host(None, None, None, 0, ctypes.byref(desc)) == 0
    assert lib.tkv_encode_pages_host(k.data_ptr(), k.data_ptr(), out.data_ptr(), -1, ctypes.byref(desc)) == INVALID
    assert lib.tkv_encode_pages_host(k.data_ptr(), k.data_ptr(), out.data_ptr(), 2, None) == INVALID
    assert lib.tkv_decode_pages_host(out.data_ptr(), k.data_ptr(), k.data_ptr(), 2, None) == INVALID
    tampered = cuda_ops.codec_desc("fp8-r2", 3, 16, 64, lib=lib)
    tampered.offset[1][0] += 128  # not what tkv_codec_desc builds: offsets could leave the page
    assert lib.tkv_encode_pages_host(k.data_ptr(), k.data_ptr(), out.data_ptr(), 2, ctypes.byref(tampered)) == INVALID
    assert lib.tkv_decode_pages_host(out.data_ptr(), k.data_ptr(), k.data_ptr(), 2, ctypes.byref(tampered)) == INVALID
    # the device entry points check the same before touching a device (no GPU needed to refuse)
    assert lib.tkv_encode_pages(k.data_ptr(), k.data_ptr(), out.data_ptr(), 2, ctypes.byref(tampered), None) == INVALID
    assert lib.tkv_decode_pages(out.data_ptr(), k.data_ptr(), k.data_ptr(), -3, ctypes.byref(desc), None) == INVALID


def test_warm_attention_refuses_a_descriptor_of_other_pages(lib):
    """tkv_tiered_attention_warm checks the descriptor against the pools' [KVH, P, D] (and W) before
    any launch, so these refusals need no GPU."""
    desc = cuda_ops.codec_desc("int4", 3, 16, 64, lib=lib)
    B, H, T, D, C, KVH, P, M = 1, 9, 1, 64, 4, 3, 16, 2
    row = torch.zeros(B, M, dtype=torch.int64)

    def call(d, *, kvh=KVH, p=P, w=1, warm_row=row.data_ptr()):
        null = [None] * 11
        return lib.tkv_tiered_attention_warm(*null, B, H, T, D, C, kvh, p, M, 0.125, 0, None, warm_row, w,
                                             None if d is None else ctypes.byref(d), None, 0, 0, None)

    assert call(None) == INVALID
    assert call(desc, kvh=1, p=P) == INVALID  # desc is for 3 kv heads
    assert call(desc, p=8) == INVALID
    assert call(desc, w=-1) == INVALID
    assert call(desc, warm_row=None) == INVALID
    assert call(desc, w=1) == INVALID  # W > 0 with a null warm_pool
    other = cuda_ops.codec_desc("int4", 3, 16, 32, lib=lib)
    assert call(other) == INVALID  # D = 32, the query's is 64


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_unpack_codes_equals_unpack(bits):
    """The uint8 shifts decode_pages unpacks 2/4/8-bit codes with give unpack's codes (6-bit
    codes take unpack's path), for every byte value and a count that cuts the last byte."""
    data = torch.cat([torch.arange(256, dtype=torch.uint8),
                      torch.randint(0, 256, (999,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))])
    data = data[: len(data) // 3 * 3]
    count = len(data) * 8 // bits - 1
    got = codec.unpack_codes(data, bits, count)
    assert got.dtype == torch.uint8 and torch.equal(got, codec.unpack(data, bits, count))
