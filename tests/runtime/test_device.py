"""The device path of the PyTorch backend (``LLM(device=)``, ``--device``): device names checked
with typed errors here; on a CUDA machine (``cuda`` marker, run by tools/gpu_check.sh) the
model, the plain cache's pools and the tiered cache's device tier on the GPU give the CPU
run's tokens and logits, and the tiered cache makes the same decisions."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from helpers import SMALL_KV as SMALL, tiny_model
from tieredkv.errors import ConfigError
from tieredkv.models.llama import prefill
from tieredkv.runtime.generate import generate
from tieredkv.runtime.llm import resolve_device
from tieredkv.runtime.paged import PagedKVCache
from tieredkv.runtime.sampling import SamplingParams, sample_token
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig

PROMPTS = [list(range(5, 205)), list(range(300, 333))]
WORK = dict(full_tokens=212, num_sequences=2)  # the longest prompt + 12 new tokens, two sequences
TIERED = {
    "unlimited": dict(),
    "exact-40": dict(device_budget="40%"),
    "exact-40-attend-all": dict(device_budget="40%", attention_budget="100%"),
    "masked-40": dict(device_budget="40%", mode="masked"),
    "warm-int4": dict(device_budget="40%", warm_codec="int4"),
    "prefetch-last": dict(device_budget="40%", attention_budget="20%", prefetch_predictor="last"),
}


def test_resolve_device_names_and_errors():
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "gpu0", "mps"):
        with pytest.raises(ConfigError, match="expected cpu, cuda or cuda:N"):
            resolve_device(bad)
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="GPU"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ConfigError, match="sees no CUDA GPU"):
            resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cli_device_cuda_without_a_gpu_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "tieredkv.cli", "generate", "--device", "cuda", "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "sees no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_seeded_sampling_draws_on_the_generators_device():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=1)
    draws = [sample_token(logits, params, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert draws[0] == draws[1]


def _runs(model, device: str, make_cache):
    m = copy.deepcopy(model).to(device)
    cache = make_cache(m)
    out = generate(m, cache, PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return [c.token_ids for c in out], cache


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(TIERED))
def test_tiered_cache_on_cuda_equals_cpu(name):
    model = tiny_model(seed=3)
    cfg = TieredKVConfig(**{**SMALL, **TIERED[name]})
    cpu_tokens, cpu_cache = _runs(model, "cpu", lambda m: TieredKVCache(m.kv_spec(), cfg, **WORK))
    gpu_tokens, gpu_cache = _runs(model, "cuda", lambda m: TieredKVCache(m.kv_spec(), cfg, **WORK))
    assert gpu_cache.mgr.device.k.device.type == "cuda" and gpu_cache.mgr.host.k.device.type == "cpu"
    assert gpu_tokens == cpu_tokens
    a, b = cpu_cache.metrics, gpu_cache.metrics
    assert (a.misses, a.fetched_pages, a.evicted_pages, a.bytes_h2d) == (b.misses, b.fetched_pages, b.evicted_pages,
                                                                         b.bytes_h2d)
    # the same batched copies, now over the copy streams through pinned staging buffers
    assert cpu_cache.mgr.transfers.stats.h2d_pages == gpu_cache.mgr.transfers.stats.h2d_pages
    assert gpu_cache.mgr.transfers.stats.h2d_copies == cpu_cache.mgr.transfers.stats.h2d_copies
    gpu_cache.close()
    assert gpu_cache.mgr.transfers.in_flight() == 0  # no staging buffer left in use


@pytest.mark.cuda
def test_paged_cache_and_logits_on_cuda_equal_cpu():
    model = tiny_model(seed=3)
    tokens = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(2))
    logits = {}
    for dev in ("cpu", "cuda"):
        m = copy.deepcopy(model).to(dev)
        for kind, cache in (("paged", PagedKVCache(m.kv_spec())),
                            ("tiered", TieredKVCache(m.kv_spec(), TieredKVConfig(**SMALL, device_budget="50%"),
                                                     full_tokens=150))):
            logits[dev, kind] = prefill(m, cache, cache.add_sequence(), tokens, chunk_size=40, all_logits=True).cpu()
    for kind in ("paged", "tiered"):
        assert (logits["cpu", kind] - logits["cuda", kind]).abs().max().item() <= 1e-4
    cpu_tokens, _ = _runs(model, "cpu", lambda m: PagedKVCache(m.kv_spec()))
    gpu_tokens, _ = _runs(model, "cuda", lambda m: PagedKVCache(m.kv_spec()))
    assert gpu_tokens == cpu_tokens
