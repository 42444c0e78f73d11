"""TieredAttention, ImportanceScore and KVAppend as ONNX nodes (custom domain + function
bodies) match the PyTorch references in ONNX Runtime CPU on inputs of awkward sizes."""

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402

from tieredkv.plugins.tiered_attention import tiered_attention  # noqa: E402
from tieredkv.plugins.importance_score import importance_score  # noqa: E402
from tieredkv.plugins.kv_append import kv_append  # noqa: E402
from tieredkv.plugins.onnx_ops import (  # noqa: E402
    DOMAIN,
    IMPORTANCE_SCORE,
    KV_APPEND,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TIERED_ATTENTION,
    importance_score_model,
    kv_append_model,
    tiered_attention_model,
)

ATOL = 1e-5


def session(model):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run(model, feeds: dict) -> dict:
    sess = session(model)
    outs = sess.run(None, {k: v.numpy() for k, v in feeds.items()})
    return dict(zip([o.name for o in sess.get_outputs()], outs))


def check_node(model, op_type: str) -> None:
    onnx.checker.check_model(model, full_check=True)
    (node,) = model.graph.node
    assert node.domain == DOMAIN and node.op_type == op_type
    attrs = {a.name: a for a in node.attribute}
    assert attrs["plugin_namespace"].s.decode() == PLUGIN_NAMESPACE
    assert attrs["plugin_version"].s.decode() == PLUGIN_VERSION
    (fn,) = model.functions
    assert fn.domain == DOMAIN and fn.name == op_type and not fn.attribute_proto  # values live on the node
    assert [o.version for o in fn.opset_import if o.domain == ""] == [21]


# --- TieredAttention ----------------------------------------------------------------------------------


def attention_inputs(b, h, kvh, t, d, p, m, seed, *, blind=False, partial=False):
    """Random pool / page lists. ``blind``: the last sequence sees no key at all (its pages are
    masked); ``partial``: the first sequence's first queries sit before every key."""
    gen = torch.Generator().manual_seed(seed)
    c = b * m + 3  # more pool pages than listed
    q = torch.randn(b, h, t, d, generator=gen)
    k_pool = torch.randn(c, kvh, p, d, generator=gen) * 2
    v_pool = torch.randn(c, kvh, p, d, generator=gen)
    page_table = torch.stack([torch.randperm(c, generator=gen)[:m] for _ in range(b)])
    page_index = torch.stack([torch.randperm(m + 2, generator=gen)[:m] for _ in range(b)])  # gaps: evicted pages
    page_mask = torch.rand(b, m, generator=gen) > 0.25
    seq_len = torch.randint(1, (m + 2) * p + 1, (b,), generator=gen)
    past = seq_len - t + torch.randint(-2, 3, (b,), generator=gen)  # decode / prefill, plus off-by-a-few
    if partial:
        past[0] = -3  # queries 0..2 see nothing, the rest see position 0 at most
        page_mask[0] = True
        page_index[0, 0] = 0
    if blind:
        page_mask[-1] = False
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, page_table=page_table, page_mask=page_mask,
                page_index=page_index, seq_len=seq_len, past=past)


ATTENTION_CASES = [
    # b, h, kvh, t, d, p, m, blind, partial
    (1, 6, 3, 1, 64, 16, 1, False, False),
    (1, 9, 3, 5, 12, 5, 7, False, True),
    (2, 6, 2, 1, 12, 5, 7, True, False),
    (3, 9, 3, 5, 64, 16, 7, True, True),
    (3, 6, 2, 5, 12, 16, 1, False, False),
    (2, 4, 1, 5, 12, 5, 7, False, True),  # MQA
    (2, 6, 6, 1, 12, 5, 7, True, False),  # MHA
]


@pytest.mark.parametrize("b,h,kvh,t,d,p,m,blind,partial", ATTENTION_CASES)
def test_tiered_attention_matches_reference(b, h, kvh, t, d, p, m, blind, partial):
    feeds = attention_inputs(b, h, kvh, t, d, p, m, seed=b * 100 + h * 10 + t + m, blind=blind, partial=partial)
    scale = d ** -0.5
    model = tiered_attention_model(scale)
    got = run(model, feeds)
    out, lse, page_probs = tiered_attention(**feeds, scale=scale)
    for name in ("out", "lse", "page_probs"):
        assert not np.isnan(got[name]).any(), name
    assert got["out"].shape == (b, h, t, d) and got["page_probs"].shape == (b, h, t, m)
    assert np.abs(got["out"] - out.numpy()).max() <= ATOL
    assert np.abs(got["page_probs"] - page_probs.numpy()).max() <= ATOL
    lse = lse.numpy()
    assert np.array_equal(np.isneginf(got["lse"]), np.isneginf(lse))
    assert np.isfinite(lse[~np.isneginf(lse)]).all()
    finite = np.isfinite(lse)
    assert np.abs(got["lse"][finite] - lse[finite]).max(initial=0.0) <= ATOL
    if blind:
        assert np.isneginf(got["lse"][-1]).all() and not got["out"][-1].any() and not got["page_probs"][-1].any()
    if partial:
        assert np.isneginf(got["lse"][0, :, :3]).all() and np.isfinite(got["lse"][0, :, 3:]).all()
    seen = np.isfinite(got["lse"])
    np.testing.assert_allclose(got["page_probs"].sum(-1)[seen], 1.0, atol=1e-5)


def test_tiered_attention_node_form():
    model = tiered_attention_model(0.125)
    check_node(model, TIERED_ATTENTION)
    (node,) = model.graph.node
    assert next(a for a in node.attribute if a.name == "scale").f == pytest.approx(0.125)


def warm_inputs(feeds: dict, codec: str, seed: int, *, share: float = 0.5) -> dict:
    """``feeds`` plus a warm pool: about ``share`` of the listed pages are stored encoded (rows in
    shuffled order, plus one unused row) and their page_table entries point at a page holding
    other values, so only the decoded bytes can give the right answer."""
    from tieredkv.plugins.codec import CODECS, encode_pages

    gen = torch.Generator().manual_seed(seed)
    b, m = feeds["page_table"].shape
    warm = torch.rand(b, m, generator=gen) < share
    warm[0, 0] = True
    n = int(warm.sum())
    rows = torch.randperm(n + 1, generator=gen)[:n]
    src = feeds["page_table"][warm]
    data = torch.zeros(n + 1, 1, dtype=torch.uint8)
    enc = encode_pages(feeds["k_pool"][src], feeds["v_pool"][src], CODECS[codec])
    data = torch.zeros(n + 1, enc.shape[1], dtype=torch.uint8)
    data[rows] = enc
    warm_row = torch.full((b, m), -1, dtype=torch.long)
    warm_row[warm] = rows
    table = feeds["page_table"].clone()
    table[warm] = (table[warm] + 1) % feeds["k_pool"].shape[0]  # wrong page: must not be read
    return {**feeds, "page_table": table, "warm_pool": data, "warm_row": warm_row}


WARM_CODECS = ["fp8-r2", "int4", "int6-r2", "int2"]


@pytest.mark.parametrize("codec", WARM_CODECS)
@pytest.mark.parametrize("b,h,kvh,t,d,p,m,blind,partial", [ATTENTION_CASES[1], ATTENTION_CASES[3], ATTENTION_CASES[5]])
def test_warm_tiered_attention_matches_reference(codec, b, h, kvh, t, d, p, m, blind, partial):
    feeds = warm_inputs(attention_inputs(b, h, kvh, t, d, p, m, seed=b + h + t + m, blind=blind, partial=partial),
                        codec, seed=m + d)
    scale = d ** -0.5
    model = tiered_attention_model(scale, warm_codec=codec, page_shape=(kvh, p, d))
    onnx.checker.check_model(model, full_check=True)
    got = run(model, feeds)
    out, lse, page_probs = tiered_attention(**feeds, scale=scale, warm_codec=codec)
    assert np.abs(got["out"] - out.numpy()).max() <= ATOL
    assert np.abs(got["page_probs"] - page_probs.numpy()).max() <= ATOL
    finite = np.isfinite(lse.numpy())
    assert np.array_equal(np.isfinite(got["lse"]), finite)
    # the warm pages matter: reading their (wrong) pool pages instead gives another answer
    plain, _, _ = tiered_attention(**{k: v for k, v in feeds.items() if not k.startswith("warm")}, scale=scale)
    assert (plain - out).abs().max() > 1e-3


def test_warm_tiered_attention_without_warm_pages():
    """No kept warm page (every warm_row -1, or masked): the NonZero is empty; equals the plain op."""
    feeds = attention_inputs(2, 6, 3, 1, 12, 5, 7, seed=3)
    feeds = warm_inputs(feeds, "int4", seed=4)
    feeds["page_mask"] = feeds["page_mask"] & (feeds["warm_row"] < 0)
    got = run(tiered_attention_model(0.3, warm_codec="int4", page_shape=(3, 5, 12)), feeds)
    out, _, probs = tiered_attention(**{k: v for k, v in feeds.items() if not k.startswith("warm")}, scale=0.3)
    assert np.abs(got["out"] - out.numpy()).max() <= ATOL and np.abs(got["page_probs"] - probs.numpy()).max() <= ATOL


def test_warm_tiered_attention_node_form():
    model = tiered_attention_model(0.125, warm_codec="fp8-r2", page_shape=(3, 16, 64))
    onnx.checker.check_model(model, full_check=True)
    (node,) = model.graph.node
    assert node.domain == DOMAIN and node.op_type == TIERED_ATTENTION and len(node.input) == 10
    attrs = {a.name: a for a in node.attribute}
    assert attrs["warm_codec"].s.decode() == "fp8-r2" and attrs["plugin_namespace"].s.decode() == PLUGIN_NAMESPACE
    assert [f.name for f in model.functions] == [TIERED_ATTENTION, "KVDecodePages_fp8_r2"]
    with pytest.raises(ValueError, match="delta coding"):
        tiered_attention_model(0.125, warm_codec="fp8-r2-delta", page_shape=(3, 16, 64))


def test_onnx_reference_runtime_agrees():
    """onnx.reference (the spec's own evaluator) runs the TieredAttention body too."""
    from onnx.reference import ReferenceEvaluator

    feeds = attention_inputs(2, 6, 3, 5, 12, 5, 7, seed=7, blind=True, partial=True)
    got = ReferenceEvaluator(tiered_attention_model(12 ** -0.5)).run(None, {k: v.numpy() for k, v in feeds.items()})
    out, _, page_probs = tiered_attention(**feeds, scale=12 ** -0.5)
    assert np.abs(got[0] - out.numpy()).max() <= ATOL
    assert np.abs(got[2] - page_probs.numpy()).max() <= ATOL


# --- ImportanceScore ----------------------------------------------------------------------------------

EDGE_DISTANCES = [0, 1, 15, 16, 17, 31, 32, 33] + [v for k in range(6, 21) for v in (2 ** k - 1, 2 ** k, 2 ** k + 1)]
HUGE_DISTANCES = [10 ** 6, 10 ** 9, 2 ** 40, 2 ** 52]


def exact_bucket(d: int, nb: int) -> int:
    """The bucket rule in Python integers: #{i in 1..NB-1 : d >= 16 * 2^(i-1)}."""
    return sum(d >= 16 * 2 ** (i - 1) for i in range(1, nb))


def score_inputs(b, h, kvh, d, m, nb, seed, *, blind=False):
    gen = torch.Generator().manual_seed(seed)
    kmin = torch.randn(b, m, kvh, d, generator=gen)
    kmax = kmin + torch.rand(b, m, kvh, d, generator=gen) * 2
    pool = torch.tensor(EDGE_DISTANCES + HUGE_DISTANCES + [-3])
    distance = pool[torch.randint(0, len(pool), (b, m), generator=gen)]
    page_mask = torch.rand(b, m, generator=gen) > 0.25
    if blind:
        page_mask[-1] = False
    return dict(q=torch.randn(b, h, d, generator=gen), kmin=kmin, kmax=kmax,
                page_tokens=torch.randint(0, 17, (b, m), generator=gen), distance=distance,
                saliency=torch.rand(b, m, generator=gen), page_mask=page_mask,
                position_table=torch.linspace(-0.2, 1.2, nb))  # outside [0, 1] at both ends: clamped


SCORE_CASES = [
    # b, h, kvh, d, m, nb, weights, blind
    (1, 6, 3, 64, 1, 16, (0.4, 0.3, 0.3), False),
    (2, 9, 3, 12, 7, 16, (0.4, 0.3, 0.3), True),
    (3, 6, 2, 12, 7, 5, (0.0, 0.5, 0.5), False),
    (3, 9, 3, 64, 7, 18, (1.0, 0.0, 0.0), True),
    (2, 4, 1, 12, 7, 1, (0.2, 0.5, 0.3), False),
]


@pytest.mark.parametrize("b,h,kvh,d,m,nb,weights,blind", SCORE_CASES)
def test_importance_score_matches_reference(b, h, kvh, d, m, nb, weights, blind):
    feeds = score_inputs(b, h, kvh, d, m, nb, seed=b * 100 + h * 10 + m + nb, blind=blind)
    scale = d ** -0.5
    got = run(importance_score_model(weights, scale), feeds)["score"]
    ref = importance_score(**feeds, weights=weights, scale=scale).numpy()
    assert got.shape == (b, m) and not np.isnan(got).any()
    assert np.abs(got - ref).max() <= ATOL
    assert not got[~feeds["page_mask"].numpy()].any()
    if weights[0] == 1.0:  # pure relevance: the best unmasked page of each sequence scores 1
        for row, mask in zip(got, feeds["page_mask"].numpy()):
            if mask.any():
                assert row[mask].max() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("nb", [16, 18])
def test_distance_bucket_edges(nb):
    """Distances at and around every power of two, and far beyond the last bucket: the ONNX
    bucket equals the reference and the integer rule exactly."""
    dist = EDGE_DISTANCES + HUGE_DISTANCES + [-1, -100]
    n = len(dist)
    table = torch.arange(nb, dtype=torch.float32) / 64  # distinct, exact, in [0, 1]
    feeds = dict(q=torch.zeros(1, 2, 4), kmin=torch.zeros(1, n, 1, 4), kmax=torch.zeros(1, n, 1, 4),
                 page_tokens=torch.ones(1, n, dtype=torch.int64), distance=torch.tensor([dist]),
                 saliency=torch.zeros(1, n), page_mask=torch.ones(1, n, dtype=torch.bool), position_table=table)
    got = run(importance_score_model((0.0, 1.0, 0.0), 0.5), feeds)["score"][0]
    ref = importance_score(**feeds, weights=(0.0, 1.0, 0.0), scale=0.5)[0].numpy()
    assert np.array_equal(got, ref)
    assert [round(float(x) * 64) for x in got] == [exact_bucket(max(x, 0), nb) for x in dist]


def test_distance_bucket_many_buckets():
    """With many buckets the ONNX op keeps the exact integer rule for distances just below a
    power of two >= 2^21, where the reference's float32 log2 rounds up (see docs/plugins.md)."""
    nb = 40
    dist = [v for k in range(4, 34) for v in (2 ** k - 1, 2 ** k)]
    n = len(dist)
    table = torch.arange(nb, dtype=torch.float32) / 64
    feeds = dict(q=torch.zeros(1, 1, 4), kmin=torch.zeros(1, n, 1, 4), kmax=torch.zeros(1, n, 1, 4),
                 page_tokens=torch.ones(1, n, dtype=torch.int64), distance=torch.tensor([dist]),
                 saliency=torch.zeros(1, n), page_mask=torch.ones(1, n, dtype=torch.bool), position_table=table)
    got = run(importance_score_model((0.0, 1.0, 0.0), 0.5), feeds)["score"][0]
    assert [round(float(x) * 64) for x in got] == [exact_bucket(x, nb) for x in dist]


def test_importance_score_node_form():
    model = importance_score_model((0.4, 0.3, 0.3), 0.125)
    check_node(model, IMPORTANCE_SCORE)
    (node,) = model.graph.node
    assert list(next(a for a in node.attribute if a.name == "weights").floats) == pytest.approx([0.4, 0.3, 0.3])
    with pytest.raises(ValueError, match="3 values"):
        importance_score_model((0.5, 0.5), 0.125)


# --- KVAppend -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("c,kvh,p,d,n,dtype", [
    (9, 3, 5, 12, 4, torch.float32),
    (4, 2, 16, 64, 1, torch.float32),
    (6, 2, 16, 64, 13, torch.float32),
    (5, 3, 5, 12, 7, torch.float16),
])
def test_kv_append_matches_reference(c, kvh, p, d, n, dtype):
    gen = torch.Generator().manual_seed(c * 100 + n)
    k_pool, v_pool = (torch.randn(c, kvh, p, d, generator=gen).to(dtype) for _ in range(2))
    k_new, v_new = (torch.randn(n, kvh, d, generator=gen).to(dtype) for _ in range(2))
    where = torch.randperm(c * p, generator=gen)[:n]  # distinct (slot, offset) pairs
    slot, offset = where // p, where % p
    feeds = dict(k_pool=k_pool, v_pool=v_pool, k_new=k_new, v_new=v_new, slot=slot, offset=offset)
    onnx_type = TensorProto.FLOAT if dtype == torch.float32 else TensorProto.FLOAT16
    got = run(kv_append_model(onnx_type), feeds)
    k_ref, v_ref = kv_append(**feeds)
    assert np.array_equal(got["k_pool_out"], k_ref.numpy()) and np.array_equal(got["v_pool_out"], v_ref.numpy())
    # the reference is pure and writes exactly the listed places
    assert not torch.equal(k_ref, k_pool) and torch.equal(k_pool, feeds["k_pool"])
    for i in range(n):
        assert torch.equal(k_ref[slot[i], :, offset[i]], k_new[i]) and torch.equal(v_ref[slot[i], :, offset[i]], v_new[i])
    touched = torch.zeros(c, p, dtype=torch.bool)
    touched[slot, offset] = True
    assert torch.equal(k_ref.permute(0, 2, 1, 3)[~touched], k_pool.permute(0, 2, 1, 3)[~touched])


def test_kv_append_node_form():
    check_node(kv_append_model(), KV_APPEND)
