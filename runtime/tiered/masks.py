"""Exact mask operations for the tier manager's per-step [L, R] columns, off torch's slow paths.

On the CPU, ``torch.where`` over float32 columns and ``Tensor.any`` over a bool mask are slow
paths: at 70B shapes ([80, 2k] columns, one thread, a random mask) ``where`` costs 0.41 ms and
``any`` 0.12 ms, where the same results through integer bit operations cost 0.09 and 0.003 ms;
a bool tensor's ``sum()`` widens every element to int64 first (1.15 ms at batch 8's [80, 16k])
where ``torch.count_nonzero`` takes 0.29 ms — the per-layer counts use it too
(docs/benchmarks.md §12, "Eleventh pass"). The results are exact — :func:`select_` selects bits,
computes none — and the same operations run on a GPU. :func:`pairs_` and :func:`longs` are the
same idea for the step's index lists: a mask's (layer, record) pairs through the extension's
``mask_pairs`` (torch's ``nonzero`` costs 0.18 ms over an [80, 2k] mask on one thread) and a Python
list of ints as a tensor through a buffer (``torch.tensor`` of a list: 3.4x slower).
"""

from __future__ import annotations

from array import array
from typing import Iterable

import torch

from tieredkv.models.cpu_attention import tier_step_ops

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


def pairs_(mask: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask.nonzero(as_tuple=True)`` of a [L, R] bool mask: (layers, records), layer by layer,
    records ascending. ``counts`` [L]: how many each layer holds, when known (checked)."""
    ops = tier_step_ops() if mask.device.type == "cpu" and mask.dim() == 2 else None
    if ops is None:
        return mask.nonzero(as_tuple=True)
    return ops.mask_pairs(mask.contiguous(), None if counts is None else counts.to(torch.long).contiguous())


def longs(values: Iterable[int]) -> torch.Tensor:
    """``torch.tensor(list(values), dtype=torch.long)`` of Python ints, through a buffer (``values``:
    also an ``array("q")``, e.g. rows joined with its ``fromlist``, taken as it is)."""
    buf = values if isinstance(values, array) and values.typecode == "q" else array("q", values)
    return torch.frombuffer(buf, dtype=torch.long) if len(buf) else torch.zeros(0, dtype=torch.long)
