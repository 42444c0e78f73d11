"""KV page codecs — reference semantics (float32 math, readable). The ONNX functions
(`tieredkv.plugins.onnx_ops`) and the CUDA kernels must match them bit for bit.

A page of one layer is K [KVH, P, D] and V [KVH, P, D]. A codec quantizes values in
*groups* that share a scale: per token (D values of one token and kv head) or per
channel (the P values of one channel across the page's tokens — KIVI's choice for keys,
whose outliers live in fixed channels). Variants:

* ``fp8``           FP8 E4M3 codes, one fp16 absmax scale per group;
* ``fp8-r2``        the design note's codec: FP8 E4M3 + a 2-bit correction of the
                    quantization residual (its own fp16 scale per group);
* ``int6-r2``       6-bit symmetric integers + the 2-bit residual;
* ``int4``          KIVI-style 4-bit asymmetric (fp16 scale and zero point per group);
* ``int4-g16``      ``int4`` with value groups of 16 instead of 32 (values carry most of
                    int4's error);
* ``int2``          KIVI-style 2-bit asymmetric;
* ``fp8-r2-delta``  the note's "periodic full-precision resync": along the page's tokens,
                    token t stores the difference to token t-1 (quantized as ``fp8-r2``)
                    except keyframes (t % ``keyframe`` == 0), stored in fp16. An
                    *update* of a KV cache is one appended token, so "resync every 10
                    updates" is a keyframe every 10 tokens. Differences are taken
                    against the original previous token (open loop; decode is a cumulative
                    sum from the last keyframe), so errors can add up for <= 9 tokens.

Codes are unsigned: an n-bit symmetric integer q in [-2^(n-1), 2^(n-1)-1] is stored as
q + 2^(n-1). Rounding is half-to-even everywhere (torch.round, ONNX Round, FP8 casts).

Non-finite input (defined behaviour): NaN is encoded as 0 and ±Inf as ±(the group's
largest finite magnitude) before quantization; scales are computed from finite values.
Zero points and keyframes are float16 and saturate at ±65504: a group reaching beyond
float16's range decodes with that error, never to Inf/NaN.
A group of zeros gets scale 1 (exactly representable; decodes to exact zeros). Scales
are bfloat16 (float32's range: tiny groups stay representable), zero points float16.

The byte layout of an encoded page (``page_layout``) is documented in docs/codec.md:
every section starts at a multiple of 128 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP16_MAX = 65504.0  # largest finite float16: zero points and keyframes saturate there
ALIGN = 128


@dataclass(frozen=True)
class CodecSpec:
    name: str
    base: str  # "fp8" | "int"
    bits: int  # code bits of the base quantizer
    asym: bool = False  # asymmetric min/max with a zero point (KIVI) instead of symmetric absmax
    residual_bits: int = 0  # 0 or 2
    key_axis: str = "token"  # grouping of keys: "token" or "channel"
    value_axis: str = "token"
    group: int = 64  # values per group along the token axis (ignored for per-channel groups: the page)
    keyframe: int = 0  # delta coding along tokens with a keyframe every `keyframe` tokens (0: none)

    def __post_init__(self) -> None:
        if self.base not in ("fp8", "int"):
            raise ValueError(f"codec base must be 'fp8' or 'int', got {self.base!r}")
        if self.base == "fp8" and (self.bits != 8 or self.asym):
            raise ValueError("fp8 codes are 8-bit E4M3, symmetric")
        if self.residual_bits not in (0, 2):
            raise ValueError(f"residual_bits must be 0 or 2, got {self.residual_bits}")
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in [2, 8], got {self.bits}")


CODECS: dict[str, CodecSpec] = {
    c.name: c for c in (
        CodecSpec("fp8", "fp8", 8),
        CodecSpec("fp8-r2", "fp8", 8, residual_bits=2),
        CodecSpec("int6-r2", "int", 6, residual_bits=2),
        CodecSpec("int4", "int", 4, asym=True, key_axis="channel", group=32),
        CodecSpec("int4-g16", "int", 4, asym=True, key_axis="channel", group=16),
        CodecSpec("int2", "int", 2, asym=True, key_axis="channel", group=32),
        CodecSpec("fp8-r2-delta", "fp8", 8, residual_bits=2, keyframe=10),
    )
}

#: the codec a bare ``--warm-codec`` selects: the measured choice for capacity (2.82:1 vs
#: float16 at +0.003 perplexity, passkey 10/10 with every cold page compressed;
#: docs/benchmarks.md §3). int6-r2 is the choice for fidelity (1.85:1, indistinguishable).
DEFAULT_CODEC = "int4"

# ------------------------------------------------------------------------------ grouping
def _to_groups(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """[KVH, P, D] -> [KVH, n_groups, G]."""
    kvh, p, d = x.shape
    if axis == "channel":
        return x.transpose(1, 2).reshape(kvh, d, p)
    g = math.gcd(group, d)
    return x.reshape(kvh, p * d // g, g)


def _from_groups(xg: torch.Tensor, axis: str, shape: tuple[int, int, int], contiguous: bool = True) -> torch.Tensor:
    kvh, p, d = shape
    if axis == "channel":
        x = xg.reshape(kvh, d, p).transpose(1, 2)
        return x.contiguous() if contiguous else x
    return xg.reshape(kvh, p, d)


def sanitize(xg: torch.Tensor) -> torch.Tensor:
    """NaN -> 0, ±Inf -> ±(largest finite |x| of the group) (module docstring)."""
    finite = torch.isfinite(xg)
    if xg.device.type == "cpu" and bool(finite.all()):  # nothing to replace (the common case; on the CPU a
        return xg                                       # check costs no device round trip)
    big = torch.where(finite, xg.abs(), torch.zeros_like(xg)).amax(-1, keepdim=True)
    x = torch.where(torch.isnan(xg), torch.zeros_like(xg), xg)
    return torch.where(torch.isinf(x), torch.sign(x) * big, x)


SCALE_DTYPE = torch.bfloat16  # float32's range in 2 bytes: tiny groups (1e-6) keep a usable scale


def _stored_scale(s: torch.Tensor) -> torch.Tensor:
    """Scales are stored in bfloat16: quantize with the value decode will see; 0 -> 1."""
    s = s.to(SCALE_DTYPE).float()
    return torch.where(s > 0, s, torch.ones_like(s))


# ------------------------------------------------------------------------------ quantizers
def quantize(xg: torch.Tensor, spec: CodecSpec) -> dict[str, torch.Tensor]:
    """Base quantizer of groups [..., G] -> {"codes" uint8, "scale" fp16, ["zero" fp16]}."""
    if spec.base == "fp8":
        scale = _stored_scale(xg.abs().amax(-1, keepdim=True) / FP8_MAX)
        # saturate like ONNX QuantizeLinear(saturate=1): the fp16-rounded scale may be a hair small
        codes = torch.clamp(xg / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return {"codes": codes, "scale": scale.to(SCALE_DTYPE)}
    levels = 2 ** spec.bits - 1
    if spec.asym:
        lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        scale = _stored_scale((hi - lo) / levels)
        # -0 -> +0 (the sign of a zero minimum is torch's reduction order's); saturated to float16's range
        zero = (lo + 0.0).clamp(-FP16_MAX, FP16_MAX).half().float()
        codes = torch.clamp(torch.round((xg - zero) / scale), 0, levels)
        return {"codes": codes.to(torch.uint8), "scale": scale.to(SCALE_DTYPE), "zero": zero.half()}
    half = 2 ** (spec.bits - 1)
    scale = _stored_scale(xg.abs().amax(-1, keepdim=True) / (half - 1))
    codes = torch.clamp(torch.round(xg / scale), -half, half - 1) + half
    return {"codes": codes.to(torch.uint8), "scale": scale.to(SCALE_DTYPE)}


def dequantize(q: dict[str, torch.Tensor], spec: CodecSpec) -> torch.Tensor:
    scale = q["scale"].float()
    if spec.base == "fp8":
        return q["codes"].view(torch.float8_e4m3fn).float() * scale
    if spec.asym:  # uint8 codes times float32 scales: computed in float32, no float copy of the codes
        return (q["codes"] * scale).add_(q["zero"].float())
    return (q["codes"].float() - 2 ** (spec.bits - 1)) * scale


def quantize_residual(r: torch.Tensor) -> dict[str, torch.Tensor]:
    """2-bit mid-rise quantizer of a residual: cells centered at (-1.5, -0.5, 0.5, 1.5) * s,
    s = absmax / 2 (bfloat16). A residual group of zeros stores s = 0 (decodes to 0)."""
    absmax = r.abs().amax(-1, keepdim=True)
    scale = _stored_scale(absmax / 2)
    codes = torch.clamp(torch.floor(r / scale) + 2, 0, 3)
    stored = torch.where(absmax > 0, scale, torch.zeros_like(scale))
    return {"rcodes": codes.to(torch.uint8), "rscale": stored.to(SCALE_DTYPE)}


def dequantize_residual(q: dict[str, torch.Tensor]) -> torch.Tensor:
    return (q["rcodes"].float() - 1.5) * q["rscale"].float()


# ------------------------------------------------------------------------------ pages
def encode(x: torch.Tensor, spec: CodecSpec, *, role: str = "k") -> dict[str, torch.Tensor]:
    """One layer's K or V page [KVH, P, D] (any float dtype) -> the encoded tensors."""
    axis = spec.key_axis if role == "k" else spec.value_axis
    x = x.float()
    out: dict[str, torch.Tensor] = {}
    if spec.keyframe:
        # keyframes (fp16) and open-loop differences to the previous token
        t = torch.arange(x.shape[1], device=x.device)
        key = (t % spec.keyframe) == 0
        xs = sanitize(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        out["keyframes"] = xs[:, key].clamp(-FP16_MAX, FP16_MAX).half()
        prev = torch.cat([torch.zeros_like(xs[:, :1]), xs[:, :-1]], dim=1)
        x = torch.where(key.view(1, -1, 1), torch.zeros_like(xs), xs - prev)
    xg = sanitize(_to_groups(x, axis, spec.group))
    q = quantize(xg, spec)
    out.update(q)
    if spec.residual_bits:
        out.update(quantize_residual(xg - dequantize(q, spec)))
    return out


def decode(enc: dict[str, torch.Tensor], spec: CodecSpec, shape: tuple[int, int, int], *,
           role: str = "k", contiguous: bool = True) -> torch.Tensor:
    """The encoded tensors -> the page [KVH, P, D] in float32 (``contiguous=False``: per-channel
    groups may come back as a transposed view, saving a copy for a caller that copies anyway)."""
    axis = spec.key_axis if role == "k" else spec.value_axis
    xg = dequantize(enc, spec)
    if spec.residual_bits:
        xg = xg + dequantize_residual(enc)
    x = _from_groups(xg, axis, shape, contiguous or bool(spec.keyframe))
    if spec.keyframe:
        t = torch.arange(shape[1], device=x.device)
        key = (t % spec.keyframe) == 0
        x = torch.where(key.view(1, -1, 1), torch.zeros_like(x), x)
        x[:, key] = enc["keyframes"].float()
        # cumulative sum restarting at every keyframe
        seg = torch.cumsum(key.long(), 0) - 1
        out = torch.empty_like(x)
        for s in range(int(seg.max()) + 1):
            idx = (seg == s).nonzero().flatten()
            out[:, idx] = torch.cumsum(x[:, idx], dim=1)
        x = out
    return x


# ------------------------------------------------------------------------------ layout
def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def page_layout(spec: CodecSpec, kv_heads: int, page_size: int, head_dim: int) -> dict[str, dict[str, int]]:
    """Byte offsets and sizes of every section of one layer's encoded page (K then V);
    each section starts at a multiple of 128 bytes. Codes are bit-packed little-endian
    (value i of a byte occupies bits [i*b, (i+1)*b) for b in {2, 4}; 6-bit codes pack 4
    values into 3 bytes)."""
    layout: dict[str, dict[str, int]] = {}
    offset = 0
    n = kv_heads * page_size * head_dim
    padded = -(-n // 4) * 4  # codes are packed in whole bytes (4 values = 1, 2 or 3 bytes)
    for role in ("k", "v"):
        axis = spec.key_axis if role == "k" else spec.value_axis
        groups = kv_heads * head_dim if axis == "channel" else n // math.gcd(spec.group, head_dim)
        sections = {"codes": padded * spec.bits // 8, "scale": 2 * groups}
        if spec.asym:
            sections["zero"] = 2 * groups
        if spec.residual_bits:
            sections["rcodes"] = padded * spec.residual_bits // 8
            sections["rscale"] = 2 * groups
        if spec.keyframe:
            sections["keyframes"] = 2 * kv_heads * -(-page_size // spec.keyframe) * head_dim
        for name, size in sections.items():
            layout[f"{role}.{name}"] = {"offset": offset, "bytes": size}
            offset += _aligned(size)
    layout["total"] = {"offset": 0, "bytes": offset}
    return layout


def page_bytes(spec: CodecSpec, kv_heads: int, page_size: int, head_dim: int) -> int:
    """Bytes of one layer's encoded page (K + V), alignment padding included."""
    return page_layout(spec, kv_heads, page_size, head_dim)["total"]["bytes"]


def as_words(pool: torch.Tensor) -> torch.Tensor:
    """Encoded pages [..., NB] uint8 as little-endian int32 words [..., NB / 4] (a view when
    ``pool`` is contiguous): the form TensorRT takes them in (plugin tensors cannot be uint8,
    and a uint8 network input may only feed a Cast). NB is a multiple of ``ALIGN``."""
    if pool.dtype != torch.uint8 or pool.shape[-1] % 4:
        raise ValueError(f"as_words: expected uint8 pages of a multiple of 4 bytes, got {pool.dtype} "
                         f"{tuple(pool.shape)}")
    return pool.contiguous().view(torch.int32)


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """Encoded pages as uint8 bytes [..., NB]: uint8 as they are, int32 words (``as_words``)
    viewed back as their bytes."""
    if pool.dtype == torch.uint8:
        return pool
    if pool.dtype != torch.int32:
        raise ValueError(f"encoded pages: expected uint8 bytes or int32 words, got {pool.dtype}")
    return pool.contiguous().view(torch.uint8)


def bits_per_value(spec: CodecSpec, kv_heads: int, page_size: int, head_dim: int) -> float:
    return 8 * page_bytes(spec, kv_heads, page_size, head_dim) / (2 * kv_heads * page_size * head_dim)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (< 2**bits) -> packed bytes (see page_layout)."""
    flat = codes.flatten().to(torch.int32)
    if bits == 8:
        return flat.to(torch.uint8)
    if bits in (2, 4):
        per = 8 // bits
        v = flat.view(-1, per) << (torch.arange(per, dtype=torch.int32, device=flat.device) * bits)
        return v.sum(-1).to(torch.uint8)
    if bits == 6:
        v = flat.view(-1, 4)
        word = v[:, 0] | (v[:, 1] << 6) | (v[:, 2] << 12) | (v[:, 3] << 18)
        return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], -1).flatten().to(torch.uint8)
    raise ValueError(f"cannot pack {bits}-bit codes")


def unpack_codes(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """``unpack`` for 2-, 4- and 8-bit codes, shifted and masked in uint8 (one pass per code of
    a byte, no widening to int32): the same codes, 1.2-1.4x faster to decode a page with (the
    dequantization multiplies them by their scales in float32 directly)."""
    if bits not in (2, 4, 8):
        return unpack(data, bits, count)
    flat = data.flatten()
    if bits == 8:
        return flat[:count]
    mask = 2 ** bits - 1
    parts = [flat & mask] + [(flat >> s) & mask for s in range(bits, 8, bits)]
    return torch.stack(parts, -1).view(-1)[:count]


def unpack(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    flat = data.flatten().to(torch.int32)
    if bits == 8:
        return flat[:count].to(torch.uint8)
    if bits in (2, 4):
        per = 8 // bits
        v = (flat.view(-1, 1) >> (torch.arange(per, dtype=torch.int32, device=flat.device) * bits)) & (2 ** bits - 1)
        return v.flatten()[:count].to(torch.uint8)
    if bits == 6:
        b = flat.view(-1, 3)
        word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], -1)
        return v.flatten()[:count].to(torch.uint8)
    raise ValueError(f"cannot unpack {bits}-bit codes")


# ------------------------------------------------------------------------------ page bytes
def _group_shape(spec: CodecSpec, role: str, kv_heads: int, page_size: int, head_dim: int) -> tuple[int, int]:
    """(groups per kv head, values per group) of one page."""
    axis = spec.key_axis if role == "k" else spec.value_axis
    if axis == "channel":
        return head_dim, page_size
    g = math.gcd(spec.group, head_dim)
    return page_size * head_dim // g, g


def _as_bytes(t: torch.Tensor, n: int) -> torch.Tensor:
    """Tensor with ``n`` pages along dim 0 (any trailing shape) -> [n, bytes per page]."""
    return t.contiguous().view(torch.uint8).reshape(n, -1)


def encode_pages(k: torch.Tensor, v: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """N pages of one layer, K and V [N, KVH, P, D] -> uint8 [N, page_bytes] in the byte
    layout of ``page_layout`` (docs/codec.md). Pages are encoded independently; this is
    ``encode`` of each page, serialized."""
    n, kvh, p, d = k.shape
    layout = page_layout(spec, kvh, p, d)
    out = torch.zeros((n, layout["total"]["bytes"]), dtype=torch.uint8, device=k.device)
    if n == 0:
        return out
    for role, x in (("k", k), ("v", v)):
        enc = encode(x.reshape(n * kvh, p, d), spec, role=role)  # pages as extra heads: same groups
        for name, t in enc.items():
            sec = layout[f"{role}.{name}"]
            if name in ("codes", "rcodes"):
                bits = spec.bits if name == "codes" else spec.residual_bits
                codes = t.reshape(n, -1)
                pad = -codes.shape[1] % 4
                if pad:
                    codes = torch.cat([codes, codes.new_zeros(n, pad)], 1)
                data = pack(codes, bits).reshape(n, -1)
            else:
                data = _as_bytes(t, n)
            assert data.shape[1] == sec["bytes"], (role, name, data.shape, sec)
            out[:, sec["offset"] : sec["offset"] + sec["bytes"]] = data
    return out


def decode_pages(data: torch.Tensor, spec: CodecSpec, shape: tuple[int, int, int], *,
                 contiguous: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, page_bytes] (``encode_pages``) -> K, V [N, KVH, P, D] float32 (``contiguous=False``:
    either may be a strided view, as :func:`decode` says)."""
    kvh, p, d = shape
    n = data.shape[0]
    if n == 0:
        return (torch.zeros((0, kvh, p, d), device=data.device),
                torch.zeros((0, kvh, p, d), device=data.device))
    layout = page_layout(spec, kvh, p, d)
    vals = kvh * p * d
    out = []
    for role in ("k", "v"):
        groups, size = _group_shape(spec, role, kvh, p, d)
        enc: dict[str, torch.Tensor] = {}
        for key, sec in layout.items():
            if not key.startswith(role + "."):
                continue
            name = key.split(".", 1)[1]
            raw = data[:, sec["offset"] : sec["offset"] + sec["bytes"]]
            if name in ("codes", "rcodes"):
                bits = spec.bits if name == "codes" else spec.residual_bits
                per_page = -(-vals // 4) * 4
                if name == "codes" and spec.base == "fp8":  # FP8 codes are reinterpreted, not converted
                    codes = unpack(raw.contiguous(), bits, n * per_page)
                else:
                    codes = unpack_codes(raw.contiguous(), bits, n * per_page)
                codes = codes.reshape(n, per_page)[:, :vals]
                enc[name] = codes.reshape(n * kvh, groups, size)
            elif name == "keyframes":
                enc[name] = raw.contiguous().view(torch.float16).reshape(n * kvh, -1, d)
            else:
                dtype = torch.float16 if name == "zero" else SCALE_DTYPE
                enc[name] = raw.contiguous().view(dtype).reshape(n * kvh, groups, 1)
        out.append(decode(enc, spec, (n * kvh, p, d), role=role, contiguous=contiguous).reshape(n, kvh, p, d))
    return out[0], out[1]
