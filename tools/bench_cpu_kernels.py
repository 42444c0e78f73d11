"""The CPU kernels of the decode path against torch's defaults, one shape at a time.

    python tools/bench_cpu_kernels.py [--threads 2] [--batches 1 16 64] [--out results/cpu-kernels.json]

* linear: ``F.linear`` (MKL's sgemm) against the packed oneDNN linear of
  ``models/cpu_linear.py``, for SmolLM2's projections (q/k/v fused 960 x 576, o 576 x 576,
  gate/up fused 3,072 x 576, down 576 x 1,536, the output projection 49,152 x 576), float32
  random weights, ``batch`` rows;
* attention: one decode step of one layer — the pages gathered, then ``models.cache.attention``
  (the torch path) — against the pool-reading op of ``models/cpu_attention.py``, ``batch``
  sequences of 576 keys in 16-token pages scattered over the pool, 9 query / 3 kv heads, head
  dim 64.

Milliseconds per call, the mean of the timed calls after warm-up calls; weights and pages are
warm in cache (a model's decode reads them cold, which the decode benchmark measures:
``tools/bench_decode.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F


def timed(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def linear_rows(batch: int) -> list[dict]:
    from tieredkv.models.cpu_linear import PackedLinears

    rows = []
    for name, (n, k) in {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                         "lm_head": (49152, 576)}.items():
        lin = nn.Linear(k, n, bias=False).requires_grad_(False)
        x, packed, calls = torch.randn(batch, k), PackedLinears(lin), 20 if n > 10000 else 200
        rows.append({"kernel": "linear", "shape": name, "batch": batch,
                     "torch_ms": round(timed(lambda: F.linear(x, lin.weight), calls), 4),
                     "ours_ms": round(timed(lambda: packed(x), calls), 4)})
    return rows


def attention_row(batch: int) -> dict:
    from tieredkv.models.cache import attention, gather_pages, pool_decode_attention

    h, kvh, d, p, m = 9, 3, 64, 16, 36
    c = batch * m + 5
    pool_k, pool_v = torch.randn(c, kvh, p, d), torch.randn(c, kvh, p, d)
    pages = torch.randperm(c)[: batch * m].view(batch, m)
    allowed = torch.arange(m * p).view(1, -1) < torch.randint(500, m * p + 1, (batch, 1))
    q = torch.randn(batch, h, 1, d)

    def torch_path():
        k = gather_pages(pool_k, pages).view(batch, kvh, m * p, d)
        v = gather_pages(pool_v, pages).view(batch, kvh, m * p, d)
        return attention(q, k, v, allowed.view(batch, 1, 1, m * p))

    ours = pool_decode_attention(q, pool_k, pool_v, pages, allowed)
    row = {"kernel": "attention", "shape": "576 keys, 9/3 heads, d 64", "batch": batch,
           "torch_ms": round(timed(torch_path, 30), 4)}
    if ours is None:
        return {**row, "ours_ms": None}
    err = (ours - torch_path()).abs().max().item()
    return {**row, "ours_ms": round(timed(lambda: pool_decode_attention(q, pool_k, pool_v, pages, allowed), 30), 4),
            "max_abs_diff": err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--out", default="results/cpu-kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            rows += linear_rows(batch) + [attention_row(batch)]
    print("| kernel | shape | batch | torch ms | ours ms | speed-up |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        up = f"{r['torch_ms'] / r['ours_ms']:.2f}×" if r["ours_ms"] else "—"
        print(f"| {r['kernel']} | {r['shape']} | {r['batch']} | {r['torch_ms']} | {r['ours_ms']} | {up} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
