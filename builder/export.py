"""A tieredkv Llama -> the decode-step ONNX graph, plus the reference step it must equal.

The graph runs one new token per sequence for a batch of B sequences (B dynamic) over
paged K/V pools, with the attention on the ``tieredkv::TieredAttention`` node and the K/V
write on the ``tieredkv::KVAppend`` node (`tieredkv.plugins.onnx_ops`: custom domain,
plugin attributes, local-function bodies that ONNX Runtime runs anywhere).

Inputs (B sequences, M listed pages, C pool pages, KVH kv heads, P page size, D head dim)::

    input_ids    [B] int64       the new token of each sequence
    positions    [B] int64       its RoPE position
    page_table   [B, M] int64    pool page of each listed page (padding: any page in [0, C))
    page_mask    [B, M] bool     attend to the listed page (residency and selection with
                                 --tiered-kv; validity without)
    page_index   [B, M] int64    logical index of the listed page in its sequence
    seq_len      [B] int64       tokens of the sequence including the new one
    write_slot   [B] int64       pool page the new token's K/V go to
    write_offset [B] int64       slot inside that page, in [0, P)
    k_pool_{l}, v_pool_{l}       [C, KVH, P, D] float32, one pair per layer

Outputs::

    logits                       [B, vocab] float32
    k_pool_out_{l}, v_pool_out_{l}  [C, KVH, P, D] the pools with the new token written
    page_mass_{l}                [B, M] float32 (tiered graphs only): TieredAttention's
                                 page_probs averaged over query heads — the attention mass
                                 per listed page the runtime's importance statistics use

Per layer: RMSNorm -> Q/K/V Gemm -> RoPE at ``positions`` -> KVAppend into the layer's pools
-> TieredAttention over the updated pools (past = seq_len - 1, T = 1) -> O Gemm -> residual
-> RMSNorm -> SwiGLU -> residual; then the final norm and the LM head (tied embeddings reuse
the embedding initializer). Weights are float32 initializers named as in the model's
state dict; RoPE uses the model's own ``inv_freq`` (config scaling, GGUF frequency factors).

The reference (:class:`PoolStep`) runs the PyTorch model's own modules through the same
explicit pools, with `plugins.attention.tiered_attention` and `plugins.onnx_ops.kv_append`
as the attention and the write.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from tieredkv.models.cache import Step
from tieredkv.models.llama import Llama
from tieredkv.plugins.attention import tiered_attention
from tieredkv.plugins.onnx_codec import _Body
from tieredkv.plugins.onnx_ops import (
    DOMAIN,
    KV_APPEND,
    OPSET,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TIERED_ATTENTION,
    kv_append,
    kv_append_function,
    tiered_attention_function,
)

__all__ = ["DecodeGraphOptions", "PoolStep", "PROTOBUF_LIMIT", "build_decode_graph", "decode_input_names",
           "decode_output_names", "initializer_bytes", "random_decode_inputs", "reference_decode_step",
           "run_onnx", "save_decode_graph"]

_F32, _I64, _BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL

#: a serialized ModelProto must stay under 2 GiB; past this many bytes of weights the
#: graph is written with its initializers in an external data file
PROTOBUF_LIMIT = 2**31 - 1 - (64 << 20)


@dataclass(frozen=True)
class DecodeGraphOptions:
    """``tiered_kv``: add the page-mass outputs (without it the graph is plain paged
    attention). ``page_size``: P, fixed in the pool shapes (B, M and C stay dynamic)."""

    tiered_kv: bool = True
    page_size: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}")


def decode_input_names(num_layers: int) -> list[str]:
    names = ["input_ids", "positions", "page_table", "page_mask", "page_index", "seq_len", "write_slot",
             "write_offset"]
    for layer in range(num_layers):
        names += [f"k_pool_{layer}", f"v_pool_{layer}"]
    return names


def decode_output_names(num_layers: int, *, tiered_kv: bool) -> list[str]:
    names = ["logits"]
    for layer in range(num_layers):
        names += [f"k_pool_out_{layer}", f"v_pool_out_{layer}"]
    if tiered_kv:
        names += [f"page_mass_{layer}" for layer in range(num_layers)]
    return names


class _Graph(_Body):
    """Nodes, weight initializers and fresh value names of the graph under construction
    (the function-body builder of the plugin ops, plus initializers; constants default to int64)."""

    def __init__(self) -> None:
        super().__init__()
        self.initializers: list[onnx.TensorProto] = []

    def weight(self, name: str, tensor: torch.Tensor) -> str:
        array = tensor.detach().to(torch.float32).contiguous().numpy()
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def const(self, values: list[int] | float, dtype: int = _I64) -> str:
        return super().const(values, dtype)

    def plugin(self, op_type: str, inputs: list[str], outputs: list[str], name: str, **attrs) -> None:
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=DOMAIN,
                                           plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION, **attrs))


def _rms_norm(g: _Graph, x: str, weight: str, eps: float) -> str:
    """x [B, hidden] -> weight * x / sqrt(mean(x^2) + eps) (the reference RMSNorm)."""
    ms = g.op("ReduceMean", g.op("Mul", x, x), g.const([-1]), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(float(eps), _F32))))
    return g.op("Mul", weight, g.op("Mul", x, inv))


def _linear(g: _Graph, x: str, weight: str) -> str:
    """x [B, in] @ weight[out, in]^T (the PyTorch layout, no transposed copy)."""
    return g.op("Gemm", x, weight, transB=1)


def _rope(g: _Graph, x: str, cos: str, sin: str, half: int) -> str:
    """x [B, heads, D] -> x * cos + rotate_half(x) * sin, with cos/sin [B, 1, D]."""
    axes = g.const([-1])
    x1 = g.op("Slice", x, g.const([0]), g.const([half]), axes)
    x2 = g.op("Slice", x, g.const([half]), g.const([2 * half]), axes)
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def build_decode_graph(model: Llama, options: DecodeGraphOptions | None = None, *,
                       progress: Callable[[Iterable[int]], Iterable[int]] | None = None) -> onnx.ModelProto:
    """The decode-step graph of ``model`` (see the module docstring). ``progress`` wraps the
    iteration over layers (e.g. tqdm)."""
    options = options or DecodeGraphOptions()
    c = model.config
    n_layers, h, kvh, d, p = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, options.page_size
    g = _Graph()
    state = model.state_dict()

    embed = g.weight("embed_tokens.weight", state["embed_tokens.weight"])
    inv_freq = g.weight("rope.inv_freq", model.inv_freq.float())
    # RoPE tables of the new tokens: emb = [freqs, freqs], freqs = position * inv_freq (float32)
    pos_f = g.op("Unsqueeze", g.op("Cast", "positions", to=_F32), g.const([1]))
    freqs = g.op("Mul", pos_f, inv_freq)  # [B, D/2]
    emb = g.op("Concat", freqs, freqs, axis=-1)
    cos = g.op("Unsqueeze", g.op("Cos", emb), g.const([1]))  # [B, 1, D]
    sin = g.op("Unsqueeze", g.op("Sin", emb), g.const([1]))
    past = g.op("Sub", "seq_len", g.const([1]), out="past")
    q_shape, kv_shape, flat = g.const([0, h, d]), g.const([0, kvh, d]), g.const([0, h * d])

    x = g.op("Gather", embed, "input_ids", axis=0)  # [B, hidden]
    layers = range(n_layers) if progress is None else progress(range(n_layers))
    for layer in layers:
        pre = f"layers.{layer}"

        def w(name: str) -> str:
            return g.weight(f"{pre}.{name}.weight", state[f"{pre}.{name}.weight"])

        hs = _rms_norm(g, x, w("input_layernorm"), c.rms_norm_eps)
        q = g.op("Reshape", _linear(g, hs, w("self_attn.q_proj")), q_shape)
        k = g.op("Reshape", _linear(g, hs, w("self_attn.k_proj")), kv_shape)
        v = g.op("Reshape", _linear(g, hs, w("self_attn.v_proj")), kv_shape)
        q = g.op("Unsqueeze", _rope(g, q, cos, sin, d // 2), g.const([2]))  # [B, H, 1, D]
        k = _rope(g, k, cos, sin, d // 2)  # [B, KVH, D]
        k_out, v_out = f"k_pool_out_{layer}", f"v_pool_out_{layer}"
        g.plugin(KV_APPEND, [f"k_pool_{layer}", f"v_pool_{layer}", k, v, "write_slot", "write_offset"],
                 [k_out, v_out], name=f"{pre}.kv_append")
        attn, lse, probs = f"{pre}.attn_out", f"{pre}.attn_lse", f"{pre}.page_probs"
        g.plugin(TIERED_ATTENTION, [q, k_out, v_out, "page_table", "page_mask", "page_index", "seq_len", past],
                 [attn, lse, probs], name=f"{pre}.attention", scale=float(d) ** -0.5)
        if options.tiered_kv:  # mean over heads (axis 1) and the single query (axis 2)
            g.op("ReduceMean", probs, g.const([1, 2]), keepdims=0, out=f"page_mass_{layer}")
        x = g.op("Add", x, _linear(g, g.op("Reshape", attn, flat), w("self_attn.o_proj")))
        hs = _rms_norm(g, x, w("post_attention_layernorm"), c.rms_norm_eps)
        gate = _linear(g, hs, w("mlp.gate_proj"))
        act = g.op("Mul", gate, g.op("Sigmoid", gate))
        x = g.op("Add", x, _linear(g, g.op("Mul", act, _linear(g, hs, w("mlp.up_proj"))), w("mlp.down_proj")))

    norm = g.weight("norm.weight", state["norm.weight"])
    head = embed if c.tie_word_embeddings else g.weight("lm_head.weight", state["lm_head.weight"])
    g.op("Gemm", _rms_norm(g, x, norm, c.rms_norm_eps), head, transB=1, out="logits")

    pool = ["C", kvh, p, d]
    ins = [helper.make_tensor_value_info("input_ids", _I64, ["B"]),
           helper.make_tensor_value_info("positions", _I64, ["B"]),
           helper.make_tensor_value_info("page_table", _I64, ["B", "M"]),
           helper.make_tensor_value_info("page_mask", _BOOL, ["B", "M"]),
           helper.make_tensor_value_info("page_index", _I64, ["B", "M"]),
           helper.make_tensor_value_info("seq_len", _I64, ["B"]),
           helper.make_tensor_value_info("write_slot", _I64, ["B"]),
           helper.make_tensor_value_info("write_offset", _I64, ["B"])]
    outs = [helper.make_tensor_value_info("logits", _F32, ["B", c.vocab_size])]
    for layer in range(n_layers):
        ins += [helper.make_tensor_value_info(f"{kv}_pool_{layer}", _F32, pool) for kv in "kv"]
        outs += [helper.make_tensor_value_info(f"{kv}_pool_out_{layer}", _F32, pool) for kv in "kv"]
    if options.tiered_kv:
        outs += [helper.make_tensor_value_info(f"page_mass_{layer}", _F32, ["B", "M"]) for layer in range(n_layers)]
    graph = helper.make_graph(g.nodes, f"{c.name}_decode{'_tiered' if options.tiered_kv else ''}", ins, outs,
                              initializer=g.initializers)
    return helper.make_model(graph, functions=[tiered_attention_function(), kv_append_function()],
                             opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                             producer_name="tieredkv.builder", doc_string=__doc__.split("\n\n")[0])


def initializer_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_decode_graph(model: onnx.ModelProto, path: str | Path, *, external_data: bool | None = None) -> bool:
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
    """A decode step over explicit pools, as the graph sees them, for the reference model.

    ``Llama.forward`` drives it through the KV-cache step protocol (``begin_step``,
    ``attend`` per layer, ``end_step``): ``attend`` writes the new token's K/V with
    :func:`kv_append` and attends with :func:`tiered_attention` over the updated pools.
    After the forward call ``k_pools`` / ``v_pools`` hold the updated pools and
    ``page_mass`` the per-layer page mass [B, M]. Tensors as in the module docstring
    (torch); it runs one step of one token per sequence."""

    def __init__(self, *, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor], page_table: torch.Tensor,
                 page_mask: torch.Tensor, page_index: torch.Tensor, seq_len: torch.Tensor, write_slot: torch.Tensor,
                 write_offset: torch.Tensor) -> None:
        self.k_pools, self.v_pools = list(k_pools), list(v_pools)
        self.page_table, self.page_mask, self.page_index = page_table, page_mask, page_index
        self.seq_len, self.write_slot, self.write_offset = seq_len, write_slot, write_offset
        self.page_mass: list[torch.Tensor | None] = [None] * len(self.k_pools)

    def begin_step(self, seq_ids, num_new: int) -> Step:
        if num_new != 1:
            raise ValueError(f"PoolStep runs a decode step (one new token per sequence), got {num_new}")
        return Step(tuple(seq_ids), 1, tuple(int(n) - 1 for n in self.seq_len))

    def attend(self, step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kp, vp = kv_append(self.k_pools[layer], self.v_pools[layer], k[:, :, 0], v[:, :, 0], self.write_slot,
                           self.write_offset)
        self.k_pools[layer], self.v_pools[layer] = kp, vp
        out, _, probs = tiered_attention(q, kp, vp, self.page_table, self.page_mask, self.page_index, self.seq_len,
                                         self.seq_len - 1, with_lse=False)
        self.page_mass[layer] = probs.mean(dim=(1, 2))
        return out

    def end_step(self, step: Step) -> None:
        """Nothing to finish: the pools were updated in ``attend``."""


@torch.no_grad()
def reference_decode_step(model: Llama, feeds: dict[str, np.ndarray], *, tiered_kv: bool = True
                          ) -> dict[str, np.ndarray]:
    """The graph's outputs computed by the PyTorch model for the graph's inputs ``feeds``."""
    n_layers = model.config.num_layers
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()}
    step = PoolStep(k_pools=[t[f"k_pool_{i}"] for i in range(n_layers)],
                    v_pools=[t[f"v_pool_{i}"] for i in range(n_layers)],
                    page_table=t["page_table"], page_mask=t["page_mask"], page_index=t["page_index"],
                    seq_len=t["seq_len"], write_slot=t["write_slot"], write_offset=t["write_offset"])
    batch = t["input_ids"].shape[0]
    logits = model(t["input_ids"].view(-1, 1), t["positions"].view(-1, 1), step, list(range(batch)))[:, 0]
    out = {"logits": logits.float().numpy()}
    for i in range(n_layers):
        out[f"k_pool_out_{i}"] = step.k_pools[i].numpy()
        out[f"v_pool_out_{i}"] = step.v_pools[i].numpy()
        if tiered_kv:
            out[f"page_mass_{i}"] = step.page_mass[i].numpy()
    return out


def random_decode_inputs(model: Llama, *, page_size: int, seq_lens: list[int], tiered_kv: bool, seed: int = 0,
                         model_kv: bool = False, spare_pages: int = 3) -> dict[str, np.ndarray]:
    """Random graph inputs: sequences of ``seq_lens`` tokens (the new one included) on pages
    scattered over a pool with ``spare_pages`` unused pages, listed in shuffled order and
    padded to the longest; random tokens, page selection and pools (normal, std 1).

    With ``model_kv`` the filled slots (the tokens before the new one) hold the K/V the model
    itself computes for random prompt tokens, as a real engine sees them; the rest of the
    pools stays random (attention must ignore it). Random std-1 K/V everywhere drive a real
    model far out of its range, where float32 rounding alone moves its logits by ~1e-3.
    With ``tiered_kv`` each listed page but the one receiving the new token is masked out
    with probability 0.3; without, the mask is validity."""
    rng = np.random.default_rng(seed)
    c = model.config
    n_pages = [-(-n // page_size) for n in seq_lens]
    m, capacity = max(n_pages), sum(n_pages) + spare_pages
    slots = rng.permutation(capacity)
    batch = len(seq_lens)
    table = np.zeros((batch, m), np.int64)
    mask = np.zeros((batch, m), bool)
    index = np.zeros((batch, m), np.int64)
    write_slot = np.zeros(batch, np.int64)
    used = 0
    for b, (n, k) in enumerate(zip(seq_lens, n_pages)):
        own = slots[used : used + k]
        used += k
        order = rng.permutation(k)  # column j lists logical page order[j]
        table[b, :k], index[b, :k] = own[order], order
        keep = rng.random(k) >= 0.3 if tiered_kv else np.ones(k, bool)
        keep[order == k - 1] = True  # the page of the new token
        mask[b, :k] = keep
        table[b, k:] = own[0]  # padding: a real page, masked out
        write_slot[b] = own[k - 1]
    seq_len = np.asarray(seq_lens, np.int64)
    feeds = {"input_ids": rng.integers(0, c.vocab_size, batch).astype(np.int64), "positions": seq_len - 1,
             "page_table": table, "page_mask": mask, "page_index": index, "seq_len": seq_len,
             "write_slot": write_slot, "write_offset": (seq_len - 1) % page_size}
    shape = (capacity, c.num_kv_heads, page_size, c.head_dim)
    for layer in range(c.num_layers):
        feeds[f"k_pool_{layer}"] = rng.standard_normal(shape, dtype=np.float32)
        feeds[f"v_pool_{layer}"] = rng.standard_normal(shape, dtype=np.float32)
    if model_kv:
        for b, n in enumerate(seq_lens):
            if n > 1:
                prompt = torch.from_numpy(rng.integers(0, c.vocab_size, n - 1).astype(np.int64))
                _write_prompt_kv(model, prompt, table[b, : n_pages[b]], index[b, : n_pages[b]], feeds)
    return feeds


@torch.no_grad()
def _write_prompt_kv(model: Llama, prompt: torch.Tensor, table: np.ndarray, index: np.ndarray,
                     feeds: dict[str, np.ndarray]) -> None:
    """Prefill ``prompt`` through a paged cache and copy its K/V into the pools of ``feeds``:
    logical page ``index[j]`` lives in pool page ``table[j]``."""
    from tieredkv.models.llama import prefill
    from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache

    page, n = feeds["k_pool_0"].shape[2], len(prompt)
    cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=page, initial_pages=-(-n // page)))
    sid = cache.add_sequence()
    prefill(model, cache, sid, prompt)
    pos = np.arange(n)
    slots = dict(zip(index.tolist(), table.tolist()))
    pool_page, offset = np.array([slots[p // page] for p in pos]), pos % page
    for layer in range(model.config.num_layers):
        k, v, _ = cache.gather(layer, [sid])  # [1, KVH, pages * P, D]
        feeds[f"k_pool_{layer}"][pool_page, :, offset] = k[0, :, :n].transpose(0, 1).float().numpy()
        feeds[f"v_pool_{layer}"][pool_page, :, offset] = v[0, :, :n].transpose(0, 1).float().numpy()


def run_onnx(path_or_session, feeds: dict[str, np.ndarray], *, threads: int = 1) -> dict[str, np.ndarray]:
    """Run the graph in ONNX Runtime CPU (a path, or an existing InferenceSession); returns
    every output by name."""
    import onnxruntime as ort

    sess = path_or_session
    if not isinstance(sess, ort.InferenceSession):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(path_or_session), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))
