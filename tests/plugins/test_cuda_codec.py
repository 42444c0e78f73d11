"""The CUDA KV page codecs (plugins/csrc/kernels/codec.cuh) against the PyTorch reference
``tieredkv.plugins.codec``, without a GPU.

libtieredkv_kernels.so is built with CMake (shared with test_cuda_build.py) and loaded with
ctypes through ``tieredkv.plugins.cuda_ops`` (loading needs no GPU); the test pages come from
tools/gpu_check.py's ``codec_pages``. The descriptor must equal
``codec.page_layout``; ``tkv_encode_pages_host`` / ``tkv_decode_pages_host`` run the very
__host__ __device__ element functions the kernels run, in CPU loops, and must equal
``codec.encode_pages`` / ``codec.decode_pages`` bit for bit. The same functions on the device
are compared with the reference by tools/gpu_check.py on a GPU machine.
"""

from __future__ import annotations

import ctypes
import zlib

import pytest
import torch
from csrc_build import load_gpu_check, load_kernels, needs_nvcc

from tieredkv.plugins import codec, cuda_ops

pytestmark = needs_nvcc

SHAPES = [(3, 16, 64), (2, 7, 12), (1, 5, 3), (4, 16, 128), (8, 16, 128)]
INVALID = 1  # cudaErrorInvalidValue


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


@pytest.fixture(scope="module")
def gpu_check():
    return load_gpu_check()


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    return load_kernels(tmp_path_factory)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
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


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(codec.CODECS))
def test_host_codec_is_bit_exact_on_random_pages(lib, gpu_check, name, shape, n):
    gen = torch.Generator().manual_seed(_seed(name, shape, n))
    k, v = gpu_check.codec_pages(gen, n, shape, "random"), gpu_check.codec_pages(gen, n, shape, "random")
    _assert_bit_exact(lib, name, k, v)


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(codec.CODECS))
def test_host_codec_is_bit_exact_on_edge_pages(lib, gpu_check, name, shape, n):
    """Zeros (a whole zero page with n = 5), ~1e-6, ~6e4, subnormals ~1e-40, NaN and +-Inf."""
    gen = torch.Generator().manual_seed(_seed(name, shape, n, "edge"))
    k, v = gpu_check.codec_pages(gen, n, shape, "edge"), gpu_check.codec_pages(gen, n, shape, "edge")
    flat = torch.cat([k.flatten(), v.flatten()])
    assert flat.isnan().any() and flat.isposinf().any() and flat.isneginf().any()
    assert ((flat != 0) & (flat.abs() < 1.17e-38)).any()  # subnormals
    _assert_bit_exact(lib, name, k, v)


@pytest.mark.parametrize("name", ["int4", "int4-g16", "int2"])
def test_signed_zero_groups_store_a_positive_zero_point(lib, gpu_check, name):
    """A group of an asymmetric codec whose sanitized values are zeros of both signs (-0.0, or a
    -Inf among zeros) has a minimum of +-0, whose sign torch leaves to its reduction order (group
    length, CPU vector width); the reference, the ONNX body and the library all store +0 as its
    fp16 zero point, so the bytes are equal everywhere."""
    spec = codec.CODECS[name]
    gen = torch.Generator().manual_seed(7)
    shape = (3, 16, 64)
    k, v = (gpu_check.codec_pages(gen, 5, shape, "signed zeros") for _ in range(2))
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
        return lib.tkv_tiered_attention_warm(*null, B, H, T, D, C, kvh, p, M, 0.125, None, warm_row, w,
                                             None if d is None else ctypes.byref(d), None)

    assert call(None) == INVALID
    assert call(desc, kvh=1, p=P) == INVALID  # desc is for 3 kv heads
    assert call(desc, p=8) == INVALID
    assert call(desc, w=-1) == INVALID
    assert call(desc, warm_row=None) == INVALID
    assert call(desc, w=1) == INVALID  # W > 0 with a null warm_pool
    other = cuda_ops.codec_desc("int4", 3, 16, 32, lib=lib)
    assert call(other) == INVALID  # D = 32, the query's is 64
