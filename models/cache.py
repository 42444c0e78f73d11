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
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q [B, H, T, D], k/v [B, KVH, S, D], mask bool [B, 1, T, S] (True = attend) or None.
    Returns [B, H, T, D] in q's dtype.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class KVCache(abc.ABC):
    """A store of per-sequence K/V that the model attends through (see module docstring)."""

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

    def max_step_tokens(self) -> int | None:
        """The most new tokens one forward call may bring (None: no limit)."""
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
