"""KV page codecs (tieredkv.plugins.codec): round trips, error bounds, layout, edge cases."""

import math

import pytest
import torch

from tieredkv.plugins.codec import (
    CODECS,
    FP8_MAX,
    CodecSpec,
    bits_per_value,
    decode,
    decode_pages,
    encode,
    encode_pages,
    pack,
    page_layout,
    unpack,
)

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
    g = torch.Generator().manual_seed(hash((name, shape)) % 2**31)
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
