"""Occupancy and expected share of HBM bandwidth of the tieredkv decode kernels on an H200, from the
``ptxas -v`` output of a build and the launch plan: the design judged before device time is spent.

No figure here is a measurement. The model (docs/roofline.md, "Kernel estimate"):

* **Occupancy** of each kernel instantiation as the CUDA occupancy calculator computes it for
  sm_90: registers per warp rounded up to 256, 64K registers, 228 KB of shared memory (static from
  ptxas + the launch's dynamic bytes + 1 KB reserved per block), 2,048 threads and 32 blocks per SM.
* **Plan**: the split plan of the design (``current``: the library's least-cost whole waves from
  that occupancy, splits balanced by kept pages; ``before``: about two waves, splits cut over listed
  columns), for a selection of the pages (``--kept`` of them, in 8 evenly spaced clusters or at
  random) of ``--batch`` sequences of ``--context`` tokens.
* **Time** of a launch: the blocks list-scheduled on the resident slots (the hardware block
  scheduler's greedy order); a block takes its fixed latencies (dependent round trips: L2 for the
  page lists, HBM for the first tile) plus its bytes at the slower of two rates: its share of HBM
  bandwidth among the resident blocks, and what its loads in flight sustain (Little's law: bytes in
  flight / HBM latency). ``current``: each warp keeps its ring of tiles (2 x 16 keys of K and V) in
  flight; ``before``: one key row of K and V per row group, a dependent round trip per row, an L2
  round trip per listed page. Plus a launch gap per dependent kernel (the merge's hidden by a
  programmatic dependent launch in ``current``) and the merge's latencies and bytes.
* **Share of HBM** = the bytes the op must move (as tools/bench_kernels.py counts them: K and V of
  the kept pages, q, the page lists, out, lse, page_probs) / time / 4.8 TB/s.

The latencies and launch gaps are assumptions (flags), not measurements; the GPU check calibrates
them (tools/bench_kernels.py reports the measured share). Tests: tests/tools/test_kernel_occupancy.py.

    python tools/kernel_occupancy.py --ptxas tests/tools/data/ptxas_sm90_current.txt --design current
    python tools/kernel_occupancy.py --ptxas tests/tools/data/ptxas_sm90_before.txt --design before
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tieredkv.errors import ConfigError
from tieredkv.models.config import preset

# ----------------------------------------------------------------------------- the GPU


@dataclass(frozen=True)
class GPUSpec:
    """An sm_90 GPU as the occupancy calculator and the model see it."""

    name: str = "NVIDIA H200 SXM"
    sms: int = 132
    regs_per_sm: int = 65536
    reg_alloc_unit: int = 256  # registers, per warp
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 228 * 1024
    smem_per_block: int = 227 * 1024
    smem_reserved: int = 1024  # per block, used by the system on sm_80+
    smem_alloc_unit: int = 128
    hbm_bytes_per_s: float = 4.8e12
    clock_hz: float = 1.98e9  # boost clock
    mma_fma_per_clk: int = 1024  # dense fp16 mma.sync per SM (half the datasheet's 989 TFLOP/s peak)
    fp32_fma_per_clk: int = 128


H200 = GPUSpec()


@dataclass(frozen=True)
class Assumptions:
    """Latencies and gaps the model assumes (not measured here)."""

    hbm_latency_ns: float = 800.0  # a dependent HBM round trip under load
    l2_latency_ns: float = 300.0  # a dependent L2 round trip under load
    launch_us: float = 1.5  # the gap before a dependent kernel starts (a CUDA graph's launch)
    pdl_launch_us: float = 0.3  # that gap with a programmatic dependent launch (its launch overlapped)


# ----------------------------------------------------------------------------- ptxas


@dataclass(frozen=True)
class KernelResources:
    """One entry function of ``ptxas -v``: registers, static shared memory, stack and spills."""

    name: str  # mangled
    registers: int
    static_smem: int
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def short(self) -> str:
        return describe(self.name)


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str, *, arch: str = "90") -> dict[str, KernelResources]:
    """Every entry function compiled for sm_``arch`` in ``ptxas -v`` output (nvcc ``-Xptxas -v``):
    {mangled name: resources}. Raises ConfigError when none is found."""
    out: dict[str, KernelResources] = {}
    name, stack = None, (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            name = m.group(1) if m.group(2) == arch else None
            stack = (0, 0, 0)
        elif name and (m := _PROPS.search(line)):
            stack = tuple(int(x) for x in m.groups())
        elif name and (m := _USED.search(line)):
            smem = _SMEM.search(line)
            out[name] = KernelResources(name, int(m.group(1)), int(smem.group(1)) if smem else 0, *stack)
            name = None
    if not out:
        raise ConfigError(f"no entry function compiled for sm_{arch} in the ptxas output (build with -Xptxas -v)")
    return out


_ELEMS = (("13__nv_bfloat16", "bf16"), ("6__half", "f16"), ("f", "f32"))


def _split_mangled(mangled: str) -> tuple[str, str]:
    """(the function's own name, the rest: template arguments and parameters) of an Itanium-mangled
    nested name ``_ZN<len><id>...``; the whole name and "" for another form."""
    if not mangled.startswith("_ZN"):
        return mangled, ""
    pos, name = 3, mangled
    while pos < len(mangled) and mangled[pos].isdigit():
        digits = re.match(r"\d+", mangled[pos:]).group(0)
        start = pos + len(digits)
        name = mangled[start:start + int(digits)]
        pos = start + int(digits)
    return name, mangled[pos:]


def describe(mangled: str) -> str:
    """A readable name of a tieredkv kernel from its mangled name, e.g. ``mma_split f16 D<=128``."""
    name, rest = _split_mangled(mangled)
    kind = name.removesuffix("_kernel")
    elem = next((tag for code, tag in _ELEMS if rest.startswith("I" + code)), "")
    ints = [int(x) for x in re.findall(r"Li(\d+)E", rest)]
    warm = " warm" if "WarmPages" in rest and "NoWarmPages" not in rest else ""
    if kind == "mma_split" and ints:
        return f"mma_split {elem} D<={ints[0]}{warm}"
    if kind in ("simt_split", "split") and len(ints) >= 2:
        return f"{kind} {elem} vec{ints[0]} q{ints[1]}{warm}"
    if kind == "bound" and ints:
        return f"bound {elem} vec{ints[0]}"
    return " ".join(x for x in (kind, elem) if x)


def find_kernel(kernels: dict[str, KernelResources], short: str) -> KernelResources:
    for k in kernels.values():
        if k.short == short:
            return k
    raise ConfigError(f"kernel {short!r} not in the ptxas output; it has {sorted(k.short for k in kernels.values())}")


# ----------------------------------------------------------------------------- occupancy


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    limiter: str
    by_registers: int
    by_smem: int
    by_threads: int


def occupancy(res: KernelResources, *, threads: int, dynamic_smem: int = 0, gpu: GPUSpec = H200) -> Occupancy:
    """Resident blocks per SM (the CUDA occupancy calculator's rules for sm_90)."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(res.registers * 32 / gpu.reg_alloc_unit) * gpu.reg_alloc_unit
    by_regs = (gpu.regs_per_sm // regs_per_warp) // warps if regs_per_warp else gpu.max_blocks_per_sm
    smem = res.static_smem + dynamic_smem
    if smem > gpu.smem_per_block:
        raise ConfigError(f"{res.short}: {smem} bytes of shared memory per block exceed {gpu.smem_per_block}")
    per_block = math.ceil((smem + gpu.smem_reserved) / gpu.smem_alloc_unit) * gpu.smem_alloc_unit
    by_smem = gpu.smem_per_sm // per_block
    by_threads = gpu.max_threads_per_sm // (warps * 32)
    limits = {"registers": by_regs, "shared memory": by_smem, "threads": by_threads,
              "blocks": gpu.max_blocks_per_sm}
    limiter = min(limits, key=limits.get)
    return Occupancy(limits[limiter], limiter, by_regs, by_smem, by_threads)


# ----------------------------------------------------------------------------- designs and plans

THREADS = 128  # the split kernels' block (4 warps)
WARPS = 4
MAX_QUERIES = 8
TILE_KEYS = 16
MMA_STAGES = 2


def mma_dim(d: int) -> int:
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def mma_smem_bytes(d: int, elem_bytes: int = 2) -> int:
    """Dynamic shared memory of the tensor-core kernel (attention_mma.cuh, mma_smem_bytes)."""
    return WARPS * MMA_STAGES * 2 * TILE_KEYS * (mma_dim(d) + 8) * elem_bytes


def row_blocks(B: int, H: int, T: int, KVH: int) -> int:
    per_kv = H // KVH * T
    return B * KVH * math.ceil(per_kv / min(per_kv, MAX_QUERIES))


def plan_current(B: int, H: int, T: int, KVH: int, M: int, *, slots: int) -> int:
    """Splits of the current chooser (tieredkv_kernels.h, tkv_tiered_attention_plan)."""
    rows = row_blocks(B, H, T, KVH)
    most = min(128, math.ceil(M / 4), 4096 // rows)
    best, cost = 1, None
    for s in range(1, max(most, 1) + 1):
        c = math.ceil(rows * s / slots) * (math.ceil(M / s) + 4) + (8 if s > 1 else 0)
        if cost is None or c < cost:
            best, cost = s, c
    return best


def plan_before(B: int, H: int, T: int, KVH: int, M: int, *, sms: int) -> tuple[int, int]:
    """(splits, listed columns per split) of the earlier chooser: about two waves of blocks."""
    rows = row_blocks(B, H, T, KVH)
    splits = max(1, min(math.ceil(2 * sms / rows), math.ceil(M / 4), 128, 1024 // rows))
    per = math.ceil(M / splits)
    return math.ceil(M / per), per


def kept_columns(M: int, kept: float, selection: str, seed: int = 0) -> list[bool]:
    """The kept columns of a listed row: ``clustered``: 8 evenly spaced runs of neighbouring pages;
    ``random``: a seeded uniform choice; ``recent``: the last pages."""
    n = max(1, round(kept * M))
    mask = [False] * M
    if selection == "clustered":
        run = math.ceil(n / 8)
        for c in range(8):
            start = c * M // 8
            for m in range(start, min(M, start + run)):
                mask[m] = True
    elif selection == "random":
        import random

        for m in random.Random(seed).sample(range(M), n):
            mask[m] = True
    elif selection == "recent":
        for m in range(M - n, M):
            mask[m] = True
    else:
        raise ConfigError(f"selection: expected clustered, random or recent, got {selection!r}")
    return mask


# ----------------------------------------------------------------------------- the time of a launch


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    KVH: int
    D: int
    P: int
    context: int
    kept: float
    selection: str = "clustered"
    T: int = 1
    elem_bytes: int = 2

    @property
    def M(self) -> int:
        return math.ceil(self.context / self.P)


@dataclass(frozen=True)
class Estimate:
    design: str
    batch: int
    kernel: str
    blocks_per_sm: int
    splits: int
    blocks: int
    waves: float
    kept_per_split_max: int
    kept_per_split_mean: float
    bytes: int
    us: float
    streaming_us: float
    share: float
    compute_ratio: float


def must_move(s: Shape) -> int:
    """Bytes TieredAttention must move (tools/bench_kernels.py, attention_bytes)."""
    kept = sum(kept_columns(s.M, s.kept, s.selection)) * s.B
    kv = 2 * kept * s.KVH * s.P * s.D * s.elem_bytes
    return kv + 2 * s.B * s.H * s.T * s.D * 4 + s.B * s.H * s.T * (s.M + 1) * 4 + s.B * s.M * 20 + 2 * s.B * 8


def schedule(durations: list[float], slots: int) -> float:
    """Makespan of blocks started in order on the first free of `slots` resident slots."""
    free = [0.0] * min(slots, len(durations))
    for d in durations:
        i = min(range(len(free)), key=free.__getitem__)
        free[i] += d
    return max(free, default=0.0)


def estimate(s: Shape, res: KernelResources, *, design: str, gpu: GPUSpec = H200,
             assume: Assumptions = Assumptions()) -> Estimate:
    """The model of one TieredAttention launch (module docstring)."""
    mask = kept_columns(s.M, s.kept, s.selection)
    K = sum(mask)
    page_kv = 2 * s.P * s.D * s.elem_bytes  # one page of one kv head, K and V
    rows = row_blocks(s.B, s.H, s.T, s.KVH)
    dyn = mma_smem_bytes(s.D, s.elem_bytes) if design == "current" else 0
    occ = occupancy(res, threads=THREADS, dynamic_smem=dyn, gpu=gpu)
    slots = gpu.sms * occ.blocks_per_sm
    hbm, l2 = assume.hbm_latency_ns * 1e-9, assume.l2_latency_ns * 1e-9
    if design == "current":
        S = plan_current(s.B, s.H, s.T, s.KVH, s.M, slots=slots)
        per_split = [(i + 1) * K // S - i * K // S for i in range(S)]
        tile = 2 * TILE_KEYS * s.D * s.elem_bytes
        inflight = WARPS * MMA_STAGES * tile  # each warp's ring in flight while it waits
        # mask scan, page lists, first tile; one split also reads the mask again at its end
        fixed = 2 * l2 + hbm + (l2 if S == 1 else 0.0)
        work = [n * page_kv for n in per_split]
        tiles_per_page = math.ceil(s.P / TILE_KEYS)
        latency_bound = [math.ceil(math.ceil(n / WARPS) * tiles_per_page / MMA_STAGES) * hbm for n in per_split]
        qgroups = rows // (s.B * s.KVH)
        # per tile of 16 keys: QK and PV, hi and lo terms: 4 * D / 16 mma of 16 x 8 x 16 FMAs
        fma = 4 * (s.D // 16) * 16 * 8 * 16 * s.B * K * s.KVH * qgroups * tiles_per_page
        compute_s = fma / (gpu.mma_fma_per_clk * gpu.clock_hz * gpu.sms)
    elif design == "before":
        S, per = plan_before(s.B, s.H, s.T, s.KVH, s.M, sms=gpu.sms)
        per_split = [sum(mask[i * per:(i + 1) * per]) for i in range(S)]
        listed = [len(mask[i * per:(i + 1) * per]) for i in range(S)]
        keys_per_warp = 32 // min(32, 2 ** math.ceil(math.log2(max(1, math.ceil(s.D * s.elem_bytes / 16)))))
        inflight = WARPS * keys_per_warp * 2 * s.D * s.elem_bytes  # one K and V row per row group
        fixed = l2
        work = [n * page_kv for n in per_split]
        # a warp's pages one after the other: an L2 round trip per listed page, one per key-row step
        steps = math.ceil(s.P / keys_per_warp)
        latency_bound = [math.ceil(c / WARPS) * l2 + math.ceil(n / WARPS) * steps * hbm
                         for c, n in zip(listed, per_split)]
        fma = 2 * s.D * s.H * s.T * K * s.B * s.P  # QK and PV per key and query, float32 FMAs
        compute_s = fma / (gpu.fp32_fma_per_clk * gpu.clock_hz * gpu.sms)
    else:
        raise ConfigError(f"design: expected current or before, got {design!r}")
    n_blocks = rows * S
    active = min(slots, n_blocks)
    share_bw = gpu.hbm_bytes_per_s / active
    block_bw = min(share_bw, inflight / hbm)
    durations = []
    for _ in range(rows):
        for w, lat in zip(work, latency_bound):
            durations.append(fixed + max(w / block_bw, lat))
    streaming = schedule(durations, slots)
    # current: both kernels are programmatic dependent launches (their launch overlaps the kernel before)
    gap = assume.pdl_launch_us if design == "current" else assume.launch_us
    total = gap * 1e-6 + streaming
    probs = s.B * s.H * s.T * s.M * 4
    if S > 1:
        partials = S * s.B * s.H * s.T * (s.D + 2) * 4
        total += gap * 1e-6 + 2 * l2 + (partials + 2 * probs) / gpu.hbm_bytes_per_s
    nbytes = must_move(s)
    return Estimate(design, s.B, res.short, occ.blocks_per_sm, S, n_blocks, n_blocks / slots, max(per_split),
                    K / S, nbytes, total * 1e6, streaming * 1e6, nbytes / total / gpu.hbm_bytes_per_s,
                    compute_s / max(streaming, 1e-12))


def score_bytes(s: Shape, *, summary_bytes: int, design: str) -> dict:
    """ImportanceScore's HBM bytes (every page competes): the summaries read once (``before``: once
    from HBM, 2 H / KVH times through L2), q, 25 bytes of page inputs and score per page, and
    (``current``) the bounds of the workspace, written back once (their read hits L2)."""
    summaries = s.B * s.M * 2 * s.KVH * s.D * summary_bytes
    base = summaries + s.B * s.H * s.D * 4 + s.B * s.M * 25
    bounds = s.B * s.H * s.M * 4 if design == "current" else 0  # written back once; read again from L2
    l2 = summaries * (2 * s.H // s.KVH) if design == "before" else summaries + 2 * bounds
    return {"hbm_bytes": base + bounds, "l2_bytes": l2, "of_attention": (base + bounds) / must_move(s)}


# ----------------------------------------------------------------------------- report


def report(kernels: dict[str, KernelResources], *, design: str, preset_name: str, batches: list[int], context: int,
           kept: float, selection: str, elem: str, assume: Assumptions) -> tuple[str, dict]:
    cfg = preset(preset_name)
    elem_bytes = {"f16": 2, "bf16": 2, "f32": 4}[elem]
    base = Shape(1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, context, kept, selection,
                 elem_bytes=elem_bytes)
    G = cfg.num_heads // cfg.num_kv_heads
    if design == "current":
        name = (f"mma_split {elem} D<={mma_dim(cfg.head_dim)}" if elem != "f32"
                else f"simt_split f32 vec4 q{8 if G > 4 else 4}")
    else:
        name = f"split {elem} vec{16 // elem_bytes} q{8 if G > 4 else 4}"
    res = find_kernel(kernels, name)
    rows = [estimate(replace(base, B=b), res, design=design, assume=assume) for b in batches]
    summary_bytes = 4 if design == "before" else elem_bytes
    scores = [score_bytes(replace(base, B=b), summary_bytes=summary_bytes, design=design) for b in batches]
    dyn = mma_smem_bytes(cfg.head_dim, elem_bytes) if design == "current" else 0
    lines = [f"Design `{design}`, kernel `{name}`: {res.registers} registers, {res.static_smem} B static + {dyn} B "
             f"dynamic shared memory, {res.spill_stores} B spill stores; {preset_name} ({cfg.num_heads} / "
             f"{cfg.num_kv_heads} heads, head dim {cfg.head_dim}), pages of 16, context {context:,}, "
             f"{100 * kept:g} % of the pages kept ({selection}), {elem} pools; H200 (132 SMs, 4.8 TB/s); "
             f"assumed HBM / L2 round trips {assume.hbm_latency_ns:g} / {assume.l2_latency_ns:g} ns, launch gap "
             f"{assume.launch_us:g} µs ({assume.pdl_launch_us:g} µs with PDL).", "",
             "| batch | blocks / SM | splits | blocks (waves) | kept pages per split, max / mean | MB moved | "
             "µs (streaming) | share of HBM | compute / memory time | ImportanceScore MB (of attention's) |",
             "|---:|---:|---:|---|---|---:|---|---:|---:|---|"]
    for e, sc in zip(rows, scores):
        lines.append(f"| {e.batch} | {e.blocks_per_sm} | {e.splits} | {e.blocks:,} ({e.waves:.2f}) | "
                     f"{e.kept_per_split_max} / {e.kept_per_split_mean:.1f} | {e.bytes / 1e6:,.1f} | "
                     f"{e.us:,.1f} ({e.streaming_us:,.1f}) | {100 * e.share:.0f} % | {e.compute_ratio:.2f} | "
                     f"{sc['hbm_bytes'] / 1e6:,.1f} ({100 * sc['of_attention']:.0f} %) |")
    data = {"design": design, "kernel": name, "resources": asdict(res), "assumptions": asdict(assume),
            "estimates": [asdict(e) for e in rows], "importance_score": scores}
    return "\n".join(lines) + "\n", data


def occupancy_table(kernels: dict[str, KernelResources]) -> str:
    """Every split / merge / score kernel of the log with its occupancy (the tensor-core kernels with
    the dynamic shared memory of their instantiation)."""
    lines = ["| kernel | registers | static smem B | dynamic smem B | spills B | blocks / SM | limited by |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for res in sorted(kernels.values(), key=lambda r: r.short):
        short = res.short
        if not re.match(r"(mma_split|simt_split|split|merge|bound|mix|relevance_share|importance_mix)\b", short):
            continue
        dyn = 0
        if short.startswith("mma_split"):
            dim = int(re.search(r"D<=(\d+)", short).group(1))
            dyn = mma_smem_bytes(dim)
        threads = 256 if short.startswith(("mix", "relevance_share", "importance_mix")) else THREADS
        occ = occupancy(res, threads=threads, dynamic_smem=dyn)
        lines.append(f"| `{short}` | {res.registers} | {res.static_smem} | {dyn} | {res.spill_stores} | "
                     f"{occ.blocks_per_sm} | {occ.limiter} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptxas", type=Path, required=True, help="ptxas -v output of a build (nvcc -Xptxas -v)")
    ap.add_argument("--design", choices=["current", "before"], default="current",
                    help="the kernels the log holds: current (tensor-core kernel, kept-page splits) or before")
    ap.add_argument("--preset", default="llama2-70b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--kept", type=float, default=0.25, help="share of the listed pages kept by the mask")
    ap.add_argument("--selection", choices=["clustered", "random", "recent"], default="clustered")
    ap.add_argument("--pool", choices=["f16", "bf16", "f32"], default="f16")
    ap.add_argument("--hbm-latency-ns", type=float, default=Assumptions.hbm_latency_ns)
    ap.add_argument("--l2-latency-ns", type=float, default=Assumptions.l2_latency_ns)
    ap.add_argument("--launch-us", type=float, default=Assumptions.launch_us)
    ap.add_argument("--pdl-launch-us", type=float, default=Assumptions.pdl_launch_us)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of markdown")
    args = ap.parse_args(argv)
    try:
        kernels = parse_ptxas(args.ptxas.read_text())
        assume = Assumptions(args.hbm_latency_ns, args.l2_latency_ns, args.launch_us, args.pdl_launch_us)
        md, data = report(kernels, design=args.design, preset_name=args.preset, batches=args.batches,
                          context=args.context, kept=args.kept, selection=args.selection, elem=args.pool,
                          assume=assume)
    except (ConfigError, OSError) as exc:
        ap.error(str(exc))
    if args.json:
        print(json.dumps(data))
    else:
        print(occupancy_table(kernels))
        print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
