"""Page storage of one tier for all layers, with vectorized slot allocation.

* device and host tiers: torch tensors k, v [L, C, KVH, P, D] (the host pool is pinned
  when CUDA is present). Both live in host memory today: the device tier is a budget
  (GPU-resident pools do not exist yet);
* disk tier (T4): a numpy memory-mapped file laid out slot-major [C, L, 2, KVH, P, D],
  so that growing it appends to the file;
* the warm sub-tier of T2: one uint8 row per page, encoded with a KV codec.

``owner[l, c]`` is the page record stored in slot c of layer l, or -1 when free. Every pool
copies and restores its own contents (``snapshot`` / ``restore``: the cache's checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _rank_within_groups(groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each element, its rank among the elements of the same group (in input order),
    and the count per group."""
    counts = torch.bincount(groups, minlength=num_groups)
    order = torch.argsort(groups, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(groups)
    rank[order] = torch.arange(len(groups)) - starts[groups[order]]
    return rank, counts


class TierPool:
    def __init__(self, name: str, num_layers: int, kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, capacity: int | None, *, pin: bool = False, initial: int = 16) -> None:
        self.name, self.num_layers = name, num_layers
        self.page_shape = (kv_heads, page_size, head_dim)
        self.dtype, self.pin = dtype, pin
        self.max_capacity = capacity
        cap = capacity if capacity is not None else initial
        self.k = self._new(cap)
        self.v = self._new(cap)
        self.owner = torch.full((num_layers, cap), -1, dtype=torch.long)
        self.element_size = self.k.element_size()

    def _new(self, cap: int) -> torch.Tensor:
        t = torch.zeros((self.num_layers, cap, *self.page_shape), dtype=self.dtype)
        return t.pin_memory() if self.pin and torch.cuda.is_available() else t

    @property
    def capacity(self) -> int:
        return self.owner.shape[1]

    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V of one page in one layer."""
        return 2 * int(np.prod(self.page_shape)) * self.element_size

    def used(self) -> torch.Tensor:
        """Owned slots per layer [L]."""
        return (self.owner >= 0).sum(1)

    def free(self) -> torch.Tensor:
        return self.capacity - self.used()

    def _grow(self, needed: int) -> None:
        new = self.capacity
        while new < needed:
            new *= 2
        if self.max_capacity is not None:
            new = min(new, self.max_capacity)
        extra = new - self.capacity
        pad = self._new(extra)
        self.k = torch.cat([self.k, pad], dim=1)
        self.v = torch.cat([self.v, pad.clone()], dim=1)
        self.owner = torch.cat([self.owner, torch.full((self.num_layers, extra), -1, dtype=torch.long)], dim=1)

    def alloc(self, layers: torch.Tensor, records: torch.Tensor) -> torch.Tensor | None:
        """Slots for (layer, record) pairs, all or none: None when a layer lacks room."""
        if len(layers) == 0:
            return torch.empty(0, dtype=torch.long)
        rank, need = _rank_within_groups(layers, self.num_layers)
        short = need > self.free()
        if short.any():
            if self.max_capacity is not None and int((self.used() + need).max()) > self.max_capacity:
                return None
            self._grow(int((self.used() + need).max()))
        # the rank-th free slot of each layer, without sorting: number the free slots per row
        free = self.owner < 0
        fl, fc = free.nonzero(as_tuple=True)  # row-major: slots ascending within each layer
        frank = torch.cumsum(free, dim=1)[fl, fc] - 1
        by_rank = torch.full_like(self.owner, -1)
        by_rank[fl, frank] = fc
        slots = by_rank[layers, rank]
        self.owner[layers, slots] = records
        return slots

    def release(self, layers: torch.Tensor, slots: torch.Tensor) -> None:
        self.owner[layers, slots] = -1

    def read(self, layers: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layers, slots], self.v[layers, slots]

    def write(self, layers: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layers, slots] = k.to(self.k.device, self.dtype)
        self.v[layers, slots] = v.to(self.v.device, self.dtype)

    def snapshot(self) -> tuple:
        return self.k.clone(), self.v.clone(), self.owner.clone()

    def restore(self, state: tuple) -> None:
        k, v, owner = state
        self.k, self.v, self.owner = k.clone(), v.clone(), owner.clone()


class DiskPool(TierPool):
    """T4: pages in a memory-mapped file, slot-major so the file grows by appending."""

    def __init__(self, path: str | Path, num_layers: int, kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, *, initial: int = 64) -> None:
        self.name, self.num_layers = "T4", num_layers
        self.page_shape = (kv_heads, page_size, head_dim)
        self.dtype, self.max_capacity = dtype, None
        self.np_dtype = torch.empty(0, dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else np.uint16
        self.element_size = torch.empty(0, dtype=dtype).element_size()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.owner = torch.full((num_layers, 0), -1, dtype=torch.long)
        self.mm = None
        self._grow(initial)

    def _grow(self, needed: int) -> None:
        new = max(needed, 2 * self.capacity, 1)
        shape = (new, self.num_layers, 2, *self.page_shape)
        nbytes = int(np.prod(shape)) * np.dtype(self.np_dtype).itemsize
        if self.mm is not None:
            self.mm.flush()
            del self.mm
        with open(self.path, "ab") as fh:
            fh.truncate(nbytes)
        self.mm = np.memmap(self.path, dtype=self.np_dtype, mode="r+", shape=shape)
        extra = new - self.capacity
        self.owner = torch.cat([self.owner, torch.full((self.num_layers, extra), -1, dtype=torch.long)], dim=1)

    def _to_torch(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(arr))
        return t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t

    def read(self, layers: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.mm[slots.numpy(), layers.numpy()]  # [N, 2, KVH, P, D]
        return self._to_torch(data[:, 0]), self._to_torch(data[:, 1])

    def write(self, layers: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        def as_np(t: torch.Tensor) -> np.ndarray:
            t = t.detach().to("cpu", self.dtype).contiguous()
            return (t.view(torch.uint16) if self.dtype == torch.bfloat16 else t).numpy()

        self.mm[slots.numpy(), layers.numpy(), 0] = as_np(k)
        self.mm[slots.numpy(), layers.numpy(), 1] = as_np(v)

    def snapshot(self) -> tuple:
        return self.mm.copy(), self.owner.clone()

    def restore(self, state: tuple) -> None:
        data, owner = state
        if data.shape[0] != self.capacity:
            self._grow(data.shape[0])
        self.mm[: data.shape[0]] = data
        self.owner = owner.clone()

    def close(self) -> None:
        if self.mm is not None:
            self.mm.flush()
            del self.mm
            self.mm = None
        self.path.unlink(missing_ok=True)


class WarmPool(TierPool):
    """The warm sub-tier of T2: pages encoded with a KV codec (``tieredkv.plugins.codec``),
    one uint8 row of ``page_bytes`` per (layer, slot) in the documented byte layout
    (docs/codec.md). Fixed capacity (the bytes the device budget gives it).

    ``keep_decoded`` (a CPU evaluation aid, off by default): keep each warm page's decoded
    float32 copy beside its bytes, so attention decodes a page once instead of every step.
    Numerics are identical (decoding is deterministic); budgets and accounting count only the
    encoded bytes. A GPU kernel decodes on the fly instead."""

    def __init__(self, num_layers: int, codec, shape: tuple[int, int, int], capacity: int, *,
                 keep_decoded: bool = False) -> None:
        from tieredkv.plugins.codec import page_bytes

        self.name, self.num_layers = "warm", num_layers
        self.codec, self.shape = codec, shape
        self.page_shape = (page_bytes(codec, *shape),)
        self.dtype, self.pin = torch.uint8, False
        self.max_capacity = capacity
        self.data = self._new(capacity)
        self.owner = torch.full((num_layers, capacity), -1, dtype=torch.long)
        self.element_size = 1
        self.decoded = (torch.zeros(num_layers, capacity, *shape), torch.zeros(num_layers, capacity, *shape)) \
            if keep_decoded else None

    @property
    def page_bytes(self) -> int:
        """Bytes of one encoded page (K + V) of one layer, alignment included."""
        return self.page_shape[0]

    def _grow(self, needed: int) -> None:  # fixed capacity: alloc() returns None instead
        raise AssertionError("the warm pool does not grow")

    def read(self, layers: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K, V [N, KVH, P, D] float32."""
        from tieredkv.plugins.codec import decode_pages

        if self.decoded is None:
            return decode_pages(self.data[layers, slots], self.codec, self.shape)
        return self.decoded[0][layers, slots], self.decoded[1][layers, slots]

    def write(self, layers: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        from tieredkv.plugins.codec import decode_pages, encode_pages

        data = encode_pages(k, v, self.codec).to(self.data.device)
        self.data[layers, slots] = data
        if self.decoded is not None:
            self.decoded[0][layers, slots], self.decoded[1][layers, slots] = decode_pages(data, self.codec, self.shape)

    def snapshot(self) -> tuple:
        decoded = None if self.decoded is None else tuple(t.clone() for t in self.decoded)
        return self.data.clone(), self.owner.clone(), decoded

    def restore(self, state: tuple) -> None:
        data, owner, decoded = state
        self.data, self.owner = data.clone(), owner.clone()
        self.decoded = None if decoded is None else tuple(t.clone() for t in decoded)
