"""Paged KV cache: fixed-size pages in one pool for all layers, per-sequence page tables,
pages shared between sequences (prefix reuse) by reference count.

A page id names one page of P tokens in every layer (the pool is [L, C, KVH, P, D]), so a
sequence lists one page table for all its layers, and a full page can be listed by several
sequences and held by the prefix index: ``refs[p]`` counts them, and the page returns to the
free list with its last reference.

Invariants (checked by :meth:`PagedKVCache.check` and the property tests):
  * every page of the pool is either on the free list or referenced — never both, never
    neither; ``refs[p]`` equals the times p is listed over all sequences plus one while the
    prefix index holds it; an indexed page is a full page;
  * a sequence of length L lists ceil(L / page_size) pages, and those ``allocate_slots`` took
    for its next step (listed by it alone); the page being written (a partial last page) is
    listed by that sequence alone;
  * ``kv_bytes == pages in use * page_bytes`` and pages in use + free == capacity;
  * attention reads K/V only through the page table, and for a single sequence the
    gathered K/V are bit-identical to a contiguous cache's, so outputs match exactly.

"No room" is a return value (``PagePool.allocate`` returns ``None``, ``allocate_slots``
``False``); the cache turns it into :class:`KVCacheFullError` only when a step cannot proceed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tieredkv.errors import ConfigError, KVCacheFullError, short
from tieredkv.models.cache import (KVCache, KVSpec, KVUsage, Step, attention, causal_mask, gather_pages,
                                   pool_decode_attention, pool_rows, write_pool_rows)


@dataclass(frozen=True)
class PagedCacheConfig:
    """``page_size`` tokens per page; ``max_pages`` the most pages the pool holds (every layer
    has them; None: grow on demand, doubling); ``initial_pages`` allocated up front."""

    page_size: int = 16
    max_pages: int | None = None
    initial_pages: int = 64

    def __post_init__(self) -> None:
        from tieredkv.runtime.tiered.config import MAX_PAGE_SIZE

        if not _integer_in(self.page_size, 1, MAX_PAGE_SIZE):
            raise ConfigError(f"page_size must be an integer in [1, {MAX_PAGE_SIZE}], got {short(self.page_size)}")
        if self.max_pages is not None and not _integer_in(self.max_pages, 1, 1 << 40):
            raise ConfigError(f"max_pages must be a positive integer or None, got {short(self.max_pages)}")
        if not _integer_in(self.initial_pages, 1, 1 << 20):
            raise ConfigError(f"initial_pages must be an integer in [1, {1 << 20}], got {short(self.initial_pages)}")


def _integer_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


class PagePool:
    """K and V pages of every layer: [L, capacity, num_kv_heads, page_size, head_dim] each, with
    a reference count per page and a LIFO free list (a freed page is the next one handed out)."""

    def __init__(self, spec: KVSpec, page_size: int, capacity: int, max_pages: int | None) -> None:
        if max_pages is not None:
            capacity = min(capacity, max_pages)
        self.spec, self.page_size, self.max_pages = spec, page_size, max_pages
        shape = (spec.num_layers, capacity, spec.num_kv_heads, page_size, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.refs = [0] * capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V of one page in one layer."""
        return 2 * self.k[0, 0].numel() * self.k.element_size()

    def free_pages(self) -> list[int]:
        return list(self._free)

    def _grow(self, needed: int) -> bool:
        old = self.capacity
        new = max(old * 2, needed)
        if self.max_pages is not None:
            new = min(new, self.max_pages)
        if new < needed or new <= old:
            return False
        pad = (self.k.shape[0], new - old, *self.k.shape[2:])
        self.k = torch.cat([self.k, torch.zeros(pad, dtype=self.k.dtype, device=self.k.device)], dim=1)
        self.v = torch.cat([self.v, torch.zeros(pad, dtype=self.v.dtype, device=self.v.device)], dim=1)
        self.refs += [0] * (new - old)
        self._free = list(range(new - 1, old - 1, -1)) + self._free
        return True

    def reserve(self, pages: int) -> None:
        """Storage for ``pages`` pages now (grown as :meth:`allocate` would grow it, within
        ``max_pages``), so that a later allocation does not copy the pool."""
        if self.max_pages is not None:
            pages = min(pages, self.max_pages)
        if pages > self.capacity:
            self._grow(pages)

    def allocate(self, n: int = 1) -> list[int] | None:
        """``n`` free pages (one reference each), or None — and nothing taken — when the pool is
        at ``max_pages`` without that many free."""
        if len(self._free) < n and not self._grow(self.capacity - len(self._free) + n):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def ref(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def unref(self, pages: Sequence[int]) -> None:
        """Drop one reference of each page; a page without references is free again."""
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)


class PagedKVCache(KVCache):
    """See module docstring. One page table per sequence, shared by its layers."""

    def __init__(self, spec: KVSpec, config: PagedCacheConfig | None = None) -> None:
        self.spec = spec
        self.config = config or PagedCacheConfig()
        c = self.config
        self.pool = PagePool(spec, c.page_size, c.initial_pages, c.max_pages)
        self.tables: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}
        self._indexed: set[int] = set()  # pages the prefix index holds
        self._expected: dict[int, int] = {}  # pages each sequence expects to list (``expect``)
        self._next_id = 0
        self._step: _PagedStep | None = None

    @property
    def page_size(self) -> int:
        return self.config.page_size

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, *, shared: Sequence[int] = ()) -> int:
        """A new sequence; ``shared``: full pages it starts with (prefix-index hits, in logical
        order) — it then has ``len(shared) * page_size`` tokens."""
        shared = list(shared)
        if any(not 0 <= p < self.pool.capacity or self.pool.refs[p] < 1 for p in shared):
            raise ValueError("shared pages must be live full pages")
        sid = self._next_id
        self._next_id += 1
        self.pool.ref(shared)
        self.tables[sid] = shared
        self._len[sid] = len(shared) * self.page_size
        return sid

    def free_sequence(self, seq_id: int) -> None:
        self.pool.unref(self.tables.pop(seq_id))
        del self._len[seq_id]
        self._expected.pop(seq_id, None)

    def expect(self, seq_id: int, tokens: int) -> None:
        """Grow the pool now (doubling, within ``max_pages``) to the pages in use plus what every
        live sequence still expects to list."""
        self._expected[seq_id] = -(-tokens // self.page_size)
        more = sum(max(0, n - len(self.tables[s])) for s, n in self._expected.items())
        self.pool.reserve(self.pool.capacity - self.pool.num_free + more)

    def length(self, seq_id: int) -> int:
        return self._len[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        P, table = self.page_size, self.tables[seq_id]
        keep = -(-length // P)
        self.pool.unref(table[keep:])
        del table[keep:]
        self._len[seq_id] = min(self._len[seq_id], length)
        if table and self._len[seq_id] % P and self.pool.refs[table[-1]] > 1:  # copy on write
            (copy,) = self._allocate(1, f"sequence {seq_id}'s private copy of a shared page")
            self.pool.k[:, copy], self.pool.v[:, copy] = self.pool.k[:, table[-1]], self.pool.v[:, table[-1]]
            self.pool.unref([table[-1]])
            table[-1] = copy

    @property
    def sequences(self) -> list[int]:
        return list(self.tables)

    def _allocate(self, n: int, what: str) -> list[int]:
        pages = self.pool.allocate(n)
        if pages is None:
            raise KVCacheFullError(f"all {self.pool.capacity} pages are in use (max_pages {self.config.max_pages}); "
                                   f"{what} needs {n} more page(s) of {self.page_size} tokens. Raise max_pages or free "
                                   "sequences.")
        return pages

    # ------------------------------------------------------------------ storage
    def allocate_slots(self, seq_ids: Sequence[int], num_new: int) -> bool:
        """The pages every sequence needs for ``num_new`` more tokens, all or nothing."""
        need = {s: -(-(self._len[s] + num_new) // self.page_size) - len(self.tables[s]) for s in seq_ids}
        total = sum(max(0, n) for n in need.values())
        if total == 0:
            return True
        pages = self.pool.allocate(total)
        if pages is None:
            return False
        for s, n in need.items():
            if n > 0:
                self.tables[s] += pages[:n]
                pages = pages[n:]
        return True

    def begin_step(self, seq_ids, num_new: int) -> Step:
        """Reserve the pages every sequence needs for the step, all or nothing: when the pool runs
        out, nothing is taken and the cache is left as it was."""
        step = super().begin_step(seq_ids, num_new)
        if not self.allocate_slots(step.seq_ids, num_new):
            raise KVCacheFullError(
                f"all {self.pool.capacity} pages are in use (max_pages {self.config.max_pages}); the step's "
                f"{len(step.seq_ids)} sequence(s) need more pages of {self.page_size} tokens. Raise max_pages or free "
                "sequences.")
        self._step = _PagedStep.of(self, step)
        return step

    def write(self, step: Step, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter the new tokens' K/V [B, KVH, T, D] into their page slots."""
        s = self._step
        pool_k, pool_v = self.pool.k[layer], self.pool.v[layer]
        # k[b, :, t] for every (b, t) in order is [B * T, KVH, D]; pool[page, :, offset] addresses the same shape
        kt, vt = (x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1]) for x in (k, v))
        if write_pool_rows(pool_k, pool_v, s.write_rows, kt, vt):  # one row copy per (token, kv head)
            return
        pool_k[s.write_pages, :, s.write_offsets] = kt
        pool_v[s.write_pages, :, s.write_offsets] = vt

    def gather(self, layer: int, seq_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [B, KVH, S, D] of whole pages (S = max pages * page_size, zero padded) and the
        lengths [B]. Reads only through the page tables."""
        tables = [self.tables[s] for s in seq_ids]
        width = max(len(t) for t in tables)
        idx = torch.tensor([t + t[-1:] * (width - len(t)) for t in tables], device=self.pool.k.device)
        k, v = _gather(self.pool.k[layer], idx), _gather(self.pool.v[layer], idx)
        return k, v, torch.tensor([self._len[s] for s in seq_ids])

    def attend(self, step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write(step, layer, k, v)
        s = self._step
        if s.allowed is not None:
            out = pool_decode_attention(q, self.pool.k[layer], self.pool.v[layer], s.read_pages, s.allowed)
            if out is not None:
                return out
        keys, values = _gather(self.pool.k[layer], s.read_pages), _gather(self.pool.v[layer], s.read_pages)
        keys, values = keys[:, :, : s.max_len], values[:, :, : s.max_len]
        return attention(q, keys, values, s.mask)

    def end_step(self, step: Step) -> None:
        for sid in step.seq_ids:
            self._len[sid] += step.num_new
        self._step = None

    # ------------------------------------------------------------------ accounting
    def pages_in_use(self) -> int:
        return self.pool.capacity - self.pool.num_free

    def kv_bytes(self) -> int:
        """Bytes of the pages held by sequences and the prefix index (what the cache needs, not what
        it reserved)."""
        return self.pages_in_use() * self.pool.page_bytes * self.spec.num_layers

    def reserved_bytes(self) -> int:
        return self.pool.capacity * self.pool.page_bytes * self.spec.num_layers

    def check(self) -> None:
        pool, P = self.pool, self.page_size
        listed = [0] * pool.capacity
        for sid, table in self.tables.items():
            n = -(-self._len[sid] // P)
            assert len(table) >= n, f"sequence {sid}: fewer pages than its length needs"
            assert all(pool.refs[p] == 1 for p in table[n:]), f"sequence {sid}: a page allocated ahead is shared"
            for p in table:
                listed[p] += 1
            if n and self._len[sid] % P:
                assert pool.refs[table[n - 1]] == 1, f"sequence {sid}: the page being written is shared"
        for p in self._indexed:
            listed[p] += 1
        assert listed == pool.refs, "reference counts disagree with the page tables and the prefix index"
        free = pool.free_pages()
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert sorted(free) == [p for p in range(pool.capacity) if pool.refs[p] == 0], "the free list is not the " \
                                                                                       "unreferenced pages"
        assert pool.max_pages is None or pool.capacity <= pool.max_pages, "the pool grew past max_pages"

    # ------------------------------------------------------------------ the serving interface
    @property
    def device_capacity(self) -> int | None:
        return self.config.max_pages

    @property
    def shares_pages(self) -> bool:
        return True

    def usage(self) -> KVUsage:
        P, per_page = self.page_size, self.pool.page_bytes * self.spec.num_layers
        full = set(self._indexed)  # shared pages are full pages: count each once
        partial = 0
        for sid, table in self.tables.items():
            n = self._len[sid] // P
            full.update(table[:n])
            partial += self._len[sid] - n * P
        used = self.pages_in_use()
        return KVUsage(sequences=len(self.tables), device_pages=used, device_capacity=self.config.max_pages,
                       device_bytes=used * per_page, token_bytes=(len(full) * P + partial) * per_page // P,
                       sequence_refs=sum(len(t) for t in self.tables.values()), indexed_pages=len(self._indexed),
                       tier_bytes={"device": used * per_page})

    def pages_of(self, seq_id: int) -> list[int]:
        return list(self.tables[seq_id])

    def hold_pages(self, pages: Sequence[int]) -> None:
        pages = list(pages)
        if any(p in self._indexed or self.pool.refs[p] < 1 for p in pages):
            raise ValueError("the prefix index holds live pages, once each")
        self._indexed.update(pages)
        self.pool.ref(pages)

    def drop_pages(self, pages: Sequence[int]) -> None:
        pages = list(pages)
        if any(p not in self._indexed for p in pages):
            raise ValueError("the prefix index lets go only of pages it holds")
        self._indexed.difference_update(pages)
        self.pool.unref(pages)

    def page_refs(self, pages: Sequence[int]) -> list[int]:
        return [self.pool.refs[p] for p in pages]

    def pages_indexed(self, pages: Sequence[int]) -> list[bool]:
        return [p in self._indexed for p in pages]

    def page_tiers(self, pages: Sequence[int]) -> list[str]:
        return ["device"] * len(pages)

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.pool.k.device)
        return self.pool.k.index_select(1, idx).cpu(), self.pool.v.index_select(1, idx).cpu()


@dataclass(frozen=True)
class _PagedStep:
    """What every layer of a step reads, built once: where the new tokens go, each sequence's
    pages to gather (padded with a real page), the causal mask."""

    write_pages: torch.Tensor  # [B * T]
    write_offsets: torch.Tensor  # [B * T]
    write_rows: torch.Tensor  # [B * T * KVH]: the same places as rows of a layer's pool viewed [C * KVH * P, D]
    read_pages: torch.Tensor  # [B, max pages]
    max_len: int
    mask: torch.Tensor  # [B, 1, T, max_len]
    allowed: torch.Tensor | None  # a decode step's keys by page slot: [B, max pages * P], True below each length

    @classmethod
    def of(cls, cache: PagedKVCache, step: Step) -> "_PagedStep":
        P, dev = cache.page_size, cache.pool.k.device
        tables = [cache.tables[s] for s in step.seq_ids]
        pos = torch.tensor(step.past).unsqueeze(1) + torch.arange(step.num_new)  # [B, T]
        width = max(len(t) for t in tables)
        pages = torch.tensor([t + t[-1:] * (width - len(t)) for t in tables])
        max_len = max(step.past) + step.num_new
        past = torch.tensor(step.past, device=dev)
        allowed = None
        if step.num_new == 1:
            allowed = torch.arange(width * P, device=dev).view(1, -1) <= past.view(-1, 1)
        write_pages, write_offsets = pages.gather(1, pos // P).flatten(), (pos % P).flatten()
        rows = pool_rows(write_pages, write_offsets, cache.pool.k.shape[2], P)
        return cls(write_pages.to(dev), write_offsets.to(dev), rows.to(dev), pages.to(dev), max_len,
                   causal_mask(past, step.num_new, max_len), allowed)


def _gather(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Pages [B, M] of one layer's pool [C, KVH, P, D] as [B, KVH, M * P, D]."""
    b, m = pages.shape
    return gather_pages(pool, pages).view(b, pool.shape[1], m * pool.shape[2], pool.shape[3])
