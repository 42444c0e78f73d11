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
