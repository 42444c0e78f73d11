"""The split-K TieredAttention kernels (plugins/csrc/kernels/tiered_attention.cuh: the tensor-core
kernel for 16-bit pools, the CUDA-core kernel for the rest) against the reference
``tieredkv.plugins.tiered_attention.tiered_attention``.

Without a GPU (needs nvcc and cmake for the library): the split plan (its limits, the least-cost
choice of whole waves from the kernel's occupancy, the 70B-like choices, the workspace bound
covering every plan and never shrinking as a size grows) and the library's host emulation
(``cuda_ops.tiered_attention_host``: the algorithm of the kernel the device would run, block by
block on the CPU through the same __host__ __device__ functions: split plan, each split's kept
pages by rank walked in scan chunks and rounds as the device walks them, the tensor-core kernel's
16-key tiles and two-term 16-bit operands or the CUDA-core kernel's lane layout, online softmax,
page log-sum-exps, warp combine, split merge) on fresh random inputs of awkward sizes: one split,
the chosen plan, forced split counts up to one page per split (splits with no kept page, splits that
see no key), G = 1, 3, 4 and 8, T > 1, float32 / float16 / bfloat16 pools, both kernels, pages of
more than 16 keys, clustered selections of a quarter of the pages, masks over several scan chunks
and rounds, warm pages of every codec as bytes or int32 words, and a 70B-like shape.

With a GPU (``cuda`` marker; tools/gpu_check.sh): the same comparisons for the device kernels, plus
a smaller or no workspace, the device against the host emulation, and the kernels' occupancy.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import shutil

import pytest
import torch
from csrc_build import load_kernels
from op_impls import assert_close, assert_close_lse, on_cuda

from tieredkv.plugins import cuda_ops
from tieredkv.plugins.codec import CODECS, as_words
from tieredkv.plugins.inputs import tiered_attention_inputs, warm_inputs
from tieredkv.plugins.tiered_attention import tiered_attention

#: max abs error of out / page_probs / finite lse against the reference: the host emulation and
#: the kernels accumulate in float32 in another order (measured: a few 1e-6); with bfloat16 pools
#: the tensor-core kernel's two-term operands carry 16 significant bits (measured: up to 2e-5)
HOST_TOL = 2e-5
HOST_TOL_BF16 = 5e-5
CUDA_TOL = 1e-4
INVALID = 1  # cudaErrorInvalidValue

CASES = [
    dict(B=1, H=6, KVH=3, T=1, D=64, P=16, M=1),
    dict(B=3, H=9, KVH=3, T=5, D=64, P=16, M=7, blind=True, partial=True),  # G * T = 15: two query groups
    dict(B=2, H=6, KVH=6, T=1, D=12, P=5, M=11, blind=True),  # MHA (G = 1), vector path with idle lanes
    dict(B=2, H=4, KVH=1, T=5, D=12, P=5, M=7, partial=True),  # MQA
    dict(B=3, H=9, KVH=3, T=1, D=64, P=16, M=9, pad=2, C=23, empty_row=True),  # SmolLM2 decode
    dict(B=2, H=16, KVH=2, T=2, D=128, P=16, M=30, pad=3, C=40),  # G = 8, T = 2: two query groups
    dict(B=1, H=16, KVH=2, T=1, D=128, P=16, M=37, C=45),  # G = 8, one query group
    dict(B=2, H=8, KVH=2, T=3, D=80, P=7, M=13, pad=1, C=19),  # G = 4
    dict(B=2, H=6, KVH=2, T=1, D=3, P=13, M=9, pad=2),  # the element path (D not a vector multiple)
    dict(B=1, H=4, KVH=1, T=2, D=256, P=4, M=10, pad=1, C=12, empty_row=True),
    dict(B=2, H=8, KVH=2, T=1, D=64, P=40, M=6, C=12),  # pages of three 16-key tiles, the last partial
    dict(B=2, H=24, KVH=2, T=1, D=32, P=32, M=9, pad=1),  # G = 12: two query groups of the kv head
]
POOL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (name, sm_count, blocks_per_sm, num_splits) of the plans compared
SPLITS = [("one", 132, 3, 1), ("auto132", 132, 3, 0), ("auto1", 1, 1, 0), ("three", 132, 3, 3),
          ("per-page", 132, 3, 10 ** 6)]
#: an H200: 132 SMs; the 70B tensor-core kernel keeps 3 blocks resident (tools/kernel_occupancy.py)
H200_SMS, H200_BLOCKS = 132, 3


def host_tol(dtype: torch.dtype) -> float:
    return HOST_TOL_BF16 if dtype == torch.bfloat16 else HOST_TOL


def case_id(case: dict) -> str:
    return ",".join(f"{k}{v}" if not isinstance(v, bool) else k for k, v in case.items())


def make(case: dict, seed: int, dtype: torch.dtype = torch.float32, *, codec: str | None = None,
         int_mask: bool = False) -> dict:
    """Inputs of the reference (the pools in ``dtype``; ``codec``: warm pages added)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = tiered_attention_inputs(gen, **case)
    if codec is not None:
        inputs = warm_inputs(gen, inputs, codec)
    inputs["k_pool"], inputs["v_pool"] = inputs["k_pool"].to(dtype), inputs["v_pool"].to(dtype)
    if int_mask:
        inputs["page_mask"] = inputs["page_mask"].to(torch.int32)
    return inputs


def tensors(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k != "warm_codec"}


def assert_matches(got, ref, tol: float) -> None:
    (out, lse, probs), (ref_out, ref_lse, ref_probs) = got, ref
    assert_close(out, ref_out, tol, "out")
    assert_close(probs, ref_probs, tol, "page_probs")
    assert_close_lse(lse, ref_lse, tol)
    seen = torch.isfinite(lse.cpu())
    assert torch.allclose(probs.cpu().sum(-1)[seen], torch.ones(int(seen.sum())), atol=1e-5)
    assert not probs.cpu()[~seen].any() and not out.cpu()[~seen].any()


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    """libtieredkv_kernels.so of the session build (needs nvcc and cmake, no GPU)."""
    if not (shutil.which("nvcc") and shutil.which("cmake")):
        pytest.skip("needs nvcc and cmake on PATH")
    return load_kernels(tmp_path_factory)


def plan(lib, case: dict, sm_count: int, blocks_per_sm: int, num_splits: int) -> tuple[int, int]:
    return cuda_ops.attention_plan(case["B"], case["H"], case["T"], case["D"], case["KVH"], case["M"],
                                   sm_count=sm_count, blocks_per_sm=blocks_per_sm, num_splits=num_splits, lib=lib)


# ----------------------------------------------------------------------------- the split plan


def _row_blocks(B: int, H: int, T: int, KVH: int) -> int:
    per_kv = H // KVH * T
    return B * KVH * math.ceil(per_kv / min(per_kv, 8))


def _least_cost_splits(rows: int, slots: int, M: int) -> int:
    """The documented chooser (tieredkv_kernels.h, tkv_tiered_attention_plan), written out here:
    whole waves of rows * s blocks over `slots`, each as long as ceil(M / s) pages + 4, merge 8."""
    most = min(128, math.ceil(M / 4), 4096 // rows)
    cost = {s: math.ceil(rows * s / slots) * (math.ceil(M / s) + 4) + (8 if s > 1 else 0)
            for s in range(1, max(most, 1) + 1)}
    return min(cost, key=lambda s: (cost[s], s))


def test_the_plan_is_the_least_cost_whole_waves_within_its_limits(lib):
    sizes = itertools.product([1, 3, 64], [(8, 8), (64, 8), (9, 3), (32, 1)], [1, 5], [0, 1, 5, 64, 2048],
                              [(1, 1), (16, 2), (132, 3), (132, 1)])
    for B, (H, KVH), T, M, (sms, per_sm) in sizes:
        for asked in (0, 1, 2, 7, 500):
            splits, per = cuda_ops.attention_plan(B, H, T, 128, KVH, M, sm_count=sms, blocks_per_sm=per_sm,
                                                  num_splits=asked, lib=lib)
            where = (B, H, KVH, T, M, sms, per_sm, asked)
            assert 1 <= splits <= cuda_ops.MAX_SPLITS, where
            assert per == math.ceil(M / splits), where  # the most kept pages a split reads
            if asked:  # that many, within M and the cap
                assert splits == min(asked, max(M, 1), cuda_ops.MAX_SPLITS), where
                continue
            rows = _row_blocks(B, H, T, KVH)
            assert splits == (_least_cost_splits(rows, sms * per_sm, M) if M else 1), where
            assert splits == 1 or (splits * rows <= 4096 and splits <= math.ceil(M / 4)), where


def test_the_plan_of_a_70b_decode(lib):
    """llama2-70b (64 query heads, 8 kv heads, head dim 128), pages of 16, on an H200 (132 SMs, 3
    resident blocks of the tensor-core kernel: 396 slots). One sequence of 32k tokens: 8 row blocks,
    49 splits fill one wave (392 blocks); with only a quarter of the pages listed, 47 splits of at most
    11 pages cost as little. 64 sequences: 512 row blocks are 1.29 waves, 3 splits make 1,536 blocks,
    3.88 waves (97 % of the last one busy)."""
    plan70 = functools.partial(cuda_ops.attention_plan, sm_count=H200_SMS, blocks_per_sm=H200_BLOCKS, lib=lib)
    assert plan70(1, 64, 1, 128, 8, 2048) == (49, 42)
    assert plan70(1, 64, 1, 128, 8, 512) == (47, 11)
    assert plan70(64, 64, 1, 128, 8, 2048) == (3, 683)
    assert plan70(8, 64, 1, 128, 8, 2048) == (6, 342)  # 384 blocks: one wave


def test_the_workspace_bound_covers_every_plan_and_grows_with_every_size(lib):
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        B, KVH, T, D, M = (int(x) for x in torch.randint(1, 9, (5,), generator=gen))
        M = M * int(torch.randint(1, 300, (1,), generator=gen))
        H = KVH * int(torch.randint(1, 9, (1,), generator=gen))
        D = D * 16
        bound = cuda_ops.attention_workspace_bytes(B, H, T, D, KVH, M, lib=lib)
        for sms, per_sm in ((1, 1), (8, 2), (132, 3), (1000, 8)):
            free, _ = cuda_ops.attention_plan(B, H, T, D, KVH, M, sm_count=sms, blocks_per_sm=per_sm, lib=lib)
            held, _ = cuda_ops.attention_plan(B, H, T, D, KVH, M, sm_count=sms, blocks_per_sm=per_sm,
                                              workspace_bytes=bound, lib=lib)
            assert held == free, (B, H, T, D, KVH, M, sms)  # the bound never lowers a chosen plan
            assert free == 1 or free * B * H * T * (D + 2) * 4 <= bound
        sizes = [B, H, T, D, KVH, M]
        for i, grow in enumerate((1, KVH, 1, 16, 0, 1)):
            bigger = list(sizes)
            bigger[i] += grow
            assert cuda_ops.attention_workspace_bytes(*bigger, lib=lib) >= bound, (sizes, i)
    assert cuda_ops.attention_workspace_bytes(1, 8, 1, 64, 1, 4, lib=lib) == 0  # 4 pages: never split
    assert lib.tkv_tiered_attention_workspace(-1, 8, 1, 64, 1, 4) == -1


def test_a_small_workspace_lowers_the_split_count(lib):
    one = 1 * 64 * 1 * (128 + 2) * 4  # bytes of one split's partials
    plan70 = functools.partial(cuda_ops.attention_plan, 1, 64, 1, 128, 8, 2048, sm_count=H200_SMS,
                               blocks_per_sm=H200_BLOCKS, lib=lib)
    assert plan70(workspace_bytes=5 * one)[0] == 5
    assert plan70(workspace_bytes=one - 1)[0] == 1
    assert plan70(num_splits=9, workspace_bytes=0)[0] == 1
    assert cuda_ops.attention_workspace_bytes(1, 64, 1, 128, 8, 2048, num_splits=9, lib=lib) == 9 * one


# ----------------------------------------------------------------------------- the host emulation


@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_host_emulation_matches_reference(lib, case, dtype):
    inputs = make(case, seed=sum(case[k] for k in ("B", "H", "T", "M", "D")), dtype=dtype, int_mask=case["M"] % 2 == 1)
    scale = case["D"] ** -0.5
    ref = tiered_attention(**inputs, scale=scale)
    seen_splits = set()
    for _, sms, per_sm, asked in SPLITS:
        splits, _ = plan(lib, case, sms, per_sm, min(asked, case["M"]))
        seen_splits.add(splits)
        got = cuda_ops.tiered_attention_host(**inputs, sm_count=sms, blocks_per_sm=per_sm,
                                             num_splits=min(asked, case["M"]), scale=scale, lib=lib)
        assert_matches(got, ref, host_tol(dtype))
    assert len(seen_splits) >= min(case["M"], 3)  # one split, several, one page each (the merge runs)


NO_KEY_CASE = dict(B=2, H=16, KVH=2, T=3, D=64, P=4, M=12)


def no_key_inputs() -> dict:
    """Pages in order, queries early in the sequence: pages 4.. are past every query of sequence
    0, and sequence 1 sees nothing (every query before position 0)."""
    inputs = make(NO_KEY_CASE, seed=12, dtype=torch.float16)
    inputs["page_index"] = torch.arange(12).repeat(2, 1)
    inputs["page_mask"] = torch.ones(2, 12, dtype=torch.int32)
    inputs["seq_len"] = torch.tensor([48, 48])
    inputs["past"] = torch.tensor([10, -5])
    return inputs


def test_host_emulation_with_splits_that_see_no_key(lib):
    """The later splits hold no visible key for any query of a block (their partials are empty:
    max -inf, sum 0); one sequence sees nothing at all."""
    case, inputs = NO_KEY_CASE, no_key_inputs()
    ref = tiered_attention(**inputs)
    assert torch.isneginf(ref[1][1]).all() and torch.isfinite(ref[1][0]).all()
    assert (ref[2][0, :, :, 4:] == 0).all()
    for asked in (2, 3, 6, 12):
        assert plan(lib, case, H200_SMS, H200_BLOCKS, asked)[0] == asked
        got = cuda_ops.tiered_attention_host(**inputs, sm_count=H200_SMS, blocks_per_sm=H200_BLOCKS, num_splits=asked,
                                             lib=lib)
        assert_matches(got, ref, HOST_TOL)


def selection_inputs(seed: int, *, B: int, H: int, KVH: int, D: int, P: int, pages: int, kept: float, where: str,
                     dtype: torch.dtype, T: int = 1) -> dict:
    """A decode step as the runtime lists it: every page of each sequence listed in order (the last
    one partial), a share ``kept`` of them kept by the int32 mask (``where``: clustered at the
    ``start``, ``middle`` or ``end`` of the list, or ``random``); pools of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, math.ceil(kept * pages))
    mask = torch.zeros(B, pages, dtype=torch.int32)
    for b in range(B):
        if where == "random":
            mask[b, torch.randperm(pages, generator=gen)[:n]] = 1
        else:
            first = {"start": 0, "middle": (pages - n) // 2, "end": pages - n}[where]
            mask[b, first:first + n] = 1
    C = B * pages + 1
    seq_len = torch.full((B,), pages * P - 3)
    return dict(q=torch.randn(B, H, T, D, generator=gen),
                k_pool=(torch.randn(C, KVH, P, D, generator=gen) * 2).to(dtype),
                v_pool=torch.randn(C, KVH, P, D, generator=gen).to(dtype),
                page_table=torch.randperm(C, generator=gen)[:B * pages].view(B, pages), page_mask=mask,
                page_index=torch.arange(pages).repeat(B, 1), seq_len=seq_len, past=seq_len - T)


@pytest.mark.parametrize("where", ["start", "middle", "end", "random"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_host_emulation_with_a_clustered_selection(lib, where, dtype):
    """Every page listed, a quarter kept in one cluster (or scattered): the splits share the kept
    pages, whatever their columns; one page per split, and more splits than kept pages (splits with
    no page at all)."""
    inputs = selection_inputs(7, B=2, H=16, KVH=2, D=64, P=16, pages=96, kept=0.25, where=where, dtype=dtype, T=2)
    ref = tiered_attention(**inputs)
    for sms, per_sm, asked in ((H200_SMS, H200_BLOCKS, 0), (1, 1, 0), (H200_SMS, 1, 1), (H200_SMS, 1, 5),
                               (H200_SMS, 1, 24), (H200_SMS, 1, 40)):
        got = cuda_ops.tiered_attention_host(**inputs, sm_count=sms, blocks_per_sm=per_sm, num_splits=asked, lib=lib)
        assert_matches(got, ref, host_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_host_emulation_over_several_scan_chunks_and_rounds(lib, dtype):
    """5,000 listed pages (three chunks of the mask scan), 3,750 kept: a split reads its kept pages
    in rounds of 256, which start and end inside chunks."""
    inputs = selection_inputs(11, B=1, H=2, KVH=1, D=16, P=4, pages=5000, kept=0.75, where="random", dtype=dtype)
    ref = tiered_attention(**inputs)
    for asked in (1, 3, 7):
        got = cuda_ops.tiered_attention_host(**inputs, sm_count=H200_SMS, blocks_per_sm=1, num_splits=asked, lib=lib)
        assert_matches(got, ref, HOST_TOL)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_host_emulation_with_warm_pages(lib, codec):
    """Warm pages decoded per element (32-bit page reader): bytes or int32 words, float32, float16 or
    bfloat16 pools (decoded values take the pools' precision, as in the reference; the 16-bit pools
    on the tensor-core kernel, pages of 40 keys included), split or not."""
    for case, dtype, words in ((CASES[1], torch.float32, False), (CASES[5], torch.float16, True),
                               (CASES[3], torch.bfloat16, True), (CASES[10], torch.bfloat16, False)):
        inputs = make(case, seed=case["M"] + len(codec), dtype=dtype, codec=codec)
        if words:
            inputs["warm_pool"] = as_words(inputs["warm_pool"])
        scale = case["D"] ** -0.5
        ref = tiered_attention(**inputs, scale=scale)
        _, kvh, p, d = inputs["k_pool"].shape
        desc = cuda_ops.codec_desc(codec, kvh, p, d, lib=lib)
        for asked in (1, 0, case["M"]):
            got = cuda_ops.tiered_attention_host(**tensors(inputs), desc=desc, sm_count=H200_SMS,
                                                 blocks_per_sm=H200_BLOCKS, num_splits=asked, scale=scale, lib=lib)
            assert_matches(got, ref, host_tol(dtype))


def seventy_b_inputs(listed: float) -> dict:
    """llama2-70b heads (64 query, 8 kv, head dim 128), pages of 16, float16 pools, one decode token
    over 2k tokens: every page listed (all kept, or a quarter kept in clusters), or a quarter of them
    listed (all kept)."""
    m_all = 128
    gen = torch.Generator().manual_seed(70)
    m = int(m_all * listed)
    inputs = tiered_attention_inputs(gen, B=1, H=64, KVH=8, T=1, D=128, P=16, M=m, C=m_all, keep=1.0,
                                     causal_cut=False)
    inputs["page_table"] = torch.randperm(m_all, generator=gen)[:m].view(1, m)
    inputs["page_index"] = torch.sort(torch.randperm(m_all, generator=gen)[:m]).values.view(1, m)
    inputs["seq_len"] = torch.tensor([m_all * 16])
    inputs["past"] = inputs["seq_len"] - 1
    inputs["k_pool"], inputs["v_pool"] = inputs["k_pool"].half(), inputs["v_pool"].half()
    inputs["page_mask"] = inputs["page_mask"].to(torch.int32)
    return inputs


@pytest.mark.parametrize("listed", [1.0, 0.25, "clustered"], ids=["all pages", "25% of pages", "25% kept"])
def test_host_emulation_at_a_70b_like_shape(lib, listed):
    """The 70B-like decode with the plan of an H200 (several splits)."""
    inputs = seventy_b_inputs(1.0 if listed == "clustered" else listed)
    if listed == "clustered":  # pages 8-23 and 80-95 kept
        inputs["page_mask"].zero_()
        inputs["page_mask"][0, 8:24] = inputs["page_mask"][0, 80:96] = 1
    m = inputs["page_table"].shape[1]
    splits, _ = cuda_ops.attention_plan(1, 64, 1, 128, 8, m, sm_count=H200_SMS, blocks_per_sm=H200_BLOCKS, lib=lib)
    assert splits > 1
    ref = tiered_attention(**inputs)
    got = cuda_ops.tiered_attention_host(**inputs, sm_count=H200_SMS, blocks_per_sm=H200_BLOCKS, lib=lib)
    assert_matches(got, ref, HOST_TOL)


def test_host_entry_refuses_bad_arguments(lib):
    """The C entry checks what the Python binding cannot: the dtype code, the descriptor, the warm
    arguments without one (no device involved)."""
    inputs = make(CASES[0], seed=1, int_mask=True)
    out = (torch.empty(1, 6, 1, 64), torch.empty(1, 6, 1), torch.empty(1, 6, 1, 1))
    ptrs = [t.data_ptr() for t in (inputs["q"], inputs["k_pool"], inputs["v_pool"], inputs["page_table"],
                                   inputs["page_mask"], inputs["page_index"], inputs["seq_len"], inputs["past"], *out)]
    sizes = (1, 6, 1, 64, inputs["k_pool"].shape[0], 3, 16, 1)

    def call(dtype=0, warm=(None, None, 0, None), sms=132, per_sm=3, splits=0, h=6):
        return lib.tkv_tiered_attention_host(*ptrs, *sizes[:1], h, *sizes[2:], 0.125, dtype, *warm, sms, per_sm,
                                             splits)

    assert call() == 0
    assert call(dtype=3) == INVALID
    assert call(h=7) == INVALID  # H not a multiple of KVH
    assert call(sms=-1) == INVALID and call(splits=-1) == INVALID and call(per_sm=-1) == INVALID
    row = torch.zeros(1, 1, dtype=torch.int64)
    assert call(warm=(None, row.data_ptr(), 0, None)) == INVALID  # warm arguments without a descriptor
    other = cuda_ops.codec_desc("int4", 3, 16, 32, lib=lib)
    assert call(warm=(None, row.data_ptr(), 0, ctypes.byref(other))) == INVALID  # D = 32, not 64
    good = cuda_ops.codec_desc("int4", 3, 16, 64, lib=lib)
    assert call(warm=(None, row.data_ptr(), 1, ctypes.byref(good))) == INVALID  # W = 1 with no warm pool
    assert call(warm=(None, row.data_ptr(), 0, ctypes.byref(good))) == 0  # W = 0: every warm row masked


# ----------------------------------------------------------------------------- on the GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_matches_reference_and_host_across_splits(kernels, case, dtype):
    inputs = make(case, seed=sum(case[k] for k in ("B", "H", "T", "M", "D")) + 1, dtype=dtype,
                  int_mask=case["M"] % 2 == 0)
    scale = case["D"] ** -0.5
    ref = tiered_attention(**inputs, scale=scale)
    dev = on_cuda(inputs)
    for _, sms, per_sm, asked in SPLITS:
        asked = min(asked, case["M"])
        got = cuda_ops.tiered_attention(**dev, scale=scale, num_splits=asked, lib=kernels)
        torch.cuda.synchronize()
        got = tuple(x.cpu() for x in got)
        assert_matches(got, ref, CUDA_TOL)
        if asked:  # the same plan on the host: the same algorithm, float32 in nearly the same order
            host = cuda_ops.tiered_attention_host(**inputs, sm_count=sms, blocks_per_sm=per_sm, num_splits=asked,
                                                  scale=scale, lib=kernels)
            assert_matches(got, host, host_tol(dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["start", "middle", "end", "random"])
@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
def test_cuda_with_a_clustered_selection(kernels, where, dtype):
    inputs = selection_inputs(8, B=2, H=16, KVH=2, D=128, P=16, pages=96, kept=0.25, where=where, dtype=dtype, T=2)
    ref = tiered_attention(**inputs)
    dev = on_cuda(inputs)
    for asked in (0, 1, 5, 24, 40):
        got = cuda_ops.tiered_attention(**dev, num_splits=asked, lib=kernels)
        torch.cuda.synchronize()
        assert_matches(tuple(x.cpu() for x in got), ref, CUDA_TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
def test_cuda_over_several_scan_chunks_and_rounds(kernels, dtype):
    inputs = selection_inputs(12, B=2, H=8, KVH=1, D=64, P=4, pages=5000, kept=0.75, where="random", dtype=dtype)
    ref = tiered_attention(**inputs)
    dev = on_cuda(inputs)
    for asked in (1, 3, 7, 0):
        got = cuda_ops.tiered_attention(**dev, num_splits=asked, lib=kernels)
        torch.cuda.synchronize()
        assert_matches(tuple(x.cpu() for x in got), ref, CUDA_TOL)


@pytest.mark.cuda
def test_cuda_70b_like_decode_matches_the_host_emulation(kernels):
    """The device's own plan (its SMs, the kernel's occupancy) on the 70B-like shape, a quarter of
    the pages kept in clusters: equal to the reference, and to the host emulation of that plan."""
    inputs = seventy_b_inputs(1.0)
    inputs["page_mask"].zero_()
    inputs["page_mask"][0, 8:24] = inputs["page_mask"][0, 80:96] = 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm, tensor_cores = cuda_ops.attention_occupancy(64, 1, 128, 8, torch.float16, lib=kernels)
    assert tensor_cores and per_sm >= 2
    got = cuda_ops.tiered_attention(**on_cuda(inputs), lib=kernels)
    torch.cuda.synchronize()
    got = tuple(x.cpu() for x in got)
    assert_matches(got, tiered_attention(**inputs), CUDA_TOL)
    host = cuda_ops.tiered_attention_host(**inputs, sm_count=sms, blocks_per_sm=per_sm, lib=kernels)
    assert_matches(got, host, HOST_TOL)


@pytest.mark.cuda
def test_cuda_occupancy_of_each_kernel(kernels):
    """16-bit pools with D a multiple of 16 run on tensor cores, the rest on CUDA cores; every
    kernel fits an SM (the 70B one at least twice, its design point)."""
    for dtype, d, tensor in ((torch.float16, 128, True), (torch.bfloat16, 64, True), (torch.float16, 256, True),
                             (torch.float16, 40, False), (torch.float32, 128, False)):
        for warm in (False, True):
            per_sm, tensor_cores = cuda_ops.attention_occupancy(64, 1, d, 8, dtype, warm=warm, lib=kernels)
            assert tensor_cores == tensor and per_sm >= 1, (dtype, d, warm)
    assert cuda_ops.attention_occupancy(64, 1, 128, 8, torch.float16, lib=kernels)[0] >= 2


@pytest.mark.cuda
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_cuda_warm_pages_as_words_and_16_bit_pools(kernels, codec):
    for case, dtype in ((CASES[1], torch.float32), (CASES[5], torch.float16), (CASES[7], torch.bfloat16)):
        inputs = make(case, seed=case["M"] * 3 + len(codec), dtype=dtype, codec=codec, int_mask=True)
        inputs["warm_pool"] = as_words(inputs["warm_pool"])
        scale = case["D"] ** -0.5
        ref = tiered_attention(**inputs, scale=scale)
        _, kvh, p, d = inputs["k_pool"].shape
        desc = cuda_ops.codec_desc(codec, kvh, p, d, lib=kernels)
        dev = on_cuda(tensors(inputs))
        for asked in (1, 0, case["M"]):
            got = cuda_ops.tiered_attention_warm(**dev, desc=desc, scale=scale, num_splits=asked, lib=kernels)
            torch.cuda.synchronize()
            assert_matches(tuple(x.cpu() for x in got), ref, CUDA_TOL)


@pytest.mark.cuda
def test_cuda_splits_that_see_no_key(kernels):
    inputs = no_key_inputs()
    ref = tiered_attention(**inputs)
    dev = on_cuda(inputs)
    for asked in (1, 2, 3, 6, 12):
        got = cuda_ops.tiered_attention(**dev, num_splits=asked, lib=kernels)
        torch.cuda.synchronize()
        assert_matches(tuple(x.cpu() for x in got), ref, CUDA_TOL)


@pytest.mark.cuda
def test_cuda_with_a_small_or_no_workspace(kernels):
    """A workspace smaller than the plan lowers the split count (no workspace: one split); the
    result stays right."""
    case = CASES[6]
    inputs = make(case, seed=5, dtype=torch.float16)
    ref = tiered_attention(**inputs)
    dev = on_cuda(inputs)
    one = case["B"] * case["H"] * case["T"] * (case["D"] + 2) * 4
    for nbytes in (0, one, 3 * one + 5):
        ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        got = cuda_ops.tiered_attention(**dev, num_splits=20, workspace=ws, lib=kernels)
        torch.cuda.synchronize()
        assert_matches(tuple(x.cpu() for x in got), ref, CUDA_TOL)
