"""Host <-> device page transfers of the tiered cache.

On CUDA (the device tier on a GPU, ``KVSpec.device``): one copy stream per direction, each
with its own pool of pinned (page-locked) host staging buffers; every transfer is batched —
the K and V of all the pages one call moves are packed into one staging buffer and cross the
link in one copy, never one small copy per page. Events order the streams: a host-to-device
copy waits for the compute stream's work already queued (the pages' slots may still be read
by it), and the compute stream waits for the copy's event before it runs anything queued
after the copy (no host synchronization: the host goes on while the copy runs). A staging
buffer returns to its stream's pool when its copy's event has completed; :meth:`close`
synchronizes and checks that every buffer came back (none leaked).

On the CPU backend host and "device" are the same memory: the transfers are the tensors
themselves, counted the same way; the asynchronous path there is the disk tier's read-ahead
thread (``TierManager._read_ahead``). docs/prefetch.md says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tieredkv.plugins.codec import ALIGN


@dataclass
class TransferStats:
    """What crossed the link, per direction: calls (one batched copy each), pages, bytes."""

    h2d_copies: int = 0
    h2d_pages: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    d2h_pages: int = 0
    d2h_bytes: int = 0
    #: pinned staging bytes allocated, over both pools (they are reused, never freed before close)
    pinned_bytes: int = 0


@dataclass
class _Buffer:
    data: torch.Tensor  # uint8, pinned
    event: object | None = None  # the copy using it; None: free


@dataclass
class StagingPool:
    """Pinned host staging buffers of one copy stream. ``take(nbytes)`` returns a free buffer of
    at least ``nbytes`` (a new one, rounded up to a power of two, when none is free and large
    enough); ``release(buf, event)`` marks it in use until ``event`` (anything with ``query()``
    and ``synchronize()``, a CUDA event) has completed. ``pin``: page-lock new buffers."""

    pin: bool = True
    buffers: list[_Buffer] = field(default_factory=list)

    def _recycle(self) -> None:
        for b in self.buffers:
            if b.event is not None and b.event.query():
                b.event = None

    def take(self, nbytes: int) -> _Buffer:
        self._recycle()
        free = [b for b in self.buffers if b.event is None and b.data.numel() >= nbytes]
        if free:
            return min(free, key=lambda b: b.data.numel())
        size = 1 << max(12, (nbytes - 1).bit_length())
        data = torch.empty(size, dtype=torch.uint8)
        buf = _Buffer(data.pin_memory() if self.pin else data)
        self.buffers.append(buf)
        return buf

    def release(self, buf: _Buffer, event) -> None:
        buf.event = event

    @property
    def nbytes(self) -> int:
        return sum(b.data.numel() for b in self.buffers)

    def in_flight(self) -> int:
        self._recycle()
        return sum(b.event is not None for b in self.buffers)

    def drain(self) -> None:
        for b in self.buffers:
            if b.event is not None:
                b.event.synchronize()
                b.event = None


def _offsets(shapes: list[torch.Size], dtype: torch.dtype) -> tuple[list[int], int]:
    """Byte offsets of consecutive ``dtype`` tensors of these shapes in one staging buffer, each
    ``ALIGN``-byte aligned as the pools' pages, and the bytes they take."""
    size = torch.empty(0, dtype=dtype).element_size()
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-shape.numel() * size // ALIGN) * ALIGN
    return offsets, end


def _views(buf: torch.Tensor, shapes: list[torch.Size], dtype: torch.dtype) -> list[torch.Tensor]:
    """Consecutive ``dtype`` views of the uint8 buffer, one per shape (``_offsets``)."""
    size = torch.empty(0, dtype=dtype).element_size()
    offsets, _ = _offsets(shapes, dtype)
    return [buf[o: o + shape.numel() * size].view(dtype).view(shape) for o, shape in zip(offsets, shapes)]


class Transfers:
    """Batched page copies between host memory and ``device`` (see the module docstring)."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stats = TransferStats()
        self.h2d_pool, self.d2h_pool = StagingPool(pin=self.cuda), StagingPool(pin=self.cuda)
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)

    def count_to_device(self, pages: int, nbytes: int) -> None:
        """Count one batched host -> device copy of ``pages`` pages (``nbytes`` bytes)."""
        self.stats.h2d_copies += 1
        self.stats.h2d_pages += pages
        self.stats.h2d_bytes += nbytes

    def to_device(self, *tensors: torch.Tensor, dtype: torch.dtype, pages: int) -> list[torch.Tensor]:
        """Host tensors (the K and V of ``pages`` pages) on the device as ``dtype``, in one copy."""
        if not tensors:
            return []
        self.count_to_device(pages, sum(t.numel() for t in tensors) * torch.empty(0, dtype=dtype).element_size())
        if not self.cuda:
            return [t.to(self.device, dtype) for t in tensors]
        compute = torch.cuda.current_stream(self.device)
        buf = self.h2d_pool.take(_offsets([t.shape for t in tensors], dtype)[1])
        self.stats.pinned_bytes = self.h2d_pool.nbytes + self.d2h_pool.nbytes
        staged = _views(buf.data, [t.shape for t in tensors], dtype)
        for view, t in zip(staged, tensors):
            view.copy_(t.detach())  # host memcpy into page-locked memory: the copy below is asynchronous
        # the result is allocated on the compute stream, so it is free of older uses there;
        # the copy stream waits for the work queued so far (slots the copy feeds may be read by it)
        out = [torch.empty(t.shape, dtype=dtype, device=self.device) for t in tensors]
        self.h2d_stream.wait_stream(compute)
        with torch.cuda.stream(self.h2d_stream):
            for dst, src in zip(out, staged):
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        for dst in out:
            dst.record_stream(self.h2d_stream)
        self.h2d_pool.release(buf, done)
        compute.wait_event(done)  # what the compute stream runs from now on sees the pages
        return out

    def to_host_counted(self, pages: int, nbytes: int) -> None:
        """Count one batched device -> host copy of ``pages`` pages (``nbytes`` bytes) made elsewhere."""
        self.stats.d2h_copies += 1
        self.stats.d2h_pages += pages
        self.stats.d2h_bytes += nbytes

    def to_host(self, *tensors: torch.Tensor, pages: int) -> list[torch.Tensor]:
        """Device tensors (the K and V of ``pages`` pages) in host memory, in one copy; returns
        when they are there (the host writes them into its tier right away)."""
        if not tensors:
            return []
        self.to_host_counted(pages, sum(t.numel() * t.element_size() for t in tensors))
        if not self.cuda or all(t.device.type == "cpu" for t in tensors):
            return [t.cpu() for t in tensors]
        dtype = tensors[0].dtype
        compute = torch.cuda.current_stream(self.device)
        buf = self.d2h_pool.take(_offsets([t.shape for t in tensors], dtype)[1])
        self.stats.pinned_bytes = self.h2d_pool.nbytes + self.d2h_pool.nbytes
        views = _views(buf.data, [t.shape for t in tensors], dtype)
        self.d2h_stream.wait_stream(compute)  # the pages' last writes are queued there
        with torch.cuda.stream(self.d2h_stream):
            for dst, src in zip(views, tensors):
                dst.copy_(src.to(dtype), non_blocking=True)
                src.record_stream(self.d2h_stream)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        done.synchronize()
        out = [v.clone() for v in views]  # the buffer goes back to the pool now
        self.d2h_pool.release(buf, None)
        return out

    def in_flight(self) -> int:
        """Staging buffers whose copy has not completed."""
        return self.h2d_pool.in_flight() + self.d2h_pool.in_flight()

    def close(self) -> None:
        """Wait for every copy; afterwards no staging buffer is in use (asserted)."""
        if self.cuda:
            self.h2d_stream.synchronize()
            self.d2h_stream.synchronize()
        self.h2d_pool.drain()
        self.d2h_pool.drain()
        assert self.in_flight() == 0, "a staging buffer is still in use after close()"
