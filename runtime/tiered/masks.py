"""Exact mask operations for the tier manager's per-step [L, R] columns, off torch's slow paths.

On the CPU, ``torch.where`` over float32 columns and ``Tensor.any`` over a bool mask are slow
paths: at 70B shapes ([80, 2k] columns, one thread, a random mask) ``where`` costs 0.41 ms and
``any`` 0.12 ms, where the same results through integer bit operations cost 0.09 and 0.003 ms;
a bool tensor's ``sum()`` widens every element to int64 first (1.15 ms at batch 8's [80, 16k])
where ``torch.count_nonzero`` takes 0.29 ms — the per-layer counts use it too
(docs/benchmarks.md §12, "Eleventh pass"). The results are exact — :func:`select_` selects bits,
computes none — and the same operations run on a GPU.
"""

from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s storage as integers of its element size (a view: writes go through)."""
    return x.view(_BITS[x.element_size()])


def any_(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` of a bool tensor."""
    return mask.numel() > 0 and bool(mask.view(torch.uint8).max())


def count_(mask: torch.Tensor) -> int:
    """``int(mask.sum())`` of a bool tensor."""
    return int(torch.count_nonzero(mask))


def select_(out: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out = torch.where(mask, values, out)`` in place (``values`` of ``out``'s dtype; ``mask`` and
    ``values`` broadcast to ``out``): ``out ^= (out ^ values) & -mask``, bit for bit."""
    if values.dtype != out.dtype:
        raise TypeError(f"select_: values are {values.dtype}, out is {out.dtype}")
    o = _bits(out)
    o.bitwise_xor_((o ^ _bits(values)) & mask.to(o.dtype).neg_())
    return out

