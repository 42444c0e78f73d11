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

import json
import os
import secrets
import weakref
from pathlib import Path

import numpy as np
import torch

from tieredkv.errors import ConfigError
from tieredkv.lifecycle import pid_alive


def _rank_within_groups(groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each element, its rank among the elements of the same group (in input order),
    and the count per group."""
    counts = torch.bincount(groups, minlength=num_groups)
    order = torch.argsort(groups, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(groups)
    rank[order] = torch.arange(len(groups)) - starts[groups[order]]
    return rank, counts


def _rows(store: torch.Tensor, layers: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool's [L, C, ...] tensor as [L * C, ...] rows, and the rows of the (layer, slot) pairs."""
    return store.view(-1, *store.shape[2:]), (layers * store.shape[1] + slots).to(store.device)


def _take(store: torch.Tensor, layers: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``store[layers, slots]`` of a pool's [L, C, ...] tensor as one ``index_select`` over its
    (layer, slot) rows: 2.5x faster on this CPU than the two-tensor advanced index."""
    flat, rows = _rows(store, layers, slots)
    return flat.index_select(0, rows)


def _put(store: torch.Tensor, layers: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``store[layers, slots] = values`` as one ``index_copy_`` over the (layer, slot) rows (distinct
    pairs): the writing twin of :func:`_take`."""
    flat, rows = _rows(store, layers, slots)
    flat.index_copy_(0, rows, values.to(store.device, store.dtype))


class TierPool:
    """``capacity``: the most pages per layer the pool may hold (None: no limit). Slots are
    allocated as they are needed (doubling, from ``initial``), never more than that: a budget
    costs memory only when the work fills it."""

    #: the tensors holding the pages, [L, C, ...] each, grown together
    STORES = ("k", "v")

    def __init__(self, name: str, num_layers: int, kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, capacity: int | None, *, pin: bool = False, initial: int = 16,
                 device: str | torch.device = "cpu") -> None:
        self.name, self.num_layers = name, num_layers
        self.page_shape = (kv_heads, page_size, head_dim)
        self.dtype, self.pin = dtype, pin
        self.device = torch.device(device)  # where the pages live; the bookkeeping stays on the host
        self.max_capacity = capacity
        cap = initial if capacity is None else min(capacity, initial)
        self.k = self._new(cap)
        self.v = self._new(cap)
        self.owner = torch.full((num_layers, cap), -1, dtype=torch.long)
        self.element_size = self.k.element_size()

    def _new(self, cap: int) -> torch.Tensor:
        t = torch.zeros((self.num_layers, cap, *self.page_shape), dtype=self.dtype, device=self.device)
        # host pages a GPU copies from: page-locked, so host->device copies run asynchronously
        return t.pin_memory() if self.pin and self.device.type == "cpu" and torch.cuda.is_available() else t

    @property
    def capacity(self) -> int:
        return self.owner.shape[1]

    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V of one page in one layer."""
        return 2 * int(np.prod(self.page_shape)) * self.element_size

    @property
    def owner(self) -> torch.Tensor:
        """[L, C]: the record each slot holds, -1 where it is free. Change it through
        :meth:`alloc` / :meth:`release` (or assign a whole new table): a write into it in place
        would leave :meth:`used` stale (``check_invariants`` compares the two)."""
        return self._owner

    @owner.setter
    def owner(self, value: torch.Tensor) -> None:
        self._owner, self._used = value, None

    def used(self) -> torch.Tensor:
        """Owned slots per layer [L]: counted when the owners were set, then kept by :meth:`alloc`
        (a release counts them again on the next call)."""
        if self._used is None:
            self._used = torch.count_nonzero(self._owner >= 0, dim=1)
        return self._used.clone()

    def free(self) -> torch.Tensor:
        """Slots per layer that may still be taken [L]: up to the capacity of a bounded pool
        (allocated or not yet), the allocated ones of a pool without a limit."""
        return (self.capacity if self.max_capacity is None else self.max_capacity) - self.used()

    def _grow(self, needed: int) -> None:
        new = max(1, self.capacity)
        while new < needed:
            new *= 2
        if self.max_capacity is not None:
            new = min(new, self.max_capacity)
        extra = new - self.capacity
        for name in self.STORES:
            setattr(self, name, torch.cat([getattr(self, name), self._new(extra)], dim=1))
        self.owner = torch.cat([self.owner, torch.full((self.num_layers, extra), -1, dtype=torch.long)], dim=1)

    def reserve(self, pages: int) -> None:
        """Slots for ``pages`` pages per layer now (at most the capacity limit), grown as
        :meth:`alloc` would grow them, so that a later ``alloc`` does not copy the pool."""
        if self.max_capacity is not None:
            pages = min(pages, self.max_capacity)
        if pages > self.capacity:
            self._grow(pages)

    def alloc(self, layers: torch.Tensor, records: torch.Tensor) -> torch.Tensor | None:
        """Slots for (layer, record) pairs, all or none: None when a layer lacks room."""
        if len(layers) == 0:
            return torch.empty(0, dtype=torch.long)
        rank, need = _rank_within_groups(layers, self.num_layers)
        used = self.used() + need
        total = int(used.max())
        if self.max_capacity is not None and total > self.max_capacity:
            return None
        if total > self.capacity:
            self._grow(total)
        # the rank-th free slot of each layer, without sorting: number the free slots per row
        free = self.owner < 0
        counted = torch.cumsum(free, dim=1)  # free slots up to and including each slot
        k = int(rank.max()) + 1
        if k * 32 <= self.capacity:  # a few per layer (a decode step's moves): the free slot numbered j + 1
            by_rank = torch.searchsorted(counted, torch.arange(1, k + 1).expand(self.num_layers, k).contiguous())
        else:  # many (a prompt's pages): every free slot by its number
            fl, fc = free.nonzero(as_tuple=True)  # row-major: slots ascending within each layer
            by_rank = torch.full_like(self.owner, -1)
            by_rank[fl, counted[fl, fc] - 1] = fc
        slots = by_rank[layers, rank]
        self._owner[layers, slots] = records
        self._used = used  # (distinct free slots: the count is exact)
        return slots

    def release(self, layers: torch.Tensor, slots: torch.Tensor) -> None:
        self._owner[layers, slots] = -1
        self._used = None  # (a pair may repeat or already be free: counted again when asked)

    def set_used(self, used: torch.Tensor) -> None:
        """The owned slots per layer [L], counted by whoever changed the owner table in place (an op
        of the CPU extension)."""
        self._used = used

    def read(self, layers: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _take(self.k, layers, slots), _take(self.v, layers, slots)

    def write(self, layers: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _put(self.k, layers, slots, k)
        _put(self.v, layers, slots, v)

    def snapshot(self) -> tuple:
        return self.k.clone(), self.v.clone(), self.owner.clone()

    def restore(self, state: tuple) -> None:
        k, v, owner = state
        self.k, self.v, self.owner = k.clone(), v.clone(), owner.clone()


#: the first bytes of every T4 file: a magic line, then JSON {"pid": ...}, padded to HEADER_BYTES
T4_MAGIC = b"TIEREDKV-T4 1\n"
HEADER_BYTES = 4096
T4_PATTERN = "tieredkv-t4-*.kv"


def _t4_owner(path: Path) -> int | None:
    """The pid recorded in a T4 file's header, or None when ``path`` is not a T4 file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(HEADER_BYTES)
        if not head.startswith(T4_MAGIC):
            return None
        return int(json.loads(head[len(T4_MAGIC):].rstrip(b"\0 \n"))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_stale_t4_files(directory: Path) -> list[Path]:
    """Remove the T4 files in ``directory`` left by processes that are gone (killed before they
    could remove their own); returns them."""
    removed = []
    for f in directory.glob(T4_PATTERN):
        pid = _t4_owner(f)
        if pid is not None and not pid_alive(pid) and not f.is_symlink():
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


def create_t4_file(path: str | Path) -> Path:
    """Create the private file of a T4 tier, exclusively: ``path`` is a directory (a new file
    ``tieredkv-t4-<pid>-<random>.kv`` inside it) or the name of a file that does not exist yet
    (its directory is created when missing). Never an existing file, never through a symbolic
    link; mode 0600; a header records the owner's pid. A T4 file at the same place left by a
    process that no longer runs is removed first. ConfigError otherwise."""
    p = Path(path).expanduser()
    if p.is_dir():
        remove_stale_t4_files(p)
        target = p / f"tieredkv-t4-{os.getpid()}-{secrets.token_hex(6)}.kv"
    else:
        target = p
        if p.is_symlink():
            raise ConfigError(f"disk_path {p} is a symbolic link; tieredkv never writes through one: give a new file "
                              "name or a directory")
        if p.exists():
            pid = _t4_owner(p)
            if pid is None or pid_alive(pid):
                why = "a file of someone else's" if pid is None else f"the T4 file of running process {pid}"
                raise ConfigError(f"disk_path {p} exists ({why}); tieredkv creates its own file and never overwrites "
                                  "one: give a new file name or a directory")
            p.unlink()  # the T4 file of a killed run
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"disk_path {p}: cannot create its directory ({exc.strerror})") from None
    try:
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise ConfigError(f"disk_path {target}: cannot create the T4 file ({exc.strerror})") from None
    with os.fdopen(fd, "wb") as fh:
        header = T4_MAGIC + json.dumps({"pid": os.getpid()}).encode() + b"\n"
        fh.write(header.ljust(HEADER_BYTES, b"\0"))
    return target


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


class DiskPool(TierPool):
    """T4: pages in a memory-mapped file, slot-major so the file grows by appending, after a
    header. The file is private (``create_t4_file``) and removed when the pool closes, when it
    is garbage-collected, and at interpreter exit (the CLI turns SIGTERM into an exit); a file
    a killed process (SIGKILL) left is removed the next time a T4 file is made at that place."""

    def __init__(self, path: str | Path, num_layers: int, kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, *, initial: int = 64) -> None:
        self.name, self.num_layers = "T4", num_layers
        self.page_shape = (kv_heads, page_size, head_dim)
        self.dtype, self.max_capacity, self.device = dtype, None, torch.device("cpu")
        self.np_dtype = torch.empty(0, dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else np.uint16
        self.element_size = torch.empty(0, dtype=dtype).element_size()
        self.path = create_t4_file(path)
        self._remove = weakref.finalize(self, _unlink, self.path)
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
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, HEADER_BYTES + nbytes)
        finally:
            os.close(fd)
        self.mm = np.memmap(self.path, dtype=self.np_dtype, mode="r+", shape=shape, offset=HEADER_BYTES)
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
            del self.mm
            self.mm = None
        self._remove()


class WarmPool(TierPool):
    """The warm sub-tier of T2: pages encoded with a KV codec (``tieredkv.plugins.codec``),
    one uint8 row of ``page_bytes`` per (layer, slot) in the documented byte layout
    (docs/codec.md). Fixed capacity (the bytes the device budget gives it).

    ``keep_decoded`` (a CPU evaluation aid, off by default): keep each warm page's decoded
    float32 copy beside its bytes, so attention decodes a page once instead of every step.
    Numerics are identical (decoding is deterministic); budgets and accounting count only the
    encoded bytes. A GPU kernel decodes on the fly instead.

    ``device``: where the encoded pages live — the device tier's device (on a GPU the warm
    pages are device memory, encoded and decoded there by the codec's torch reference; the
    owner table stays on the host)."""

    STORES = ("data",)

    def __init__(self, num_layers: int, codec, shape: tuple[int, int, int], capacity: int, *,
                 keep_decoded: bool = False, initial: int = 16, device: torch.device | str = "cpu") -> None:
        from tieredkv.plugins.codec import page_bytes

        self.name, self.num_layers = "warm", num_layers
        self.codec, self.shape = codec, shape
        self.page_shape = (page_bytes(codec, *shape),)
        self.dtype, self.pin, self.device = torch.uint8, False, torch.device(device)
        self.max_capacity = capacity
        cap = min(capacity, initial)
        self.data = self._new(cap)
        self.owner = torch.full((num_layers, cap), -1, dtype=torch.long)
        self.element_size = 1
        self.decoded = (self._decoded(cap), self._decoded(cap)) if keep_decoded else None

    def _decoded(self, cap: int) -> torch.Tensor:
        return torch.zeros(self.num_layers, cap, *self.shape, device=self.device)

    @property
    def page_bytes(self) -> int:
        """Bytes of one encoded page (K + V) of one layer, alignment included."""
        return self.page_shape[0]

    def _grow(self, needed: int) -> None:
        old = self.capacity
        super()._grow(needed)
        if self.decoded is not None:
            extra = self._decoded(self.capacity - old)
            self.decoded = tuple(torch.cat([t, extra], dim=1) for t in self.decoded)

    def read(self, layers: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K, V [N, KVH, P, D] float32 (keys may be a strided view: the reader copies them)."""
        from tieredkv.plugins.codec import decode_pages

        if self.decoded is None:
            return decode_pages(_take(self.data, layers, slots), self.codec, self.shape, contiguous=False)
        return _take(self.decoded[0], layers, slots), _take(self.decoded[1], layers, slots)

    def write(self, layers: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        from tieredkv.models.cache import encode_warm_pages
        from tieredkv.plugins.codec import decode_pages

        data = encode_warm_pages(k.to(self.device), v.to(self.device), self.codec)  # encoded where the warm pages live
        _put(self.data, layers, slots, data)
        if self.decoded is not None:
            for store, values in zip(self.decoded, decode_pages(data, self.codec, self.shape)):
                _put(store, layers, slots, values)

    #: rungs of precision (a :class:`WarmLadder` has several)
    num_rungs = 1

    def bytes_used(self) -> int:
        """Bytes of the encoded pages held now, every layer."""
        return int(self.used().sum()) * self.page_bytes

    def page_bytes_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Bytes of the page each slot holds."""
        return torch.full_like(slots, self.page_bytes)

    def snapshot(self) -> tuple:
        decoded = None if self.decoded is None else tuple(t.clone() for t in self.decoded)
        return self.data.clone(), self.owner.clone(), decoded

    def restore(self, state: tuple) -> None:
        data, owner, decoded = state
        self.data, self.owner = data.clone(), owner.clone()
        self.decoded = None if decoded is None else tuple(t.clone() for t in decoded)


class WarmLadder:
    """The warm sub-tier as a ladder of rungs of falling precision (``warm.ladder``): one
    :class:`WarmPool` per rung, each with its codec and the pages its share of the warm bytes
    pays for. Which rung holds a page is the manager's choice (``WarmTier.demote`` grades the
    warm pages by priority); the ladder stores them. Slots are numbered across the rungs: rung
    r's slot s is ``offsets[r] + s`` (``offsets``: the capacities of the rungs above), so the
    page table keeps one warm slot per page and the rung follows from it. The same interface as
    a single :class:`WarmPool`; ``codec`` is the top rung's."""

    name = "warm"

    def __init__(self, num_layers: int, codecs, shape: tuple[int, int, int], capacities, *,
                 keep_decoded: bool = False, device: torch.device | str = "cpu") -> None:
        self.rungs = [WarmPool(num_layers, c, shape, cap, keep_decoded=keep_decoded, device=device)
                      for c, cap in zip(codecs, capacities)]
        self.num_layers, self.shape, self.codec = num_layers, shape, self.rungs[0].codec
        self.num_rungs = len(self.rungs)
        self.capacities = torch.tensor([r.max_capacity for r in self.rungs])
        self.offsets = torch.cumsum(self.capacities, 0) - self.capacities
        self.max_capacity = int(self.capacities.sum())
        self.device = self.rungs[0].device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the top rung (the most a warm page takes)."""
        return self.rungs[0].page_bytes

    def rung_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The rung of each (global) slot."""
        return torch.searchsorted(self.offsets, slots, right=True) - 1

    def _by_rung(self, rungs: torch.Tensor):
        """(rung, its pool, the positions in ``rungs`` naming it) for every rung named."""
        for r, pool in enumerate(self.rungs):
            idx = (rungs == r).nonzero().flatten()
            if len(idx):
                yield r, pool, idx

    def _split(self, slots: torch.Tensor):
        """(pool, positions of ``slots`` in it, their local slots) for every rung holding some."""
        for r, pool, idx in self._by_rung(self.rung_of(slots)):
            yield pool, idx, slots[idx] - int(self.offsets[r])

    def used(self) -> torch.Tensor:
        return sum(r.used() for r in self.rungs)

    def free(self) -> torch.Tensor:
        return sum(r.free() for r in self.rungs)

    def bytes_used(self) -> int:
        return sum(int(r.used().sum()) * r.page_bytes for r in self.rungs)

    def page_bytes_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Bytes of the page each slot holds."""
        return torch.tensor([r.page_bytes for r in self.rungs])[self.rung_of(slots)]

    @property
    def owner(self) -> torch.Tensor:
        """[L, capacity of every rung]: the record each global slot holds (-1 where free)."""
        out = torch.full((self.num_layers, self.max_capacity), -1, dtype=torch.long)
        for r, pool in enumerate(self.rungs):
            off = int(self.offsets[r])
            out[:, off: off + pool.capacity] = pool.owner
        return out

    def reserve(self, pages: int) -> None:
        for r in self.rungs:
            r.reserve(pages)

    def alloc(self, layers: torch.Tensor, records: torch.Tensor, rungs: torch.Tensor) -> torch.Tensor | None:
        """Slots for (layer, record) pairs in the given rungs, all or none (None: a rung lacks room)."""
        slots = torch.empty_like(layers)
        for r, pool, idx in self._by_rung(rungs):
            got = pool.alloc(layers[idx], records[idx])
            if got is None:
                return None
            slots[idx] = got + int(self.offsets[r])
        return slots

    def release(self, layers: torch.Tensor, slots: torch.Tensor) -> None:
        for pool, idx, local in self._split(slots):
            pool.release(layers[idx], local)

    def read(self, layers: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K, V [N, KVH, P, D] float32, each page by its rung's codec."""
        k = torch.empty((len(slots), *self.shape), device=self.device)
        v = torch.empty_like(k)
        for pool, idx, local in self._split(slots):
            ks, vs = pool.read(layers[idx], local)
            k[idx.to(k.device)], v[idx.to(k.device)] = ks, vs
        return k, v

    def write(self, layers: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for pool, idx, local in self._split(slots):
            pool.write(layers[idx], local, k[idx.to(k.device)], v[idx.to(v.device)])

    def snapshot(self) -> tuple:
        return tuple(r.snapshot() for r in self.rungs)

    def restore(self, state: tuple) -> None:
        for r, st in zip(self.rungs, state):
            r.restore(st)


def warm_pool(num_layers: int, codecs: list[str], shape: tuple[int, int, int], capacities: tuple[int, ...], *,
              keep_decoded: bool = False, device: torch.device | str = "cpu") -> WarmPool | WarmLadder:
    """The warm sub-tier for codecs (by name, highest precision first) holding ``capacities``
    pages per layer each: one :class:`WarmPool`, or a :class:`WarmLadder` of them."""
    from tieredkv.plugins.codec import CODECS

    if len(codecs) == 1:
        return WarmPool(num_layers, CODECS[codecs[0]], shape, capacities[0], keep_decoded=keep_decoded, device=device)
    return WarmLadder(num_layers, [CODECS[c] for c in codecs], shape, capacities, keep_decoded=keep_decoded,
                      device=device)
