"""ImportanceScore: the reference's signals (Quest bound, relevance by share and by head rank,
distance buckets, ranges), and every implementation (ONNX node in ONNX Runtime, CUDA kernel)
against the reference on inputs of awkward sizes, edge distances and masked sequences."""

import math

import pytest
import torch
from op_impls import IMPLEMENTATIONS, TOLERANCE, assert_close, check_node, on_cuda, run_onnx

from tieredkv.plugins.importance_score import (
    cosine_position_init,
    distance_bucket,
    importance_score,
    quest_upper_bound,
    relevance,
)
from tieredkv.plugins.inputs import EDGE_DISTANCES, importance_score_inputs

CASES = [
    dict(B=1, H=6, KVH=3, D=64, M=1, NB=16, weights=(0.4, 0.3, 0.3)),
    dict(B=2, H=9, KVH=3, D=12, M=7, NB=16, weights=(0.4, 0.3, 0.3), blind=True),
    dict(B=3, H=6, KVH=2, D=12, M=7, NB=5, weights=(0.0, 0.5, 0.5)),
    dict(B=3, H=9, KVH=3, D=64, M=7, NB=18, weights=(1.0, 0.0, 0.0), blind=True),
    dict(B=2, H=4, KVH=1, D=12, M=7, NB=1, weights=(0.2, 0.5, 0.3)),
    dict(B=3, H=9, KVH=3, D=64, M=37, NB=12, weights=(0.4, 0.3, 0.3)),
    dict(B=2, H=6, KVH=2, D=80, M=5, NB=1, P=5, weights=(1.0, 0.0, 0.0)),
    dict(B=2, H=64, KVH=8, D=128, M=2048, NB=16, weights=(0.4, 0.3, 0.3)),  # a 70B-like layer at 32k
]


def case_id(case: dict) -> str:
    return ",".join(f"{k}{v}" if not isinstance(v, bool) else k for k, v in case.items())


def run(impl: str, inputs: dict, scale: float, request) -> torch.Tensor:
    if impl == "onnx":
        pytest.importorskip("onnx")
        from tieredkv.plugins.onnx_ops import importance_score_model

        tensors = {k: v for k, v in inputs.items() if k != "weights"}
        tensors["page_mask"] = tensors["page_mask"].to(torch.int32)  # plugin tensors cannot be bool
        return run_onnx(importance_score_model(inputs["weights"], scale), tensors)["score"]
    from tieredkv.plugins import cuda_ops

    lib = request.getfixturevalue("kernels")
    got = cuda_ops.importance_score(**on_cuda(inputs), scale=scale, lib=lib)
    torch.cuda.synchronize()
    return got.cpu()


# ----------------------------------------------------------------------------- the reference


def test_quest_bound_is_an_upper_bound():
    gen = torch.Generator().manual_seed(1)
    h, kvh, d, m, p = 6, 3, 16, 5, 8
    keys = torch.randn(m, p, kvh, d, generator=gen)
    q = torch.randn(1, h, d, generator=gen)
    ub = quest_upper_bound(q, keys.amin(1)[None], keys.amax(1)[None])[0]  # [H, M]
    g = h // kvh
    exact = torch.einsum("hd,mphd->hmp", q[0], keys.repeat_interleave(g, 2)).amax(-1)
    assert (ub >= exact - 1e-5).all()
    # tight for single-token pages
    one = keys[:, :1]
    ub1 = quest_upper_bound(q, one.amin(1)[None], one.amax(1)[None])[0]
    assert torch.allclose(ub1, torch.einsum("hd,mhd->hm", q[0], one[:, 0].repeat_interleave(g, 1)), atol=1e-5)


def test_relevance_and_score_ranges():
    gen = torch.Generator().manual_seed(2)
    kmin = torch.randn(2, 10, 2, 8, generator=gen)
    kmax = kmin + torch.rand(2, 10, 2, 8, generator=gen)
    q = torch.randn(2, 4, 8, generator=gen)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    tokens = torch.full((2, 10), 16)
    rel = relevance(q, kmin, kmax, tokens, mask)
    assert torch.allclose(rel.amax(-1), torch.ones(2)) and (rel[1, 7:] == 0).all() and (rel >= 0).all()
    table = cosine_position_init(16)
    score = importance_score(q, kmin, kmax, tokens, torch.arange(10).expand(2, -1) * 100,
                             torch.rand(2, 10, generator=gen), mask, table, (0.4, 0.3, 0.3))
    assert (score >= 0).all() and (score <= 1).all() and (score[1, 7:] == 0).all()
    relevance_only = importance_score(q, kmin, kmax, tokens, torch.zeros(2, 10, dtype=torch.long), torch.rand(2, 10),
                                      mask, table, (1.0, 0.0, 0.0))
    assert torch.equal(relevance_only, rel)  # the score with weights (1, 0, 0) is the relevance itself


def random_pages(gen: torch.Generator, B: int, H: int, KVH: int, D: int, M: int) -> tuple:
    """A query and M pages' key bounds per sequence: (q, kmin, kmax, tokens, mask), ~20 % masked."""
    kmin = torch.randn(B, M, KVH, D, generator=gen)
    kmax = kmin + torch.rand(B, M, KVH, D, generator=gen)
    q = torch.randn(B, H, D, generator=gen)
    return q, kmin, kmax, torch.randint(1, 17, (B, M), generator=gen), torch.rand(B, M, generator=gen) > 0.2


@pytest.mark.parametrize("seed", range(6))
def test_head_rank_selection_is_the_union_of_every_heads_top_pages(seed):
    """Top k by relevance(aggregate="head-rank") = the union of each head's top j pages (by its
    bound) for the largest j whose union fits in k, topped up by the next ranks; masked pages 0."""
    gen = torch.Generator().manual_seed(seed)
    B, H, KVH, D, M = 2, 6, 3, 8, 23
    q, kmin, kmax, tokens, mask = random_pages(gen, B, H, KVH, D, M)
    score = relevance(q, kmin, kmax, tokens, mask, aggregate="head-rank")
    assert (score[~mask] == 0).all() and (score[mask] > 0).all() and (score <= 1).all()
    ub = quest_upper_bound(q, kmin, kmax) / math.sqrt(D) + torch.log(tokens.float()).unsqueeze(1)
    for b in range(B):
        kept = mask[b].nonzero().flatten().tolist()
        per_head = [sorted(kept, key=lambda m: (-float(ub[b, h, m]), m)) for h in range(H)]
        assert all(float(score[b, ranked[0]]) == 1.0 for ranked in per_head)  # every head's best page
        for k in (1, 4, 9, len(kept)):
            top = set(torch.topk(score[b], k).indices.tolist())
            j = max(j for j in range(len(kept) + 1) if len({m for r in per_head for m in r[:j]}) <= k)
            assert {m for r in per_head for m in r[:j]} <= top


def test_head_rank_with_one_head_orders_by_the_bound():
    gen = torch.Generator().manual_seed(9)
    kmin = torch.randn(1, 12, 1, 4, generator=gen)
    kmax = kmin + torch.rand(1, 12, 1, 4, generator=gen)
    q = torch.randn(1, 1, 4, generator=gen)
    tokens = torch.full((1, 12), 4)
    mask = torch.ones(1, 12, dtype=torch.bool)
    by_rank = torch.argsort(relevance(q, kmin, kmax, tokens, mask, aggregate="head-rank")[0], descending=True)
    assert torch.equal(by_rank, torch.argsort(relevance(q, kmin, kmax, tokens, mask)[0], descending=True))
    with pytest.raises(ValueError, match="aggregate"):
        relevance(q, kmin, kmax, tokens, mask, aggregate="mean")


def exact_bucket(d: int, nb: int) -> int:
    """The bucket rule in Python integers: #{i in 1..NB-1 : d >= 16 * 2^(i-1)}."""
    return sum(d >= 16 * 2 ** (i - 1) for i in range(1, nb))


def test_distance_buckets():
    d = torch.tensor([0, 15, 16, 31, 32, 64, 10**9])
    assert distance_bucket(d, 16).tolist() == [0, 0, 1, 1, 2, 3, 15]
    edges = [x for x in EDGE_DISTANCES if x >= 0]
    assert distance_bucket(torch.tensor(edges), 18).tolist() == [exact_bucket(x, 18) for x in edges]
    t = cosine_position_init(16)
    assert t[0] == 1 and abs(float(t[-1])) < 1e-6 and (t[1:] <= t[:-1]).all()


# ----------------------------------------------------------------------------- implementations


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_implementation_matches_reference(impl, case, request):
    inputs = importance_score_inputs(torch.Generator().manual_seed(case["M"] + case["NB"] + case["H"]), **case)
    scale = case["D"] ** -0.5
    ref = importance_score(**inputs, scale=scale)
    got = run(impl, inputs, scale, request)
    assert_close(got, ref, TOLERANCE[impl], "score")
    assert not got[~inputs["page_mask"]].any()
    if case["weights"][0] == 1.0:  # pure relevance: the best unmasked page of each sequence scores 1
        for row, mask in zip(got, inputs["page_mask"]):
            if mask.any():
                assert float(row[mask].max()) == pytest.approx(1.0, abs=1e-6)


def position_only_inputs(distances: list[int], nb: int) -> dict:
    n = len(distances)
    return dict(q=torch.zeros(1, 2, 4), kmin=torch.zeros(1, n, 1, 4), kmax=torch.zeros(1, n, 1, 4),
                page_tokens=torch.ones(1, n, dtype=torch.int64), distance=torch.tensor([distances]),
                saliency=torch.zeros(1, n), page_mask=torch.ones(1, n, dtype=torch.bool),
                position_table=torch.arange(nb, dtype=torch.float32) / 64,  # distinct, exact, in [0, 1]
                weights=(0.0, 1.0, 0.0))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("nb", [16, 18])
def test_distance_bucket_edges(impl, nb, request):
    """Distances at and around every power of two, far beyond the last bucket, and negative: the
    implementation's bucket equals the reference and the integer rule exactly."""
    dist = EDGE_DISTANCES + [-1, -100]
    inputs = position_only_inputs(dist, nb)
    got = run(impl, inputs, 0.5, request)[0]
    assert torch.equal(got, importance_score(**inputs, scale=0.5)[0])
    assert [round(float(x) * 64) for x in got] == [exact_bucket(max(x, 0), nb) for x in dist]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_distance_bucket_many_buckets(impl, request):
    """With 40 buckets the implementations keep the exact integer rule for distances just below a
    power of two >= 2^21 (where a float32 log2 would round up; see docs/plugins.md)."""
    nb = 40
    dist = [v for k in range(4, 34) for v in (2 ** k - 1, 2 ** k)]
    got = run(impl, position_only_inputs(dist, nb), 0.5, request)[0]
    assert [round(float(x) * 64) for x in got] == [exact_bucket(x, nb) for x in dist]


def test_onnx_node_form():
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_ops import IMPORTANCE_SCORE, importance_score_model

    node = check_node(importance_score_model((0.4, 0.3, 0.3), 0.125), IMPORTANCE_SCORE)
    assert list(next(a for a in node.attribute if a.name == "weights").floats) == pytest.approx([0.4, 0.3, 0.3])
    with pytest.raises(ValueError, match="3 values"):
        importance_score_model((0.5, 0.5), 0.125)


@pytest.mark.parametrize("seed", range(4))
def test_kv_head_relevance_is_the_share_of_each_query_group_alone(seed):
    """relevance(aggregate="kv-head") [B, KVH, M]: for kv head j, the "share" relevance of its
    query group over its own keys; with one kv head, the share relevance itself. The mixed
    score broadcasts the page signals over the kv heads."""
    gen = torch.Generator().manual_seed(seed)
    B, H, KVH, D, M = 2, 9, 3, 8, 13
    q, kmin, kmax, tokens, mask = random_pages(gen, B, H, KVH, D, M)
    rel = relevance(q, kmin, kmax, tokens, mask, aggregate="kv-head")
    assert rel.shape == (B, KVH, M) and (rel[~mask.unsqueeze(1).expand_as(rel)] == 0).all()
    g = H // KVH
    for j in range(KVH):
        alone = relevance(q[:, j * g : (j + 1) * g], kmin[:, :, j : j + 1], kmax[:, :, j : j + 1], tokens, mask)
        assert torch.allclose(rel[:, j], alone, atol=1e-6)
    assert torch.equal(relevance(q[:, :g], kmin[:, :, :1], kmax[:, :, :1], tokens, mask, aggregate="kv-head")[:, 0],
                       relevance(q[:, :g], kmin[:, :, :1], kmax[:, :, :1], tokens, mask))
    distance, saliency = torch.randint(0, 4000, (B, M), generator=gen), torch.rand(B, M, generator=gen)
    table, w = cosine_position_init(16), (0.5, 0.3, 0.2)
    score = importance_score(q, kmin, kmax, tokens, distance, saliency, mask, table, w, aggregate="kv-head")
    for j in range(KVH):
        by_head = 0.5 * rel[:, j] + 0.3 * table[distance_bucket(distance, 16)] + 0.2 * saliency
        assert torch.allclose(score[:, j], torch.where(mask, by_head, torch.zeros_like(by_head)), atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("summary", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[6], CASES[7]], ids=case_id)
def test_cuda_one_pass_over_16_bit_summaries(kernels, case, summary, q_dtype):
    """The one-pass kernels over page summaries in a pool's 16-bit type (exact for the min / max of
    keys of that type) and a 16-bit or float32 q: equal to the reference on the same values."""
    from tieredkv.plugins import cuda_ops

    inputs = importance_score_inputs(torch.Generator().manual_seed(case["M"] + 7), **case)
    inputs |= dict(q=inputs["q"].to(q_dtype), kmin=inputs["kmin"].to(summary), kmax=inputs["kmax"].to(summary))
    scale = case["D"] ** -0.5
    widened = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    ref = importance_score(**widened, scale=scale)
    got = cuda_ops.importance_score(**on_cuda(inputs), scale=scale, lib=kernels)
    torch.cuda.synchronize()
    assert_close(got.cpu(), ref, TOLERANCE["cuda"], "score")


@pytest.mark.cuda
def test_cuda_float32_entry_without_workspace(kernels):
    """tkv_importance_score (float32, no workspace: the TensorRT plugin's entry) equals the
    reference too."""
    import ctypes

    case = CASES[7]
    inputs = importance_score_inputs(torch.Generator().manual_seed(5), **case)
    scale = case["D"] ** -0.5
    ref = importance_score(**inputs, scale=scale)
    dev = on_cuda({k: v for k, v in inputs.items() if k != "weights"})
    dev["page_mask"] = dev["page_mask"].to(torch.int32)
    score = torch.empty(case["B"], case["M"], device="cuda")
    names = ("q", "kmin", "kmax", "page_tokens", "distance", "saliency", "page_mask", "position_table")
    status = kernels.tkv_importance_score(*(dev[n].data_ptr() for n in names), score.data_ptr(), case["B"], case["H"],
                                         case["D"], case["M"], case["KVH"], case["NB"], *case["weights"], scale,
                                         ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert status == 0
    torch.cuda.synchronize()
    assert_close(score.cpu(), ref, TOLERANCE["cuda"], "score")
