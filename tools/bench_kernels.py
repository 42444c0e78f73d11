"""Benchmark of the tieredkv CUDA kernels at real model shapes (needs a CUDA GPU and
libtieredkv_kernels.so; correctness is the ``cuda`` tests' job: ``pytest -m cuda tests/plugins``).

For each model shape (``--presets``, default SmolLM2-135M and a Llama-2-70B layer) and context
(``--contexts``, default 4k and 32k tokens, P = 16, one decode token per sequence, ``--batch``
sequences) it times, with CUDA events (median of ``--repeats`` calls after 3 warm-ups):

* TieredAttention over every page of the context (pages scattered over the pool);
* ImportanceScore over the same pages;
* KVAppend of one token per sequence, in place (what the runtime does) and as the TensorRT
  plugin runs it (copy both pools to the outputs, then scatter);
* per codec: encode_pages / decode_pages of the whole context and the warm TieredAttention
  with every listed page warm;

and reports the median in µs and GB/s of the bytes each call must move (the codec ops and the
warm attention: of the encoded bytes). Timings include each op's host side (argument checks,
the ctypes call) between the events. Writes ``OUT/bench_kernels.json`` and ``.md``.

    python tools/bench_kernels.py --out gpu_out [--lib build/plugins/libtieredkv_kernels.so]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tieredkv.models.config import preset
from tieredkv.plugins import codec, cuda_ops
from tieredkv.plugins.inputs import tiered_attention_inputs

PAGE = 16


@dataclass
class Timing:
    op: str
    model: str
    shape: str
    median_us: float
    bytes: int
    gb_per_s: float
    extra: dict = field(default_factory=dict)


def _time(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` (3 warm-up calls), each call timed with CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _timing(op: str, model: str, shape: str, ms: float, nbytes: int, **extra) -> Timing:
    return Timing(op, model, shape, round(ms * 1e3, 2), int(nbytes), round(nbytes / (ms * 1e-3) / 1e9, 1), extra)


def decode_step(gen: torch.Generator, *, B: int, H: int, KVH: int, D: int, context: int) -> dict:
    """TieredAttention inputs of a decode step over every page of a ``context``-token sequence:
    every page kept, in order, no padding, the pages scattered over a pool of B * M pages."""
    m = context // PAGE
    inputs = tiered_attention_inputs(gen, B=B, H=H, KVH=KVH, T=1, D=D, P=PAGE, M=m, C=B * m, keep=1.0,
                                     causal_cut=False)
    dev = gen.device
    inputs["page_index"] = torch.arange(m, device=dev).repeat(B, 1)
    inputs["seq_len"] = torch.full((B,), context, dtype=torch.int64, device=dev)
    inputs["past"] = inputs["seq_len"] - 1
    return inputs


def bench_shape(lib, model: str, cfg, context: int, batch: int, repeats: int, codecs: list[str]) -> list[Timing]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inputs = decode_step(gen, B=batch, H=H, KVH=KVH, D=D, context=context)
    B, M = inputs["page_table"].shape
    shape = f"B={B} H={H} KVH={KVH} D={D} ctx={context} P={PAGE} M={M} T=1"
    scale = D ** -0.5
    q = inputs["q"]
    outs = (torch.empty_like(q), torch.empty(B, H, 1, device="cuda"), torch.empty(B, H, 1, M, device="cuda"))
    timings = []

    ms = _time(lambda: cuda_ops.tiered_attention(**inputs, scale=scale, out=outs, lib=lib), repeats)
    kv_bytes = 2 * B * M * PAGE * KVH * D * 4
    io_bytes = 2 * q.numel() * 4 + B * H * (M + 1) * 4 + B * M * 17
    timings.append(_timing("TieredAttention", model, shape, ms, kv_bytes + io_bytes))

    kmin = torch.randn(B, M, KVH, D, generator=gen, device="cuda")
    kmax = kmin + torch.rand(B, M, KVH, D, generator=gen, device="cuda")
    score_in = dict(q=q[:, :, 0].contiguous(), kmin=kmin, kmax=kmax,
                    page_tokens=torch.full((B, M), PAGE, dtype=torch.int64, device="cuda"),
                    distance=(context - (torch.arange(M, device="cuda") + 1) * PAGE).repeat(B, 1),
                    saliency=torch.rand(B, M, generator=gen, device="cuda"), page_mask=inputs["page_mask"],
                    position_table=torch.rand(16, generator=gen, device="cuda"), weights=(0.4, 0.3, 0.3))
    score = torch.empty(B, M, device="cuda")
    ms = _time(lambda: cuda_ops.importance_score(**score_in, scale=scale, out=score, lib=lib), repeats)
    timings.append(_timing("ImportanceScore", model, shape, ms, 2 * kmin.numel() * 4 + B * M * 25))

    k_pool, v_pool = inputs["k_pool"], inputs["v_pool"]
    new = dict(k_new=torch.randn(B, KVH, D, generator=gen, device="cuda"),
               v_new=torch.randn(B, KVH, D, generator=gen, device="cuda"),
               slot=inputs["page_table"][:, -1].contiguous(),
               offset=torch.full((B,), PAGE - 1, dtype=torch.int64, device="cuda"))
    new_bytes = 2 * 2 * new["k_new"].numel() * 4
    ms = _time(lambda: cuda_ops.kv_append(k_pool, v_pool, **new, out=(k_pool, v_pool), lib=lib), repeats)
    timings.append(_timing("KVAppend (in place)", model, shape, ms, new_bytes))
    copies = (torch.empty_like(k_pool), torch.empty_like(v_pool))
    ms = _time(lambda: cuda_ops.kv_append(k_pool, v_pool, **new, out=copies, lib=lib), repeats)
    timings.append(_timing("KVAppend (copy + scatter)", model, shape, ms, 2 * 2 * k_pool.numel() * 4 + new_bytes,
                           pool_mib=round(2 * k_pool.numel() * 4 / 2**20, 1)))

    n = B * M
    k, v = k_pool[:n], v_pool[:n]
    float_bytes = 2 * k.numel() * 4
    warm_in = dict(inputs, warm_row=torch.randperm(n, device="cuda").view(B, M))
    for name in codecs:
        desc = cuda_ops.codec_desc(name, KVH, PAGE, D, lib=lib)
        data = torch.empty(n, desc.page_bytes, dtype=torch.uint8, device="cuda")
        ms = _time(lambda: cuda_ops.encode_pages(k, v, desc, out=data, lib=lib), repeats)
        timings.append(_timing(f"encode_pages [{name}]", model, shape, ms, data.numel(), float_bytes_read=float_bytes))
        dec = (torch.empty_like(k), torch.empty_like(v))
        ms = _time(lambda: cuda_ops.decode_pages(data, desc, out=dec, lib=lib), repeats)
        timings.append(_timing(f"decode_pages [{name}]", model, shape, ms, data.numel(),
                               float_bytes_written=float_bytes))
        ms = _time(lambda: cuda_ops.tiered_attention_warm(**warm_in, warm_pool=data, desc=desc, scale=scale, out=outs,
                                                          lib=lib), repeats)
        timings.append(_timing(f"TieredAttention warm [{name}]", model, shape, ms, data.numel(),
                               bits_per_value=round(8 * desc.page_bytes / (2 * KVH * PAGE * D), 2)))
    torch.cuda.empty_cache()
    return timings


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_kernels.json").write_text(json.dumps(report, indent=2, default=str))
    lines = ["# tieredkv kernel benchmark", "",
             f"- device: {report.get('device', 'none')}; torch {report['torch']}, CUDA {report['torch_cuda']}",
             f"- library: `{report['library']}`; {report['date']}; `{report['command']}`", "",
             "Median of CUDA-event timed calls; GB/s of the bytes each call must move (codec ops and the warm "
             "attention: of the encoded pages).", "",
             "| op | model | shape | median µs | MB moved | GB/s |", "|---|---|---|---|---|---|"]
    for t in report.get("timings", []):
        lines.append(f"| {t['op']} | {t['model']} | {t['shape']} | {t['median_us']} | {t['bytes'] / 1e6:.2f} | "
                     f"{t['gb_per_s']} |")
    if report.get("error"):
        lines += ["", f"Error: {report['error']}"]
    (out / "bench_kernels.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", type=Path, default=None, help=f"libtieredkv_kernels.so (default: ${cuda_ops.ENV_VAR}, "
                                                           f"else {cuda_ops.DEFAULT_LIBRARY})")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_out"))
    ap.add_argument("--presets", nargs="+", default=["smollm2-135m", "llama2-70b"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--codecs", nargs="*", default=sorted(codec.CODECS))
    args = ap.parse_args(argv)
    report = {"library": str(cuda_ops.library_path(args.lib)), "torch": torch.__version__,
              "torch_cuda": torch.version.cuda, "host": platform.platform(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python", *sys.argv])}
    if not torch.cuda.is_available():
        report["error"] = "no CUDA device (torch.cuda.is_available() is False)"
        write_report(args.out, report)
        print(f"bench_kernels: {report['error']}; nothing was timed", file=sys.stderr)
        return 2
    report["device"] = f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
    lib = cuda_ops.load_library(args.lib)
    timings: list[Timing] = []
    try:
        for name in args.presets:
            for context in args.contexts:
                timings += bench_shape(lib, name, preset(name), context, args.batch, args.repeats, args.codecs)
                for t in timings[-1:]:
                    print(f"{name} ctx {context}: done ({t.op} {t.median_us} us)", file=sys.stderr)
    except RuntimeError as exc:  # a launch or execution error: report what ran
        report["error"] = str(exc)
    report["timings"] = [asdict(t) for t in timings]
    write_report(args.out, report)
    for t in timings:
        print(f"{t.op:34s} {t.model:14s} {t.shape}: {t.median_us} us, {t.gb_per_s} GB/s")
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
