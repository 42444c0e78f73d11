"""TieredAttention, ImportanceScore, SelectPages and KVAppend as ONNX nodes: custom domain
``tieredkv`` and a local-function body of standard ops (opset 21) that ONNX Runtime,
onnx.reference and polygraphy run anywhere. The plugin ops (TieredAttention, ImportanceScore,
KVAppend) carry the node attributes ``plugin_namespace`` / ``plugin_version``, so TensorRT
swaps in the registered plugin; SelectPages carries none (TensorRT inlines its body). The
bodies compute what the PyTorch references of ``tieredkv.plugins`` compute (same names:
``tiered_attention``, ``importance_score``, ``select_pages``, ``kv_append``); each op's test
module in ``tests/plugins/`` compares them in ONNX Runtime CPU. Spec: ``docs/plugins.md``.

    TieredAttention<scale>(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past)
        -> out [B, H, T, D], lse [B, H, T], page_probs [B, H, T, M]
    TieredAttention<scale, warm_codec>(..., past, warm_pool, warm_row) -> the same (warm pages
        read from their encoded bytes; see tiered_attention_function)
    ImportanceScore<weights, scale>(q, kmin, kmax, page_tokens, distance, saliency, page_mask,
                                    position_table) -> score [B, M]
    SelectPages(score, valid, pinned, attend_pages) -> selected [B, M]
    KVAppend(k_pool, v_pool, k_new, v_new, slot, offset) -> k_pool_out, v_pool_out

All sizes are dynamic: the bodies read them with Shape/Gather and build every reshape
target from them.
"""

from __future__ import annotations

from onnx import AttributeProto, FunctionProto, ModelProto, TensorProto, helper

from tieredkv.plugins.codec import CODECS, page_bytes
from tieredkv.plugins.importance_score import EXACT_TOKENS
from tieredkv.plugins.onnx_codec import (DOMAIN, OPSET, PLUGIN_NAMESPACE, PLUGIN_VERSION, decode_pages_function,
                                         decode_pages_op_type, digits)
from tieredkv.plugins.onnx_graph import OnnxGraph

__all__ = ["DOMAIN", "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "OPSET", "TIERED_ATTENTION", "IMPORTANCE_SCORE",
           "SELECT_PAGES", "KV_APPEND", "TOPK_LIMIT", "tiered_attention_function", "tiered_attention_model",
           "importance_score_function", "importance_score_model", "select_pages_function", "select_pages_model",
           "kv_append_function", "kv_append_model", "warm_functions"]

TIERED_ATTENTION = "TieredAttention"
IMPORTANCE_SCORE = "ImportanceScore"
SELECT_PAGES = "SelectPages"
KV_APPEND = "KVAppend"
#: TensorRT's largest TopK K (ITopKLayer): SelectPages keeps its K within the attention budget
TOPK_LIMIT = 3840
#: attributes every node of this module carries (declared by the functions, set on the node)
PLUGIN_ATTRS = ["plugin_namespace", "plugin_version"]

_I64 = TensorProto.INT64
_F32 = TensorProto.FLOAT


# --- body-building helpers ------------------------------------------------------------------


def _attr_const(b: OnnxGraph, attr: str, kind: str) -> str:
    """A Constant whose value is the calling node's attribute ``attr`` (``kind``: value_float /
    value_floats)."""
    out = b.fresh(attr)
    node = helper.make_node("Constant", [], [out])
    attr_type = AttributeProto.FLOAT if kind == "value_float" else AttributeProto.FLOATS
    node.attribute.append(helper.make_attribute_ref(kind, attr_type, ref_attr_name=attr))
    b.nodes.append(node)
    return out


def _shape(b: OnnxGraph, *dims: str) -> str:
    return b.op("Concat", *dims, axis=0)


def _scalar(b: OnnxGraph, one: str) -> str:
    """[1] -> [] (for Range)."""
    return b.op("Squeeze", one, b.const([0], _I64))


def _masked_softmax(b: OnnxGraph, logits: str, allowed: str) -> tuple[str, str]:
    """Softmax over the last axis of ``logits`` restricted to ``allowed`` (bool, broadcastable).
    Rows with no allowed entry give probabilities 0 and log-sum-exp -inf (no NaN).
    Returns (probs, lse with keepdims=1)."""
    axes = b.const([-1], _I64)
    masked = b.op("Where", allowed, logits, b.const(float("-inf")))
    seen = b.op("Cast", b.op("ReduceMax", b.op("Cast", allowed, to=_F32), axes, keepdims=1), to=TensorProto.BOOL)
    mx = b.op("Where", seen, b.op("ReduceMax", masked, axes, keepdims=1), b.const(0.0))
    e = b.op("Exp", b.op("Sub", masked, mx))  # exp(-inf) = 0 on removed entries
    total = b.op("Where", seen, b.op("ReduceSum", e, axes, keepdims=1), b.const(1.0))  # rows seeing nothing: 0 / 1
    probs = b.op("Div", e, total)
    lse = b.op("Where", seen, b.op("Add", b.op("Log", total), mx), b.const(float("-inf")))
    return probs, lse


def _word_bytes(b: OnnxGraph, words: str, nbytes: int) -> str:
    """int32 words [N, nbytes / 4] -> their little-endian bytes [N, nbytes] uint8 (ONNX has no
    bitcast: each word's unsigned value, divided by 256^j, modulo 256, is byte j)."""
    unsigned = b.op("BitwiseAnd", b.op("Cast", words, to=_I64), b.const(0xFFFFFFFF, _I64))
    byte = digits(b, unsigned, 256, 4)  # [N, nbytes / 4, 4]
    return b.op("Reshape", b.op("Cast", byte, to=TensorProto.UINT8), b.const([-1, nbytes], _I64))


def _function(name: str, inputs: list[str], outputs: list[str], b: OnnxGraph, attrs: list[str], *,
              calls_domain: bool = False, plugin: bool = True) -> FunctionProto:
    """``calls_domain``: the body calls other functions of the tieredkv domain; ``plugin``: the
    op has a TensorRT plugin (its nodes carry the plugin attributes)."""
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(DOMAIN, 1)] if calls_domain else [])
    return helper.make_function(DOMAIN, name, inputs, outputs, b.nodes, opsets,
                                attributes=attrs + (PLUGIN_ATTRS if plugin else []))


def node_attributes(op_type: str) -> dict[str, str]:
    """The plugin attributes a node of ``op_type`` carries (none for SelectPages, whose body
    TensorRT inlines)."""
    return {} if op_type == SELECT_PAGES else {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}


def _model(fn: FunctionProto, ins: list[tuple[str, int, list]], outs: list[tuple[str, int, list]],
           **attrs) -> ModelProto:
    node = helper.make_node(fn.name, [n for n, _, _ in ins], [n for n, _, _ in outs], domain=DOMAIN,
                            **node_attributes(fn.name), **attrs)
    graph = helper.make_graph([node], f"{fn.name}_graph",
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in ins],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outs])
    return helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", OPSET),
                                                                   helper.make_opsetid(DOMAIN, 1)])


# --- TieredAttention ------------------------------------------------------------------------

_ATTN_INPUTS = ["q", "k_pool", "v_pool", "page_table", "page_mask", "page_index", "seq_len", "past"]
_ATTN_OUTPUTS = ["out", "lse", "page_probs"]


_WARM_INPUTS = ["warm_pool", "warm_row"]


def tiered_attention_function(warm_codec: str | None = None,
                              page_shape: tuple[int, int, int] | None = None) -> FunctionProto:
    """``tieredkv::TieredAttention`` (attribute ``scale``: float), equal to
    ``tiered_attention(..., scale=scale)``.

    Inputs: q [B, H, T, D] float32; k_pool, v_pool [C, KVH, P, D] float32, float16 or bfloat16
    (one type; the listed pages are read in float32, as the plugin does); page_table [B, M]
    int64; page_mask [B, M] int32 (nonzero = kept: TensorRT plugins take no bool tensors);
    page_index [B, M] int64; seq_len [B] int64; past [B] int64.
    Outputs: out [B, H, T, D] float32 (0 for a query that sees no key), lse [B, H, T] float32
    (-inf when nothing is seen), page_probs [B, H, T, M] float32. H must be a multiple of KVH
    (query head h reads kv head h // (H / KVH)).

    With ``warm_codec`` (and the pools' ``page_shape`` (KVH, P, D), which fixes the byte
    layout) the op also reads compressed pages, as ``tiered_attention(..., warm_pool=,
    warm_row=, warm_codec=)``: two more inputs, warm_pool [W, NB / 4] int32 (the encoded bytes
    as little-endian words, ``codec.as_words``: plugin tensors cannot be uint8) and warm_row
    [B, M] int64, and the node carries the string attribute ``warm_codec``. The body gathers
    the kept warm pages (NonZero of ``page_mask & warm_row >= 0``), splits their words into
    bytes and decodes them with ``KVDecodePages_<codec>``
    (:func:`warm_functions` lists the functions a model needs) and scatters them over the
    gathered pages before attending.
    """
    if (warm_codec is None) != (page_shape is None):
        raise ValueError("warm_codec and page_shape go together")
    b = OnnxGraph()
    B, H, T, D = (b.dim("q", i) for i in range(4))
    KVH, P = b.dim("k_pool", 1), b.dim("k_pool", 2)
    M = b.dim("page_table", 1)
    G = b.op("Div", H, KVH)
    MP = b.op("Mul", M, P)
    one = b.const([1], _I64)
    # gather the listed pages: [B, M, KVH, P, D] -> [B, KVH, 1, M*P, D] (the 1 broadcasts over G)
    kv_shape = _shape(b, B, KVH, one, MP, D)

    page_mask = b.op("Cast", "page_mask", to=TensorProto.BOOL)  # int32 on the node: nonzero = kept
    gathered = {pool: b.op("Gather", pool, "page_table", axis=0) for pool in ("k_pool", "v_pool")}  # [B,M,KVH,P,D]
    if warm_codec is not None:
        take = b.op("And", page_mask, b.op("GreaterOrEqual", "warm_row", b.const(0, _I64)))
        idx = b.op("Transpose", b.op("NonZero", take), perm=[1, 0])  # [N, 2] (b, m) of the kept warm pages
        words = b.op("Gather", "warm_pool", b.op("GatherND", "warm_row", idx), axis=0)  # [N, NB / 4] int32
        enc = _word_bytes(b, words, page_bytes(CODECS[warm_codec], *page_shape))  # [N, NB] uint8
        k_dec, v_dec = b.fresh("warm_k"), b.fresh("warm_v")
        b.nodes.append(helper.make_node(decode_pages_op_type(CODECS[warm_codec]), [enc], [k_dec, v_dec],
                                        domain=DOMAIN))
        for pool, dec in (("k_pool", k_dec), ("v_pool", v_dec)):  # decoded values in the pools' type
            gathered[pool] = b.op("ScatterND", gathered[pool], idx, b.op("CastLike", dec, gathered[pool]))

    def pages(pool: str) -> str:  # the listed pages in float32, whatever the pools' type
        pages = b.op("Cast", gathered[pool], to=_F32)
        return b.op("Reshape", b.op("Transpose", pages, perm=[0, 2, 1, 3, 4]), kv_shape)

    k, v = pages("k_pool"), pages("v_pool")
    qg = b.op("Reshape", "q", _shape(b, B, KVH, G, T, D))
    scale = _attr_const(b, "scale", "value_float")
    logits = b.op("Mul", b.op("MatMul", qg, b.op("Transpose", k, perm=[0, 1, 2, 4, 3])), scale)  # [B,KVH,G,T,MP]
    # key position of slot o of listed page m: page_index * P + o -> [B, M*P]
    p_range = b.op("Range", b.const(0, _I64), _scalar(b, P), b.const(1, _I64))
    key_pos = b.op("Reshape", b.op("Add", b.op("Mul", b.unsqueeze("page_index", 2), P), p_range), _shape(b, B, MP))
    mask_mp = b.op("Reshape", b.op("Expand", b.unsqueeze(page_mask, 2), _shape(b, B, M, P)), _shape(b, B, MP))
    valid = b.op("And", mask_mp, b.op("Less", key_pos, b.unsqueeze("seq_len", 1)))  # [B, MP]
    t_range = b.op("Range", b.const(0, _I64), _scalar(b, T), b.const(1, _I64))
    q_pos = b.op("Add", b.unsqueeze("past", 1), t_range)  # [B, T]
    causal = b.op("LessOrEqual", b.unsqueeze(key_pos, 1), b.unsqueeze(q_pos, 2))  # [B, T, MP]
    allowed = b.op("And", b.unsqueeze(valid, 1), causal)
    allowed = b.op("Reshape", allowed, _shape(b, B, one, one, T, MP))
    probs, lse = _masked_softmax(b, logits, allowed)  # [B,KVH,G,T,MP], [B,KVH,G,T,1]
    b.op("Reshape", b.op("MatMul", probs, v), _shape(b, B, H, T, D), out="out")
    b.op("Reshape", lse, _shape(b, B, H, T), out="lse")
    per_page = b.op("ReduceSum", b.op("Reshape", probs, _shape(b, B, KVH, G, T, M, P)), b.const([-1], _I64),
                    keepdims=0)
    b.op("Reshape", per_page, _shape(b, B, H, T, M), out="page_probs")
    if warm_codec is None:
        return _function(TIERED_ATTENTION, _ATTN_INPUTS, _ATTN_OUTPUTS, b, ["scale"])
    return _function(TIERED_ATTENTION, _ATTN_INPUTS + _WARM_INPUTS, _ATTN_OUTPUTS, b, ["scale", "warm_codec"],
                     calls_domain=True)


def warm_functions(warm_codec: str | None, page_shape: tuple[int, int, int] | None) -> list[FunctionProto]:
    """The functions a model with (warm) TieredAttention nodes carries: TieredAttention's, and
    with a warm codec the page decoder its body calls."""
    fns = [tiered_attention_function(warm_codec, page_shape)]
    if warm_codec is not None:
        fns.append(decode_pages_function(CODECS[warm_codec], page_shape))
    return fns


def tiered_attention_model(scale: float, *, warm_codec: str | None = None,
                           page_shape: tuple[int, int, int] | None = None,
                           pool_dtype: int = TensorProto.FLOAT) -> ModelProto:
    """A one-node model running TieredAttention (all sizes dynamic but, with a warm codec, the
    page shape; the model passes ``scale = D ** -0.5``) on pools of ``pool_dtype``."""
    f, i64, i32 = _F32, _I64, TensorProto.INT32
    pool = ["C", "KVH", "P", "D"] if page_shape is None else ["C", *page_shape]
    ins = [("q", f, ["B", "H", "T", "D"]), ("k_pool", pool_dtype, pool), ("v_pool", pool_dtype, pool),
           ("page_table", i64, ["B", "M"]), ("page_mask", i32, ["B", "M"]), ("page_index", i64, ["B", "M"]),
           ("seq_len", i64, ["B"]), ("past", i64, ["B"])]
    attrs = {"scale": float(scale)}
    if warm_codec is not None:
        ins += [("warm_pool", i32, ["W", page_bytes(CODECS[warm_codec], *page_shape) // 4]),
                ("warm_row", i64, ["B", "M"])]
        attrs["warm_codec"] = warm_codec
    outs = [("out", f, ["B", "H", "T", "D"]), ("lse", f, ["B", "H", "T"]), ("page_probs", f, ["B", "H", "T", "M"])]
    model = _model(tiered_attention_function(warm_codec, page_shape), ins, outs, **attrs)
    if warm_codec is not None:
        model.functions.append(decode_pages_function(CODECS[warm_codec], page_shape))
    return model


# --- ImportanceScore ------------------------------------------------------------------------

_SCORE_INPUTS = ["q", "kmin", "kmax", "page_tokens", "distance", "saliency", "page_mask", "position_table"]


def _distance_bucket(b: OnnxGraph, distance: str, num_buckets: str) -> str:
    """bucket = #{i in 1..NB-1 : d >= 16 * 2^(i-1)} (int64, same shape as ``distance``): the
    log-spaced bucket of `importance.distance_bucket` computed with exact comparisons (float64
    thresholds: exact for distances below 2^53). Negative distances fall in bucket 0."""
    i = b.op("Cast", b.op("Range", b.const(1, _I64), num_buckets, b.const(1, _I64)), to=TensorProto.DOUBLE)
    thr = b.op("Mul", b.const(float(EXACT_TOKENS), TensorProto.DOUBLE),
               b.op("Pow", b.const(2.0, TensorProto.DOUBLE), b.op("Sub", i, b.const(1.0, TensorProto.DOUBLE))))
    d = b.unsqueeze(b.op("Cast", distance, to=TensorProto.DOUBLE), -1)
    return b.op("ReduceSum", b.op("Cast", b.op("GreaterOrEqual", d, thr), to=_I64), b.const([-1], _I64), keepdims=0)


def importance_score_function() -> FunctionProto:
    """``tieredkv::ImportanceScore`` (attributes ``weights``: 3 floats (relevance, position,
    saliency); ``scale``: float), equal to ``importance_score(..., weights, scale=scale)``.

    Inputs: q [B, H, D] float32; kmin, kmax [B, M, KVH, D] float32; page_tokens [B, M] int64;
    distance [B, M] int64; saliency [B, M] float32; page_mask [B, M] int32 (nonzero: the page
    competes); position_table [NB] float32. Output: score [B, M] float32 (0 where page_mask is 0).
    """
    b = OnnxGraph()
    page_mask = b.op("Cast", "page_mask", to=TensorProto.BOOL)
    B, H, D = (b.dim("q", i) for i in range(3))
    KVH, M = b.dim("kmin", 2), b.dim("kmin", 1)
    G = b.op("Div", H, KVH)
    zero = b.const(0.0)
    # relevance: Quest upper bound sum_d max(q*lo, q*hi) = relu(q) @ hi - relu(-q) @ lo
    qg = b.op("Reshape", "q", _shape(b, B, KVH, G, D))
    lo = b.op("Transpose", "kmin", perm=[0, 2, 3, 1])  # [B, KVH, D, M]
    hi = b.op("Transpose", "kmax", perm=[0, 2, 3, 1])
    ub = b.op("Sub", b.op("MatMul", b.op("Relu", qg), hi), b.op("MatMul", b.op("Relu", b.op("Neg", qg)), lo))
    ub = b.op("Reshape", ub, _shape(b, B, H, M))
    log_len = b.op("Log", b.op("Max", b.op("Cast", "page_tokens", to=_F32), b.const(1.0)))
    ub = b.op("Add", b.op("Mul", ub, _attr_const(b, "scale", "value_float")), b.unsqueeze(log_len, 1))
    share, _ = _masked_softmax(b, ub, b.unsqueeze(page_mask, 1))  # [B, H, M]
    share = b.op("ReduceMax", share, b.const([1], _I64), keepdims=0)  # [B, M]
    best = b.op("Max", b.op("ReduceMax", share, b.const([-1], _I64), keepdims=1), b.const(1e-30))
    rel = b.op("Div", share, best)
    # position: learned value of the distance's log-spaced bucket, clamped to [0, 1]
    nb = _scalar(b, b.dim("position_table", 0))
    pos = b.op("Clip", b.op("Gather", "position_table", _distance_bucket(b, "distance", nb), axis=0), zero,
               b.const(1.0))
    w = _attr_const(b, "weights", "value_floats")
    w_rel, w_pos, w_sal = (b.op("Gather", w, b.const(i, _I64), axis=0) for i in range(3))
    rel_term = b.op("Where", b.op("Equal", w_rel, zero), zero, b.op("Mul", w_rel, rel))  # the reference skips w_rel = 0
    score = b.op("Add", b.op("Add", rel_term, b.op("Mul", w_pos, pos)), b.op("Mul", w_sal, "saliency"))
    b.op("Where", page_mask, score, zero, out="score")
    return _function(IMPORTANCE_SCORE, _SCORE_INPUTS, ["score"], b, ["weights", "scale"])


def importance_score_model(weights: tuple[float, float, float], scale: float) -> ModelProto:
    """A one-node model running ImportanceScore (all sizes dynamic; the model passes
    ``scale = D ** -0.5``)."""
    if len(weights) != 3:
        raise ValueError(f"weights: expected 3 values (relevance, position, saliency), got {len(weights)}")
    f, i64 = _F32, _I64
    ins = [("q", f, ["B", "H", "D"]), ("kmin", f, ["B", "M", "KVH", "D"]), ("kmax", f, ["B", "M", "KVH", "D"]),
           ("page_tokens", i64, ["B", "M"]), ("distance", i64, ["B", "M"]), ("saliency", f, ["B", "M"]),
           ("page_mask", TensorProto.INT32, ["B", "M"]), ("position_table", f, ["NB"])]
    return _model(importance_score_function(), ins, [("score", f, ["B", "M"])],
                  weights=[float(x) for x in weights], scale=float(scale))


# --- SelectPages ----------------------------------------------------------------------------

_SELECT_INPUTS = ["score", "valid", "pinned", "attend_pages"]


def select_pages_function() -> FunctionProto:
    """``tieredkv::SelectPages`` (no attributes), equal to ``select_pages``.

    Inputs: score [B, M] float32; valid, pinned [B, M] bool; attend_pages [B] int64.
    Output: selected [B, M] bool. A candidate (valid, not pinned) is selected when its rank
    (score descending, ties: lower column first) is below ``extra = attend_pages - #(valid
    pinned)``; every valid page when ``attend_pages`` covers them all. The ranks come from one
    sorted TopK whose K is the largest ``extra`` of the sequences that do not select every page
    (at least 1, at most M): K is bounded by the attention budget, not by the context, so
    TensorRT's TopK limit (K <= :data:`TOPK_LIMIT`) holds for any context as long as the budget
    beyond T0 stays within it (the TensorRT backend checks).
    """
    b = OnnxGraph()
    m = b.dim("score", 1)
    count = lambda x: b.op("ReduceSum", b.op("Cast", x, to=_I64), b.const([1], _I64), keepdims=0)  # noqa: E731
    pinned = b.op("And", "pinned", "valid")
    cand = b.op("And", "valid", b.op("Not", "pinned"))
    ranked = b.op("Where", cand, "score", b.const(float("-inf")))
    extra = b.op("Sub", "attend_pages", count(pinned))  # [B]
    every = b.op("GreaterOrEqual", "attend_pages", count("valid"))  # [B]
    need = b.op("Where", every, b.const(0, _I64), extra)
    k = b.op("Min", b.op("Max", b.op("ReduceMax", need, b.const([0], _I64), keepdims=1), b.const([1], _I64)), m)
    values, order = b.fresh("topk_values"), b.fresh("topk_order")
    b.nodes.append(helper.make_node("TopK", [ranked, k], [values, order], axis=-1, largest=1, sorted=1))
    rank = b.unsqueeze(b.op("Range", b.const(0, _I64), _scalar(b, k), b.const(1, _I64)), 0)  # [1, K]
    within = b.op("Cast", b.op("Less", rank, b.unsqueeze(extra, 1)), to=_I64)  # [B, K]
    zeros = b.op("ConstantOfShape", b.op("Shape", "score"), value=helper.make_tensor("zero", _I64, [1], [0]))
    top = b.op("And", cand, b.op("Cast", b.op("ScatterElements", zeros, order, within, axis=1), to=TensorProto.BOOL))
    b.op("And", "valid", b.op("Or", b.op("Or", pinned, b.unsqueeze(every, 1)), top), out="selected")
    return _function(SELECT_PAGES, _SELECT_INPUTS, ["selected"], b, [], plugin=False)


def select_pages_model() -> ModelProto:
    """A one-node model running SelectPages (all sizes dynamic)."""
    bool_ = TensorProto.BOOL
    ins = [("score", _F32, ["B", "M"]), ("valid", bool_, ["B", "M"]), ("pinned", bool_, ["B", "M"]),
           ("attend_pages", _I64, ["B"])]
    return _model(select_pages_function(), ins, [("selected", bool_, ["B", "M"])])


# --- KVAppend -------------------------------------------------------------------------------

_APPEND_INPUTS = ["k_pool", "v_pool", "k_new", "v_new", "slot", "offset"]
_APPEND_OUTPUTS = ["k_pool_out", "v_pool_out"]


def kv_append_function() -> FunctionProto:
    """``tieredkv::KVAppend``, equal to ``kv_append``.

    Inputs: k_pool, v_pool [C, KVH, P, D]; k_new, v_new [N, KVH, D] (pool dtype); slot [N]
    int64; offset [N] int64. Outputs: k_pool_out, v_pool_out [C, KVH, P, D]. One ScatterND
    per pool with indices [N, KVH, 3] = (slot[n], h, offset[n]) and updates [N, KVH, D].
    """
    b = OnnxGraph()
    N, KVH = b.dim("k_new", 0), b.dim("k_new", 1)
    shape = _shape(b, N, KVH, b.const([1], _I64))
    h = b.op("Range", b.const(0, _I64), _scalar(b, KVH), b.const(1, _I64))
    parts = [b.op("Expand", b.unsqueeze("slot", 1, 2), shape),
             b.op("Expand", b.unsqueeze(h, 0, 2), shape),
             b.op("Expand", b.unsqueeze("offset", 1, 2), shape)]
    idx = b.op("Concat", *parts, axis=-1)  # [N, KVH, 3]
    b.op("ScatterND", "k_pool", idx, "k_new", out="k_pool_out")
    b.op("ScatterND", "v_pool", idx, "v_new", out="v_pool_out")
    return _function(KV_APPEND, _APPEND_INPUTS, _APPEND_OUTPUTS, b, [])


def kv_append_model(dtype: int = TensorProto.FLOAT) -> ModelProto:
    """A one-node model running KVAppend on pools of ``dtype`` (all sizes dynamic)."""
    pool = ["C", "KVH", "P", "D"]
    ins = [("k_pool", dtype, pool), ("v_pool", dtype, pool), ("k_new", dtype, ["N", "KVH", "D"]),
           ("v_new", dtype, ["N", "KVH", "D"]), ("slot", _I64, ["N"]), ("offset", _I64, ["N"])]
    return _model(kv_append_function(), ins, [("k_pool_out", dtype, pool), ("v_pool_out", dtype, pool)])
