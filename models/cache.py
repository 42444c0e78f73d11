"""The KV-cache interface the reference model attends through, and the plain contiguous
cache that is the oracle for every other cache.

The model never touches K/V storage itself. Per forward call it opens a *step* for a set
of sequences that each receive the same number of new tokens, and per layer hands the
cache the new tokens' (already rotated) queries, keys and values; the cache stores the
keys and values and returns the attention output. That lets a paged cache gather
through its page table and a tiered cache choose, mask and measure what is attended,
without the model knowing.

Shapes (B = sequences in the step, T = new tokens per sequence):
  q: [B, num_heads, T, head_dim]      k, v: [B, num_kv_heads, T, head_dim]
  attend(...) -> [B, num_heads, T, head_dim]
New token ``t`` of sequence ``b`` sees every cached token of ``b`` and new tokens ``<= t``.

The serving layer (scheduler, engine, prefix index, remote tier, Triton health) sees a cache
through the rest of :class:`KVCache` only, the paged and the tiered cache alike (in the
spirit of vLLM's ``KVCacheManager``): its page arithmetic (``page_size``, capacities, the
device pages a sequence holds as it grows), slots for a step (``allocate_slots``: no room is
``False``, never an exception), ``free_sequence``, ``pause`` / ``resume`` (demotion, where the
cache ``demotes``), ``usage`` (pages and bytes per tier), prefix pages (``pages_of``,
``add_sequence(shared=...)``, ``hold_pages`` / ``drop_pages``, ``page_refs``, ``page_tiers``,
where the cache ``shares_pages``), page read / load for the remote tier (``read_pages``,
``load_pages``) and ``check`` (the cache's invariants).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from tieredkv.models.cpu_attention import decode_attention_op


@dataclass(frozen=True)
class KVSpec:
    """The geometry of the K/V a model produces."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    #: where the model runs: the caches keep the K/V they attend over there (the tiered cache:
    #: its device tier; host and disk tiers stay in host memory)
    device: str = "cpu"

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of K plus V for one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Step:
    """One forward call: which sequences, how many new tokens each, and how many tokens
    each had cached before the call (``past[b]``)."""

    seq_ids: tuple[int, ...]
    num_new: int
    past: tuple[int, ...]


def causal_mask(past: torch.Tensor, num_new: int, kv_len: int) -> torch.Tensor:
    """Boolean mask [B, 1, T, S]: new token t of sequence b (absolute index past[b] + t)
    may attend key slot s iff s <= past[b] + t."""
    t = torch.arange(num_new, device=past.device).view(1, 1, num_new, 1)
    s = torch.arange(kv_len, device=past.device).view(1, 1, 1, kv_len)
    return s <= (past.view(-1, 1, 1, 1) + t)


def gather_pages(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Pages [B, M] (slots) of one layer's page pool [C, KVH, P, D] as [B, KVH, M, P, D], in one
    copy: each (page, kv head) row of P x D values is read whole, in the order attention reads
    them (``.view(B, KVH, M * P, D)`` is then the keys of each kv head in logical order, with
    no second copy to move the heads in front of the pages)."""
    c, kvh, p, d = pool.shape
    b, m = pages.shape
    rows = (pages.unsqueeze(1) * kvh + torch.arange(kvh, device=pages.device).view(1, kvh, 1)).flatten()
    return pool.reshape(c * kvh, p, d).index_select(0, rows).view(b, kvh, m, p, d)


def pool_rows(slots: torch.Tensor, offsets: torch.Tensor, kv_heads: int, page_size: int) -> torch.Tensor:
    """Where new tokens go as rows of a layer's pool [C, KVH, P, D] viewed [C * KVH * P, D]:
    token n (page ``slots[..., n]``, place ``offsets[n]`` in it) and kv head h at row
    ``(slot * KVH + h) * P + offset``; [..., N * KVH], token-major — the order of the new
    tokens' K [N, KVH, D] reshaped [N * KVH, D]. ``slots`` [N], or [L, N] for every layer."""
    heads = torch.arange(kv_heads, device=slots.device)
    return ((slots.unsqueeze(-1) * kv_heads + heads) * page_size + offsets.unsqueeze(-1)).flatten(-2)


def write_pool_rows(pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> bool:
    """New tokens' K, V [N, KVH, D] into one layer's pools [C, KVH, P, D] at :func:`pool_rows`'
    ``rows``: one ``index_copy_`` per pool (the values cast to the pool's dtype). False, writing
    nothing, where a pool is not contiguous (the caller then scatters by page and offset)."""
    if not (pool_k.is_contiguous() and pool_v.is_contiguous()):
        return False
    for pool, new in ((pool_k, k), (pool_v, v)):
        d = pool.shape[-1]
        pool.view(-1, d).index_copy_(0, rows, new.reshape(-1, d).to(pool.device, pool.dtype))
    return True


def decode_op_applies(q: torch.Tensor, pool_k: torch.Tensor) -> bool:
    """Whether the CPU decode-attention ops take q [B, H, T, D] over a pool of ``pool_k``'s
    dtype: one query per sequence, float32 on the CPU, no autograd."""
    return (q.shape[2] == 1 and q.device.type == "cpu" and q.dtype == pool_k.dtype == torch.float32
            and not (torch.is_grad_enabled() and q.requires_grad))


def pool_decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, pages: torch.Tensor,
                          allowed: torch.Tensor) -> torch.Tensor | None:
    """Decode attention read straight from one layer's page pools, or ``None`` where that op
    does not apply (then the caller gathers and calls :func:`attention`).

    q [B, H, 1, D]; pool_k / pool_v [C, KVH, P, D]; pages [B, M] slots; allowed [B, M * P] bool
    (the keys each query may see, in page order). Returns [B, H, 1, D]. The op
    (:mod:`tieredkv.models.cpu_attention`) runs float32 decode on the CPU without autograd; it
    agrees with gather + :func:`attention` to float32 rounding and reads each page once instead of
    copying every page into a batch first."""
    b, h, t, d = q.shape
    if not decode_op_applies(q, pool_k):
        return None
    op = decode_attention_op()
    if op is None:
        return None
    return op(q.reshape(b, h, d).contiguous(), pool_k.contiguous(), pool_v.contiguous(), pages.long().contiguous(),
              allowed.contiguous(), d ** -0.5).view(b, h, 1, d)


#: where a page of :func:`tiered_decode_attention` lives: the device pool, the warm pool
#: (encoded), the extra pages (read from the host, disk, or an exact copy)
POOL, WARM, EXTRA = 0, 1, 2


def warm_codec_args(spec, kv_heads: int, page_size: int, head_dim: int) -> list[int] | None:
    """The warm-pool layout :func:`tiered_decode_attention` reads ([bits, value group, the byte
    offsets of the key codes, scales, zero points, the value codes, scales, zero points]), or
    ``None`` for a codec it cannot read encoded (only asymmetric 2- and 4-bit integer codes with
    per-channel keys and per-token values: the default int4, int4-g16 and int2)."""
    import math

    from tieredkv.plugins.codec import page_layout

    if (spec.base != "int" or not spec.asym or spec.bits not in (2, 4) or spec.residual_bits or spec.keyframe
            or spec.key_axis != "channel" or spec.value_axis != "token"):
        return None
    lay = page_layout(spec, kv_heads, page_size, head_dim)
    return [spec.bits, math.gcd(spec.group, head_dim)] + [lay[f"{r}.{n}"]["offset"] for r in "kv"
                                                          for n in ("codes", "scale", "zero")]


def encode_warm_pages(k: torch.Tensor, v: torch.Tensor, spec) -> torch.Tensor:
    """``plugins.codec.encode_pages`` (K, V [N, KVH, P, D] -> uint8 [N, page bytes]), through the
    CPU op (``models/csrc/kv_codec.cpp``: one pass per page, the same bytes) where it applies:
    float32 pages on the CPU, every value finite, a codec :func:`warm_codec_args` reads."""
    from tieredkv.models.cpu_attention import encode_op
    from tieredkv.plugins.codec import encode_pages, page_bytes

    if k.device.type == "cpu" and k.dtype == v.dtype == torch.float32 and k.dim() == 4 and k.shape[0]:
        _, kvh, p, d = k.shape
        args = warm_codec_args(spec, kvh, p, d)
        op = encode_op() if args is not None else None
        if op is not None and bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all()):
            return op(k.contiguous(), v.contiguous(), args, page_bytes(spec, kvh, p, d))
    return encode_pages(k, v, spec)


def tiered_in_place(mgr, device: torch.device) -> list[int] | tuple | None:
    """Whether the tiered cache's decode layers (``mgr``: its ``TierManager``) can attend through
    :func:`tiered_decode_attention`: ``None`` where not (another device or dtype, the op not
    built), else the warm pool's layout for the op to read it encoded (a single-codec warm pool
    without decoded copies, in a codec :func:`warm_codec_args` reads), or ``()`` where the warm
    pages are read by the manager instead."""
    from tieredkv.models.cpu_attention import tiered_attention_op

    if torch.device(device).type != "cpu" or mgr.device.k.dtype != torch.float32 or tiered_attention_op() is None:
        return None
    warm = mgr.warm
    if warm is None or getattr(warm, "decoded", True) is not None or not hasattr(warm, "codec"):
        return ()
    return warm_codec_args(warm.codec, *warm.shape) or ()


def tiered_decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, kind: torch.Tensor,
                            slot: torch.Tensor, allowed: torch.Tensor, *, warm: torch.Tensor | None = None,
                            warm_codec: list[int] | None = None, extra_k: torch.Tensor | None = None,
                            extra_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode attention over pages in three places, with each page's attention mass, or
    ``None`` where the op does not apply (as :func:`pool_decode_attention`; then the caller
    gathers the pages and attends over the copy).

    q [B, H, 1, D]; kind [B, M] (:data:`POOL`, :data:`WARM`, :data:`EXTRA`) and slot [B, M]:
    where each listed page is — a slot of pool_k / pool_v [C, KVH, P, D], of ``warm`` [Cw, NB]
    (one layer's encoded pages, in the layout ``warm_codec`` from :func:`warm_codec_args`), or an
    index of extra_k / extra_v [X, KVH, P, D]; allowed [B, 1 or KVH, M * P] bool (the keys each
    query, or each kv head's queries, may see; a page none may see is not read). Returns
    (out [B, H, 1, D], mass [B, M]: each page's attention probability, mean over the query heads)."""
    b, h, t, d = q.shape
    if not decode_op_applies(q, pool_k):
        return None
    from tieredkv.models.cpu_attention import tiered_attention_op

    op = tiered_attention_op()
    if op is None or (warm is not None and warm_codec is None):
        return None
    kvh, p = pool_k.shape[1], pool_k.shape[2]
    if extra_k is None:
        extra_k = extra_v = pool_k.new_zeros(0, kvh, p, d)
    if warm is None:
        warm, warm_codec = torch.zeros(0, 0, dtype=torch.uint8), [0] * 8
    out, mass = op(q.reshape(b, h, d).contiguous(), pool_k.contiguous(), pool_v.contiguous(), extra_k.contiguous(),
                   extra_v.contiguous(), warm.contiguous(), warm_codec, kind.to(torch.int8).contiguous(),
                   slot.long().contiguous(), allowed.contiguous(), d ** -0.5)
    return out.view(b, h, 1, d), mass.sum(1) / h


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q [B, H, T, D], k/v [B, KVH, S, D], mask bool [B, 1, T, S] (True = attend) or None.
    Returns [B, H, T, D] in q's dtype (zeros for a query that sees no key).

    A decode step of several sequences (T = 1, B > 1) runs as two batched matmuls with each kv
    head's query heads as the rows of one product (in float32), which is what this project's CPU
    runs fastest there: within 10 % of ``scaled_dot_product_attention``'s kernel at 2-8
    sequences, 1.2-1.4x faster at 16-64; that kernel is faster for one sequence (1.2x) and runs
    prefill (docs/benchmarks.md §12, "One attention kernel for both caches").
    """
    b, h, t, d = q.shape
    kvh = k.shape[1]
    if t != 1 or b == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != kvh)
    logits = torch.matmul(q.float().view(b, kvh, h // kvh, d), k.float().transpose(-1, -2)) * d ** -0.5
    if mask is not None:  # [B, 1, 1, S] over [B, KVH, G, S]
        logits = logits.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a row that sees no key: nan -> 0
    return torch.matmul(probs, v.float()).view(b, h, 1, d).to(q.dtype)


@dataclass(frozen=True)
class KVUsage:
    """What a cache holds now (``KVCache.usage``), for the serving layer's metrics and health.
    Pages are counted per layer (every layer holds the same pages); bytes over all layers."""

    sequences: int  # sequences open (running or paused)
    device_pages: int  # pages the device holds, for sequences and the prefix index
    device_capacity: int | None  # the most it may hold (None: no bound)
    device_bytes: int  # bytes of those pages on the device (encoded pages at their encoded size)
    token_bytes: int  # of ``device_bytes``, the bytes that hold tokens (a partial page holds fewer than P)
    sequence_refs: int  # page references held by sequences (a page two sequences share counts twice)
    indexed_pages: int  # pages the prefix index holds
    tier_bytes: dict[str, int] = field(default_factory=dict)  # bytes per tier (paged: {"device": ...})


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVCache(abc.ABC):
    """A store of per-sequence K/V that the model attends through (see module docstring).

    The defaults of the serving interface describe a cache without pages, counted in tokens
    and without a budget (the contiguous oracle); the paged and the tiered cache override
    them."""

    spec: KVSpec

    @abc.abstractmethod
    def add_sequence(self) -> int:
        """Register a new, empty sequence; returns its id."""

    @abc.abstractmethod
    def free_sequence(self, seq_id: int) -> None:
        """Drop a sequence and release everything it holds."""

    @abc.abstractmethod
    def length(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` the cache has seen (all layers agree between steps)."""

    @abc.abstractmethod
    def truncate(self, seq_id: int, length: int) -> None:
        """Forget every token of ``seq_id`` from index ``length`` on (roll back a fork)."""

    def checkpoint(self, seq_id: int):
        """State to return to with :meth:`rollback` (default: the sequence length)."""
        return self.length(seq_id)

    def rollback(self, seq_id: int, state) -> None:
        self.truncate(seq_id, state)

    def max_step_tokens(self, *, fixed: bool = False) -> int | None:
        """The most new tokens one forward call may bring now (None: no limit); ``fixed``: a
        limit that holds whatever the open sequences' lengths become (one chunk size for a
        whole prompt)."""
        return None

    def begin_step(self, seq_ids: tuple[int, ...] | list[int], num_new: int) -> Step:
        return Step(tuple(seq_ids), num_new, tuple(self.length(s) for s in seq_ids))

    @abc.abstractmethod
    def attend(self, step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v of the new tokens in ``layer`` and return their attention output."""

    def end_step(self, step: Step) -> None:
        """Called after the last layer of a forward call."""

    @abc.abstractmethod
    def kv_bytes(self) -> int:
        """Bytes of K/V storage this cache holds right now."""

    def close(self) -> None:
        """Release what outlives the sequences (files); the cache's statistics stay readable."""

    # ------------------------------------------------------------------ the serving interface
    @property
    def page_size(self) -> int:
        """Tokens per page (1: a cache without pages is counted in tokens)."""
        return 1

    @property
    def device_capacity(self) -> int | None:
        """Pages (per layer) the device may hold; None: no bound."""
        return None

    @property
    def host_capacity(self) -> int | None:
        """Pages (per layer) a bounded host tier holds when no disk tier takes what it cannot;
        None: no bound to count against."""
        return None

    @property
    def demotes(self) -> bool:
        """Whether :meth:`pause` can take a sequence's pages off the device (preemption by
        demotion) and :meth:`resume` bring it back."""
        return False

    @property
    def shares_pages(self) -> bool:
        """Whether sequences can share full pages (prefix reuse: ``add_sequence(shared=...)``,
        :meth:`hold_pages`)."""
        return False

    def device_pages(self, tokens_now: int, tokens_after: int, *, prompt: int | None = None) -> int:
        """Device pages one running sequence holds while it grows from ``tokens_now`` to
        ``tokens_after`` tokens; ``prompt``: its prompt's length while it is still prefilling it."""
        return _pages(tokens_after, self.page_size)

    def admission_pages(self, prompt: int, first_chunk: int) -> int:
        """Device pages a newly admitted sequence with a ``prompt``-token prompt needs before it
        makes progress (its first prefill chunk of ``first_chunk`` tokens)."""
        return _pages(first_chunk, self.page_size)

    def reserve_pages(self, tokens: int) -> int:
        """Device pages to reserve for a sequence that will reach ``tokens`` tokens, so that it
        never needs more."""
        return _pages(tokens, self.page_size)

    def holds_working_sets(self, token_counts: Sequence[int]) -> bool:
        """Whether the device holds, at once, every page that sequences of these lengths read in
        a step. A cache that keeps every page of its sequences on the device: always (their
        growth is what :meth:`device_pages` counts); the tiered cache: the pages each attends,
        at full precision or warm — past that, a step reads pages from the host."""
        return True

    def expect(self, seq_id: int, tokens: int) -> None:
        """``seq_id`` will reach up to ``tokens`` tokens (the serving engine says so when it admits
        a request). A cache whose storage grows as it fills grows it now, for every live
        sequence's expected pages at once (within its budget), so that no decode step pays for a
        copy of its pools. A hint: it takes no pages from anyone (admission is
        :meth:`allocate_slots`'s) and a sequence may still go past it."""

    def allocate_slots(self, seq_ids: Sequence[int], num_new: int) -> bool:
        """Make room for ``num_new`` more tokens of each of ``seq_ids`` in the next step: True when
        the step will find its slots, False (and nothing taken) when there is no room."""
        return True

    def pause(self, seq_id: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not demote sequences")

    def resume(self, seq_id: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not demote sequences")

    @abc.abstractmethod
    def usage(self) -> KVUsage:
        """Pages and bytes held now (:class:`KVUsage`)."""

    def counters(self) -> dict[str, int]:
        """Totals since the cache started of what it counts about its pages (the tiered cache:
        hits, misses, masked pages, bytes moved per direction, page moves per kind); empty for a
        cache that moves nothing."""
        return {}

    def pages_of(self, seq_id: int) -> list[int]:
        """The pages of a sequence, in logical order (page ids of the cache's page space)."""
        raise NotImplementedError(f"{type(self).__name__} has no shared pages")

    def hold_pages(self, pages: Sequence[int]) -> None:
        """The prefix index keeps these full pages past their sequences (one reference each)."""
        raise NotImplementedError(f"{type(self).__name__} has no shared pages")

    def drop_pages(self, pages: Sequence[int]) -> None:
        """The prefix index lets these pages go; the ones no sequence lists are freed."""
        raise NotImplementedError(f"{type(self).__name__} has no shared pages")

    def page_refs(self, pages: Sequence[int]) -> list[int]:
        """References to each page (sequences listing it, plus one while the index holds it)."""
        raise NotImplementedError(f"{type(self).__name__} has no shared pages")

    def pages_indexed(self, pages: Sequence[int]) -> list[bool]:
        """Whether the prefix index holds each page."""
        raise NotImplementedError(f"{type(self).__name__} has no shared pages")

    def page_tiers(self, pages: Sequence[int]) -> list[str]:
        """Where each page is: ``device``, ``host`` or ``disk``."""
        raise NotImplementedError(f"{type(self).__name__} has no shared pages")

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact K, V of full pages, [L, n, KVH, P, D] each, in host memory (in the cache's
        storage dtype)."""
        raise NotImplementedError(f"{type(self).__name__} has no pages to read")

    @property
    def warm_codec(self) -> tuple[str, object] | None:
        """``(name, codec)`` of the codec the cache keeps warm pages in (``encode_pages`` /
        ``decode_pages``, docs/codec.md), which the remote tier may store pages in; None
        when it keeps none."""
        return None

    def load_pages(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append whole pages of K, V ([L, n, KVH, P, D] each) to a sequence whose length is a
        multiple of the page size: its next ``n * P`` tokens, written as steps write them (as
        many pages per step as ``max_step_tokens`` allows)."""
        n, P = k.shape[1], self.page_size
        if self.length(seq_id) % P:
            raise ValueError(f"load_pages: sequence {seq_id} ends inside a page ({self.length(seq_id)} tokens)")
        lo = 0
        while lo < n:
            limit = self.max_step_tokens()  # what fits next to the hot windows held now
            m = min(n - lo, n if limit is None else max(1, limit // P))
            step = self.begin_step([seq_id], m * P)
            for layer in range(self.spec.num_layers):
                # [m, KVH, P, D] -> [1, KVH, m * P, D]: the step's new tokens in order
                self.write(step, layer, k[layer, lo:lo + m].permute(1, 0, 2, 3).reshape(1, k.shape[2], m * P, -1),
                           v[layer, lo:lo + m].permute(1, 0, 2, 3).reshape(1, v.shape[2], m * P, -1))
            self.end_step(step)
            lo += m

    def write(self, step: Step, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the open step's new K/V of one layer ([B, KVH, T, D]) without attending."""
        raise NotImplementedError(f"{type(self).__name__} cannot store without attending")

    def check(self) -> None:
        """Raise AssertionError when one of the cache's invariants does not hold."""


class ContiguousKVCache(KVCache):
    """One growing [KVH, S, D] tensor pair per (layer, sequence). The oracle."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self._k: dict[int, list[torch.Tensor | None]] = {}
        self._v: dict[int, list[torch.Tensor | None]] = {}
        self._len: dict[int, int] = {}
        self._next_id = 0

    def add_sequence(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self._k[sid] = [None] * self.spec.num_layers
        self._v[sid] = [None] * self.spec.num_layers
        self._len[sid] = 0
        return sid

    def free_sequence(self, seq_id: int) -> None:
        del self._k[seq_id], self._v[seq_id], self._len[seq_id]

    def length(self, seq_id: int) -> int:
        return self._len[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        for store in (self._k[seq_id], self._v[seq_id]):
            for layer, t in enumerate(store):
                if t is not None:
                    store[layer] = t[:, :length].clone()
        self._len[seq_id] = min(self._len[seq_id], length)

    def attend(self, step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for b, sid in enumerate(step.seq_ids):
            prev_k, prev_v = self._k[sid][layer], self._v[sid][layer]
            kb = k[b] if prev_k is None else torch.cat([prev_k, k[b]], dim=1)
            vb = v[b] if prev_v is None else torch.cat([prev_v, v[b]], dim=1)
            self._k[sid][layer], self._v[sid][layer] = kb, vb
            past = torch.tensor([step.past[b]], device=q.device)
            mask = causal_mask(past, step.num_new, kb.shape[1])
            outs.append(attention(q[b : b + 1], kb.unsqueeze(0), vb.unsqueeze(0), mask))
        return torch.cat(outs, dim=0)

    def end_step(self, step: Step) -> None:
        for sid in step.seq_ids:
            self._len[sid] += step.num_new

    def kv_bytes(self) -> int:
        total = 0
        for layers in (self._k, self._v):
            for per_layer in layers.values():
                total += sum(t.numel() * t.element_size() for t in per_layer if t is not None)
        return total

    def usage(self) -> KVUsage:
        n = self.kv_bytes()
        return KVUsage(sequences=len(self._len), device_pages=sum(self._len.values()), device_capacity=None,
                       device_bytes=n, token_bytes=n, sequence_refs=sum(self._len.values()), indexed_pages=0,
                       tier_bytes={"device": n})
