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

At one to four input rows (decode at a small batch) the GEMMs are matrix-vector products bound
by reading the weights, and the packed GEMM reads them at ~17-19 GB/s here: those rows go
through the CPU extension's ``small_linear`` instead (``models/csrc/small_linear.cpp``: each
weight row streamed once from nn.Linear's own row-major layout, no copy), 1.2-1.8x faster per
decode step's linear layers at one to four rows (docs/benchmarks.md §12, "Sixteenth pass"). Its
sums differ from oneDNN's in rounding (both within float32 rounding of ``F.linear``), and each
output is the same whatever the other rows.

From five to ``PANEL_ROWS`` rows (decode at a larger batch) the extension's ``panel_linear`` runs
instead, on AVX-512 CPUs: the weights packed once more, into panels of 16 output columns
([ceil(N / 16), K, 16]), eight input rows times three panels in registers, the weights streamed
once per step — 1.0-1.4x oneDNN's packed GEMM's speed per projection at 8-64 rows here
(docs/benchmarks.md §12, "Nineteenth pass"). Each of its outputs sums K in blocks of 64, the blocks'
sums added in order: the same value whatever the other rows (oneDNN's is not).

The price is a second copy of the weights (the packed one; a third where both the panel pack and
oneDNN's are used: decode at more than four rows and prefill through one model).
``set_cpu_linear("torch")`` or ``TIEREDKV_CPU_LINEAR=torch`` turns all three off; other devices and
dtypes, autograd and tracing always take ``F.linear``.
"""

from __future__ import annotations

import os

import torch
from torch import nn
import torch.nn.functional as F

from tieredkv.errors import ConfigError

BACKENDS = ("onednn", "torch")
_STATE = {"backend": "onednn"}
#: input rows up to which the fast path runs the extension's row-major product (``small_linear``)
SMALL_ROWS = 4
#: ... and from there up to which its product from panel-packed weights (``panel_linear``)
PANEL_ROWS = 64
_SMALL: dict = {}


def _small_op():
    """``models/csrc/small_linear.cpp``'s op, or ``None`` where the extension cannot be built."""
    if "op" not in _SMALL:
        from tieredkv.models.cpu_attention import small_linear_op

        _SMALL["op"] = small_linear_op()
    return _SMALL["op"]


def _panel_op():
    """``models/csrc/small_linear.cpp``'s ``panel_linear``, or ``None`` where it cannot run here."""
    if "panel" not in _SMALL:
        from tieredkv.models.cpu_attention import panel_linear_op

        _SMALL["panel"] = panel_linear_op()
    return _SMALL["panel"]


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """Weights w [N, K] as ``panel_linear`` reads them: [ceil(N / 16), K, 16], row n in panel n // 16,
    lane n % 16, the last panel's missing rows zero."""
    n, k = w.shape
    nb = -(-n // 16)
    padded = w.new_zeros(nb * 16, k)
    padded[:n] = w
    return padded.view(nb, 16, k).transpose(1, 2).contiguous()


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
        self._panels = None
        self._sizes: list[int] = []
        self._weights: list[torch.Tensor] = []

    def __getstate__(self):
        return {"linears": self.linears, "_key": None, "_packed": None, "_panels": None, "_sizes": [], "_weights": []}

    def _pack(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weights when the oneDNN path applies to ``x`` (repacked when a weight was
        replaced or changed in place), else ``None``. Checked on every call, in the order that
        costs least on the decode path (a few attribute reads; the pack keeps the weights it was
        made from, so a replaced weight's id cannot be reused while it is compared)."""
        if not (x.dtype is torch.float32 and _STATE["backend"] == "onednn" and _ONEDNN and x.device.type == "cpu"):
            return None
        weights = [lin.weight for lin in self.linears]
        key = [(id(w), w.data_ptr(), w._version) for w in weights]
        if key != self._key:
            if not all(w.dtype is torch.float32 and w.device.type == "cpu" for w in weights):
                return None
            w = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
            self._packed, self._key = torch.ops.mkldnn._reorder_linear_weight(w, None), key
            self._sizes, self._weights, self._panels = [w.shape[0] for w in weights], weights, None
        if (torch.is_grad_enabled() and any(w.requires_grad for w in weights)) or torch.jit.is_tracing() \
                or torch.compiler.is_compiling():
            return None
        return self._packed

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs concatenated on the last dimension, [..., sum of out_features]:
        one GEMM's output on the fast path (no copy), the ``F.linear`` outputs concatenated
        otherwise. Equal bit for bit to ``torch.cat(self(x), -1)``."""
        packed = self._pack(x)
        if packed is None:
            outs = [F.linear(x, lin.weight) for lin in self.linears]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return self._product(x, packed)

    def _product(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The fast path's joint output: a few rows (decode at a small batch) through the
        extension's row-major product, more through oneDNN's packed GEMM."""
        rows, small = x.numel() // x.shape[-1], _small_op()
        if rows <= SMALL_ROWS and small is not None and all(w.is_contiguous() for w in self._weights):
            return small(x.reshape(rows, x.shape[-1]).contiguous(), self._weights).view(*x.shape[:-1], -1)
        if rows <= PANEL_ROWS and (panel := _panel_op()) is not None:
            if self._panels is None:  # (packed on first use: a model that never decodes in batches has none)
                self._panels = pack_panels(torch.cat([w.detach() for w in self._weights]))
            n = sum(self._sizes)
            return panel(x.reshape(rows, x.shape[-1]).contiguous(), self._panels, n).view(*x.shape[:-1], n)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = self._pack(x)
        if packed is None:
            return tuple(F.linear(x, lin.weight) for lin in self.linears)
        y = self._product(x, packed)
        return (y,) if len(self._sizes) == 1 else y.split(self._sizes, dim=-1)
