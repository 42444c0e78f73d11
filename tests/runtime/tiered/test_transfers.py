"""Host <-> device transfers (runtime/tiered/transfers.py): the staging-buffer pools (reuse
only after a copy's event completed, growth, nothing in flight after drain), batched copies
counted per call on the CPU backend, and the manager's transfers agreeing with its metrics.
The CUDA streams themselves run in the ``cuda`` tests (tests/runtime/test_device.py)."""

from __future__ import annotations

import pytest
import torch

from helpers import SMALL_KV as SMALL, tiny_model
from tieredkv.runtime.generate import generate
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.transfers import StagingPool, Transfers



class Event:
    """A copy's completion as the pool sees it (query / synchronize), settable by the test."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_staging_pool_reuses_a_buffer_only_after_its_copy():
    pool = StagingPool(pin=False)
    a = pool.take(5000)
    assert a.data.numel() == 8192  # a power of two
    ev = Event()
    pool.release(a, ev)
    b = pool.take(100)
    assert b is not a and pool.in_flight() == 1
    pool.release(b, None)
    assert pool.take(100) is b  # free and large enough
    ev.done = True
    assert pool.take(6000) is a and pool.in_flight() == 0
    pool.release(a, Event())
    pool.drain()
    assert pool.in_flight() == 0 and len(pool.buffers) == 2 and pool.nbytes == 8192 + 4096


def test_cpu_transfers_are_the_tensors_counted_per_batched_call():
    tr = Transfers("cpu")
    k, v = torch.randn(3, 2, 8, 4), torch.randn(3, 2, 8, 4)
    dk, dv = tr.to_device(k, v, dtype=torch.float16, pages=3)
    assert dk.dtype == torch.float16 and torch.equal(dk, k.half()) and torch.equal(dv, v.half())
    hk, hv = tr.to_host(dk, dv, pages=3)
    assert torch.equal(hk, dk)
    s = tr.stats
    assert (s.h2d_copies, s.h2d_pages, s.h2d_bytes) == (1, 3, 2 * k.numel() * 2)
    assert (s.d2h_copies, s.d2h_pages, s.d2h_bytes) == (1, 3, 2 * k.numel() * 2)
    assert tr.to_device(dtype=torch.float32, pages=0) == [] and tr.stats.h2d_copies == 1
    tr.close()


@pytest.mark.parametrize("extra", [{}, {"prefetch_predictor": "last", "attention_budget": "12.5%"}],
                         ids=["demand", "prefetch"])
def test_manager_transfers_agree_with_the_metrics(extra):
    model = tiny_model(seed=3)
    cache = TieredKVCache(model.kv_spec(), TieredKVConfig(device_budget="40%", **SMALL, **extra), full_tokens=216)
    generate(model, cache, [list(range(5, 205))], SamplingParams(max_new_tokens=16, ignore_eos=True))
    tr, m = cache.mgr.transfers, cache.metrics
    page_bytes = cache.mgr.page_bytes
    assert tr.stats.d2h_pages == m.writebacks  # every write-back is one page down, batched
    assert tr.stats.d2h_copies <= tr.stats.d2h_pages
    # every page fetched or streamed crossed the link at least once; batched: fewer copies than pages
    assert tr.stats.h2d_bytes >= m.bytes_h2d and tr.stats.h2d_bytes == tr.stats.h2d_pages * page_bytes
    assert 0 < tr.stats.h2d_copies < tr.stats.h2d_pages
    cache.close()
    assert tr.in_flight() == 0
