"""The model's linear layers on the CPU: oneDNN with packed weights.

torch's ``F.linear`` runs float32 on the CPU through MKL's sgemm, which re-reads the weight in
its row-major layout on every call. oneDNN's linear with the weight packed once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the path
torch's Inductor takes for a frozen CPU graph, and the one vLLM's CPU build takes with its own
oneDNN binding) is up to 1.9x faster per projection at decode and 1.8-3x for the output
projection over a 49k vocabulary on this project's CPU, and the paged cache decodes 1.36-1.54x
faster with it and ``cpu_attention`` (docs/benchmarks.md §12, "Eighth pass"). Projections that
read the same input run as one GEMM over their concatenated weights (q / k / v, gate / up): one
call where there were three, bit-identical to the separate calls.

The price is a second copy of the weights (the packed one). ``set_cpu_linear("torch")`` or
``TIEREDKV_CPU_LINEAR=torch`` turns it off; other devices and dtypes, autograd and tracing
always take ``F.linear``.
"""

from __future__ import annotations

import os

import torch
from torch import nn
import torch.nn.functional as F

from tieredkv.errors import ConfigError

BACKENDS = ("onednn", "torch")
_STATE = {"backend": "onednn"}


def _onednn_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


_ONEDNN = _onednn_available()


def set_cpu_linear(backend: str) -> None:
    """``"onednn"`` (the default) or ``"torch"`` (``F.linear``) for float32 CPU inference."""
    if backend not in BACKENDS:
        raise ConfigError(f"cpu linear backend (set_cpu_linear or TIEREDKV_CPU_LINEAR) must be one of "
                          f"{BACKENDS}, got {backend!r}")
    _STATE["backend"] = backend


set_cpu_linear(os.environ.get("TIEREDKV_CPU_LINEAR", "onednn"))


def cpu_linear() -> str:
    """The backend in use: ``"onednn"`` where it is chosen and this torch has it, else ``"torch"``."""
    return "onednn" if _STATE["backend"] == "onednn" and _ONEDNN else "torch"


class PackedLinears:
    """Bias-free linear layers that read the same input, run as one oneDNN GEMM over their
    weights packed together, or one ``F.linear`` each where the fast path does not apply.
    ``__call__`` returns one output per layer. The pack is rebuilt when a weight is replaced or
    changed in place (by its version counter); copies and pickles leave it behind."""

    def __init__(self, *linears: nn.Linear) -> None:
        if any(lin.bias is not None for lin in linears):
            raise ValueError("PackedLinears takes bias-free layers")
        self.linears = linears
        self._key = None
        self._packed = None

    def __getstate__(self):
        return {"linears": self.linears, "_key": None, "_packed": None}

    def _fast(self, x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
        return (_STATE["backend"] == "onednn" and _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32
                and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)
                and not (torch.is_grad_enabled() and any(w.requires_grad for w in weights))
                and not torch.jit.is_tracing() and not torch.compiler.is_compiling())

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = [lin.weight for lin in self.linears]
        if not self._fast(x, weights):
            return tuple(F.linear(x, w) for w in weights)
        key = tuple((w.data_ptr(), w._version, tuple(w.shape)) for w in weights)
        if key != self._key:
            w = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
            self._packed, self._key = torch.ops.mkldnn._reorder_linear_weight(w, None), key
        y = torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        return (y,) if len(weights) == 1 else y.split([w.shape[0] for w in weights], dim=-1)
