"""GPU check of the tieredkv CUDA kernels (libtieredkv_kernels.so, C ABI in
plugins/csrc/tieredkv_kernels.h) against the PyTorch references of ``tieredkv.plugins``.

For each op (TieredAttention, KVAppend, ImportanceScore) it draws fresh random inputs at
awkward sizes (GQA, odd head dims, P = 5, T > 1, padding columns with page_index = 1 << 40,
masked pages, a sequence that sees nothing, causal cuts inside pages), runs the kernel through
its PyTorch op of ``tieredkv.plugins.cuda_ops`` (the ctypes binding of the C ABI: torch CUDA
tensors, torch's current stream), and compares with the reference computed on the CPU
(float32 max abs error <= --tol; KVAppend bit-exact). The KV page codecs (every codec of
``codec.CODECS``, awkward page shapes, random and edge data: zeros, 1e-6, 6e4, subnormals,
NaN, ±Inf) are compared bit for bit: encode_pages on the GPU with the reference
bytes and with the library's host encoder, decode_pages with the reference floats. The warm
TieredAttention (pages read from an encoded warm pool: a mix of warm and pool pages, masked
warm pages, warm rows past the pool) is compared with ``tiered_attention(..., warm_pool=,
warm_row=, warm_codec=)`` at --tol. Then it times each kernel at real model shapes (SmolLM2-135M:
H=9, KVH=3, D=64; a Llama-2-70B-like layer: H=64, KVH=8, D=128; contexts 4k and 32k, P=16,
one decode token) with CUDA events (median of --repeats) and reports GB/s of the bytes each
call must move (decode_pages and warm TieredAttention: of the encoded bytes they read).

``tieredkv.plugins`` (the references and ``cuda_ops``) comes from this checkout, installed or
not: the script needs torch and a built library only. The library is ``--lib``, else
``$TIEREDKV_KERNELS``, else build/plugins/libtieredkv_kernels.so (``cuda_ops.load_library``).
The timings include each op's host side (argument checks, ctypes call) between the events.

Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md``; exits 0 when every check passes,
1 when a check fails, 2 when there is no CUDA device or the library cannot be loaded.

    python tools/gpu_check.py --lib build/plugins/libtieredkv_kernels.so --out gpu_out
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAD_PAGE_INDEX = 1 << 40


# --- the references and the CUDA ops, imported from this checkout ---------------------------


def _import_references() -> types.ModuleType:
    """``tieredkv.plugins`` from this checkout, whether or not tieredkv is installed: a bare
    ``tieredkv`` package over ``tieredkv/`` (its __init__ is not run) and ``tieredkv.plugins``
    over ``plugins/``, as pyproject's package-dir maps them."""
    if "tieredkv" not in sys.modules:
        pkg = types.ModuleType("tieredkv")
        pkg.__path__ = [str(ROOT / "tieredkv")]
        sys.modules["tieredkv"] = pkg
    if "tieredkv.plugins" not in sys.modules:
        spec = importlib.util.spec_from_file_location("tieredkv.plugins", ROOT / "plugins" / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / "plugins")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["tieredkv.plugins"] = mod
        spec.loader.exec_module(mod)
        sys.modules["tieredkv"].plugins = mod
    return sys.modules["tieredkv.plugins"]


_import_references()  # before the import below: this checkout's tieredkv.plugins, installed or not
from tieredkv.plugins import cuda_ops  # noqa: E402  (torch + ctypes only)


def _kv_append_reference():
    """(function, where it came from): ``onnx_ops.kv_append`` needs the onnx package; without
    it, the same three lines (clone, then index-assign) stated here."""
    try:
        from tieredkv.plugins.onnx_ops import kv_append
        return kv_append, "tieredkv.plugins.onnx_ops.kv_append"
    except ImportError:
        def kv_append(k_pool, v_pool, k_new, v_new, slot, offset):
            k_out, v_out = k_pool.clone(), v_pool.clone()
            k_out[slot, :, offset] = k_new.to(k_out.dtype)
            v_out[slot, :, offset] = v_new.to(v_out.dtype)
            return k_out, v_out
        return kv_append, "gpu_check copy of onnx_ops.kv_append (onnx not installed)"


# --- correctness ------------------------------------------------------------------------------


@dataclass
class Check:
    op: str
    case: str
    errors: dict[str, float]
    ok: bool
    note: str = ""


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _lse_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error over finite entries; inf when the -inf pattern differs or a NaN appears."""
    if torch.isnan(got).any() or not torch.equal(torch.isinf(got), torch.isinf(ref)):
        return math.inf
    finite = torch.isfinite(ref)
    return _max_err(got[finite], ref[finite])


def attention_inputs(gen: torch.Generator, *, B, H, KVH, T, D, P, M, pad, C, empty_row):
    """Random TieredAttention inputs (CPU): shuffled logical pages, ~80% kept, the last `pad`
    columns padding (page_index 1 << 40, some of them even marked kept), causal cuts inside
    pages, and optionally a first sequence that sees nothing (seq_len 0)."""
    real = M - pad
    q = torch.randn(B, H, T, D, generator=gen)
    k_pool = torch.randn(C, KVH, P, D, generator=gen)
    v_pool = torch.randn(C, KVH, P, D, generator=gen)
    page_table = torch.randint(0, C, (B, M), generator=gen)
    page_index = torch.full((B, M), PAD_PAGE_INDEX, dtype=torch.int64)
    for b in range(B):
        page_index[b, :real] = torch.randperm(real, generator=gen)
    page_mask = torch.rand(B, M, generator=gen) < 0.8
    seq_len = torch.randint(1, real * P + 1, (B,), generator=gen)
    if empty_row:
        seq_len[0] = 0
    past = (seq_len - T - torch.randint(0, 2 * P, (B,), generator=gen)).clamp(min=0)
    return q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past


def check_attention(lib: ctypes.CDLL, refs, gen: torch.Generator, tol: float) -> list[Check]:
    cases = [
        dict(B=3, H=9, KVH=3, T=1, D=64, P=16, M=9, pad=2, C=23, empty_row=True),
        dict(B=3, H=9, KVH=3, T=3, D=64, P=5, M=11, pad=3, C=17, empty_row=False),
        dict(B=2, H=6, KVH=2, T=2, D=80, P=7, M=6, pad=1, C=9, empty_row=False),
        dict(B=1, H=8, KVH=8, T=4, D=128, P=16, M=13, pad=0, C=13, empty_row=False),
        dict(B=2, H=4, KVH=1, T=1, D=256, P=4, M=5, pad=1, C=7, empty_row=True),
        dict(B=2, H=8, KVH=2, T=2, D=128, P=16, M=300, pad=20, C=320, empty_row=False),
    ]
    checks = []
    for case in cases:
        inputs = attention_inputs(gen, **case)
        scale = case["D"] ** -0.5
        ref_out, ref_lse, ref_probs = refs.tiered_attention(*inputs, scale=scale)
        dev = [x.cuda() for x in inputs]
        got = cuda_ops.tiered_attention(*dev, scale=scale, lib=lib)
        torch.cuda.synchronize()
        got_out, got_lse, got_probs = (x.cpu() for x in got)
        errors = {"out": _max_err(got_out, ref_out), "lse": _lse_err(got_lse, ref_lse),
                  "page_probs": _max_err(got_probs, ref_probs)}
        ok = all(e <= tol for e in errors.values()) and not torch.isnan(got_out).any()
        name = ", ".join(f"{k}={v}" for k, v in case.items())
        checks.append(Check("TieredAttention", name, errors, ok,
                            f"{int((ref_lse == -math.inf).sum())} queries see nothing"))
    return checks


def check_kv_append(lib: ctypes.CDLL, kv_append, gen: torch.Generator) -> list[Check]:
    checks = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for C, KVH, P, D, N in ((20, 3, 16, 64, 7), (11, 2, 5, 80, 30), (4, 8, 16, 128, 1)):
            k_pool = torch.randn(C, KVH, P, D, generator=gen).to(dtype)
            v_pool = torch.randn(C, KVH, P, D, generator=gen).to(dtype)
            k_new = torch.randn(N, KVH, D, generator=gen).to(dtype)
            v_new = torch.randn(N, KVH, D, generator=gen).to(dtype)
            where = torch.randperm(C * P, generator=gen)[:N]  # distinct (slot, offset) pairs
            slot, offset = where // P, where % P
            ref_k, ref_v = kv_append(k_pool, v_pool, k_new, v_new, slot, offset)
            dev = [x.cuda() for x in (k_pool, v_pool, k_new, v_new, slot, offset)]
            k_out, v_out = torch.empty_like(dev[0]), torch.empty_like(dev[1])
            cuda_ops.kv_append(*dev, out=(k_out, v_out), lib=lib)  # copy + scatter
            k_in_place, v_in_place = dev[0].clone(), dev[1].clone()
            cuda_ops.kv_append(k_in_place, v_in_place, *dev[2:], out=(k_in_place, v_in_place), lib=lib)  # scatter only
            torch.cuda.synchronize()
            exact = {
                "copy": torch.equal(k_out.cpu(), ref_k) and torch.equal(v_out.cpu(), ref_v),
                "in_place": torch.equal(k_in_place.cpu(), ref_k) and torch.equal(v_in_place.cpu(), ref_v),
                "inputs_untouched": torch.equal(dev[0].cpu(), k_pool) and torch.equal(dev[1].cpu(), v_pool),
            }
            errors = {"copy": _max_err(k_out.cpu(), ref_k) + _max_err(v_out.cpu(), ref_v),
                      "in_place": _max_err(k_in_place.cpu(), ref_k) + _max_err(v_in_place.cpu(), ref_v)}
            name = f"dtype={str(dtype).removeprefix('torch.')}, C={C}, KVH={KVH}, P={P}, D={D}, N={N}"
            checks.append(Check("KVAppend", name, errors, all(exact.values()),
                                "bit-exact: " + ", ".join(f"{k}={v}" for k, v in exact.items())))
    return checks


def importance_inputs(gen: torch.Generator, *, B, H, KVH, D, M, NB, P, empty_row):
    q = torch.randn(B, H, D, generator=gen)
    a, b = torch.randn(B, M, KVH, D, generator=gen), torch.randn(B, M, KVH, D, generator=gen)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    page_tokens = torch.randint(0, P + 1, (B, M), generator=gen)
    edges = torch.tensor([0, 1, 15, 16, 17, 31, 32, 33, 1023, 1024, PAD_PAGE_INDEX, -3])
    distance = torch.where(torch.rand(B, M, generator=gen) < 0.5,
                           edges[torch.randint(0, len(edges), (B, M), generator=gen)],
                           torch.randint(0, 1 << 20, (B, M), generator=gen))
    saliency = torch.rand(B, M, generator=gen)
    page_mask = torch.rand(B, M, generator=gen) < 0.75
    if empty_row:
        page_mask[0] = False
    position_table = torch.randn(NB, generator=gen) * 0.7 + 0.5  # some values outside [0, 1]: clipped
    return q, kmin, kmax, page_tokens, distance, saliency, page_mask, position_table


def check_importance(lib: ctypes.CDLL, refs, gen: torch.Generator, tol: float) -> list[Check]:
    cases = [
        (dict(B=3, H=9, KVH=3, D=64, M=37, NB=12, P=16, empty_row=True), (0.4, 0.3, 0.3)),
        (dict(B=3, H=9, KVH=3, D=64, M=37, NB=12, P=16, empty_row=False), (0.0, 0.5, 0.5)),
        (dict(B=2, H=6, KVH=2, D=80, M=5, NB=1, P=5, empty_row=False), (1.0, 0.0, 0.0)),
        (dict(B=2, H=64, KVH=8, D=128, M=2048, NB=16, P=16, empty_row=False), (0.4, 0.3, 0.3)),
    ]
    checks = []
    for case, weights in cases:
        inputs = importance_inputs(gen, **case)
        scale = case["D"] ** -0.5
        ref = refs.importance_score(*inputs, weights, scale=scale)
        dev = [x.cuda() for x in inputs]
        got = cuda_ops.importance_score(*dev, weights, scale=scale, lib=lib)
        torch.cuda.synchronize()
        err = _max_err(got.cpu(), ref)
        name = ", ".join(f"{k}={v}" for k, v in case.items()) + f", weights={weights}"
        checks.append(Check("ImportanceScore", name, {"score": err}, err <= tol and not torch.isnan(got).any()))
    return checks


# --- KV page codecs ----------------------------------------------------------------------------

#: (page shape [KVH, P, D], pages N): SmolLM2 and 70B-like pages, odd page sizes (codes padded to
#: whole units of 4, groups not starting on byte boundaries), D not a multiple of the group, P = 1
CODEC_SHAPES = [((3, 16, 64), 7), ((2, 7, 12), 5), ((1, 5, 3), 3), ((8, 16, 128), 4), ((2, 13, 80), 2),
                ((4, 1, 256), 3)]
CODEC_DATA = ("random", "edge", "signed zeros")


def codec_pages(gen: torch.Generator, n: int, shape: tuple[int, int, int], kind: str) -> torch.Tensor:
    """Pages [n, KVH, P, D] float32 (CPU) to encode.

    * ``random``: normal * 3;
    * ``edge``: each token row (n, h, t) one of: zeros, ~1e-6, ~±6e4, subnormals ~1e-40, normal * 3,
      normal * 1e5 (beyond float16: zero points and keyframes saturate) (row kind (n + t) % 6; with
      n > 1 page 0 is all zeros), then NaN and +Inf at a few positions
      anywhere and -Inf at a few positions of non-zero rows;
    * ``signed zeros``: ``edge`` plus -0.0 and -Inf inside zero rows: groups whose sanitized
      values are zeros of both signs (the asymmetric codecs store their minimum, +0 or -0 by
      torch's reduction order, as a zero point canonicalized to +0).
    """
    kvh, p, d = shape
    if kind == "random":
        return torch.randn(n, kvh, p, d, generator=gen) * 3
    if kind not in CODEC_DATA:
        raise ValueError(f"unknown codec data kind {kind!r}")
    sign = torch.where(torch.rand(n, kvh, p, d, generator=gen) < 0.5, -1.0, 1.0)
    normal = torch.randn(n, kvh, p, d, generator=gen)
    by_kind = [torch.zeros(n, kvh, p, d), normal * 1e-6, sign * 6e4 * (1 + 0.03 * normal), normal * 1e-40,
               normal * 3, normal * 1e5]
    row_kind = (torch.arange(n).view(n, 1, 1, 1) + torch.arange(p).view(1, 1, p, 1)) % len(by_kind)
    if n > 1:
        row_kind = torch.where(torch.arange(n).view(n, 1, 1, 1) == 0, 0, row_kind)
    row_kind = row_kind.expand(n, kvh, p, d)
    x = torch.zeros(n, kvh, p, d)
    for i, values in enumerate(by_kind):
        x = torch.where(row_kind == i, values, x)
    flat, zero_row = x.view(-1), (row_kind == 0).reshape(-1)
    few = max(2, flat.numel() // 128)
    order = torch.randperm(flat.numel(), generator=gen)  # distinct positions for the special values
    anywhere = order[: 2 * few]
    flat[anywhere] = torch.tensor([float("nan"), float("inf")])[torch.arange(2 * few) % 2]
    rest = order[2 * few:]
    flat[rest[~zero_row[rest]][:few]] = float("-inf")
    if kind == "signed zeros":
        zero_pos = rest[zero_row[rest]][: 4 * few]
        flat[zero_pos] = torch.tensor([-0.0, float("-inf")])[torch.arange(len(zero_pos)) % 2]
    return x


def check_codecs(lib: ctypes.CDLL, gen: torch.Generator) -> list[Check]:
    """Every codec at CODEC_SHAPES on every CODEC_DATA kind: GPU encode == host encode == the
    reference bytes, GPU decode == the reference floats."""
    from tieredkv.plugins import codec

    checks = []
    for name, spec in codec.CODECS.items():
        for shape, n in CODEC_SHAPES:
            desc = cuda_ops.codec_desc(name, *shape, lib=lib)
            exact = {"encode=host": True, "encode=reference": True, "decode=reference": True}
            errors = {"encode bytes differing": 0.0, "decode max abs error": 0.0}
            for kind in CODEC_DATA:
                k, v = codec_pages(gen, n, shape, kind), codec_pages(gen, n, shape, kind)
                ref = codec.encode_pages(k, v, spec)
                host = cuda_ops.encode_pages_host(k, v, desc, lib=lib)
                got = cuda_ops.encode_pages(k.cuda(), v.cuda(), desc, lib=lib).cpu()
                ref_k, ref_v = codec.decode_pages(ref, spec, shape)
                dec_k, dec_v = (x.cpu() for x in cuda_ops.decode_pages(ref.cuda(), desc, lib=lib))
                torch.cuda.synchronize()
                exact["encode=host"] &= torch.equal(got, host)
                exact["encode=reference"] &= torch.equal(got, ref)
                exact["decode=reference"] &= torch.equal(dec_k, ref_k) and torch.equal(dec_v, ref_v)
                errors["encode bytes differing"] += float((got != ref).sum())
                errors["decode max abs error"] = max(errors["decode max abs error"],
                                                     _max_err(dec_k.nan_to_num(), ref_k.nan_to_num()),
                                                     _max_err(dec_v.nan_to_num(), ref_v.nan_to_num()))
            case = f"codec={name}, KVH,P,D={shape}, N={n}, data: {', '.join(CODEC_DATA)}"
            checks.append(Check("KV codec", case, errors, all(exact.values()),
                                "bit-exact: " + ", ".join(f"{k}={v}" for k, v in exact.items())))
    return checks


def warm_inputs(gen: torch.Generator, spec, inputs, W: int):
    """A warm pool of W random pages encoded with `spec` and warm rows for `inputs`' page list:
    ~45% warm, ~10% warm rows past the pool (the kernel masks them), ~5% other negative rows (read
    from the pools, like -1). Returns (warm_pool, warm_row, reference mask, reference warm_row)."""
    from tieredkv.plugins import codec

    _, k_pool, _, page_table, page_mask, *_ = inputs
    _, kvh, p, d = k_pool.shape
    b, m = page_table.shape
    warm_pool = codec.encode_pages(torch.randn(W, kvh, p, d, generator=gen) * 1.5,
                                   torch.randn(W, kvh, p, d, generator=gen) * 1.5, spec)
    u = torch.rand(b, m, generator=gen)
    warm_row = torch.full((b, m), -1, dtype=torch.int64)
    warm_row = torch.where(u < 0.45, torch.randint(0, W, (b, m), generator=gen), warm_row)
    warm_row = torch.where(u > 0.9, W + torch.randint(0, 3, (b, m), generator=gen), warm_row)
    warm_row = torch.where((u > 0.85) & (u <= 0.9), -torch.randint(2, 9, (b, m), generator=gen), warm_row)
    ref_mask = page_mask & (warm_row < W)  # a row past the pool is masked
    ref_row = torch.where(warm_row >= W, -1, warm_row)
    return warm_pool, warm_row, ref_mask, ref_row


def check_warm_attention(lib: ctypes.CDLL, refs, gen: torch.Generator, tol: float) -> list[Check]:
    """Warm TieredAttention vs tiered_attention(..., warm_pool=, warm_row=, warm_codec=): every
    codec at a SmolLM2-like shape and at one of the awkward shapes."""
    from tieredkv.plugins import codec

    awkward = [
        dict(B=3, H=9, KVH=3, T=3, D=64, P=5, M=11, pad=3, C=17, empty_row=False, W=13),
        dict(B=2, H=6, KVH=2, T=2, D=80, P=7, M=6, pad=1, C=9, empty_row=False, W=5),
        dict(B=1, H=8, KVH=8, T=4, D=128, P=16, M=13, pad=0, C=13, empty_row=False, W=20),
        dict(B=2, H=4, KVH=1, T=1, D=256, P=4, M=5, pad=1, C=7, empty_row=True, W=3),
        dict(B=2, H=6, KVH=3, T=2, D=12, P=13, M=9, pad=2, C=8, empty_row=False, W=7),
        dict(B=2, H=8, KVH=2, T=2, D=128, P=16, M=300, pad=20, C=320, empty_row=False, W=290),
        dict(B=2, H=6, KVH=2, T=1, D=3, P=16, M=7, pad=1, C=5, empty_row=False, W=6),
    ]
    smol = dict(B=3, H=9, KVH=3, T=1, D=64, P=16, M=9, pad=2, C=23, empty_row=True, W=11)
    checks = []
    for i, (name, spec) in enumerate(codec.CODECS.items()):
        for case in (smol, awkward[i % len(awkward)]):
            shape = {k: v for k, v in case.items() if k != "W"}
            inputs = attention_inputs(gen, **shape)
            warm_pool, warm_row, ref_mask, ref_row = warm_inputs(gen, spec, inputs, case["W"])
            q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past = inputs
            scale = case["D"] ** -0.5
            ref_out, ref_lse, ref_probs = refs.tiered_attention(q, k_pool, v_pool, page_table, ref_mask, page_index,
                                                                seq_len, past, scale=scale, warm_pool=warm_pool,
                                                                warm_row=ref_row, warm_codec=name)
            desc = cuda_ops.codec_desc(name, case["KVH"], case["P"], case["D"], lib=lib)
            dev = [x.cuda() for x in inputs]
            got = cuda_ops.tiered_attention_warm(*dev, warm_pool.cuda(), warm_row.cuda(), desc, scale=scale, lib=lib)
            torch.cuda.synchronize()
            got_out, got_lse, got_probs = (x.cpu() for x in got)
            errors = {"out": _max_err(got_out, ref_out), "lse": _lse_err(got_lse, ref_lse),
                      "page_probs": _max_err(got_probs, ref_probs)}
            ok = all(e <= tol for e in errors.values()) and not torch.isnan(got_out).any()
            kept = page_mask
            note = (f"kept pages: {int((kept & (warm_row >= 0) & (warm_row < case['W'])).sum())} warm, "
                    f"{int((kept & (warm_row < 0)).sum())} pool, {int((kept & (warm_row >= case['W'])).sum())} "
                    f"past the pool; {int((~kept & (warm_row >= 0)).sum())} warm masked")
            checks.append(Check("TieredAttention warm", f"codec={name}, " + ", ".join(f"{k}={v}" for k, v in case.items()),
                                errors, ok, note))
    return checks


# --- timing -----------------------------------------------------------------------------------

MODELS = [("SmolLM2-135M", 9, 3, 64), ("llama2-70b-like", 64, 8, 128)]
CONTEXTS = [4096, 32768]


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
    """Median milliseconds of `fn` (3 warm-up calls), each timed with CUDA events."""
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


def _timing(op, model, shape, ms, nbytes, **extra) -> Timing:
    return Timing(op, model, shape, round(ms * 1e3, 2), int(nbytes), round(nbytes / (ms * 1e-3) / 1e9, 1), extra)


def _decode_step(B: int, H: int, T: int, D: int, M: int, ctx: int, dev):
    """Queries and page list of a decode step over every page of a ``ctx``-token context:
    (q, page_mask, page_index, seq_len, past, (out, lse, page_probs) buffers)."""
    q = torch.randn(B, H, T, D, device=dev)
    page_mask = torch.ones(B, M, dtype=torch.bool, device=dev)
    page_index = torch.arange(M, device=dev).repeat(B, 1)
    seq_len = torch.full((B,), ctx, dtype=torch.int64, device=dev)
    out = (torch.empty_like(q), torch.empty(B, H, T, device=dev), torch.empty(B, H, T, M, device=dev))
    return q, page_mask, page_index, seq_len, seq_len - T, out


def _timed_shapes(page_size: int):
    """(model, H, KVH, D, context, pages per sequence) of every timed case."""
    for model, H, KVH, D in MODELS:
        for ctx in CONTEXTS:
            yield model, H, KVH, D, ctx, ctx // page_size


def time_kernels(lib: ctypes.CDLL, repeats: int, batch: int) -> list[Timing]:
    timings = []
    dev = torch.device("cuda")
    B, T, P = batch, 1, 16
    for model, H, KVH, D, ctx, M in _timed_shapes(P):
        C = B * M
        shape = f"B={B} H={H} KVH={KVH} D={D} ctx={ctx} P={P} M={M} T={T}"
        # TieredAttention over every page of the context, pages scattered over the pool
        q, page_mask, page_index, seq_len, past, out = _decode_step(B, H, T, D, M, ctx, dev)
        k_pool = torch.randn(C, KVH, P, D, device=dev)
        v_pool = torch.randn(C, KVH, P, D, device=dev)
        page_table = torch.randperm(C, device=dev).view(B, M)
        ms = _time(lambda: cuda_ops.tiered_attention(q, k_pool, v_pool, page_table, page_mask, page_index,
                                                     seq_len, past, scale=D ** -0.5, out=out, lib=lib), repeats)
        kv_bytes = 2 * B * M * P * KVH * D * 4
        io_bytes = 2 * q.numel() * 4 + B * H * T * (M + 1) * 4 + B * M * 17
        timings.append(_timing("TieredAttention", model, shape, ms, kv_bytes + io_bytes))
        # ImportanceScore over the same pages
        kmin = torch.randn(B, M, KVH, D, device=dev)
        kmax = kmin + torch.rand(B, M, KVH, D, device=dev)
        page_tokens = torch.full((B, M), P, dtype=torch.int64, device=dev)
        distance = (ctx - (torch.arange(M, device=dev) + 1) * P).repeat(B, 1)
        saliency = torch.rand(B, M, device=dev)
        position_table = torch.rand(16, device=dev)
        score = torch.empty(B, M, device=dev)
        qs = q[:, :, 0].contiguous()
        ms = _time(lambda: cuda_ops.importance_score(qs, kmin, kmax, page_tokens, distance, saliency, page_mask,
                                                     position_table, (0.4, 0.3, 0.3), scale=D ** -0.5, out=score,
                                                     lib=lib), repeats)
        timings.append(_timing("ImportanceScore", model, shape, ms, 2 * kmin.numel() * 4 + B * M * (8 + 8 + 4 + 1 + 4)))
        # KVAppend of one token per sequence: in place (scatter only) and as the plugin runs it
        # (copy both pools to the outputs, then scatter)
        k_new = torch.randn(B, KVH, D, device=dev)
        v_new = torch.randn(B, KVH, D, device=dev)
        slot = page_table[:, -1].contiguous()
        offset = torch.full((B,), P - 1, dtype=torch.int64, device=dev)
        new_bytes = 2 * 2 * k_new.numel() * 4
        ms = _time(lambda: cuda_ops.kv_append(k_pool, v_pool, k_new, v_new, slot, offset, out=(k_pool, v_pool),
                                              lib=lib), repeats)
        timings.append(_timing("KVAppend (in place)", model, shape, ms, new_bytes))
        k_out, v_out = torch.empty_like(k_pool), torch.empty_like(v_pool)
        ms = _time(lambda: cuda_ops.kv_append(k_pool, v_pool, k_new, v_new, slot, offset, out=(k_out, v_out),
                                              lib=lib), repeats)
        timings.append(_timing("KVAppend (copy + scatter)", model, shape, ms,
                               2 * 2 * k_pool.numel() * 4 + new_bytes, pool_mib=round(2 * k_pool.numel() * 4 / 2**20, 1)))
        del k_pool, v_pool, k_out, v_out, kmin, kmax
        torch.cuda.empty_cache()
    return timings


def time_codecs(lib: ctypes.CDLL, repeats: int, batch: int) -> list[Timing]:
    """encode_pages / decode_pages of one layer's whole context and the warm TieredAttention over
    it (every listed page warm), per codec; GB/s of the encoded bytes written / read."""
    from tieredkv.plugins import codec

    timings = []
    dev = torch.device("cuda")
    B, T, P = batch, 1, 16
    for model, H, KVH, D, ctx, M in _timed_shapes(P):
        N = B * M
        shape = f"B={B} H={H} KVH={KVH} D={D} ctx={ctx} P={P} pages={N} T={T}"
        k = torch.randn(N, KVH, P, D, device=dev)
        v = torch.randn(N, KVH, P, D, device=dev)
        q, page_mask, page_index, seq_len, past, att_out = _decode_step(B, H, T, D, M, ctx, dev)
        page_table = torch.zeros(B, M, dtype=torch.int64, device=dev)  # ignored: every page is warm
        warm_row = torch.randperm(N, device=dev).view(B, M)
        float_bytes = 2 * k.numel() * 4
        for name in codec.CODECS:
            desc = cuda_ops.codec_desc(name, KVH, P, D, lib=lib)
            data = torch.empty(N, desc.page_bytes, dtype=torch.uint8, device=dev)
            enc_bytes = data.numel()
            ms = _time(lambda: cuda_ops.encode_pages(k, v, desc, out=data, lib=lib), repeats)
            timings.append(_timing(f"encode_pages [{name}]", model, shape, ms, enc_bytes,
                                   float_bytes_read=float_bytes))
            dec = (torch.empty_like(k), torch.empty_like(v))
            ms = _time(lambda: cuda_ops.decode_pages(data, desc, out=dec, lib=lib), repeats)
            timings.append(_timing(f"decode_pages [{name}]", model, shape, ms, enc_bytes,
                                   float_bytes_written=float_bytes))
            ms = _time(lambda: cuda_ops.tiered_attention_warm(q, k, v, page_table, page_mask, page_index,
                                                              seq_len, past, data, warm_row, desc,
                                                              scale=D ** -0.5, out=att_out, lib=lib), repeats)
            timings.append(_timing(f"TieredAttention warm [{name}]", model, shape, ms, enc_bytes,
                                   bits_per_value=round(8 * desc.page_bytes / (2 * KVH * P * D), 2)))
            del data, dec
        del k, v
        torch.cuda.empty_cache()
    return timings


# --- report -----------------------------------------------------------------------------------


def write_report(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    lines = ["# tieredkv GPU check", "",
             f"- result: **{report['result']}**",
             f"- device: {report.get('device', 'none')}",
             f"- library: `{report.get('library')}`",
             f"- torch {report.get('torch')}, CUDA {report.get('torch_cuda')}, {report.get('host')}",
             f"- tolerance (float32 max abs error): {report.get('tolerance')}",
             f"- KVAppend reference: {report.get('kv_append_reference', '-')}", ""]
    if report.get("error"):
        lines += [f"Error: {report['error']}", ""]
    if report.get("checks"):
        lines += ["## Correctness (kernel vs PyTorch reference, fresh random inputs)", "",
                  "| op | case | max abs errors | ok | note |", "|---|---|---|---|---|"]
        for c in report["checks"]:
            errs = ", ".join(f"{k} {v:.2e}" for k, v in c["errors"].items())
            lines.append(f"| {c['op']} | {c['case']} | {errs} | {'yes' if c['ok'] else '**NO**'} | {c['note']} |")
        lines.append("")
    if report.get("timings"):
        lines += ["## Timing (median of CUDA-event timed calls; GB/s of the bytes each call must move)", "",
                  "encode_pages / decode_pages / TieredAttention warm: MB and GB/s of the encoded pages "
                  "(written by encode, read by decode and by the warm attention, whose every listed page is "
                  "warm); the float32 bytes are in gpu_check.json.", "",
                  "| op | model | shape | median µs | MB moved | GB/s |", "|---|---|---|---|---|---|"]
        for t in report["timings"]:
            lines.append(f"| {t['op']} | {t['model']} | {t['shape']} | {t['median_us']} | "
                         f"{t['bytes'] / 1e6:.2f} | {t['gb_per_s']} |")
        lines.append("")
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Needs a CUDA device and torch with CUDA; without one it says so and exits 2.")
    parser.add_argument("--lib", type=Path, default=None,
                        help=f"path of libtieredkv_kernels.so (default: ${cuda_ops.ENV_VAR}, else "
                             f"{cuda_ops.DEFAULT_LIBRARY})")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_out"),
                        help="report directory (default: $OUT or ./gpu_out)")
    parser.add_argument("--tol", type=float, default=1e-4, help="float32 max abs error allowed (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per shape (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the timing shapes (default: %(default)s)")
    parser.add_argument("--no-timing", action="store_true", help="run the correctness checks only")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: fresh, recorded in the report)")
    args = parser.parse_args(argv)

    seed = args.seed if args.seed is not None else int(time.time_ns() % (2**31))
    report: dict = {"result": "not run", "library": str(cuda_ops.library_path(args.lib)), "torch": torch.__version__,
                    "torch_cuda": torch.version.cuda, "host": platform.platform(), "tolerance": args.tol, "seed": seed}
    if not torch.cuda.is_available():
        report["result"] = "no CUDA device"
        report["error"] = "torch.cuda.is_available() is False: no CUDA device (or torch built without CUDA)"
        write_report(args.out, report)
        print(f"gpu_check: no CUDA device here ({report['error']}); nothing was run. Report: {args.out}",
              file=sys.stderr)
        return 2
    report["device"] = f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
    try:
        lib = cuda_ops.load_library(args.lib)
    except cuda_ops.KernelLibraryError as exc:
        report["result"] = "library not loaded"
        report["error"] = f"cannot load the kernels: {exc}"
        write_report(args.out, report)
        print(f"gpu_check: {report['error']}", file=sys.stderr)
        return 2

    refs = _import_references()
    kv_append, report["kv_append_reference"] = _kv_append_reference()
    gen = torch.Generator().manual_seed(seed)
    checks: list[Check] = []
    try:
        checks += check_attention(lib, refs, gen, args.tol)
        checks += check_kv_append(lib, kv_append, gen)
        checks += check_importance(lib, refs, gen, args.tol)
        checks += check_codecs(lib, gen)
        checks += check_warm_attention(lib, refs, gen, args.tol)
    except RuntimeError as exc:  # a launch or execution error: report what ran so far
        report["error"] = str(exc)
    report["checks"] = [asdict(c) for c in checks]
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.op:20s} {c.case}  " +
              " ".join(f"{k}={v:.2e}" for k, v in c.errors.items()) + (f"  [{c.note}]" if c.note else ""))
    passed = bool(checks) and all(c.ok for c in checks) and "error" not in report

    if not args.no_timing and "error" not in report:
        try:
            timings = time_kernels(lib, args.repeats, args.batch) + time_codecs(lib, args.repeats, args.batch)
            report["timings"] = [asdict(t) for t in timings]
            for t in timings:
                print(f"time {t.op:34s} {t.model:16s} {t.shape}: {t.median_us} us, {t.gb_per_s} GB/s")
        except RuntimeError as exc:
            report["error"] = f"timing: {exc}"
            passed = False
    report["result"] = "pass" if passed else "FAIL"
    write_report(args.out, report)
    print(f"gpu_check: {report['result']} ({sum(c.ok for c in checks)}/{len(checks)} checks); report in {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
