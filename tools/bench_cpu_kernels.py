"""The CPU kernels of the decode path against torch's defaults, one shape at a time.

    python tools/bench_cpu_kernels.py [--threads 2] [--batches 1 16 64] [--cold] [--out results/cpu-kernels.json]

* linear: ``F.linear`` (MKL's sgemm) against the linear layers of ``models/cpu_linear.py``
  ("ours": ``small_linear`` at one to four rows, ``panel_linear`` at five to 64 on AVX-512 CPUs,
  oneDNN's packed GEMM beyond; the packed GEMM alone in its own column), for SmolLM2's
  projections (q/k/v fused 960 x 576, o 576 x 576, gate/up fused 3,072 x 576, down 576 x 1,536,
  the output projection 49,152 x 576), float32 random weights, ``batch`` rows;
* attention: one decode step of one layer — the pages gathered, then ``models.cache.attention``
  (the torch path) — against the pool-reading op of ``models/cpu_attention.py``, ``batch``
  sequences of 576 keys in 16-token pages scattered over the pool, 9 query / 3 kv heads, head
  dim 64.

Milliseconds per call, the mean of the timed calls after warm-up calls. By default weights and
pages are warm in cache; with ``--cold`` they come from memory as in a model's decode step: 30
copies of each (one per layer of SmolLM2; 3 of the output projection) called in turn, and each
sequence's pages in consecutive slots, as the paged cache allocates a prompt's pages. The
decode benchmark (``tools/bench_decode.py``) measures the model itself.
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


def linear_rows(batch: int, copies: int) -> list[dict]:
    from tieredkv.models.cpu_linear import PackedLinears

    rows = []
    for name, (n, k) in {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                         "lm_head": (49152, 576)}.items():
        reps = copies if n < 10000 else max(1, copies // 8)
        lins = [nn.Linear(k, n, bias=False).requires_grad_(False) for _ in range(reps)]
        x, packs = torch.randn(batch, k), [PackedLinears(lin) for lin in lins]
        calls = max(2, (20 if n > 10000 else 200) // reps)
        onednn = [p._pack(x) for p in packs]
        row = {"kernel": "linear", "shape": name, "batch": batch,
               "torch_ms": round(timed(lambda: [F.linear(x, lin.weight) for lin in lins], calls) / reps, 4),
               "ours_ms": round(timed(lambda: [p(x) for p in packs], calls) / reps, 4)}
        if onednn[0] is not None:
            row["onednn_ms"] = round(timed(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                    for w in onednn], calls) / reps, 4)
        rows.append(row)
    return rows


def attention_row(batch: int, copies: int) -> dict:
    from tieredkv.models.cache import attention, gather_pages, pool_decode_attention

    h, kvh, d, p, m = 9, 3, 64, 16, 36
    c = batch * m + 5
    pools = [(torch.randn(c, kvh, p, d), torch.randn(c, kvh, p, d)) for _ in range(copies)]
    # one layer's pages scattered over the pool (warm); a prompt's pages in turn (cold: the model's case)
    pages = (torch.arange(batch * m) if copies > 1 else torch.randperm(c)[: batch * m]).view(batch, m)
    allowed = torch.arange(m * p).view(1, -1) < torch.randint(500, m * p + 1, (batch, 1))
    q = torch.randn(batch, h, 1, d)

    def torch_path(pool_k, pool_v):
        k = gather_pages(pool_k, pages).view(batch, kvh, m * p, d)
        v = gather_pages(pool_v, pages).view(batch, kvh, m * p, d)
        return attention(q, k, v, allowed.view(batch, 1, 1, m * p))

    ours = pool_decode_attention(q, *pools[0], pages, allowed)
    row = {"kernel": "attention", "shape": "576 keys, 9/3 heads, d 64", "batch": batch,
           "torch_ms": round(timed(lambda: [torch_path(*pp) for pp in pools], max(2, 30 // copies)) / copies, 4)}
    if ours is None:
        return {**row, "ours_ms": None}
    err = (ours - torch_path(*pools[0])).abs().max().item()
    ours_ms = timed(lambda: [pool_decode_attention(q, *pp, pages, allowed) for pp in pools], max(2, 30 // copies))
    return {**row, "ours_ms": round(ours_ms / copies, 4), "max_abs_diff": err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--cold", action="store_true", help="weights and pages from memory (30 copies in turn)")
    ap.add_argument("--out", default="results/cpu-kernels.json")
    args = ap.parse_args()
    copies = 30 if args.cold else 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            rows += linear_rows(batch, copies) + [attention_row(batch, copies)]
    print("| kernel | shape | batch | torch ms | oneDNN packed ms | ours ms | speed-up over torch |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        up = f"{r['torch_ms'] / r['ours_ms']:.2f}×" if r["ours_ms"] else "—"
        print(f"| {r['kernel']} | {r['shape']} | {r['batch']} | {r['torch_ms']} | {r.get('onednn_ms', '—')} | "
              f"{r['ours_ms']} | {up} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
