"""Check and time the tieredkv CUDA kernels at real model shapes (needs a CUDA GPU and
libtieredkv_kernels.so; tools/gpu_check.sh runs it after the ``cuda`` tests).

Groups, each run on its own (an exception is recorded in the report and the next group runs):

* ``copy``: the device-to-device copy bandwidth of this GPU (a 1 GiB torch copy, many calls
  between one event pair): the practical ceiling the kernels are compared with, besides the
  nominal HBM bandwidth (``--hbm-gbps``, 4800 GB/s for an H200);
* ``check``: every kernel against its PyTorch reference (run on the CPU) at a 70B-like shape:
  the llama2-70b preset (64 query heads, 8 KV heads, head dim 128), pages of 16, one sequence
  of ``--check-context`` tokens (32k), float16 pools, with every page listed, with 25 % of
  them listed, and with every page listed and 25 % kept in clusters: TieredAttention (the
  library's split plan from this GPU's occupancy, and one split), the warm TieredAttention (int4,
  half the listed pages warm, as int32 words), ImportanceScore (float16 summaries; float32 and
  float16 q), KVAppend (in place and copy; exact) and the int4 page codec (exact, on a slice of
  the pages);
* ``timing``: per preset (``--presets``), context (``--contexts``), selection (``--listed``
  shares of the pages listed, all kept; ``--kept`` shares kept by the mask, every page listed,
  in clusters) and pool dtype (``--dtypes``), one decode token per sequence (``--batch``):
  TieredAttention, ImportanceScore, KVAppend (in place; and copy + scatter as a plugin without
  aliasing), and per codec (``--codecs``) encode, decode and the warm TieredAttention. Each op
  is captured ``--inner`` times in a CUDA graph and the graph replayed ``--repeats`` times
  between one event pair (no host overhead; falls back to eager calls between one event pair
  when capture fails). Reported: µs per call, the bytes the op must move (K / V of the kept
  pages or the encoded bytes, plus its other inputs and outputs), GB/s, and that as a share of
  the nominal HBM bandwidth and of the measured copy bandwidth; for TieredAttention the split
  plan, the kernel's occupancy and whether it ran on tensor cores (compare with
  ``tools/kernel_occupancy.py``'s estimate), for ImportanceScore its bytes as a share of
  TieredAttention's.

Writes ``OUT/bench_kernels.json`` and ``OUT/bench_kernels.md``. Exit status: 0 when every check
matched and no group failed, 1 otherwise, 2 without a CUDA device.

    python tools/bench_kernels.py --out gpu_out [--lib build/plugins/libtieredkv_kernels.so]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tieredkv.models.config import preset
from tieredkv.plugins import codec, cuda_ops
from tieredkv.plugins.importance_score import importance_score
from tieredkv.plugins.kv_append import kv_append
from tieredkv.plugins.tiered_attention import tiered_attention

PAGE = 16
CHECK_PRESET = "llama2-70b"
#: max abs error of float outputs against the reference (as the cuda tests)
TOLERANCE = 1e-4


@dataclass
class Timing:
    op: str
    model: str
    shape: str
    us: float
    bytes: int
    gb_per_s: float
    of_hbm: float
    of_copy: float | None
    method: str
    extra: dict = field(default_factory=dict)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    errors: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- timing


def time_op(fn, *, inner: int, repeats: int) -> tuple[float, str]:
    """Milliseconds per call of ``fn``: ``inner`` calls captured in a CUDA graph, replayed
    ``repeats`` times between one event pair; eager calls between one event pair when the
    capture fails."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # allocations of the op (workspace) settle before the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / (repeats * inner), f"CUDA graph ({inner} calls x {repeats})"
    except RuntimeError:
        torch.cuda.synchronize()
        calls = inner * repeats
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls, f"eager ({calls} calls, one event pair)"


def copy_bandwidth(gib: float = 1.0, repeats: int = 20) -> float:
    """GB/s of a device-to-device torch copy of ``gib`` GiB (bytes read + written)."""
    n = int(gib * 2**30) // 4
    src, dst = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    src.uniform_()
    ms, _ = time_op(lambda: dst.copy_(src), inner=1, repeats=repeats)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


class Timer:
    def __init__(self, args, copy_gbps: float | None):
        self.args, self.copy_gbps, self.timings = args, copy_gbps, []

    def __call__(self, op: str, model: str, shape: str, fn, nbytes: int, **extra) -> Timing:
        ms, method = time_op(fn, inner=self.args.inner, repeats=self.args.repeats)
        gbps = nbytes / (ms * 1e-3) / 1e9
        t = Timing(op, model, shape, round(ms * 1e3, 2), int(nbytes), round(gbps, 1),
                   round(gbps / self.args.hbm_gbps, 3), round(gbps / self.copy_gbps, 3) if self.copy_gbps else None,
                   method, extra)
        self.timings.append(t)
        print(f"  {op:36s} {shape}: {t.us} us, {t.gb_per_s} GB/s ({100 * t.of_hbm:.0f} % of HBM)", file=sys.stderr)
        return t


# ----------------------------------------------------------------------------- inputs


def decode_inputs(*, B: int, H: int, KVH: int, D: int, context: int, listed: float, dtype: torch.dtype,
                  seed: int = 0, kept: float = 1.0) -> dict:
    """TieredAttention inputs of one decode step per sequence over a ``context``-token sequence
    (pages of 16 scattered over a pool of all sequences' pages): ``listed`` of its pages listed
    (every page, or a random subset in order, as an attention budget selects); ``kept`` of the
    listed pages kept by the int32 page mask, in 8 clusters of neighbouring pages (the runtime's
    form: every page listed, the selection masked in, here clustered as a recency-and-relevance
    selection tends to be; the last page always kept); pools in ``dtype``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = context // PAGE
    m = max(1, round(pages * listed))
    pool = torch.randperm(B * pages, generator=gen, device="cuda").view(B, pages)
    if m == pages:
        index = torch.arange(pages, device="cuda").repeat(B, 1)
    else:
        keep = torch.stack([torch.randperm(pages - 1, generator=gen, device="cuda")[: m - 1] for _ in range(B)])
        index = torch.cat([torch.sort(keep, dim=1).values, torch.full((B, 1), pages - 1, device="cuda")], dim=1)
    mask = torch.ones(B, m, dtype=torch.int32, device="cuda")
    if kept < 1.0:
        mask.zero_()
        run = max(1, round(m * kept / 8))
        for b in range(B):
            for start in torch.randint(0, max(1, m - run), (8,), generator=gen, device="cuda").tolist():
                mask[b, start:start + run] = 1
        mask[:, -1] = 1
    return dict(q=torch.randn(B, H, 1, D, generator=gen, device="cuda"),
                k_pool=(torch.randn(B * pages, KVH, PAGE, D, generator=gen, device="cuda") * 2).to(dtype),
                v_pool=torch.randn(B * pages, KVH, PAGE, D, generator=gen, device="cuda").to(dtype),
                page_table=torch.gather(pool, 1, index), page_mask=mask,
                page_index=index.contiguous(), seq_len=torch.full((B,), context, dtype=torch.int64, device="cuda"),
                past=torch.full((B,), context - 1, dtype=torch.int64, device="cuda"))


def device_plan(lib, inputs: dict) -> dict:
    """The split plan the op runs for ``inputs`` on this GPU: its SMs, the split kernel's occupancy
    (``cuda_ops.attention_occupancy``) and the library's plan for them."""
    B, H, T, D = inputs["q"].shape
    M = inputs["page_table"].shape[1]
    KVH = inputs["k_pool"].shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm, tensor_cores = cuda_ops.attention_occupancy(H, T, D, KVH, inputs["k_pool"].dtype, lib=lib)
    splits, per = cuda_ops.attention_plan(B, H, T, D, KVH, M, sm_count=sms, blocks_per_sm=per_sm, lib=lib)
    return dict(splits=splits, pages_per_split=per, blocks_per_sm=per_sm, tensor_cores=tensor_cores)


def score_inputs(inputs: dict, context: int, seed: int = 1) -> dict:
    """ImportanceScore inputs over the listed pages of ``inputs``: page key bounds in the pools'
    dtype (which holds a min / max of its keys exactly), distances; every listed page competes."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = inputs["q"][:, :, 0].contiguous()
    B, M = inputs["page_table"].shape
    KVH, D = inputs["k_pool"].shape[1], inputs["k_pool"].shape[3]
    dtype = inputs["k_pool"].dtype
    kmin = torch.randn(B, M, KVH, D, generator=gen, device="cuda").to(dtype)
    kmax = (kmin.float() + torch.rand(B, M, KVH, D, generator=gen, device="cuda")).to(dtype)
    return dict(q=q, kmin=kmin, kmax=torch.maximum(kmin, kmax),
                page_tokens=torch.full((B, M), PAGE, dtype=torch.int64, device="cuda"),
                distance=context - (inputs["page_index"] + 1) * PAGE,
                saliency=torch.rand(B, M, generator=gen, device="cuda"),
                page_mask=torch.ones(B, M, dtype=torch.int32, device="cuda"),
                position_table=torch.rand(16, generator=gen, device="cuda"))


def score_bytes(s_in: dict) -> int:
    """What ImportanceScore must move: the summaries of the competing pages, q, the page inputs
    (tokens, distance, saliency, mask) and the score."""
    B, M = s_in["page_mask"].shape
    competing = int((s_in["page_mask"] != 0).sum())
    per_page = 2 * s_in["kmin"][0, 0].numel() * s_in["kmin"].element_size()
    return competing * per_page + s_in["q"].numel() * s_in["q"].element_size() + B * M * 28


def append_inputs(inputs: dict, seed: int = 2) -> dict:
    """One new token per sequence, written at the last slot of its last listed page."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B = inputs["q"].shape[0]
    _, KVH, _, D = inputs["k_pool"].shape
    dtype = inputs["k_pool"].dtype
    return dict(k_new=torch.randn(B, KVH, D, generator=gen, device="cuda").to(dtype),
                v_new=torch.randn(B, KVH, D, generator=gen, device="cuda").to(dtype),
                slot=inputs["page_table"][:, -1].contiguous(),
                offset=torch.full((B,), PAGE - 1, dtype=torch.int64, device="cuda"))


def attention_bytes(inputs: dict, *, kv_bytes: int | None = None) -> int:
    """What TieredAttention must move: K and V of the kept pages (or ``kv_bytes``), q, the page
    list (table, mask, index), out, lse, page_probs."""
    q = inputs["q"]
    B, H, T, D = q.shape
    M = inputs["page_table"].shape[1]
    _, KVH, P, _ = inputs["k_pool"].shape
    if kv_bytes is None:
        kept = int((inputs["page_mask"] != 0).sum())
        kv_bytes = 2 * kept * KVH * P * D * inputs["k_pool"].element_size()
    return kv_bytes + 2 * q.numel() * 4 + B * H * T * (M + 1) * 4 + B * M * 20 + 2 * B * 8


# ----------------------------------------------------------------------------- checks


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return math.inf
    if not a.numel():
        return 0.0
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = (a - b).abs().masked_fill(both_inf, 0.0)
    return float(diff.nan_to_num(math.inf).max())


def _compare(name: str, got, ref, tol: float) -> Check:
    errors = {k: _err(g, r) for k, g, r in zip(("out", "lse", "page_probs"), got, ref)}
    ok = all(e <= tol for e in errors.values())
    return Check(name, ok, f"max abs error {max(errors.values()):.2e} (tolerance {tol:.0e})", errors)


def _cpu(inputs: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def run_checks(lib, args) -> list[Check]:
    cfg = preset(CHECK_PRESET)
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    checks = []
    for listed, kept in ((1.0, 1.0), (0.25, 1.0), (1.0, 0.25)):
        tag = f"{CHECK_PRESET} ctx={args.check_context} listed={int(listed * 100)}% kept={int(kept * 100)}% fp16"
        inputs = decode_inputs(B=1, H=H, KVH=KVH, D=D, context=args.check_context, listed=listed,
                               dtype=torch.float16, seed=7, kept=kept)
        ref = tiered_attention(**_cpu(inputs))
        M = inputs["page_table"].shape[1]
        plan = device_plan(lib, inputs)
        got = cuda_ops.tiered_attention(**inputs, lib=lib)
        checks.append(_compare(f"TieredAttention [{tag}, {plan['splits']} splits, {plan['blocks_per_sm']} "
                               f"blocks / SM, tensor cores {plan['tensor_cores']}]", got, ref, TOLERANCE))
        got = cuda_ops.tiered_attention(**inputs, num_splits=1, lib=lib)
        checks.append(_compare(f"TieredAttention [{tag}, one split]", got, ref, TOLERANCE))

        # warm: half the listed pages int4, the pool as int32 words; their page_table entries point elsewhere
        desc = cuda_ops.codec_desc("int4", KVH, PAGE, D, lib=lib)
        warm = torch.arange(M, device="cuda") % 2 == 0
        src = inputs["page_table"][0, warm]
        enc = cuda_ops.encode_pages(inputs["k_pool"][src].float().contiguous(),
                                    inputs["v_pool"][src].float().contiguous(), desc, lib=lib)
        warm_row = torch.full((1, M), -1, dtype=torch.int64, device="cuda")
        warm_row[0, warm] = torch.arange(int(warm.sum()), device="cuda")
        table = inputs["page_table"].clone()
        table[0, warm] = (table[0, warm] + 1) % inputs["k_pool"].shape[0]
        warm_in = dict(inputs, page_table=table)
        words = codec.as_words(enc)
        ref_w = tiered_attention(**_cpu(warm_in), warm_pool=words.cpu(), warm_row=warm_row.cpu(), warm_codec="int4")
        got = cuda_ops.tiered_attention_warm(**warm_in, warm_pool=words, warm_row=warm_row, desc=desc, lib=lib)
        checks.append(_compare(f"TieredAttention warm int4 [{tag}, half the pages warm]", got, ref_w, TOLERANCE))

        s_in = score_inputs(inputs, args.check_context)
        weights = (0.4, 0.3, 0.3)
        ref_s = importance_score(**{k: v.float() if v.is_floating_point() else v for k, v in _cpu(s_in).items()},
                                 weights=weights, scale=D ** -0.5)
        for q_dtype in (torch.float32, torch.float16):
            got_s = cuda_ops.importance_score(**(s_in | dict(q=s_in["q"].to(q_dtype))), weights=weights,
                                              scale=D ** -0.5, lib=lib)
            err = _err(got_s, ref_s if q_dtype == torch.float32 else importance_score(
                **{k: v.float() if v.is_floating_point() else v for k, v in _cpu(s_in).items()
                   } | dict(q=s_in["q"].to(q_dtype).float().cpu()), weights=weights, scale=D ** -0.5))
            checks.append(Check(f"ImportanceScore [{tag}, fp16 summaries, q {str(q_dtype)[6:]}]", err <= TOLERANCE,
                                f"max abs error {err:.2e}", {"score": err}))

    inputs = decode_inputs(B=1, H=H, KVH=KVH, D=D, context=args.check_context, listed=1.0, dtype=torch.float16, seed=8)
    new = append_inputs(inputs)
    pools = (inputs["k_pool"].clone(), inputs["v_pool"].clone())
    ref_k, ref_v = kv_append(inputs["k_pool"].cpu(), inputs["v_pool"].cpu(), *(_cpu(new)[k] for k in new))
    copy = cuda_ops.kv_append(inputs["k_pool"], inputs["v_pool"], **new, lib=lib)
    cuda_ops.kv_append(*pools, **new, out=pools, lib=lib)
    for how, (k, v) in (("copy", copy), ("in place", pools)):
        ok = torch.equal(k.cpu(), ref_k) and torch.equal(v.cpu(), ref_v)
        checks.append(Check(f"KVAppend {how} [{CHECK_PRESET} ctx={args.check_context} fp16]", ok,
                            "bit-exact" if ok else "differs from the reference"))

    n = 64  # the CPU reference of the codec is slow: a slice of the pages
    k, v = inputs["k_pool"][:n].float().contiguous(), inputs["v_pool"][:n].float().contiguous()
    desc = cuda_ops.codec_desc("int4", KVH, PAGE, D, lib=lib)
    ref_bytes = codec.encode_pages(k.cpu(), v.cpu(), codec.CODECS["int4"])
    got_bytes = cuda_ops.encode_pages(k, v, desc, lib=lib)
    ref_dec = codec.decode_pages(ref_bytes, codec.CODECS["int4"], (KVH, PAGE, D))
    got_dec = cuda_ops.decode_pages(ref_bytes.to(k.device), desc, lib=lib)
    ok = torch.equal(got_bytes.cpu(), ref_bytes) and all(torch.equal(g.cpu(), r) for g, r in zip(got_dec, ref_dec))
    checks.append(Check(f"int4 encode / decode [{n} pages of {CHECK_PRESET}]", ok,
                        "bit-exact" if ok else "differs from the reference"))
    torch.cuda.empty_cache()
    return checks


# ----------------------------------------------------------------------------- timings


def bench_shape(lib, timer: Timer, model: str, cfg, context: int, listed: float, dtype: torch.dtype, args,
                kept: float = 1.0) -> None:
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inputs = decode_inputs(B=args.batch, H=H, KVH=KVH, D=D, context=context, listed=listed, dtype=dtype, kept=kept)
    B, M = inputs["page_table"].shape
    plan = device_plan(lib, inputs)
    dname = str(dtype).removeprefix("torch.")
    shape = (f"B={B} H={H} KVH={KVH} D={D} ctx={context} M={M} ({int(listed * 100)}% listed, "
             f"{int(kept * 100)}% kept) {dname}")
    q = inputs["q"]
    outs = (torch.empty_like(q), torch.empty(B, H, 1, device="cuda"), torch.empty(B, H, 1, M, device="cuda"))
    ws = torch.empty(max(1, cuda_ops.attention_workspace_bytes(B, H, 1, D, KVH, M, lib=lib)), dtype=torch.uint8,
                     device="cuda")
    timer("TieredAttention", model, shape, lambda: cuda_ops.tiered_attention(**inputs, out=outs, workspace=ws,
                                                                               lib=lib),
          attention_bytes(inputs), **plan)
    timer("TieredAttention (one split)", model, shape,
          lambda: cuda_ops.tiered_attention(**inputs, out=outs, num_splits=1, lib=lib), attention_bytes(inputs))

    s_in = score_inputs(inputs, context)
    score = torch.empty(B, M, device="cuda")
    s_ws = torch.empty(cuda_ops.importance_score_workspace_bytes(B, H, M, lib=lib), dtype=torch.uint8, device="cuda")
    timer("ImportanceScore", model, shape,
          lambda: cuda_ops.importance_score(**s_in, weights=(0.4, 0.3, 0.3), workspace=s_ws, out=score, lib=lib),
          score_bytes(s_in), summaries=dname, of_attention_bytes=round(score_bytes(s_in) / attention_bytes(inputs), 3))

    new = append_inputs(inputs)
    k_pool, v_pool = inputs["k_pool"], inputs["v_pool"]
    row_bytes = 2 * 2 * new["k_new"].numel() * k_pool.element_size() + B * 16  # read + write the rows, slot, offset
    timer("KVAppend (in place)", model, shape,
          lambda: cuda_ops.kv_append(k_pool, v_pool, **new, out=(k_pool, v_pool), lib=lib), row_bytes)
    copies = (torch.empty_like(k_pool), torch.empty_like(v_pool))
    pool_bytes = 2 * k_pool.numel() * k_pool.element_size()
    timer("KVAppend (copy + scatter)", model, shape,
          lambda: cuda_ops.kv_append(k_pool, v_pool, **new, out=copies, lib=lib), 2 * pool_bytes + row_bytes,
          pool_mib=round(pool_bytes / 2**20, 1))

    n = B * M
    src = inputs["page_table"].reshape(-1)
    k, v = k_pool[src].float().contiguous(), v_pool[src].float().contiguous()
    warm_row = torch.arange(n, device="cuda").view(B, M)
    for name in args.codecs:
        desc = cuda_ops.codec_desc(name, KVH, PAGE, D, lib=lib)
        data = torch.empty(n, desc.page_bytes, dtype=torch.uint8, device="cuda")
        floats = 2 * k.numel() * 4
        timer(f"encode_pages [{name}]", model, shape, lambda: cuda_ops.encode_pages(k, v, desc, out=data, lib=lib),
              floats + data.numel())
        dec = (torch.empty_like(k), torch.empty_like(v))
        timer(f"decode_pages [{name}]", model, shape, lambda: cuda_ops.decode_pages(data, desc, out=dec, lib=lib),
              data.numel() + floats)
        words = codec.as_words(data)
        timer(f"TieredAttention warm [{name}]", model, shape,
              lambda: cuda_ops.tiered_attention_warm(**inputs, warm_pool=words, warm_row=warm_row, desc=desc, out=outs,
                                                     workspace=ws, lib=lib),
              attention_bytes(inputs, kv_bytes=data.numel()),
              bits_per_value=round(8 * desc.page_bytes / (2 * KVH * PAGE * D), 2))


# ----------------------------------------------------------------------------- report


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_kernels.json").write_text(json.dumps(report, indent=2, default=str))
    copy = report.get("copy_gbps")
    lines = ["# tieredkv kernel check and benchmark", "",
             f"- device: {report.get('device', 'none')}; driver {report.get('driver', '?')}; torch {report['torch']}, "
             f"CUDA {report['torch_cuda']}",
             f"- library: `{report['library']}`; {report['date']}; `{report['command']}`",
             f"- device-to-device copy: {copy:.0f} GB/s (a 1 GiB torch copy); nominal HBM: {report['hbm_gbps']} GB/s"
             if copy else "- device-to-device copy: not measured", ""]
    checks = report.get("checks", [])
    if checks:
        lines += ["## Checks against the references", "", "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c['name']} | {'ok' if c['ok'] else '**MISMATCH**'} | {c['detail']} |" for c in checks]
        lines.append("")
    timings = report.get("timings", [])
    if timings:
        lines += ["## Timings", "",
                  "Per call (CUDA graph replays between one event pair); GB/s of the bytes each op must move "
                  "(K / V of the kept pages, or the encoded bytes, plus its other inputs and outputs).", "",
                  "| op | model | shape | µs | MB moved | GB/s | of HBM | of copy | notes |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in timings:
            of_copy = f"{100 * t['of_copy']:.0f} %" if t["of_copy"] is not None else "-"
            notes = ", ".join(f"{k}={v}" for k, v in t["extra"].items())
            lines.append(f"| {t['op']} | {t['model']} | {t['shape']} | {t['us']} | {t['bytes'] / 1e6:.2f} | "
                         f"{t['gb_per_s']} | {100 * t['of_hbm']:.0f} % | {of_copy} | {notes} |")
        lines.append("")
    for group, error in report.get("errors", {}).items():
        lines += [f"Error in `{group}`:", "", "```", error.strip(), "```", ""]
    (out / "bench_kernels.md").write_text("\n".join(lines) + "\n")


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", type=Path, default=None, help=f"libtieredkv_kernels.so (default: ${cuda_ops.ENV_VAR}, "
                                                           f"else {cuda_ops.DEFAULT_LIBRARY})")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_out"))
    ap.add_argument("--groups", nargs="+", default=["copy", "check", "timing"], choices=["copy", "check", "timing"])
    ap.add_argument("--presets", nargs="+", default=["smollm2-135m", "llama2-70b"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--listed", type=float, nargs="+", default=[1.0, 0.25],
                    help="shares of the pages listed (all kept)")
    ap.add_argument("--kept", type=float, nargs="*", default=[0.25],
                    help="shares of the pages kept by the mask, every page listed (the runtime's form; clustered)")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "float32"], choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--check-context", type=int, default=32768)
    ap.add_argument("--codecs", nargs="*", default=["int4", "fp8-r2"])
    ap.add_argument("--inner", type=int, default=10, help="calls captured per CUDA graph")
    ap.add_argument("--repeats", type=int, default=10, help="graph replays between the event pair")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="nominal HBM bandwidth (H200: 4800)")
    args = ap.parse_args(argv)
    report = {"library": str(cuda_ops.library_path(args.lib)), "torch": torch.__version__,
              "torch_cuda": torch.version.cuda, "host": platform.platform(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python", *sys.argv]), "hbm_gbps": args.hbm_gbps, "errors": {}}
    if not torch.cuda.is_available():
        report["errors"]["setup"] = "no CUDA device (torch.cuda.is_available() is False)"
        write_report(args.out, report)
        print(f"bench_kernels: {report['errors']['setup']}; nothing was run", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    report["device"] = f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)"
    report["driver"] = _driver()
    lib = cuda_ops.load_library(args.lib)
    copy_gbps = None

    def group(name: str, fn) -> None:
        print(f"bench_kernels: {name}", file=sys.stderr)
        try:
            fn()
        except Exception:  # one group's failure is reported; the others still run
            report["errors"][name] = traceback.format_exc()
            print(report["errors"][name], file=sys.stderr)
            torch.cuda.synchronize()
        write_report(args.out, report)

    if "copy" in args.groups:
        def run_copy() -> None:
            nonlocal copy_gbps
            copy_gbps = copy_bandwidth()
            report["copy_gbps"] = round(copy_gbps, 1)
            torch.cuda.empty_cache()
        group("copy", run_copy)
    if "check" in args.groups:
        def run_check() -> None:
            report["checks"] = [asdict(c) for c in run_checks(lib, args)]
        group("check", run_check)
    if "timing" in args.groups:
        timer = Timer(args, copy_gbps)
        report["timings"] = []
        for model in args.presets:
            for context in args.contexts:
                selections = [(listed, 1.0) for listed in args.listed] + [(1.0, kept) for kept in args.kept]
                for listed, kept in selections:
                    for dname in args.dtypes:
                        def run_shape(model=model, context=context, listed=listed, kept=kept, dname=dname) -> None:
                            bench_shape(lib, timer, model, preset(model), context, listed, getattr(torch, dname), args,
                                        kept=kept)
                            report["timings"] = [asdict(t) for t in timer.timings]
                            torch.cuda.empty_cache()  # the shape's tensors are gone with bench_shape
                        group(f"timing {model} ctx={context} listed={listed} kept={kept} {dname}", run_shape)
    write_report(args.out, report)
    failed = [c["name"] for c in report.get("checks", []) if not c["ok"]]
    for name in failed:
        print(f"bench_kernels: MISMATCH {name}", file=sys.stderr)
    return 1 if failed or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
