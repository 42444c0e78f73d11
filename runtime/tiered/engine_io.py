"""Engine I/O: the step graph's inputs and outputs, declared once, and how the tiered cache
fills the one and takes the other.

:class:`StepFeeds` and :class:`StepOutputs` have one field per graph input / output (a
per-layer input is a list, named ``<field>_<layer>`` in the graph): their names, dtypes,
shapes, the graphs that have them and what they mean are these declarations, which the
builder (``builder/export.py``) reads to declare the graph, the backends
(``runtime/engine.py``) to bind it, and the reference step (``export.PoolStep``) to run it.

Dimensions: L layers, B sequences, T new tokens each, M listed pages (the longest
sequence's; shorter ones are padded), C_l pool pages of layer l (``C{l}``), KVH kv heads, P
page size, D head dim, NB position buckets, W_l warm pages of layer l, PW int32 words of an
encoded page (its bytes / 4), V vocabulary.

Per step (an engine backend's call): :func:`step_feeds` builds the inputs from the open step's plan —
the page list of each sequence, each layer's page table into its device pool, the residency
mask, the pools themselves (plus the non-resident pages a step must read staged after them:
exact-mode misses, prefill, warm pages a graph without a warm codec cannot decode), key
summaries and the scorer's parameters; the engine runs; :func:`finish_step` writes the new
K/V into the cache and records each layer's access from the graph's selection, relevance
and attention mass, as the PyTorch backend does inside its forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from tieredkv.errors import ConfigError
from tieredkv.plugins.codec import CODECS, as_words
from tieredkv.plugins.codec import page_bytes as codec_page_bytes
from tieredkv.plugins.select_pages import ATTEND_ALL

#: the graphs an input or output belongs to: every graph, tiered graphs (--tiered-kv), graphs
#: with a warm codec (--warm-codec); ``"runtime"``: none — what the runtime keeps from
#: :func:`step_feeds` for :func:`finish_step`
GRAPHS = ("all", "tiered", "warm", "runtime")
#: the dtype of the K/V tensors (pools, new K/V): the engine's precision (float32 or float16,
#: ``config.json``'s ``build.precision``), the dtype of the tiered cache's pools for the engine
KV_DTYPE = "kv"


def tensor(dtype: torch.dtype | str, dims: tuple[str, ...], doc: str, *, graphs: str = "all",
           per_layer: bool = False) -> Any:
    """One input or output of the step graph."""
    return field(default=None, metadata={"dtype": dtype, "dims": dims, "doc": doc, "graphs": graphs,
                                         "per_layer": per_layer})


class _GraphTensors:
    """What StepFeeds and StepOutputs share: the declarations and the names they give."""

    @classmethod
    def specs(cls, *, tiered_kv: bool, warm: bool = False) -> list[tuple[str, dict]]:
        """(field name, declaration) of the tensors a graph built with these options has."""
        keep = {"all"} | ({"tiered"} if tiered_kv else set()) | ({"warm"} if warm else set())
        return [(f.name, f.metadata) for f in fields(cls) if f.metadata["graphs"] in keep]

    @classmethod
    def names(cls, num_layers: int, *, tiered_kv: bool, warm: bool = False) -> list[str]:
        """The graph's tensor names, in graph order: the whole-step tensors, then per layer."""
        specs = cls.specs(tiered_kv=tiered_kv, warm=warm)
        names = [name for name, meta in specs if not meta["per_layer"]]
        for layer in range(num_layers):
            names += [f"{name}_{layer}" for name, meta in specs if meta["per_layer"]]
        return names

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor set, by graph name."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.metadata["graphs"] == "runtime":
                continue
            if f.metadata["per_layer"]:
                out.update({f"{f.name}_{layer}": t for layer, t in enumerate(value)})
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, tensors: dict[str, Any]):
        """The inverse of :meth:`as_dict` (per-layer tensors gathered in layer order)."""
        values = {}
        for f in fields(cls):
            if f.metadata["per_layer"]:
                layers = sorted(int(k.rsplit("_", 1)[1]) for k in tensors if k.rsplit("_", 1)[0] == f.name)
                values[f.name] = [tensors[f"{f.name}_{layer}"] for layer in layers] or None
            else:
                values[f.name] = tensors.get(f.name)
        return cls(**values)


@dataclass
class StepFeeds(_GraphTensors):
    """The inputs of an engine's step graph."""

    input_ids: torch.Tensor = tensor(torch.int64, ("B", "T"), "the new tokens")
    positions: torch.Tensor = tensor(torch.int64, ("B", "T"), "their RoPE positions")
    seq_len: torch.Tensor = tensor(torch.int64, ("B",), "tokens of the sequence, the new ones included")
    page_index: torch.Tensor = tensor(torch.int64, ("B", "M"), "logical index of each listed page in its sequence; "
                                      "padding columns: PAD_PAGE_INDEX, past any sequence (ignored)")
    page_table: torch.Tensor = tensor(torch.int64, ("L", "B", "M"), "pool page of each listed page, per layer")
    page_mask: torch.Tensor = tensor(torch.bool, ("L", "B", "M"), "the listed page is in the layer's pool "
                                     "(device-resident, or staged for this step)")
    write_slot: torch.Tensor = tensor(torch.int64, ("L", "B", "T"), "pool page each new token's K/V go to, per layer")
    write_offset: torch.Tensor = tensor(torch.int64, ("B", "T"), "slot inside that page, in [0, P)")
    page_pinned: torch.Tensor = tensor(torch.bool, ("B", "M"), "T0 pages: attended whatever their score",
                                       graphs="tiered")
    page_tokens: torch.Tensor = tensor(torch.int64, ("B", "M"), "tokens written in each page, new ones included",
                                       graphs="tiered")
    attend_pages: torch.Tensor = tensor(torch.int64, ("B",), "attention budget in pages, T0 included "
                                        "(>= M: every page)", graphs="tiered")
    key_min: torch.Tensor = tensor(torch.float32, ("L", "B", "M", "KVH", "D"), "per-page element-wise key minimum",
                                   graphs="tiered")
    key_max: torch.Tensor = tensor(torch.float32, ("L", "B", "M", "KVH", "D"), "per-page element-wise key maximum",
                                   graphs="tiered")
    page_saliency: torch.Tensor = tensor(torch.float32, ("L", "B", "M"), "mean learned saliency of each page's keys",
                                         graphs="tiered")
    position_table: torch.Tensor = tensor(torch.float32, ("L", "NB"), "the scorer's learned position table",
                                          graphs="tiered")
    page_warm_row: torch.Tensor = tensor(torch.int64, ("L", "B", "M"), "row of the layer's warm pool holding the "
                                         "listed page, or -1 (read from k_pool / v_pool; a warm page's page_table "
                                         "entry is ignored)", graphs="warm")
    k_pool: list[torch.Tensor] = tensor(KV_DTYPE, ("C{l}", "KVH", "P", "D"), "the layer's key page pool",
                                        per_layer=True)
    v_pool: list[torch.Tensor] = tensor(KV_DTYPE, ("C{l}", "KVH", "P", "D"), "the layer's value page pool",
                                        per_layer=True)
    warm_pool: list[torch.Tensor] = tensor(torch.int32, ("W{l}", "PW"), "the layer's warm pages, encoded with the "
                                           "codec in the byte layout of codec.encode_pages (docs/codec.md), as "
                                           "little-endian int32 words (codec.as_words: TensorRT takes no uint8 "
                                           "plugin tensors)",
                                           graphs="warm", per_layer=True)
    exact_reads: torch.Tensor = tensor(torch.bool, ("L", "B", "M"), "warm pages staged from their exact copy "
                                       "(warm.exact_reads), not a graph input: finish_step accounts them",
                                       graphs="runtime")


@dataclass
class StepOutputs(_GraphTensors):
    """The outputs of an engine's step graph."""

    logits: torch.Tensor = tensor(torch.float32, ("B", "T", "V"), "next-token logits")
    k_new: torch.Tensor = tensor(KV_DTYPE, ("L", "B", "KVH", "T", "D"), "the new tokens' keys (rotated), which "
                                 "the runtime writes into its own pools")
    v_new: torch.Tensor = tensor(KV_DTYPE, ("L", "B", "KVH", "T", "D"), "the new tokens' values")
    page_selected: torch.Tensor = tensor(torch.bool, ("L", "B", "M"), "SelectPages: T0 plus the top (attend_pages - "
                                         "|T0|) other pages by ImportanceScore (ties: lower column first); every valid "
                                         "page when attend_pages covers them all", graphs="tiered")
    page_relevance: torch.Tensor = tensor(torch.float32, ("L", "B", "M"), "ImportanceScore's query relevance (0 on T0 "
                                          "and padding)", graphs="tiered")
    page_mass: torch.Tensor = tensor(torch.float32, ("L", "B", "M"), "attention mass per page (mean over query heads, "
                                     "sum over the step's queries); 0 where not attended", graphs="tiered")


# ------------------------------------------------------------------ the cache's side


def step_feeds(cache, *, tiered_graph: bool, warm_codec: str | None = None,
               kv_dtype: torch.dtype = torch.float32) -> StepFeeds:
    """The inputs of the graph for the cache's open step (``TieredKVCache.begin_step``): the
    pools where the cache's device tier lives (bound in place by the backends; ``kv_dtype``,
    the engine's K/V dtype, is the cache's own unless the KV config set another, which costs
    a converted copy of the pools per step), the rest CPU tensors; ``input_ids`` and
    ``positions`` are the caller's.

    A listed page is in a layer's pool when it is resident in full precision, or staged for
    this step after the pool: warm pages decoded, and (exact mode, prefill) the non-resident
    pages read from the host / disk tiers — the graph attends the selected pages among them,
    as the PyTorch backend does. A graph built with ``warm_codec`` (the cache's own codec)
    reads warm pages itself: the feeds carry each layer's warm pool as it is (its encoded
    bytes) and each listed page's warm row, and warm pages are not staged — but those of a
    decode step's ``warm.exact_reads`` (:meth:`TierManager.exact_read_choice`, the same pages the
    PyTorch backend reads exact), which are staged from their exact copy. Staged pages are
    accounted when attended (:func:`finish_step`), as if the kernel fetched them on demand.
    """
    mgr, plan, table = cache.mgr, cache.plan, cache.mgr.table
    L, T = mgr.L, plan.num_new
    stage_missing = not plan.decode or cache.config.selection.mode == "exact"
    B, M = plan.batch, plan.width
    index, tokens, pinned, valid, recs = plan.index, plan.tokens, plan.t0, plan.valid, plan.recs
    flat = recs.flatten()
    device_slot = table.device_slot[:, flat].view(L, B, M)
    warm_slot = table.warm_slot[:, flat].view(L, B, M)
    full = (device_slot >= 0) & valid
    # warm.exact_reads: staged from the exact copy, not read through the codec (the pages the PyTorch backend reads)
    choice = cache.layers.exact_choice
    exact = torch.zeros_like(full) if choice is None else choice.cpu()
    warm_in_graph = (warm_slot >= 0) & valid & ~exact if warm_codec is not None else torch.zeros_like(full)
    stage = valid & ~full & ~warm_in_graph & ((warm_slot >= 0) | stage_missing)
    page_table = torch.where(full, device_slot, torch.zeros_like(device_slot))
    k_pools, v_pools = [], []
    for layer in range(L):
        k_pool, v_pool = mgr.device.k[layer], mgr.device.v[layer]
        cols = stage[layer].nonzero()
        if len(cols):
            k_staged, v_staged = mgr.read_pages(layer, recs[cols[:, 0], cols[:, 1]], kv_dtype,
                                                exact=exact[layer, cols[:, 0], cols[:, 1]])
            page_table[layer, cols[:, 0], cols[:, 1]] = k_pool.shape[0] + torch.arange(len(cols))
            k_pool, v_pool = torch.cat([k_pool.to(kv_dtype), k_staged]), torch.cat([v_pool.to(kv_dtype), v_staged])
        k_pools.append(k_pool.to(kv_dtype))
        v_pools.append(v_pool.to(kv_dtype))
    feeds = StepFeeds(seq_len=plan.seq_len, page_index=index, page_table=page_table,
                      page_mask=full | stage | warm_in_graph,
                      write_slot=table.device_slot[:, plan.write_recs].view(L, B, T),
                      write_offset=plan.write_offsets.view(B, T), k_pool=k_pools, v_pool=v_pools,
                      exact_reads=exact)
    if warm_codec is not None:
        feeds.page_warm_row = torch.where(warm_in_graph, warm_slot, torch.full_like(warm_slot, -1))
        feeds.warm_pool = [_warm_pool(cache, layer, warm_codec) for layer in range(L)]
    if tiered_graph:
        budget = cache.budgets.attention_pages
        attend = ATTEND_ALL if budget is None or not plan.decode else budget
        kmin, kmax, saliency = mgr.summaries(slice(None), flat, tokens.flatten())
        summary = (L, B, M, mgr.kv_heads, mgr.head_dim)
        feeds.page_pinned, feeds.page_tokens, feeds.attend_pages = pinned, tokens, torch.full((B,), attend)
        feeds.key_min, feeds.key_max = kmin.view(summary).float(), kmax.view(summary).float()
        feeds.page_saliency = saliency.view(L, B, M).float()
        feeds.position_table = cache.scorer.position.detach().float()
    return feeds


def _warm_pool(cache, layer: int, warm_codec: str) -> torch.Tensor:
    """The warm pool of one layer as a graph input [W, PW] int32 words: the pool's own rows
    viewed as words (no copy), or one zero row when the cache keeps no warm tier (the graph
    then reads none)."""
    warm = cache.mgr.warm
    if warm is not None:
        if cache.config.warm.codec != warm_codec:
            raise ConfigError(f"warm_codec {cache.config.warm.codec!r} of the KV config does not match the "
                              f"engine's {warm_codec!r}")
        return as_words(warm.data[layer])
    spec = cache.spec
    return as_words(torch.zeros((1, codec_page_bytes(CODECS[warm_codec], spec.num_kv_heads, cache.config.page_size,
                                                     spec.head_dim)), dtype=torch.uint8))


def finish_step(cache, step, feeds: StepFeeds, outputs: StepOutputs) -> None:
    """Finish the cache's open step from the graph's outputs: write the new K/V of every layer,
    record every layer's access from the graph's selection, relevance and attention mass (a
    plain graph attends every page in its pool: the cache has no budget), close the step."""
    plan, L = cache.plan, cache.mgr.L
    for layer in range(L):
        cache.store(layer, outputs.k_new[layer], outputs.v_new[layer])
    rec, valid = cache.layers.rec, plan.valid.unsqueeze(0)
    cache.layers.ran = True
    if outputs.page_selected is not None:
        selected = outputs.page_selected.to(torch.bool) & valid
        rec.relevance = outputs.page_relevance.float().to(rec.relevance.device)
        rec.mass = outputs.page_mass.float().to(rec.mass.device)
    else:
        selected = valid.expand(L, -1, -1)
    rec.selected = selected.to(rec.selected.device)
    attended = selected & feeds.page_mask
    rec.attended = attended.to(rec.attended.device)
    if rec.exact is not None:
        rec.exact = (feeds.exact_reads & attended).to(rec.exact.device)
    cache.end_step(step)
