"""The model's packed oneDNN linear layers against ``F.linear`` (models/cpu_linear.py)."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tieredkv.errors import ConfigError
from tieredkv.models import cpu_linear
from tieredkv.models.cpu_linear import PackedLinears, set_cpu_linear

pytestmark = pytest.mark.skipif(cpu_linear.cpu_linear() != "onednn", reason="this torch has no oneDNN linear")


@pytest.fixture
def layers():
    torch.manual_seed(0)
    return [nn.Linear(37, n, bias=False) for n in (29, 11, 11)]


@pytest.mark.parametrize("rows", [(1, 1), (3, 1), (1, 7), (5, 13)])
def test_fused_matches_f_linear(layers, rows):
    x = torch.randn(*rows, 37)
    with torch.no_grad():
        got = PackedLinears(*layers)(x)
    for y, lin in zip(got, layers):
        assert y.shape == (*rows, lin.out_features)
        torch.testing.assert_close(y, F.linear(x, lin.weight), rtol=1e-5, atol=1e-6)


def test_fused_is_the_separate_calls_bit_for_bit(layers):
    x = torch.randn(6, 37)
    with torch.no_grad():
        fused = PackedLinears(*layers)(x)
        apart = [PackedLinears(lin)(x)[0] for lin in layers]
    assert all(torch.equal(a, b) for a, b in zip(fused, apart))


def test_repacks_when_a_weight_changes(layers):
    packed, x = PackedLinears(*layers), torch.randn(2, 37)
    with torch.no_grad():
        packed(x)
        layers[1].weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(packed(x)[1], F.linear(x, layers[1].weight), rtol=1e-5, atol=1e-6)
        layers[2].weight = nn.Parameter(torch.randn(11, 37))  # replaced
        torch.testing.assert_close(packed(x)[2], F.linear(x, layers[2].weight), rtol=1e-5, atol=1e-6)


def test_copies_and_pickles_leave_the_pack_behind(layers):
    owner = nn.Module()
    owner.a, owner.b = layers[0], layers[1]
    owner.fused = PackedLinears(owner.a, owner.b)
    x = torch.randn(3, 37)
    with torch.no_grad():
        want = owner.fused(x)
        other = copy.deepcopy(owner)
        assert other.fused.linears[0] is other.a  # the copy packs its own layers
        assert all(torch.equal(a, b) for a, b in zip(other.fused(x), want))
    torch.save(owner, io.BytesIO())


def test_autograd_and_the_torch_backend_take_f_linear(layers):
    x = torch.randn(2, 37)
    y = PackedLinears(layers[0])(x)[0]
    assert y.grad_fn is not None  # weights that need grad: F.linear, differentiable
    try:
        set_cpu_linear("torch")
        with torch.no_grad():
            assert torch.equal(PackedLinears(layers[0])(x)[0], F.linear(x, layers[0].weight))
    finally:
        set_cpu_linear("onednn")
    with pytest.raises(ConfigError, match="onednn"):
        set_cpu_linear("mkl")


def test_bias_is_refused():
    with pytest.raises(ValueError, match="bias-free"):
        PackedLinears(nn.Linear(4, 4))


# ------------------------------------------------------------------ a few rows: small_linear
SMALL = cpu_linear._small_op()
needs_small = pytest.mark.skipif(SMALL is None, reason="the CPU extension could not be built here")


@needs_small
@pytest.mark.parametrize("k", [576, 48, 37, 80])  # a multiple of 64, of 16 only, neither, 16 with a remainder
@pytest.mark.parametrize("outs", [(1,), (29, 11, 11), (130, 64, 200)])
def test_small_linear_matches_f_linear_and_each_row_alone(k, outs):
    """Every row count it takes, weights spanning several units of work, K on and off the vector
    path: the exact products' values to float32 rounding (1e-6 of the sum of |w x|), and each
    input row's output the same bit for bit whatever rows come with it and whatever the thread
    count."""
    gen = torch.Generator().manual_seed(k + sum(outs))
    weights = [torch.randn(n, k, generator=gen) for n in outs]
    x = torch.randn(4, k, generator=gen)
    want = torch.cat([F.linear(x.double(), w.double()) for w in weights], -1)
    bound = 1e-6 * torch.cat([F.linear(x.abs().double(), w.abs().double()) for w in weights], -1)  # float32 rounding
    threads = torch.get_num_threads()
    try:
        for rows in range(1, 5):
            got = SMALL(x[:rows].contiguous(), weights)
            assert got.shape == (rows, sum(outs))
            assert bool(((got.double() - want[:rows]).abs() <= bound[:rows]).all())
            for i in range(rows):
                assert torch.equal(got[i], SMALL(x[i:i + 1].contiguous(), weights)[0])
        torch.set_num_threads(1)
        assert torch.equal(SMALL(x, weights), got)
    finally:
        torch.set_num_threads(threads)


@needs_small
def test_small_linear_refuses_bad_arguments():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        SMALL(torch.randn(5, 16), [w])
    with pytest.raises(RuntimeError, match="columns"):
        SMALL(torch.randn(2, 15), [w])
    with pytest.raises(RuntimeError, match="float32"):
        SMALL(torch.randn(2, 16), [w.double()])
    with pytest.raises(RuntimeError, match="at least one weight"):
        SMALL(torch.randn(2, 16), [])


@needs_small
def test_packed_layers_take_small_linear_up_to_four_rows():
    """Up to four rows the layers' joint output is small_linear's, beyond it oneDNN's; both
    F.linear's to rounding."""
    torch.manual_seed(1)
    layers = [nn.Linear(64, n, bias=False) for n in (40, 24)]
    packed = PackedLinears(*layers)
    with torch.no_grad():
        for shape in [(1, 1), (2, 2), (4, 1), (5, 1), (3, 5)]:
            x = torch.randn(*shape, 64)
            got = packed.joint(x)
            rows = x.numel() // 64
            if rows <= cpu_linear.SMALL_ROWS:
                assert torch.equal(got, SMALL(x.reshape(rows, 64), [lin.weight for lin in layers]).view(*shape, -1))
            torch.testing.assert_close(got, torch.cat([F.linear(x, lin.weight) for lin in layers], -1),
                                       rtol=1e-5, atol=1e-5)


PANEL = cpu_linear._panel_op()
needs_panel = pytest.mark.skipif(PANEL is None, reason="the CPU extension could not be built here, or without AVX-512")


@needs_panel
@pytest.mark.parametrize("k", [576, 100, 37, 7])  # whole blocks of 64, a partial last block, less than one
@pytest.mark.parametrize("n", [1, 16, 47, 200])  # one lane, one panel, a partial last panel, groups of three and a rest
def test_panel_linear_matches_f_linear_and_each_row_alone(k, n):
    """Rows 1-21 (eight-row blocks and every remainder), any K, N on and off the 16-column panels:
    the exact products to float32 rounding (1e-6 of the sum of |w x|), and each row's output the
    same bit for bit whatever rows come with it and whatever the thread count."""
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(21, k, generator=gen)
    packed = cpu_linear.pack_panels(w)
    assert packed.shape == (-(-n // 16), k, 16)
    want = F.linear(x.double(), w.double())
    bound = 1e-6 * F.linear(x.abs().double(), w.abs().double())
    threads = torch.get_num_threads()
    try:
        for rows in (1, 3, 8, 9, 16, 21):
            got = PANEL(x[:rows].contiguous(), packed, n)
            assert got.shape == (rows, n)
            assert bool(((got.double() - want[:rows]).abs() <= bound[:rows]).all())
            for i in range(rows):
                assert torch.equal(got[i], PANEL(x[i:i + 1].contiguous(), packed, n)[0])
        torch.set_num_threads(1)
        assert torch.equal(PANEL(x, packed, n), got)
    finally:
        torch.set_num_threads(threads)


@needs_panel
def test_panel_linear_refuses_bad_arguments():
    packed = cpu_linear.pack_panels(torch.randn(40, 16))  # 3 panels
    with pytest.raises(RuntimeError, match="does not fit 3 panels"):
        PANEL(torch.randn(2, 16), packed, 48 + 1)
    with pytest.raises(RuntimeError, match="does not fit"):
        PANEL(torch.randn(2, 16), packed, 32)
    with pytest.raises(RuntimeError, match="packed must be"):
        PANEL(torch.randn(2, 15), packed, 40)
    with pytest.raises(RuntimeError, match="float32"):
        PANEL(torch.randn(2, 16).double(), packed, 40)


@needs_panel
def test_packed_layers_take_panel_linear_from_five_rows_to_panel_rows():
    """From five rows to PANEL_ROWS the joint output is panel_linear's over the layers' weights
    packed together (packed on first use, again after a weight changes), beyond it oneDNN's;
    all F.linear's to rounding."""
    torch.manual_seed(2)
    layers = [nn.Linear(64, n, bias=False) for n in (40, 24)]
    packed = PackedLinears(*layers)
    top = cpu_linear.PANEL_ROWS
    with torch.no_grad():
        for shape in [(5, 1), (3, 7), (top, 1), (top + 1, 1)]:
            x = torch.randn(*shape, 64)
            got = packed.joint(x)
            rows = x.numel() // 64
            weights = torch.cat([lin.weight for lin in layers])
            if cpu_linear.SMALL_ROWS < rows <= top:
                want = PANEL(x.reshape(rows, 64), cpu_linear.pack_panels(weights), 64)
                assert torch.equal(got, want.view(*shape, -1))
            torch.testing.assert_close(got, F.linear(x, weights), rtol=1e-5, atol=1e-5)
        layers[0].weight.mul_(3)
        x = torch.randn(6, 64)
        torch.testing.assert_close(packed(x)[0], F.linear(x, layers[0].weight), rtol=1e-5, atol=1e-5)
