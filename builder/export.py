"""A tieredkv Llama -> the step ONNX graph of an engine, plus the reference step it must equal.

One graph serves both kinds of step: a decode step (T = 1 new token per sequence) and a
chunked-prefill step (T > 1), for a batch of B sequences (B, T, M and the pool sizes are
dynamic). Attention runs on ``tieredkv::TieredAttention`` nodes, the K/V write on
``tieredkv::KVAppend``, and (tiered graphs) page scoring on ``tieredkv::ImportanceScore`` and
page selection on ``tieredkv::SelectPages`` (`tieredkv.plugins.onnx_ops`: custom domain,
plugin attributes, local-function bodies that ONNX Runtime runs anywhere).

Inputs and outputs: ``StepFeeds`` and ``StepOutputs`` of ``tieredkv.runtime.tiered.engine_io``
declare every one (name, dtype, shape, which graphs have it, what it means) — the graph's
interface is read from there.

A page is attended when selected and in the pool (``page_selected & page_mask``): the
runtime puts non-resident pages in the pool (exact mode, prefill) or leaves them out and
counts the miss (masked mode). Plain graphs (no --tiered-kv) attend ``page_mask``.

Per layer: RMSNorm -> Q/K/V Gemm -> RoPE -> KVAppend into the layer's pools ->
[ImportanceScore on the last new token's query -> SelectPages] -> TieredAttention over
the updated pools -> O Gemm -> residual -> RMSNorm -> SwiGLU -> residual; then the final
norm and the LM head (tied embeddings reuse the embedding initializer). Weights are
initializers of the graph's precision (``StepGraphOptions.precision``: float32, or float16 with
the pools and activations; see ``build_step_graph``) named as in the model's state dict; RoPE uses the model's own
``inv_freq`` (config scaling, GGUF frequency factors). The ImportanceScore weights (the
selection mix) are a build option, recorded in the engine's config.json.

The reference (:class:`PoolStep`) runs the PyTorch model's own modules through the same
explicit inputs with the PyTorch references of the ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from tieredkv.models.cache import Step
from tieredkv.models.llama import Llama
from tieredkv.plugins.tiered_attention import PAD_PAGE_INDEX, tiered_attention
from tieredkv.plugins.codec import CODECS, encode_pages, page_bytes
from tieredkv.plugins.importance_score import RELEVANCE_ONLY, relevance_and_ranking
from tieredkv.plugins.kv_append import kv_append
from tieredkv.plugins.onnx_graph import OnnxGraph
from tieredkv.plugins.onnx_ops import (
    DOMAIN,
    IMPORTANCE_SCORE,
    KV_APPEND,
    OPSET,
    SELECT_PAGES,
    TIERED_ATTENTION,
    importance_score_function,
    kv_append_function,
    node_attributes,
    select_pages_function,
    warm_functions,
)
from tieredkv.plugins.select_pages import select_pages
from tieredkv.runtime.tiered.engine_io import KV_DTYPE, StepFeeds, StepOutputs

__all__ = ["StepGraphOptions", "PoolStep", "PROTOBUF_LIMIT", "PRECISIONS", "build_step_graph", "initializer_bytes",
           "model_at", "random_step_inputs", "reference_step", "run_onnx", "onnx_session",
           "save_step_graph", "PAD_INDEX", "RELEVANCE_ONLY"]

_F32, _I64, _BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL

#: a serialized ModelProto must stay under 2 GiB; past this many bytes of weights the
#: graph is written with its initializers in an external data file
PROTOBUF_LIMIT = 2**31 - 1 - (64 << 20)
#: page_index of padding columns (past any sequence: no key of it is ever valid)
PAD_INDEX = PAD_PAGE_INDEX
#: the graph's precision (``StepGraphOptions.precision``) -> the dtype of its weights, pools and
#: activations (a bfloat16 graph is left out: ONNX Runtime's CPU provider, which verifies every
#: engine, has no bfloat16 kernels for most ops)
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16}
_ONNX_OF = {torch.float32: _F32, torch.float16: TensorProto.FLOAT16}


@dataclass(frozen=True)
class StepGraphOptions:
    """``tiered_kv``: scoring, selection and the page outputs (without it the graph is plain
    paged attention over ``page_mask``). ``page_size``: P, fixed in the pool shapes.
    ``selection_weights``: (relevance, position, saliency) of the ImportanceScore mix that
    ranks pages for the attention budget (the runtime's ``selection_weights``).
    ``warm_codec``: the graph also takes each layer's warm (compressed) pool and attention
    reads those pages from their encoded bytes (the runtime's ``warm_codec``).
    ``precision``: the dtype of the weights, the K/V pools and the activations between the
    matrix products (:data:`PRECISIONS`; see :func:`build_step_graph`)."""

    tiered_kv: bool = True
    page_size: int = 16
    selection_weights: tuple[float, float, float] = RELEVANCE_ONLY
    warm_codec: str | None = None
    precision: str = "fp32"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of ``precision``: the graph's weights, pools and activations."""
        return PRECISIONS[self.precision]

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}")
        if self.warm_codec is not None:
            from tieredkv.plugins.codec import CODECS

            if not self.tiered_kv:
                raise ValueError("warm_codec needs a tiered graph (--tiered-kv): plain graphs hold no warm tier")
            spec = CODECS.get(self.warm_codec)
            if spec is None or spec.keyframe:
                raise ValueError(f"warm_codec {self.warm_codec!r}: expected one of "
                                 f"{sorted(n for n, c in CODECS.items() if not c.keyframe)} (the delta codec's "
                                 "decode is a scan along tokens and has no ONNX form)")
        w = tuple(float(x) for x in self.selection_weights)
        if len(w) != 3 or any(not x >= 0 for x in w) or abs(sum(w) - 1.0) > 1e-6:
            raise ValueError(f"selection_weights: expected 3 non-negative floats summing to 1 (the runtime's "
                             f"selection_weights), got {self.selection_weights!r}")
        object.__setattr__(self, "selection_weights", w)


class _StepGraph(OnnxGraph):
    """The step graph under construction: weights in the graph's dtype ``dt`` (an ONNX
    TensorProto type), constants default to int64."""

    def __init__(self, dt: int) -> None:
        super().__init__()
        self.dt = dt

    def weight(self, name: str, tensor: torch.Tensor) -> str:
        dtype = torch.float16 if self.dt == TensorProto.FLOAT16 else torch.float32
        return self.initializer(name, tensor.detach().to(dtype).contiguous().numpy())

    def const(self, values: list[int] | float, dtype: int = _I64) -> str:
        return super().const(values, dtype)

    def f32(self, x: str) -> str:
        """An activation of the graph's dtype as float32 (no node in a float32 graph)."""
        return x if self.dt == _F32 else self.op("Cast", x, to=_F32)

    def act(self, x: str) -> str:
        """A float32 value as an activation of the graph's dtype (no node in a float32 graph)."""
        return x if self.dt == _F32 else self.op("Cast", x, to=self.dt)

    def custom(self, op_type: str, inputs: list[str], outputs: list[str], name: str, **attrs) -> None:
        """A node of one of the tieredkv ops (with its plugin attributes, where it has a plugin)."""
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=DOMAIN,
                                           **node_attributes(op_type), **attrs))

    def layer_of(self, stacked: str, layer: int) -> str:
        """Row ``layer`` of a per-layer stacked input (axis 0 dropped)."""
        return self.op("Gather", stacked, self.const(layer), axis=0)


def _rms_norm(g: _StepGraph, x: str, weight: str, eps: float) -> str:
    """x [N, hidden] -> weight * (x / sqrt(mean(x^2) + eps)), the reference RMSNorm: normalized
    in float32, rounded to the graph's dtype, then scaled by the weight."""
    xf = g.f32(x)
    ms = g.op("ReduceMean", g.op("Mul", xf, xf), g.const([-1]), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(float(eps), _F32))))
    return g.op("Mul", weight, g.act(g.op("Mul", xf, inv)))


def _linear(g: _StepGraph, x: str, weight: str) -> str:
    """x [N, in] @ weight[out, in]^T (the PyTorch layout, no transposed copy)."""
    return g.op("Gemm", x, weight, transB=1)


def _rope(g: _StepGraph, x: str, cos: str, sin: str, half: int) -> str:
    """x [B, heads, T, D] -> x * cos + rotate_half(x) * sin, with cos/sin [B, 1, T, D]."""
    axes = g.const([-1])
    x1 = g.op("Slice", x, g.const([0]), g.const([half]), axes)
    x2 = g.op("Slice", x, g.const([half]), g.const([2 * half]), axes)
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def build_step_graph(model: Llama, options: StepGraphOptions | None = None, *,
                     progress: Callable[[Iterable[int]], Iterable[int]] | None = None) -> onnx.ModelProto:
    """The step graph of ``model`` (see the module docstring). ``progress`` wraps the
    iteration over layers (e.g. tqdm).

    The graph computes what ``model_at(model, options.dtype)`` computes: weights, pools, the
    new K/V and the activations between the matrix products in ``options.dtype``; RMSNorm's
    normalization, SiLU, the RoPE tables and attention (q, the softmax, the plugin's outputs)
    in float32, each result rounded to the graph's dtype where the model rounds it; logits,
    relevance and attention mass in float32. Every type is explicit, so TensorRT builds the
    graph as a strongly typed network: what it reads and writes in float16 is what the graph
    says, nothing more, nothing less."""
    options = options or StepGraphOptions()
    c = model.config
    n_layers, h, kvh, d, p = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, options.page_size
    tiered = options.tiered_kv
    g = _StepGraph(_ONNX_OF[options.dtype])
    state = model.state_dict()
    scale = float(d) ** -0.5

    embed = g.weight("embed_tokens.weight", state["embed_tokens.weight"])
    inv_freq = g.initializer("rope.inv_freq", model.inv_freq.float().numpy())  # float32 in every precision
    B, T = g.dim("input_ids", 0), g.dim("input_ids", 1)
    # RoPE tables of the new tokens: emb = [freqs, freqs], freqs = position * inv_freq (float32),
    # cos / sin rounded to the graph's dtype (as the model's rope_cos_sin)
    freqs = g.op("Mul", g.op("Unsqueeze", g.op("Cast", "positions", to=_F32), g.const([2])), inv_freq)  # [B,T,D/2]
    emb = g.op("Concat", freqs, freqs, axis=-1)
    cos = g.op("Unsqueeze", g.act(g.op("Cos", emb)), g.const([1]))  # [B, 1, T, D]
    sin = g.op("Unsqueeze", g.act(g.op("Sin", emb)), g.const([1]))
    past = g.op("Sub", "seq_len", g.op("Squeeze", T, g.const([0])), out="past")
    heads = lambda n: g.op("Concat", B, T, g.const([n, d]), axis=0)  # noqa: E731  [B, T, n, D]
    q_shape, kv_shape = heads(h), heads(kvh)
    rows = g.const([-1, kvh, d])  # [B*T, KVH, D] for KVAppend
    flat, logits_shape = g.const([-1, h * d]), g.op("Concat", B, T, g.const([c.vocab_size]), axis=0)
    offsets = g.op("Reshape", "write_offset", g.const([-1]))
    valid = g.op("Less", g.op("Mul", "page_index", g.const(p)), g.op("Unsqueeze", "seq_len", g.const([1])))
    if tiered:
        cand = g.op("Cast", g.op("And", valid, g.op("Not", "page_pinned")), to=TensorProto.INT32)  # plugin mask: int32
        # distance of each page's last token from the last new token (the position signal)
        last_tok = g.op("Sub", g.op("Add", g.op("Mul", "page_index", g.const(p)), "page_tokens"), g.const(1))
        distance = g.op("Sub", g.op("Unsqueeze", g.op("Sub", "seq_len", g.const(1)), g.const([1])), last_tok)
        t_last = g.op("Sub", T, g.const([1]))
    news: dict[str, list[str]] = {"k": [], "v": [], "selected": [], "relevance": [], "mass": []}

    x = g.op("Reshape", g.op("Gather", embed, "input_ids", axis=0), g.const([-1, c.hidden_size]))  # [B*T, hidden]
    layers = range(n_layers) if progress is None else progress(range(n_layers))
    for layer in layers:
        pre = f"layers.{layer}"

        def w(name: str) -> str:
            return g.weight(f"{pre}.{name}.weight", state[f"{pre}.{name}.weight"])

        hs = _rms_norm(g, x, w("input_layernorm"), c.rms_norm_eps)
        q = g.op("Transpose", g.op("Reshape", _linear(g, hs, w("self_attn.q_proj")), q_shape), perm=[0, 2, 1, 3])
        k = g.op("Transpose", g.op("Reshape", _linear(g, hs, w("self_attn.k_proj")), kv_shape), perm=[0, 2, 1, 3])
        v = g.op("Transpose", g.op("Reshape", _linear(g, hs, w("self_attn.v_proj")), kv_shape), perm=[0, 2, 1, 3])
        q, k = _rope(g, q, cos, sin, d // 2), _rope(g, k, cos, sin, d // 2)  # [B, H|KVH, T, D]
        news["k"].append(g.op("Unsqueeze", k, g.const([0])))
        news["v"].append(g.op("Unsqueeze", v, g.const([0])))
        k_rows = g.op("Reshape", g.op("Transpose", k, perm=[0, 2, 1, 3]), rows)
        v_rows = g.op("Reshape", g.op("Transpose", v, perm=[0, 2, 1, 3]), rows)
        k_out, v_out = f"{pre}.k_pool_updated", f"{pre}.v_pool_updated"
        slots = g.op("Reshape", g.layer_of("write_slot", layer), g.const([-1]))
        g.custom(KV_APPEND, [f"k_pool_{layer}", f"v_pool_{layer}", k_rows, v_rows, slots, offsets],
                 [k_out, v_out], name=f"{pre}.kv_append")
        table, in_pool = g.layer_of("page_table", layer), g.layer_of("page_mask", layer)
        if tiered:
            q_last = g.f32(g.op("Squeeze", g.op("Slice", q, t_last, T, g.const([2])), g.const([2])))  # [B, H, D]
            score_in = [q_last, g.layer_of("key_min", layer), g.layer_of("key_max", layer), "page_tokens", distance,
                        g.layer_of("page_saliency", layer), cand]
            pos_table = g.layer_of("position_table", layer)
            rel = f"{pre}.page_relevance"
            g.custom(IMPORTANCE_SCORE, score_in + [pos_table], [rel], name=f"{pre}.relevance",
                     weights=list(RELEVANCE_ONLY), scale=scale)
            score = rel
            if options.selection_weights != RELEVANCE_ONLY:
                score = f"{pre}.selection_score"
                g.custom(IMPORTANCE_SCORE, score_in + [pos_table], [score], name=f"{pre}.selection_score",
                         weights=list(options.selection_weights), scale=scale)
            selected = f"{pre}.page_selected"
            g.custom(SELECT_PAGES, [score, valid, "page_pinned", "attend_pages"], [selected], name=f"{pre}.select")
            attended = g.op("And", selected, in_pool)
            news["selected"].append(g.op("Unsqueeze", selected, g.const([0])))
            news["relevance"].append(g.op("Unsqueeze", rel, g.const([0])))
        else:
            attended = g.op("And", in_pool, valid)
        attn, lse, probs = f"{pre}.attn_out", f"{pre}.attn_lse", f"{pre}.page_probs"
        attended = g.op("Cast", attended, to=TensorProto.INT32)  # plugin tensors cannot be bool
        attn_in = [g.f32(q), k_out, v_out, table, attended, "page_index", "seq_len", past]
        warm_attrs = {}
        if options.warm_codec is not None:
            attn_in += [f"warm_pool_{layer}", g.layer_of("page_warm_row", layer)]
            warm_attrs["warm_codec"] = options.warm_codec
        g.custom(TIERED_ATTENTION, attn_in, [attn, lse, probs], name=f"{pre}.attention", scale=scale, **warm_attrs)
        if tiered:  # mean over query heads (axis 1), sum over the step's queries (then axis 1)
            mass = g.op("ReduceSum", g.op("ReduceMean", probs, g.const([1]), keepdims=0), g.const([1]), keepdims=0)
            news["mass"].append(g.op("Unsqueeze", mass, g.const([0])))
        attn_rows = g.act(g.op("Reshape", g.op("Transpose", attn, perm=[0, 2, 1, 3]), flat))  # [B*T, H*D]
        x = g.op("Add", x, _linear(g, attn_rows, w("self_attn.o_proj")))
        hs = _rms_norm(g, x, w("post_attention_layernorm"), c.rms_norm_eps)
        gate = g.f32(_linear(g, hs, w("mlp.gate_proj")))
        act = g.act(g.op("Mul", gate, g.op("Sigmoid", gate)))  # SiLU in float32, rounded once
        x = g.op("Add", x, _linear(g, g.op("Mul", act, _linear(g, hs, w("mlp.up_proj"))), w("mlp.down_proj")))

    norm = g.weight("norm.weight", state["norm.weight"])
    head = embed if c.tie_word_embeddings else g.weight("lm_head.weight", state["lm_head.weight"])
    logits = g.f32(g.op("Gemm", _rms_norm(g, x, norm, c.rms_norm_eps), head, transB=1))
    g.op("Reshape", logits, logits_shape, out="logits")
    g.op("Concat", *news["k"], axis=0, out="k_new")
    g.op("Concat", *news["v"], axis=0, out="v_new")
    if tiered:
        g.op("Concat", *news["selected"], axis=0, out="page_selected")
        g.op("Concat", *news["relevance"], axis=0, out="page_relevance")
        g.op("Concat", *news["mass"], axis=0, out="page_mass")

    warm = options.warm_codec is not None
    known = {"L": n_layers, "KVH": kvh, "P": p, "D": d, "V": c.vocab_size}
    if warm:
        known["PW"] = page_bytes(CODECS[options.warm_codec], kvh, p, d) // 4
    ins = _value_infos(StepFeeds, n_layers, known, options.dtype, tiered_kv=tiered, warm=warm)
    outs = _value_infos(StepOutputs, n_layers, known, options.dtype, tiered_kv=tiered, warm=warm)
    graph = helper.make_graph(g.nodes, f"{c.name}_step{'_tiered' if tiered else ''}", ins, outs,
                              initializer=g.initializers)
    functions = warm_functions(options.warm_codec, (kvh, p, d) if warm else None) + [kv_append_function()]
    if tiered:
        functions += [importance_score_function(), select_pages_function()]
    return helper.make_model(graph, functions=functions,
                             opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                             producer_name="tieredkv.builder", doc_string=__doc__.split("\n\n")[0])


_ONNX_TYPES = {**_ONNX_OF, torch.int64: _I64, torch.int32: TensorProto.INT32, torch.bool: _BOOL}


def _value_infos(tensors, num_layers: int, known: dict[str, int], kv_dtype: torch.dtype, *, tiered_kv: bool,
                 warm: bool) -> list:
    """The graph's inputs or outputs as declared by ``StepFeeds`` / ``StepOutputs``: known
    dimensions by value, the others symbolic (``C{l}``: per layer); the K/V tensors
    (``KV_DTYPE``) in ``kv_dtype``."""
    specs = dict(tensors.specs(tiered_kv=tiered_kv, warm=warm))
    infos = []
    for name in tensors.names(num_layers, tiered_kv=tiered_kv, warm=warm):
        base, layer = (name, None) if name in specs else tuple(name.rsplit("_", 1))
        meta = specs[base]
        dims = [known.get(dim, dim.format(l=layer)) for dim in meta["dims"]]
        dtype = kv_dtype if meta["dtype"] == KV_DTYPE else meta["dtype"]
        infos.append(helper.make_tensor_value_info(name, _ONNX_TYPES[dtype], dims))
    return infos


def initializer_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_step_graph(model: onnx.ModelProto, path: str | Path, *, external_data: bool | None = None) -> bool:
    """Write ``model`` to ``path``; with ``external_data`` (None: when the weights pass
    :data:`PROTOBUF_LIMIT`) the initializers go to ``<name>.data`` beside it. Returns whether
    external data was used. ``model`` is modified when external data is used."""
    path = Path(path)
    if external_data is None:
        external_data = initializer_bytes(model) > PROTOBUF_LIMIT
    if external_data:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{path.name}.data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
    return external_data


# ---------------------------------------------------------------------------- reference


class PoolStep:
    """One step over explicit inputs (``StepFeeds``), as the graph sees them, for the reference model.

    ``Llama.forward`` drives it through the KV-cache step protocol (``begin_step``, ``attend``
    per layer, ``end_step``): ``attend`` writes the new tokens' K/V with ``kv_append``, scores
    and selects pages with ``importance_score`` and ``select_pages`` (tiered), and attends with
    ``tiered_attention`` over the updated pools. Afterwards ``outputs`` holds the graph's
    outputs but the logits."""

    def __init__(self, feeds: StepFeeds, *, num_layers: int, tiered_kv: bool,
                 selection_weights: tuple[float, float, float], warm_codec: str | None = None) -> None:
        self.feeds, self.tiered, self.weights, self.warm_codec = feeds, tiered_kv, selection_weights, warm_codec
        self.page_size = feeds.k_pool[0].shape[2]
        self.valid = feeds.page_index * self.page_size < feeds.seq_len.unsqueeze(1)
        self.news: dict[str, list] = {k: [None] * num_layers for k in
                                      ("k_new", "v_new", "page_selected", "page_relevance", "page_mass")}

    def begin_step(self, seq_ids, num_new: int) -> Step:
        return Step(tuple(seq_ids), num_new, tuple(int(n) - num_new for n in self.feeds.seq_len))

    def _selected(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.feeds
        cand = self.valid & ~f.page_pinned
        last_tok = f.page_index * self.page_size + f.page_tokens - 1
        distance = (f.seq_len - 1).unsqueeze(1) - last_tok
        rel, ranking = relevance_and_ranking(q[:, :, -1], f.key_min[layer], f.key_max[layer], f.page_tokens, distance,
                                             f.page_saliency[layer], cand, f.position_table[layer], self.weights)
        return select_pages(ranking, self.valid, f.page_pinned, f.attend_pages), rel

    def attend(self, step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        f = self.feeds
        self.news["k_new"][layer], self.news["v_new"][layer] = k, v
        rows = lambda x: x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])  # noqa: E731  [B*T, KVH, D]
        kp, vp = kv_append(f.k_pool[layer], f.v_pool[layer], rows(k), rows(v), f.write_slot[layer].reshape(-1),
                           f.write_offset.reshape(-1))
        in_pool = f.page_mask[layer]
        if self.tiered:
            selected, rel = self._selected(layer, q)
            attended = selected & in_pool
            self.news["page_selected"][layer], self.news["page_relevance"][layer] = selected, rel
        else:
            attended = in_pool & self.valid
        warm = {}
        if self.warm_codec is not None:
            warm = dict(warm_pool=f.warm_pool[layer], warm_row=f.page_warm_row[layer], warm_codec=self.warm_codec)
        out, _, probs = tiered_attention(q, kp, vp, f.page_table[layer], attended, f.page_index, f.seq_len,
                                         f.seq_len - step.num_new, with_lse=False, **warm)
        if self.tiered:
            self.news["page_mass"][layer] = probs.mean(1).sum(1)
        return out

    def end_step(self, step: Step) -> None:
        """Nothing to finish: the graph's runtime writes the new K/V."""

    @property
    def outputs(self) -> dict[str, torch.Tensor]:
        return {k: torch.stack(v) for k, v in self.news.items() if v[0] is not None}


def model_at(model: Llama, dtype: torch.dtype) -> Llama:
    """The reference of a graph of ``dtype``: ``model`` itself in its own dtype, else a copy with
    its weights in ``dtype`` (RoPE's inverse frequencies stay float32, as
    ``load_checkpoint(dtype=...)`` keeps them) — the torch backend running that dtype."""
    if model.dtype == dtype:
        return model
    import copy

    other = copy.deepcopy(model).to(dtype)
    other.inv_freq = model.inv_freq.float().clone()
    return other


@torch.no_grad()
def reference_step(model: Llama, feeds: dict[str, np.ndarray], *, tiered_kv: bool = True,
                   selection_weights: tuple[float, float, float] = RELEVANCE_ONLY,
                   warm_codec: str | None = None) -> dict[str, np.ndarray]:
    """The graph's outputs computed by the PyTorch model for the graph's inputs ``feeds`` (the
    reference of a graph of another dtype than ``model``'s is ``model_at(model, dtype)``)."""
    f = StepFeeds.from_dict({k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()})
    step = PoolStep(f, num_layers=model.config.num_layers, tiered_kv=tiered_kv,
                    selection_weights=tuple(float(x) for x in selection_weights), warm_codec=warm_codec)
    logits = model(f.input_ids, f.positions, step, list(range(f.input_ids.shape[0])))
    return {"logits": logits.float().numpy(), **{k: v.numpy() for k, v in step.outputs.items()}}


def random_step_inputs(model: Llama, *, page_size: int, seq_lens: list[int], new_tokens: int = 1,
                       tiered_kv: bool, seed: int = 0, model_kv: bool = False, spare_pages: int = 3,
                       attend_fraction: float = 0.6, warm_codec: str | None = None,
                       kv_dtype: torch.dtype = torch.float32) -> dict[str, np.ndarray]:
    """Random graph inputs: sequences of ``seq_lens`` tokens (the ``new_tokens`` new ones
    included) whose pages are scattered over each layer's pool (a different placement per
    layer) with ``spare_pages`` unused pages, listed in shuffled order and padded to the
    longest (padding: :data:`PAD_INDEX`); random tokens and pools (normal, std 1).

    With ``model_kv`` the filled slots of the cached tokens hold the K/V the model itself
    computes for random prompt tokens, as a real engine sees them (random std-1 K/V drive
    a real model far out of its range, where float32 rounding alone moves its logits by
    ~1e-3); the rest of the pools stays random (attention must ignore it). Tiered inputs:
    each listed page but the ones receiving new tokens is out of the pool with probability
    0.3; T0 = the first and the last page; the attention budget ``attend_fraction`` of each
    sequence's pages; key summaries are the real min/max of the pool slots. With ``warm_codec``
    about half of each layer's other in-pool pages become warm: their pool page is encoded into
    the layer's warm pool (rows shuffled, one spare row) and their page_table entry is pointed
    at another page, so that only the decoded bytes give the right answer. The pools are of
    ``kv_dtype`` (the graph's precision); key summaries and warm pages are made from the values
    they hold."""
    rng = np.random.default_rng(seed)
    c = model.config
    L, P = c.num_layers, page_size
    n_pages = [-(-n // P) for n in seq_lens]
    m, capacity, batch = max(n_pages), sum(n_pages) + spare_pages, len(seq_lens)
    seq_len = np.asarray(seq_lens, np.int64)
    pos = seq_len[:, None] - new_tokens + np.arange(new_tokens)  # [B, T]
    index = np.full((batch, m), PAD_INDEX, np.int64)
    order = [rng.permutation(k) for k in n_pages]  # column j lists logical page order[b][j]
    for b, k in enumerate(n_pages):
        index[b, :k] = order[b]
    table = np.zeros((L, batch, m), np.int64)
    in_pool = np.zeros((L, batch, m), bool)
    write_slot = np.zeros((L, batch, new_tokens), np.int64)
    logical_slot = np.zeros((L, batch, m), np.int64)  # pool page of logical page j
    for layer in range(L):
        slots, used = rng.permutation(capacity), 0
        for b, k in enumerate(n_pages):
            own = slots[used : used + k]
            used += k
            logical_slot[layer, b, :k] = own
            table[layer, b, :k] = own[order[b]]
            keep = rng.random(k) >= 0.3 if tiered_kv else np.ones(k, bool)
            keep[np.isin(order[b], pos[b] // P)] = True  # pages receiving new tokens
            in_pool[layer, b, :k] = keep
            write_slot[layer, b] = own[pos[b] // P]
    shape = (capacity, c.num_kv_heads, P, c.head_dim)
    feeds = StepFeeds(input_ids=rng.integers(0, c.vocab_size, (batch, new_tokens)).astype(np.int64), positions=pos,
                      seq_len=seq_len, page_index=index, page_table=table, page_mask=in_pool, write_slot=write_slot,
                      write_offset=pos % P, k_pool=[], v_pool=[])
    for _ in range(L):
        feeds.k_pool.append(rng.standard_normal(shape, dtype=np.float32))
        feeds.v_pool.append(rng.standard_normal(shape, dtype=np.float32))
    if model_kv:
        for b, n in enumerate(seq_lens):
            if n > new_tokens:
                prompt = torch.from_numpy(rng.integers(0, c.vocab_size, n - new_tokens).astype(np.int64))
                _write_prompt_kv(model, prompt, logical_slot[:, b, : n_pages[b]], feeds)
    np_dtype = torch.empty(0, dtype=kv_dtype).numpy().dtype
    feeds.k_pool = [x.astype(np_dtype) for x in feeds.k_pool]
    feeds.v_pool = [x.astype(np_dtype) for x in feeds.v_pool]
    if tiered_kv:
        tokens = np.zeros((batch, m), np.int64)
        pinned = np.zeros((batch, m), bool)
        kmin = np.zeros((L, batch, m, c.num_kv_heads, c.head_dim), np.float32)
        kmax = np.zeros_like(kmin)
        for b, (n, k) in enumerate(zip(seq_lens, n_pages)):
            tokens[b, :k] = np.minimum(P, n - order[b] * P)
            pinned[b, :k] = (order[b] == 0) | (order[b] == k - 1)
            for layer in range(L):
                for j in range(k):
                    page = feeds.k_pool[layer][table[layer, b, j], :, : tokens[b, j]]  # [KVH, n, D]
                    kmin[layer, b, j], kmax[layer, b, j] = page.min(1), page.max(1)
        feeds.page_pinned, feeds.page_tokens = pinned, tokens
        feeds.attend_pages = np.array([max(1, round(attend_fraction * k)) for k in n_pages], np.int64)
        feeds.key_min, feeds.key_max = kmin, kmax
        feeds.page_saliency = rng.random((L, batch, m)).astype(np.float32)
        feeds.position_table = rng.random((L, 16)).astype(np.float32)
    if warm_codec is not None:
        _make_warm(feeds, rng, CODECS[warm_codec], pos // P, index, n_pages)
    return feeds.as_dict()


def _make_warm(feeds: StepFeeds, rng: np.random.Generator, spec, write_pages: np.ndarray,
               index: np.ndarray, n_pages: list[int]) -> None:
    """Turn about half of the in-pool pages not receiving new tokens into warm pages (see
    :func:`random_step_inputs`)."""
    table, L = feeds.page_table, feeds.page_table.shape[0]
    capacity = feeds.k_pool[0].shape[0]
    warm_row = np.full(table.shape, -1, np.int64)
    warm_pools = []
    for layer in range(L):
        warm = feeds.page_mask[layer] & (rng.random(table.shape[1:]) < 0.5)
        for b, k in enumerate(n_pages):
            warm[b, k:] = False
            warm[b, np.isin(index[b], write_pages[b])] = False  # KVAppend writes those into the pool
        cols = np.argwhere(warm)
        rows = rng.permutation(len(cols) + 1)[: len(cols)]
        src = torch.from_numpy(table[layer][warm])
        enc = encode_pages(torch.from_numpy(feeds.k_pool[layer])[src].float(),
                           torch.from_numpy(feeds.v_pool[layer])[src].float(), spec)
        data = np.zeros((len(cols) + 1, page_bytes(spec, *feeds.k_pool[0].shape[1:])), np.uint8)
        data[rows] = enc.numpy()
        warm_pools.append(data.view(np.int32))  # the graph takes the encoded bytes as int32 words
        warm_row[layer][warm] = rows
        table[layer][warm] = (table[layer][warm] + 1) % capacity
    feeds.warm_pool, feeds.page_warm_row = warm_pools, warm_row


@torch.no_grad()
def _write_prompt_kv(model: Llama, prompt: torch.Tensor, logical_slot: np.ndarray, feeds: StepFeeds) -> None:
    """Prefill ``prompt`` through a paged cache and copy its K/V into the pools of ``feeds``:
    logical page j of layer l lives in pool page ``logical_slot[l, j]``."""
    from tieredkv.models.llama import prefill
    from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache

    page, n = feeds.k_pool[0].shape[2], len(prompt)
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=page, initial_pages=-(-n // page)))
    sid = cache.add_sequence()
    prefill(model, cache, sid, prompt)
    pos = np.arange(n)
    for layer in range(model.config.num_layers):
        k, v, _ = cache.gather(layer, [sid])  # [1, KVH, pages * P, D]
        pool_page, offset = logical_slot[layer, pos // page], pos % page
        feeds.k_pool[layer][pool_page, :, offset] = k[0, :, :n].transpose(0, 1).float().numpy()
        feeds.v_pool[layer][pool_page, :, offset] = v[0, :, :n].transpose(0, 1).float().numpy()


def onnx_session(path: str | Path, *, threads: int = 1):
    """An ONNX Runtime CPU session for the graph at ``path`` (``threads`` intra-op threads)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_onnx(path_or_session, feeds: dict[str, np.ndarray], *, threads: int = 1) -> dict[str, np.ndarray]:
    """Run the graph in ONNX Runtime CPU (a path, or an existing InferenceSession); returns
    every output by name."""
    import onnxruntime as ort

    sess = path_or_session
    if not isinstance(sess, ort.InferenceSession):
        sess = onnx_session(path_or_session, threads=threads)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))
