"""tools/kernel_occupancy.py: ptxas parsing, the occupancy calculator, the split plans, the launch
model's arithmetic and its report, on the stored ptxas output of the kernels before and after the
roofline work (nvcc 13.0, sm_90; tests/tools/data)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import kernel_occupancy as ko  # noqa: E402

from tieredkv.errors import ConfigError  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
CURRENT = DATA / "ptxas_sm90_current.txt"
BEFORE = DATA / "ptxas_sm90_before.txt"
SEVENTY_B = ko.Shape(B=1, H=64, KVH=8, D=128, P=16, context=32768, kept=0.25)


@pytest.fixture(scope="module")
def current() -> dict:
    return ko.parse_ptxas(CURRENT.read_text())


@pytest.fixture(scope="module")
def before() -> dict:
    return ko.parse_ptxas(BEFORE.read_text())


def test_parse_reads_every_entry_function_of_the_samples(current, before):
    mma = ko.find_kernel(current, "mma_split f16 D<=128")
    assert (mma.registers, mma.static_smem, mma.spill_stores) == (162, 5424, 0)
    assert ko.find_kernel(current, "mma_split f16 D<=128 warm").spill_stores == 16
    assert len([k for k in current.values() if k.short.startswith("mma_split")]) == 12  # 2 types x 3 dims x warm
    assert len([k for k in current.values() if k.short.startswith("simt_split")]) == 16
    old = ko.find_kernel(before, "split f16 vec8 q8")
    assert (old.registers, old.static_smem) == (247, 33056)
    assert ko.find_kernel(before, "split f32 vec4 q8 warm").stack == 24
    with pytest.raises(ConfigError, match="not in the ptxas output"):
        ko.find_kernel(before, "mma_split f16 D<=128")


def test_parse_keeps_the_architecture_asked_and_refuses_an_empty_log():
    text = """ptxas info    : Compiling entry function '_ZN8tieredkv7kernels5mergeEv' for 'sm_80'
ptxas info    : Used 40 registers, used 1 barriers, 64 bytes smem
ptxas info    : Compiling entry function '_ZN8tieredkv7kernels12merge_kernelEv' for 'sm_90'
ptxas info    : Function properties for _ZN8tieredkv7kernels12merge_kernelEv
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers
"""
    (res,) = ko.parse_ptxas(text).values()
    assert (res.short, res.registers, res.static_smem, res.stack, res.spill_stores, res.spill_loads) == \
        ("merge", 32, 0, 8, 4, 12)
    assert list(ko.parse_ptxas(text, arch="80").values())[0].registers == 40
    with pytest.raises(ConfigError, match="no entry function compiled for sm_90"):
        ko.parse_ptxas("nvcc: nothing here\n")


def test_describe_names_the_template_arguments():
    assert ko.describe("_ZN8tieredkv7kernels9attention16mma_split_kernelI13__nv_bfloat16Li64ENS1_9WarmPagesEEEv") \
        == "mma_split bf16 D<=64 warm"
    assert ko.describe("_ZN8tieredkv7kernels9attention17simt_split_kernelIfLi4ELi8ENS1_11NoWarmPagesEEEv") \
        == "simt_split f32 vec4 q8"
    assert ko.describe("_ZN8tieredkv7kernels10importance12bound_kernelI6__halfLi8EEEvPKv") == "bound f16 vec8"
    assert ko.describe("plain_c_kernel") == "plain_c"  # not a nested name: the suffix dropped all the same


def test_occupancy_follows_the_calculator_rules():
    res = ko.KernelResources("k", registers=255, static_smem=33056)
    occ = ko.occupancy(res, threads=128)
    assert (occ.blocks_per_sm, occ.limiter) == (2, "registers")  # 8192 registers a warp: 8 warps
    assert ko.occupancy(replace(res, registers=168), threads=128).blocks_per_sm == 3  # 5376 a warp: 12 warps
    assert ko.occupancy(replace(res, registers=169), threads=128).blocks_per_sm == 2  # 5632 a warp: 11 warps
    # the 70B tensor-core kernel: 162 registers (3 blocks), 5424 + 69632 + 1024 reserved bytes (3 blocks)
    mma = ko.occupancy(ko.KernelResources("k", 162, 5424), threads=128, dynamic_smem=ko.mma_smem_bytes(128))
    assert (mma.by_registers, mma.by_smem, mma.blocks_per_sm) == (3, 3, 3)
    wide = ko.occupancy(ko.KernelResources("k", 128, 5424), threads=128, dynamic_smem=ko.mma_smem_bytes(256))
    assert (wide.blocks_per_sm, wide.limiter) == (1, "shared memory")
    small = ko.occupancy(ko.KernelResources("k", 16, 0), threads=128)
    assert small.blocks_per_sm == 16 and small.by_threads == 16
    with pytest.raises(ConfigError, match="exceed"):
        ko.occupancy(ko.KernelResources("k", 16, 200 * 1024), threads=128, dynamic_smem=30 * 1024)


def test_the_dynamic_shared_memory_of_the_tensor_core_kernel():
    # 4 warps x 2 stages x (K and V) x 16 keys x (D + 8) elements x 2 bytes
    assert [ko.mma_smem_bytes(d) for d in (16, 64, 80, 128, 256)] == [36864, 36864, 69632, 69632, 135168]


def test_the_plans_of_both_designs():
    slots = 132 * 3
    assert ko.plan_current(1, 64, 1, 8, 2048, slots=slots) == 49  # one wave of 392 blocks
    assert ko.plan_current(64, 64, 1, 8, 2048, slots=slots) == 3  # 3.88 waves
    assert ko.plan_current(1, 64, 1, 8, 3, slots=slots) == 1  # too few pages to split
    assert ko.plan_before(1, 64, 1, 8, 2048, sms=132) == (33, 63)  # the earlier rule: about two x SMs
    assert ko.plan_before(64, 64, 1, 8, 2048, sms=132) == (1, 2048)


@pytest.mark.parametrize("selection", ["clustered", "random", "recent"])
def test_kept_columns(selection):
    mask = ko.kept_columns(2048, 0.25, selection, seed=3)
    assert len(mask) == 2048 and sum(mask) == 512
    runs = sum(1 for m in range(2048) if mask[m] and (m == 0 or not mask[m - 1]))
    assert runs == {"clustered": 8, "recent": 1}.get(selection, runs)
    with pytest.raises(ConfigError, match="selection"):
        ko.kept_columns(10, 0.5, "stripes")


def test_the_plan_equals_the_library(tmp_path_factory):
    """The tool's copy of the chooser is the library's (tkv_tiered_attention_plan)."""
    from csrc_build import load_kernels, needs_nvcc  # noqa: F401

    import shutil

    if not (shutil.which("nvcc") and shutil.which("cmake")):
        pytest.skip("needs nvcc and cmake on PATH")
    from tieredkv.plugins import cuda_ops

    lib = load_kernels(tmp_path_factory)
    for B in (1, 2, 5, 16, 64):
        for H, KVH in ((64, 8), (9, 3), (32, 32)):
            for M in (1, 4, 5, 100, 512, 2048, 5000):
                for sms, per_sm in ((132, 3), (132, 1), (16, 2)):
                    want, _ = cuda_ops.attention_plan(B, H, 1, 128, KVH, M, sm_count=sms, blocks_per_sm=per_sm, lib=lib)
                    assert ko.plan_current(B, H, 1, KVH, M, slots=sms * per_sm) == want, (B, H, KVH, M, sms, per_sm)


def test_with_nothing_but_bandwidth_the_share_is_the_bytes_ratio(current):
    """No latency, no launch gap: the balanced splits of one wave stream the KV at the full HBM
    bandwidth, then the merge moves the partials and page_probs: the share is the bytes the op must
    move over those timed bytes."""
    res = ko.find_kernel(current, "mma_split f16 D<=128")
    none = ko.Assumptions(hbm_latency_ns=1e-6, l2_latency_ns=0.0, launch_us=0.0, pdl_launch_us=0.0)
    e = ko.estimate(replace(SEVENTY_B, B=16), res, design="current", assume=none)
    kv = 2 * 16 * 512 * 8 * 16 * 128 * 2
    merge = 3 * 16 * 64 * (128 + 2) * 4 + 2 * 16 * 64 * 2048 * 4
    assert e.splits == 3 and e.blocks == 384 and e.kept_per_split_max == 171  # 512 kept pages: 170, 171, 171
    streamed = kv * 171 * 3 / 512  # every slot busy as long as the largest split
    assert e.streaming_us == pytest.approx(1e6 * streamed / 4.8e12, rel=1e-6)
    assert e.share == pytest.approx(e.bytes / (streamed + merge), rel=1e-6)


def test_the_70b_estimates_before_and_after(current, before):
    """At the default assumptions: the earlier kernel leaves most of HBM idle (its clustered
    selection piles into few splits; one dependent round trip per key row); the tensor-core kernel
    reaches the goal from batch 2 on and loses batch 1 to its fixed latencies."""
    new = ko.find_kernel(current, "mma_split f16 D<=128")
    old = ko.find_kernel(before, "split f16 vec8 q8")
    after = {b: ko.estimate(replace(SEVENTY_B, B=b), new, design="current") for b in (1, 2, 8, 64)}
    was = {b: ko.estimate(replace(SEVENTY_B, B=b), old, design="before") for b in (1, 2, 8, 64)}
    assert all(e.share < 0.3 for e in was.values())
    assert was[1].kept_per_split_max == 63 and was[1].kept_per_split_mean == pytest.approx(512 / 33)
    assert after[1].kept_per_split_max == 11  # 512 kept pages over 49 splits
    assert all(after[b].share >= 0.6 for b in (2, 8, 64)) and after[1].share > 0.5
    assert all(after[b].share > 3 * was[b].share for b in after)
    slow = ko.Assumptions(hbm_latency_ns=1600.0)
    assert ko.estimate(SEVENTY_B, new, design="current", assume=slow).share < after[1].share


def test_importance_score_bytes(current):
    del current
    fp16 = ko.score_bytes(SEVENTY_B, summary_bytes=2, design="current")
    assert fp16["hbm_bytes"] == 2048 * 2 * 8 * 128 * 2 + 64 * 128 * 4 + 2048 * 25 + 64 * 2048 * 4
    assert fp16["of_attention"] == pytest.approx(fp16["hbm_bytes"] / ko.must_move(SEVENTY_B))
    old = ko.score_bytes(SEVENTY_B, summary_bytes=4, design="before")
    assert old["l2_bytes"] == 2048 * 2 * 8 * 128 * 4 * 16  # 2 passes x 8 query heads per summary
    assert old["hbm_bytes"] > 1.8 * fp16["hbm_bytes"] - 64 * 2048 * 8


def test_the_cli_prints_the_tables_and_json(capsys):
    assert ko.main(["--ptxas", str(CURRENT), "--batches", "1", "64"]) == 0
    out = capsys.readouterr().out
    assert "| `mma_split f16 D<=128` | 162 | 5424 | 69632 | 0 | 3 | registers |" in out
    assert out.count("\n| 1 |") == 1 and "| 64 | 3 | 3 | 1,536 (3.88) |" in out
    assert ko.main(["--ptxas", str(BEFORE), "--design", "before", "--batches", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kernel"] == "split f16 vec8 q8" and data["estimates"][0]["splits"] == 5
    assert math.isclose(data["estimates"][0]["waves"], 320 / 264)
    with pytest.raises(SystemExit):
        ko.main(["--ptxas", str(DATA / "missing.txt")])
