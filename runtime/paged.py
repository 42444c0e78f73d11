"""Paged KV cache: fixed-size pages, one page pool per layer, per-sequence page tables.

Invariants (checked by the property tests):
  * every page of a pool is either on its free list or in exactly one sequence's page
    table for that layer — never both, never neither;
  * a sequence of length L holds exactly ceil(L / page_size) pages in every layer;
  * ``allocated_bytes == pages in use * page_bytes`` and pages in use + free == capacity;
  * attention reads K/V only through the page table, and for a single sequence the
    gathered K/V are bit-identical to a contiguous cache's, so outputs match exactly.

"No room" is a return value at the pool (``PagePool.allocate`` returns ``None``); the
cache turns it into :class:`KVCacheFullError` only when a step cannot proceed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tieredkv.errors import ConfigError, KVCacheFullError, short
from tieredkv.models.cache import KVCache, KVSpec, Step, attention, causal_mask


@dataclass(frozen=True)
class PagedCacheConfig:
    """``page_size`` tokens per page; ``max_pages`` per layer (None: grow on demand,
    doubling); ``initial_pages`` per layer allocated up front."""

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
    """K and V storage of one layer: [capacity, num_kv_heads, page_size, head_dim] each,
    with a LIFO free list (a freed page is the next one handed out)."""

    def __init__(self, spec: KVSpec, page_size: int, capacity: int, max_pages: int | None) -> None:
        if max_pages is not None:
            capacity = min(capacity, max_pages)
        self.spec, self.page_size, self.max_pages = spec, page_size, max_pages
        shape = (capacity, spec.num_kv_heads, page_size, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        return 2 * self.k[0].numel() * self.k.element_size()

    def free_pages(self) -> list[int]:
        return list(self._free)

    def _grow(self) -> bool:
        old = self.capacity
        new = old * 2 if self.max_pages is None else min(old * 2, self.max_pages)
        if new <= old:
            return False
        pad = (new - old, *self.k.shape[1:])
        self.k = torch.cat([self.k, torch.zeros(pad, dtype=self.k.dtype, device=self.k.device)])
        self.v = torch.cat([self.v, torch.zeros(pad, dtype=self.v.dtype, device=self.v.device)])
        self._free = list(range(new - 1, old - 1, -1)) + self._free
        return True

    def allocate(self) -> int | None:
        """A free page id, or None when the pool is at ``max_pages`` and full."""
        if not self._free and not self._grow():
            return None
        return self._free.pop()

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class PagedKVCache(KVCache):
    """See module docstring. Page tables are per (layer, sequence)."""

    def __init__(self, spec: KVSpec, config: PagedCacheConfig | None = None) -> None:
        self.spec = spec
        self.config = config or PagedCacheConfig()
        c = self.config
        self.pools = [PagePool(spec, c.page_size, c.initial_pages, c.max_pages) for _ in range(spec.num_layers)]
        self.tables: dict[int, list[list[int]]] = {}
        self._len: dict[int, list[int]] = {}
        self._next_id = 0

    @property
    def page_size(self) -> int:
        return self.config.page_size

    # ------------------------------------------------------------------ sequences
    def add_sequence(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self.tables[sid] = [[] for _ in range(self.spec.num_layers)]
        self._len[sid] = [0] * self.spec.num_layers
        return sid

    def free_sequence(self, seq_id: int) -> None:
        for layer, pages in enumerate(self.tables.pop(seq_id)):
            self.pools[layer].free(pages)
        del self._len[seq_id]

    def length(self, seq_id: int) -> int:
        return self._len[seq_id][-1]

    def truncate(self, seq_id: int, length: int) -> None:
        keep = -(-length // self.page_size)
        for layer, table in enumerate(self.tables[seq_id]):
            self.pools[layer].free(table[keep:])
            del table[keep:]
            self._len[seq_id][layer] = min(self._len[seq_id][layer], length)

    @property
    def sequences(self) -> list[int]:
        return list(self.tables)

    # ------------------------------------------------------------------ storage
    def begin_step(self, seq_ids, num_new: int) -> Step:
        """Reserve the pages every layer of every sequence needs for the step, all or
        nothing: when a pool runs out, the pages taken so far are returned and the
        cache is left as it was."""
        step = super().begin_step(seq_ids, num_new)
        taken: list[tuple[int, int, int]] = []  # (layer, seq, page)
        for sid, past in zip(step.seq_ids, step.past):
            need = -(-(past + num_new) // self.page_size)
            for layer, pool in enumerate(self.pools):
                table = self.tables[sid][layer]
                while len(table) < need:
                    page = pool.allocate()
                    if page is None:
                        for lyr, s, pg in reversed(taken):
                            self.tables[s][lyr].pop()
                            self.pools[lyr].free([pg])
                        raise KVCacheFullError(
                            f"layer {layer}: all {pool.capacity} pages are in use; sequence {sid} needs "
                            f"{need - len(table)} more page(s) of {self.page_size} tokens. Raise max_pages "
                            "or free sequences."
                        )
                    table.append(page)
                    taken.append((layer, sid, page))
        return step

    def _write(self, layer: int, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter the new tokens' K/V [B, KVH, T, D] into their page slots."""
        pool, ps = self.pools[layer], self.page_size
        pages, offs, rows, cols = [], [], [], []
        for b, sid in enumerate(step.seq_ids):
            start = self._len[sid][layer]
            table = self.tables[sid][layer]
            for t in range(step.num_new):
                pos = start + t
                pages.append(table[pos // ps])
                offs.append(pos % ps)
                rows.append(b)
                cols.append(t)
            self._len[sid][layer] = start + step.num_new
        dev = pool.k.device
        p, o = torch.tensor(pages, device=dev), torch.tensor(offs, device=dev)
        r, c = torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)
        # k[r, :, c] is [N, KVH, D]; pool.k[p, :, o] addresses the same shape.
        pool.k[p, :, o] = k[r, :, c]
        pool.v[p, :, o] = v[r, :, c]

    def gather(self, layer: int, seq_ids: tuple[int, ...] | list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [B, KVH, S, D] of whole pages (S = max pages * page_size, zero padded) and
        the lengths [B]. Reads only through the page tables."""
        pool = self.pools[layer]
        tables = [self.tables[s][layer] for s in seq_ids]
        max_pages = max(len(t) for t in tables)
        idx = torch.tensor([t + [t[-1]] * (max_pages - len(t)) for t in tables],  # pad with a real page id
                           device=pool.k.device)
        b = len(tables)
        k = pool.k[idx].permute(0, 2, 1, 3, 4).reshape(b, self.spec.num_kv_heads, max_pages * self.page_size, -1)
        v = pool.v[idx].permute(0, 2, 1, 3, 4).reshape(b, self.spec.num_kv_heads, max_pages * self.page_size, -1)
        lengths = torch.tensor([self._len[s][layer] for s in seq_ids])  # host: read by Python
        return k, v, lengths

    def attend(self, step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._write(layer, step, k, v)
        keys, values, lengths = self.gather(layer, step.seq_ids)
        max_len = int(lengths.max())
        keys, values = keys[:, :, :max_len], values[:, :, :max_len]
        mask = causal_mask(torch.tensor(step.past, device=q.device), step.num_new, max_len)
        return attention(q, keys, values, mask)

    # ------------------------------------------------------------------ accounting
    def pages_in_use(self, layer: int | None = None) -> int:
        layers = range(self.spec.num_layers) if layer is None else [layer]
        return sum(self.pools[i].capacity - self.pools[i].num_free for i in layers)

    def kv_bytes(self) -> int:
        """Bytes of the pages held by sequences (what the cache needs, not what it reserved)."""
        return self.pages_in_use() * self.pools[0].page_bytes

    def reserved_bytes(self) -> int:
        return sum(p.capacity for p in self.pools) * self.pools[0].page_bytes
