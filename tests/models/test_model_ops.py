"""The model's one-op forms equal the reference forms bit for bit (models/llama.py): RMSNorm
through torch's ``rms_norm`` at up to ``FUSED_NORM_ROWS`` rows, RoPE on q and k together with the
sign folded into the sine table, the packed projections' joint output, and the new tokens'
write into a pool as one row copy (``models.cache.pool_rows``) — KVAppend's result."""

import pytest
import torch
from torch import nn

from tieredkv.models import cpu_linear
from tieredkv.models.cache import pool_rows, write_pool_rows
from tieredkv.models.cpu_linear import PackedLinears, set_cpu_linear
from tieredkv.models.llama import (FUSED_NORM_ROWS, RMSNorm, apply_rope, apply_rope_heads_last, rope_cos_sin,
                                   rope_tables)
from tieredkv.plugins.kv_append import kv_append


def reference_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


@pytest.mark.parametrize("rows", [1, 3, 16, 65, FUSED_NORM_ROWS, FUSED_NORM_ROWS + 1, 700])
@pytest.mark.parametrize("dim", [576, 37])
def test_rms_norm_is_the_reference_bit_for_bit(rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=gen) * 2)
        for scale in (1e-3, 1.0, 300.0):
            x = torch.randn(rows, 1, dim, generator=gen) * scale
            assert torch.equal(norm(x), reference_norm(norm, x))
            assert torch.equal(norm(x.view(1, rows, dim)), reference_norm(norm, x.view(1, rows, dim)))


def test_rms_norm_keeps_other_dtypes_on_the_reference_path():
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(2, 1, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = norm.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        assert norm(x).dtype == want.dtype and torch.equal(norm(x), want)


@pytest.mark.parametrize("b,t,heads,d", [(1, 1, 12, 64), (3, 1, 5, 6), (2, 7, 4, 64), (1, 33, 3, 12)])
def test_rope_heads_last_is_apply_rope_bit_for_bit(b, t, heads, d):
    gen = torch.Generator().manual_seed(b * 1000 + t)
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.randint(0, 8192, (b, t), generator=gen)
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    x = torch.randn(b, t, heads, d, generator=gen) * 3
    want = apply_rope(x.transpose(1, 2), cos, sin)  # [B, heads, T, D]
    got = apply_rope_heads_last(x, *rope_tables(cos, sin)).transpose(1, 2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_joint_is_the_outputs_concatenated(backend):
    if backend == "onednn" and cpu_linear.cpu_linear() != "onednn":
        pytest.skip("this torch has no oneDNN linear")
    torch.manual_seed(0)
    layers = [nn.Linear(37, n, bias=False) for n in (29, 11, 11)]
    x = torch.randn(2, 3, 37)
    try:
        set_cpu_linear(backend)
        with torch.no_grad():
            packed = PackedLinears(*layers)
            assert torch.equal(packed.joint(x), torch.cat(packed(x), dim=-1))
            one = PackedLinears(layers[0])
            assert torch.equal(one.joint(x), one(x)[0])
    finally:
        set_cpu_linear("onednn")


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("c, kvh, p, d, n", [(7, 3, 16, 64, 5), (13, 1, 5, 9, 13), (4, 2, 1, 3, 4)])
def test_write_by_rows_is_kv_append(pool_dtype, c, kvh, p, d, n):
    gen = torch.Generator().manual_seed(c * kvh * p + n)
    k_pool, v_pool = (torch.randn(c, kvh, p, d, generator=gen).to(pool_dtype) for _ in range(2))
    places = torch.randperm(c * p, generator=gen)[:n]  # distinct (slot, offset) pairs, in no order
    slots, offsets = places // p, places % p
    k, v = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
    want_k, want_v = kv_append(k_pool, v_pool, k, v, slots, offsets)
    assert write_pool_rows(k_pool, v_pool, pool_rows(slots, offsets, kvh, p), k, v)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    # every layer's rows at once ([L, N] slots) are each layer's own rows
    layers = torch.stack([slots, slots.flip(0)])
    assert torch.equal(pool_rows(layers, offsets, kvh, p)[1], pool_rows(slots.flip(0), offsets, kvh, p))


def test_write_by_rows_declines_a_strided_pool():
    pool = torch.zeros(4, 2, 8, 6)[:, :, ::2]  # [4, 2, 4, 6], not contiguous
    k = torch.ones(1, 2, 6)
    assert not write_pool_rows(pool, pool, pool_rows(torch.tensor([1]), torch.tensor([0]), 2, 4), k, k)
    assert not pool.any()
