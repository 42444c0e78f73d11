"""Equal-bytes peers of the tiered cache: the quantized full cache users already run —
transformers' ``QuantizedCache`` (KIVI-style: the whole cache quantized, the newest tokens
kept at full precision) — alone, or with a kvpress press applied on it, as
:class:`~tieredkv.runtime.eval.harness.EvalMethod` s scored by the same perplexity and task
code as every other method (the question-agnostic protocol of ``kvpress_methods``).

Backend: HQQ (the ``hqq`` package from PyPI), which quantizes at 8, 4 and 2 bits on the CPU in
plain PyTorch. transformers' other backend, optimum-quanto, takes only 2 and 4 bits in
``QuantizedCache``, so it cannot give the int8 row; one backend serves every row.

Settings (transformers' defaults where it has them): ``group`` values per quantization group
(64), ``residual`` the newest tokens kept at full precision before the whole cache is
re-quantized (128), ``axis`` the axis HQQ groups along: 1 (the default here, the layout
transformers' documentation shows for HQQ) makes contiguous groups of ``group`` values — with
SmolLM2's head dim of 64, one group per token and kv head, KIVI's per-token grouping; 0
(``QuantizedCache``'s own default) groups ``group`` values strided across the whole tensor,
mixing tokens, heads and channels. HQQ packs the codes of an axis-1 tensor along its groups,
two (int4) or four (int2) groups to a byte, and fails when their count does not divide (an
odd kept length at int4: a press keeps any length); with ``axis=1`` the codes are therefore
kept one to a byte (``bitpack=False``: the same codes and values, decoded without unpacking)
and *counted* as packed.

**Bytes, counted as the project counts its own codecs** (docs/codec.md): the codes as packed
(HQQ packs two 4-bit or four 2-bit codes a byte), one scale and one zero point per group at
2 bytes each (HQQ keeps them in the compute dtype; a deployment stores them in fp16, as the
project's codecs store theirs in bf16 / fp16), and the residual tokens at 2 bytes a value (the
fp16 a deployment computes in). The *nominal* share of the full cache's fp16 bytes is
``(bits / 8 + 4 / group) / 2``: 53.1 % (int8), 28.1 % (int4), 15.6 % (int2) at group 64 — a
quantized full cache never fits 50 / 25 / 12.5 % by itself. The residual (up to
``residual - 1`` tokens at full precision) comes on top; the measured peak of every session is
in the method's stats (``kv_fp16_fraction_peak``), over the fp16 bytes of the work (context +
everything fed after it), as a tiered cache's percentage budget counts.

**A press on the quantized cache** (``press=NAME``) makes the peer fit a budget exactly: at
budget ``b`` the press keeps the context tokens with which the session's peak — the kept
context and everything fed after it quantized, plus a full residual — stays within ``b`` of the
full cache's fp16 bytes (:func:`kept_context`); where the quantized cache fits without pruning
no press runs. kvpress compresses a ``QuantizedCache`` itself (its presses dequantize the
prefill's keys and values, prune them and quantize the rest again).

Continuations are fed one token per forward call: the residual's flushes make a chunk of
teacher-forced tokens differ from as many decode steps.
"""

from __future__ import annotations

import math
from typing import Any

from kvpress_methods import KVPressMethod, attn_implementation_for, make_press, press_names
from tieredkv.errors import ConfigError
from tieredkv.models.llama import Llama

__all__ = ["QUANT_BITS", "QuantizedCacheMethod", "cache_bytes", "kept_context", "nominal_fraction", "parse_settings"]

#: the precisions the peers run at
QUANT_BITS = (8, 4, 2)
#: transformers' QuantizedCache defaults (group, residual) and HQQ's documented axis
DEFAULTS = {"group": 64, "residual": 128, "axis": 1}
FP16 = 2  # bytes of a scale, a zero point, a residual value


def nominal_fraction(bits: int, group: int) -> float:
    """The quantized cache's share of the full cache's fp16 bytes: codes + one fp16 scale and
    zero point per group, over 2 bytes a value (the residual not counted)."""
    return (bits / 8 + 2 * FP16 / group) / FP16


def kept_context(budget: float, *, context: int, total: int, bits: int, group: int, residual: int) -> int:
    """Context tokens a press may keep so that the session's peak bytes stay within ``budget``
    of the full cache's fp16 bytes for ``total`` tokens: the kept context and the
    ``total - context`` tokens fed after it, quantized, plus up to ``residual - 1`` of them at
    full precision. At least 1, at most ``context``."""
    q = nominal_fraction(bits, group)
    after = max(0, total - context)
    room = budget * total - q * after - (1 - q) * min(residual - 1, after)
    return max(1, min(context, math.floor(room / q)))


def layer_bytes(layer: Any) -> int:
    """Bytes of one QuantizedLayer as a deployment stores it (module docstring)."""
    n = 0
    for q in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
        if q is None:
            continue
        codes, meta = q  # HQQ: the codes (packed in bytes, or one per element) and their metadata
        packed = codes.numel() * codes.element_size() if meta["packing"] else -(-codes.numel() * meta["nbits"] // 8)
        n += packed + FP16 * (meta["scale"].numel() + meta["zero"].numel())
    for t in (layer.keys, layer.values):
        if t is not None and t.dim() == 4:
            n += FP16 * t.numel()
    return n


def cache_bytes(cache: Any) -> int:
    return sum(layer_bytes(layer) for layer in cache.layers)


def parse_settings(args: str) -> dict[str, Any]:
    """``int4[,press=snapkv][,group=64][,residual=128][,axis=1][,name=NAME][,budget=12.5%]`` ->
    settings (``budget``: with a press, run at that budget only)."""
    parts = [p.strip() for p in args.split(",") if p.strip()]
    if not parts or not parts[0].startswith("int") or not parts[0][3:].isdigit() or int(parts[0][3:]) not in QUANT_BITS:
        raise ConfigError(f"quantized:{args}: expected int8, int4 or int2 first (e.g. quantized:int4,press=snapkv)")
    out: dict[str, Any] = {"bits": int(parts[0][3:]), "press": None, "name": None, "budget": None, **DEFAULTS}
    for part in parts[1:]:
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep or key not in ("press", "name", "budget", *DEFAULTS):
            raise ConfigError(f"quantized:{args}: {part!r} is not one of press=, name=, budget=, group=, residual=, "
                              "axis=")
        if key == "budget":
            try:
                out[key] = float(value.removesuffix("%")) / 100
            except ValueError:
                out[key] = 0.0
            if not value.endswith("%") or not 0 < out[key] <= 1:
                raise ConfigError(f"quantized:{args}: budget must be a percentage in (0, 100], got {value!r}")
        elif key == "press":
            if value not in press_names():
                raise ConfigError(f"quantized:{args}: unknown press {value!r}; expected one of {press_names()}")
            out[key] = value
        elif key == "name":
            out[key] = value
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise ConfigError(f"quantized:{args}: {key} must be an integer, got {value!r}") from None
    if out["group"] < 1 or out["residual"] < 1 or out["axis"] not in (0, 1):
        raise ConfigError(f"quantized:{args}: group and residual must be >= 1 and axis 0 or 1")
    if out["budget"] is not None and out["press"] is None:
        raise ConfigError(f"quantized:{args}: budget= pins the budget of a press; the quantized cache alone runs at "
                          "its own share of the fp16 bytes")
    out["name"] = out["name"] or (f"quantized-int{out['bits']}" + (f"+{out['press']}" if out["press"] else ""))
    return out


class QuantizedCacheMethod(KVPressMethod):
    """transformers' ``QuantizedCache`` (HQQ backend) at ``bits``, with the press ``press_name``
    sized to ``budget`` (None: the quantized cache alone, ``budget`` only labels the row)."""

    def __init__(self, model: Llama, *, bits: int, budget: float, press_name: str | None = None, group: int = 64,
                 residual: int = 128, axis: int = 1, name: str | None = None, hf_model: Any = None) -> None:
        from transformers.utils import is_hqq_available

        if not is_hqq_available():
            raise ConfigError("the quantized-cache peer needs the hqq package (pip install -e '.[eval]')")
        self.bits, self.group, self.residual, self.axis, self.press_name = bits, group, residual, axis, press_name
        probe = make_press(press_name, 0.5) if press_name else None
        info = {"backend": "transformers-QuantizedCache", "quantizer": "hqq", "bits": bits, "group": group,
                "residual": residual, "axis": axis, "press_name": press_name,
                "nominal_fp16_fraction": nominal_fraction(bits, group)}
        super().__init__(model, None, name=name or f"quantized-int{bits}", budget=budget,
                         attn_implementation=attn_implementation_for(probe), teacher_forcing_chunk=1,
                         hf_model=hf_model, info=info)
        spec = model.kv_spec()
        self.fp16_token_bytes = 2 * spec.num_kv_heads * spec.head_dim * FP16 * spec.num_layers
        self._work: list[list[int]] = []  # per session: [total tokens, peak bytes, kept context]

    def new_cache(self) -> Any:
        from transformers import QuantizedCache

        cache = QuantizedCache("hqq", self.hf_model.config, nbits=self.bits, axis_key=self.axis,
                               axis_value=self.axis, q_group_size=self.group, residual_length=self.residual)
        if self.axis == 1:
            for layer in cache.layers:
                layer.quantizer = _unpacked_quantizer()
        return cache

    def session_press(self, context_len: int, total_tokens: int | None) -> Any:
        total = max(total_tokens or context_len, context_len)
        keep = context_len
        if self.press_name is not None:
            keep = kept_context(self.budget, context=context_len, total=total, bits=self.bits, group=self.group,
                                residual=self.residual)
        self._work.append([total, 0, keep])
        if keep >= context_len:
            return None
        self.press = make_press(self.press_name, 1.0 - keep / context_len)
        return self.press

    def snapshot(self, cache: Any) -> list[tuple]:
        self.after_forward(cache)
        # update() rebinds these attributes, never writes into them: keeping references is a snapshot
        return [(layer._quantized_keys, layer._quantized_values, layer.keys, layer.values, layer.cumulative_length)
                for layer in cache.layers]

    def restore(self, cache: Any, saved: list[tuple]) -> None:
        for layer, (qk, qv, k, v, n) in zip(cache.layers, saved):
            layer._quantized_keys, layer._quantized_values, layer.keys, layer.values = qk, qv, k, v
            layer.cumulative_length = n

    def after_forward(self, cache: Any) -> None:
        work = self._work[-1]
        work[1] = max(work[1], cache_bytes(cache))

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self._work:
            fractions = [peak / (total * self.fp16_token_bytes) for total, peak, _ in self._work]
            out.update(kv_fp16_fraction_peak=max(fractions), kv_fp16_fraction_mean=sum(fractions) / len(fractions),
                       kept_context_tokens=[keep for _, _, keep in self._work])
        return out


def _unpacked_quantizer() -> type:
    """HQQ's Quantizer with ``bitpack=False`` (module docstring: axis 1)."""
    global _UNPACKED
    if _UNPACKED is None:
        from hqq.core.quantize import Quantizer

        class UnpackedQuantizer(Quantizer):
            @classmethod
            def quantize(cls, tensor, **kwargs):
                return super().quantize(tensor, bitpack=False, **kwargs)

        _UNPACKED = UnpackedQuantizer
    return _UNPACKED


_UNPACKED: type | None = None
