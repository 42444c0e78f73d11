"""The branch-free mask operations against torch.where / Tensor.any: bit for bit."""

import torch
from hypothesis import given, settings, strategies as st

from tieredkv.runtime.tiered.masks import any_, select_


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.int64, torch.int32, torch.bool]),
       rows=st.integers(1, 7), cols=st.integers(1, 300), share=st.floats(0, 1), broadcast=st.booleans(),
       seed=st.integers(0, 999))
def test_select_equals_where_bit_for_bit(dtype, rows, cols, share, broadcast, seed):
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    info = torch.iinfo(bits)

    def random():  # every bit pattern: NaNs, infinities, -0.0 and denormals included
        x = torch.randint(info.min, info.max, (rows, cols), generator=gen, dtype=torch.int64).to(bits).view(dtype)
        return (x.view(torch.uint8) & 1).bool() if dtype == torch.bool else x

    out, values = random(), random()
    mask = torch.rand((1 if broadcast else rows, cols), generator=gen) < share
    want = torch.where(mask, values, out)
    assert select_(out, mask, values) is out
    assert torch.equal(out.view(bits), want.view(bits))


def test_select_refuses_another_dtype():
    import pytest

    with pytest.raises(TypeError, match="float64"):
        select_(torch.zeros(3), torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.float64))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 200), share=st.floats(0, 0.05), step=st.integers(1, 3), seed=st.integers(0, 99))
def test_any_equals_torch_any(n, share, step, seed):
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(seed)) < share
    view = mask[:, ::step]  # strided too
    assert any_(view) == bool(view.any())
    assert any_(mask) == bool(mask.any())


def test_count_equals_sum():
    from tieredkv.runtime.tiered.masks import count_

    mask = torch.rand(3, 1000, generator=torch.Generator().manual_seed(1)) < 0.3
    assert count_(mask) == int(mask.sum()) and count_(mask[:, ::3]) == int(mask[:, ::3].sum())
    assert count_(torch.zeros(0, dtype=torch.bool)) == 0


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(0, 70), share=st.floats(0, 1), counted=st.booleans(),
       seed=st.integers(0, 999))
def test_pairs_equal_nonzero(rows, cols, share, counted, seed):
    """The extension's mask_pairs (the CPU path of pairs_) against nonzero: widths across its
    8-byte words (0 .. 70 records), empty and full layers."""
    from tieredkv.runtime.tiered.masks import pairs_

    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=gen) < share
    if rows > 2:
        mask[1] = False
        mask[2] = True
    layers, recs = pairs_(mask, torch.count_nonzero(mask, dim=1) if counted else None)
    want = mask.nonzero(as_tuple=True)
    assert torch.equal(layers, want[0]) and torch.equal(recs, want[1])
    assert layers.dtype == recs.dtype == torch.long


def test_pairs_refuse_counts_that_disagree():
    import pytest

    from tieredkv.models.cpu_attention import tier_step_ops
    from tieredkv.runtime.tiered.masks import pairs_

    if tier_step_ops() is None:
        pytest.skip("the CPU ops are not built here")
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask[1, [0, 7, 8, 19]] = True
    for counts, layer in (([0, 3, 0], 1), ([0, 5, 0], 1), ([1, 4, 0], 0)):
        with pytest.raises(RuntimeError, match=rf"counts\[{layer}\]"):
            pairs_(mask, torch.tensor(counts))
    with pytest.raises(RuntimeError, match="outside"):
        pairs_(mask, torch.tensor([0, 21, 0]))


def test_longs_equal_torch_tensor():
    from array import array

    from tieredkv.runtime.tiered.masks import longs

    for values in ([], [7], [3, -1, 2**40, 0], list(range(1000))):
        got = longs(values)
        assert got.dtype == torch.long and torch.equal(got, torch.tensor(values, dtype=torch.long))
    rows = array("q", [1, 2])
    rows.fromlist([3])
    assert torch.equal(longs(rows), torch.tensor([1, 2, 3]))
