"""The codec ops as ONNX nodes: custom domain ``tieredkv``, attributes ``plugin_namespace`` /
``plugin_version`` (TensorRT >= 10.15 swaps in the registered plugin when they are set),
and a local-function body of standard ops (opset 21) that ONNX Runtime, onnx.reference
and polygraphy run anywhere. The bodies compute exactly what `tieredkv.plugins.codec`
does, bit for bit (the tests compare them in ONNX Runtime CPU).

The ops work on *groups*: ``x`` [N, G] float32, one scale (and zero point) per row. The
page <-> groups reshapes (per token or per channel) are plain Reshape/Transpose nodes of
the surrounding graph. Outputs are unpacked codes (one uint8 per value; FP8 codes come
back from ONNX Runtime as uint8 too) and float32 scales that are exactly representable in
bfloat16 (zero points: in float16) — bit packing is a storage-layout step
(`codec.pack`).

    KVEncode<codec>(x) -> codes [N, G], scale [N, 1] (, zero [N, 1]) (, rcodes [N, G], rscale [N, 1])
    KVDecode<codec>(codes, scale, (zero,) (rcodes, rscale)) -> x_hat [N, G]
"""

from __future__ import annotations

from onnx import FunctionProto, ModelProto, TensorProto, helper

from tieredkv.plugins.codec import FP8_MAX, FP16_MAX, CodecSpec
from tieredkv.plugins.onnx_graph import OnnxGraph

from tieredkv.plugins import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION  # noqa: E402  (re-exported)
OPSET = 21
_ATTRS = ["plugin_namespace", "plugin_version"]


def _stored_scale(b: OnnxGraph, raw: str, out: str) -> str:
    """bfloat16-rounded scale, 0 -> 1 (codec._stored_scale)."""
    s = b.op("Cast", b.op("Cast", raw, to=TensorProto.BFLOAT16), to=TensorProto.FLOAT)
    return b.op("Where", b.op("Greater", s, b.const(0.0)), s, b.const(1.0), out=out)


def _absmax(b: OnnxGraph, x: str) -> str:
    return b.op("ReduceMax", b.op("Abs", x), b.const([-1], TensorProto.INT64), keepdims=1)


def _quantize(b: OnnxGraph, x: str, spec: CodecSpec) -> tuple[list[str], str]:
    """Base quantizer; returns (output names, the dequantized tensor name)."""
    if spec.base == "fp8":
        scale = _stored_scale(b, b.op("Div", _absmax(b, x), b.const(FP8_MAX)), "scale")
        xc = b.op("Clip", b.op("Div", x, scale), b.const(-FP8_MAX), b.const(FP8_MAX))
        codes = b.op("Cast", xc, to=TensorProto.FLOAT8E4M3FN, saturate=1, out="codes")
        deq = b.op("Mul", b.op("Cast", codes, to=TensorProto.FLOAT), scale)
        return ["codes", "scale"], deq
    levels = float(2 ** spec.bits - 1)
    axes = b.const([-1], TensorProto.INT64)
    if spec.asym:
        lo = b.op("ReduceMin", x, axes, keepdims=1)
        hi = b.op("ReduceMax", x, axes, keepdims=1)
        scale = _stored_scale(b, b.op("Div", b.op("Sub", hi, lo), b.const(levels)), "scale")
        zero16 = b.op("Cast", b.op("Clip", b.op("Add", lo, b.const(0.0)), b.const(-FP16_MAX), b.const(FP16_MAX)),
                      to=TensorProto.FLOAT16)  # -0 -> +0, saturated (codec.quantize)
        zero = b.op("Cast", zero16, to=TensorProto.FLOAT, out="zero")
        q = b.op("Clip", b.op("Round", b.op("Div", b.op("Sub", x, zero), scale)), b.const(0.0), b.const(levels))
        codes = b.op("Cast", q, to=TensorProto.UINT8, out="codes")
        deq = b.op("Add", b.op("Mul", b.op("Cast", codes, to=TensorProto.FLOAT), scale), zero)
        return ["codes", "scale", "zero"], deq
    half = float(2 ** (spec.bits - 1))
    scale = _stored_scale(b, b.op("Div", _absmax(b, x), b.const(half - 1)), "scale")
    q = b.op("Clip", b.op("Round", b.op("Div", x, scale)), b.const(-half), b.const(half - 1))
    codes = b.op("Cast", b.op("Add", q, b.const(half)), to=TensorProto.UINT8, out="codes")
    deq = b.op("Mul", b.op("Sub", b.op("Cast", codes, to=TensorProto.FLOAT), b.const(half)), scale)
    return ["codes", "scale"], deq


def _residual(b: OnnxGraph, r: str) -> list[str]:
    absmax = _absmax(b, r)
    scale = _stored_scale(b, b.op("Div", absmax, b.const(2.0)), "rscale_q")
    q = b.op("Clip", b.op("Add", b.op("Floor", b.op("Div", r, scale)), b.const(2.0)), b.const(0.0), b.const(3.0))
    b.op("Cast", q, to=TensorProto.UINT8, out="rcodes")
    b.op("Where", b.op("Greater", absmax, b.const(0.0)), scale, b.const(0.0), out="rscale")
    return ["rcodes", "rscale"]


def _check(spec: CodecSpec) -> None:
    if spec.keyframe:
        raise ValueError(f"{spec.name}: delta coding runs along a page's tokens (a scan); it has a PyTorch "
                         "reference but no ONNX form")


def _sanitize(b: OnnxGraph, x: str) -> str:
    """NaN -> 0, ±Inf -> ±(largest finite |x| of the row) (codec.sanitize)."""
    nan, inf = b.op("IsNaN", x), b.op("IsInf", x)
    finite = b.op("Not", b.op("Or", nan, inf))
    big = b.op("ReduceMax", b.op("Where", finite, b.op("Abs", x), b.const(0.0)), b.const([-1], TensorProto.INT64),
               keepdims=1)
    x1 = b.op("Where", nan, b.const(0.0), x)
    return b.op("Where", b.op("IsInf", x1), b.op("Mul", b.op("Sign", x1), big), x1)


def encode_function(spec: CodecSpec) -> FunctionProto:
    """Equals ``codec.encode`` on groups (sanitize, quantize, residual)."""
    _check(spec)
    b = OnnxGraph()
    x = _sanitize(b, "x")
    outputs, deq = _quantize(b, x, spec)
    if spec.residual_bits:
        outputs += _residual(b, b.op("Sub", x, deq))
    return helper.make_function(DOMAIN, op_type("encode", spec), ["x"], outputs, b.nodes,
                                [helper.make_opsetid("", OPSET)], attributes=_ATTRS)


def decode_function(spec: CodecSpec) -> FunctionProto:
    _check(spec)
    b = OnnxGraph()
    inputs = ["codes", "scale"] + (["zero"] if spec.asym else []) + (["rcodes", "rscale"] if spec.residual_bits else [])
    codes = b.op("Cast", "codes", to=TensorProto.FLOAT)  # FP8 codes are typed float8e4m3fn: a value cast
    if spec.base == "fp8":
        x = b.op("Mul", codes, "scale")
    elif spec.asym:
        x = b.op("Add", b.op("Mul", codes, "scale"), "zero")
    else:
        x = b.op("Mul", b.op("Sub", codes, b.const(float(2 ** (spec.bits - 1)))), "scale")
    if spec.residual_bits:
        r = b.op("Mul", b.op("Sub", b.op("Cast", "rcodes", to=TensorProto.FLOAT), b.const(1.5)), "rscale")
        x = b.op("Add", x, r)
    b.op("Identity", x, out="x_hat")
    return helper.make_function(DOMAIN, op_type("decode", spec), inputs, ["x_hat"], b.nodes,
                                [helper.make_opsetid("", OPSET)], attributes=_ATTRS)


def op_type(kind: str, spec: CodecSpec) -> str:
    """e.g. KVEncode_fp8_r2, KVDecode_int4."""
    return f"KV{kind.capitalize()}_{spec.name.replace('-', '_')}"


def _io_types(kind: str, spec: CodecSpec) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    code_t = TensorProto.FLOAT8E4M3FN if spec.base == "fp8" else TensorProto.UINT8
    enc = [("codes", code_t), ("scale", TensorProto.FLOAT)]
    if spec.asym:
        enc.append(("zero", TensorProto.FLOAT))
    if spec.residual_bits:
        enc += [("rcodes", TensorProto.UINT8), ("rscale", TensorProto.FLOAT)]
    if kind == "encode":
        return [("x", TensorProto.FLOAT)], enc
    return enc, [("x_hat", TensorProto.FLOAT)]


def codec_model(kind: str, spec: CodecSpec) -> ModelProto:
    """A one-node model running the encode or decode op on groups [N, G] (N, G dynamic)."""
    fn = encode_function(spec) if kind == "encode" else decode_function(spec)
    ins, outs = _io_types(kind, spec)

    def vi(name: str, t: int):
        return helper.make_tensor_value_info(name, t, ["N", "G" if not name.endswith(("scale", "zero")) else 1])

    node = helper.make_node(fn.name, [n for n, _ in ins], [n for n, _ in outs], domain=DOMAIN,
                            plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)
    graph = helper.make_graph([node], f"{fn.name}_graph", [vi(n, t) for n, t in ins], [vi(n, t) for n, t in outs])
    return helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", OPSET),
                                                                   helper.make_opsetid(DOMAIN, 1)])


# --- page-level decode: the byte layout of codec.encode_pages -> K, V ----------------------------


def _lut(b: OnnxGraph, values) -> str:
    """A float32 lookup table (1-D numpy array) as a Constant node."""
    import numpy as np

    return b.array(np.asarray(values, np.float32), "lut")


def _byte_luts(b: OnnxGraph) -> dict[str, str]:
    """Exact byte -> float32 tables: 'fp8' (256 E4M3 codes), 'bf16' and 'f16' (65536 patterns
    each, indexed by the little-endian 16-bit word). ONNX has no bitcast; a Gather into an exact
    table decodes stored bit patterns without rounding."""
    import numpy as np
    import torch

    words = np.arange(65536, dtype=np.uint32)
    return {"fp8": _lut(b, torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()),
            "bf16": _lut(b, (words << 16).view(np.float32)),
            "f16": _lut(b, words.astype(np.uint16).view(np.float16).astype(np.float32))}


def _section(b: OnnxGraph, data: str, sec: dict[str, int]) -> str:
    i64 = TensorProto.INT64
    return b.op("Slice", data, b.const([sec["offset"]], i64), b.const([sec["offset"] + sec["bytes"]], i64),
                b.const([1], i64))


def _unpack(b: OnnxGraph, raw: str, bits: int, count: int) -> str:
    """Packed codes [N, nbytes] uint8 -> the first ``count`` codes [N, count] int64 (codec.unpack)."""
    i64 = TensorProto.INT64
    x = b.op("Cast", raw, to=i64)
    nbytes = -(-count // 4) * 4 * bits // 8  # whole bytes of the padded code count (codec.page_layout)
    if bits == 6:  # 4 codes in a 24-bit little-endian word of 3 bytes
        words = nbytes // 3
        x = b.op("Reshape", x, b.const([0, words, 3], i64))  # explicit sizes: N may be 0
        byte = lambda i: b.op("Gather", x, b.const(i, i64), axis=2)  # noqa: E731
        word = b.op("Add", b.op("Add", byte(0), b.op("Mul", byte(1), b.const(256, i64))),
                    b.op("Mul", byte(2), b.const(65536, i64)))
        parts, per, base = [word], 4, 64
    else:
        words = nbytes
        parts, per, base = [x], 8 // bits, 2 ** bits
    if bits != 8:
        x = b.op("Reshape", digits(b, parts[0], base, per), b.const([0, words * per], i64))
    return b.op("Slice", x, b.const([0], i64), b.const([count], i64), b.const([1], i64))


def digits(b: OnnxGraph, src: str, base: int, per: int) -> str:
    """Non-negative int64 values [...] -> their ``per`` little-endian base-``base`` digits
    [..., per] (int64): digit i is src // base^i mod base."""
    i64 = TensorProto.INT64
    powers = b.const([base ** i for i in range(per)], i64)
    return b.op("Mod", b.op("Div", b.unsqueeze(src, -1), powers), b.const(base, i64))


def _words(b: OnnxGraph, raw: str, lut: str, count: int) -> str:
    """``count`` little-endian 16-bit words [N, 2 count] bytes -> their float32 values [N, count]
    through ``lut``."""
    i64 = TensorProto.INT64
    pairs = b.op("Reshape", b.op("Cast", raw, to=i64), b.const([0, count, 2], i64))
    lo, hi = (b.op("Gather", pairs, b.const(i, i64), axis=2) for i in (0, 1))
    return b.op("Gather", lut, b.op("Add", lo, b.op("Mul", hi, b.const(256, i64))), axis=0)


def decode_pages_function(spec: CodecSpec, page_shape: tuple[int, int, int]) -> FunctionProto:
    """``tieredkv::KVDecodePages_<codec>``: encoded pages ``data`` [N, page_bytes] uint8 in the
    byte layout of ``codec.encode_pages`` (for pages of ``page_shape`` = (KVH, P, D)) -> ``k``,
    ``v`` [N, KVH, P, D] float32, equal to ``codec.decode_pages`` bit for bit. The page shape is
    part of the layout, so it is fixed in the body (one function per codec and shape in a model)."""
    from tieredkv.plugins.codec import _group_shape, page_layout

    _check(spec)
    kvh, p, d = page_shape
    i64 = TensorProto.INT64
    layout = page_layout(spec, kvh, p, d)
    vals = kvh * p * d
    b = OnnxGraph()
    luts = _byte_luts(b)
    for role, out in (("k", "k"), ("v", "v")):
        axis = spec.key_axis if role == "k" else spec.value_axis
        groups, size = _group_shape(spec, role, kvh, p, d)
        sec = lambda name: layout[f"{role}.{name}"]  # noqa: E731
        codes = _unpack(b, _section(b, "data", sec("codes")), spec.bits, vals)
        grouped = b.const([0, kvh * groups, size], i64)
        per_group = b.const([0, kvh * groups, 1], i64)
        if spec.base == "fp8":
            value = b.op("Gather", luts["fp8"], codes, axis=0)
        else:
            value = b.op("Cast", codes, to=TensorProto.FLOAT)
        value = b.op("Reshape", value, grouped)
        scale = b.op("Reshape", _words(b, _section(b, "data", sec("scale")), luts["bf16"], kvh * groups), per_group)
        if spec.base == "fp8":
            x = b.op("Mul", value, scale)
        elif spec.asym:
            zero = b.op("Reshape", _words(b, _section(b, "data", sec("zero")), luts["f16"], kvh * groups), per_group)
            x = b.op("Add", b.op("Mul", value, scale), zero)
        else:
            x = b.op("Mul", b.op("Sub", value, b.const(float(2 ** (spec.bits - 1)))), scale)
        if spec.residual_bits:
            rc = b.op("Reshape", b.op("Cast", _unpack(b, _section(b, "data", sec("rcodes")), spec.residual_bits, vals),
                                      to=TensorProto.FLOAT), grouped)
            rs = b.op("Reshape", _words(b, _section(b, "data", sec("rscale")), luts["bf16"], kvh * groups), per_group)
            x = b.op("Add", x, b.op("Mul", b.op("Sub", rc, b.const(1.5)), rs))
        if axis == "channel":  # groups are (kv head, channel) rows of the page's tokens
            b.op("Transpose", b.op("Reshape", x, b.const([0, kvh, d, p], i64)), perm=[0, 1, 3, 2], out=out)
        else:
            b.op("Reshape", x, b.const([0, kvh, p, d], i64), out=out)
    return helper.make_function(DOMAIN, decode_pages_op_type(spec), ["data"], ["k", "v"], b.nodes,
                                [helper.make_opsetid("", OPSET)])


def decode_pages_op_type(spec: CodecSpec) -> str:
    """e.g. KVDecodePages_int4."""
    return f"KVDecodePages_{spec.name.replace('-', '_')}"


def decode_pages_model(spec: CodecSpec, page_shape: tuple[int, int, int]) -> ModelProto:
    """A one-node model decoding N encoded pages (N dynamic)."""
    from tieredkv.plugins.codec import page_bytes

    kvh, p, d = page_shape
    fn = decode_pages_function(spec, page_shape)
    node = helper.make_node(fn.name, ["data"], ["k", "v"], domain=DOMAIN)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([node], f"{fn.name}_graph", [vi("data", TensorProto.UINT8, ["N", page_bytes(spec, *page_shape)])],
                              [vi(n, TensorProto.FLOAT, ["N", kvh, p, d]) for n in ("k", "v")])
    return helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", OPSET),
                                                                   helper.make_opsetid(DOMAIN, 1)])
