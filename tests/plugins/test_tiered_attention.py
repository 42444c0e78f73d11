"""TieredAttention: the reference against naive attention, and every implementation (ONNX
node in ONNX Runtime, CUDA kernel) against the reference on inputs of awkward sizes (GQA, MQA,
MHA, odd head dims and page sizes, T > 1, padding columns, sequences that see nothing, queries
before every key, causal cuts inside pages), with and without warm (encoded) pages."""

import math

import pytest
import torch
from op_impls import IMPLEMENTATIONS, TOLERANCE, assert_close, assert_close_lse, check_node, on_cuda, run_onnx

from tieredkv.plugins.codec import CODECS, as_words
from tieredkv.plugins.inputs import tiered_attention_inputs, warm_inputs
from tieredkv.plugins.tiered_attention import attention_over_pages, merge_attention, tiered_attention

CASES = [
    dict(B=1, H=6, KVH=3, T=1, D=64, P=16, M=1),
    dict(B=1, H=9, KVH=3, T=5, D=12, P=5, M=7, partial=True),
    dict(B=2, H=6, KVH=2, T=1, D=12, P=5, M=7, blind=True),
    dict(B=3, H=9, KVH=3, T=5, D=64, P=16, M=7, blind=True, partial=True),
    dict(B=3, H=6, KVH=2, T=5, D=12, P=16, M=1),
    dict(B=2, H=4, KVH=1, T=5, D=12, P=5, M=7, partial=True),  # MQA
    dict(B=2, H=6, KVH=6, T=1, D=12, P=5, M=7, blind=True),  # MHA
    dict(B=3, H=9, KVH=3, T=1, D=64, P=16, M=9, pad=2, C=23, empty_row=True),  # SmolLM2 decode
    dict(B=3, H=9, KVH=3, T=3, D=64, P=5, M=11, pad=3, C=17),
    dict(B=2, H=6, KVH=2, T=2, D=80, P=7, M=6, pad=1, C=9),
    dict(B=1, H=8, KVH=8, T=4, D=128, P=16, M=13, C=13),
    dict(B=2, H=4, KVH=1, T=1, D=256, P=4, M=5, pad=1, C=7, empty_row=True),
    dict(B=2, H=8, KVH=2, T=2, D=128, P=16, M=300, pad=20, C=320),  # a long page list
]
WARM_CASES = [CASES[1], CASES[3], CASES[5], CASES[7], CASES[9],
              dict(B=2, H=6, KVH=3, T=2, D=12, P=13, M=9, pad=2, C=8), dict(B=2, H=6, KVH=2, T=1, D=3, P=16, M=7)]


def case_id(case: dict) -> str:
    return ",".join(f"{k}{v}" if not isinstance(v, bool) else k for k, v in case.items())


def make(case: dict, seed: int, *, codec: str | None = None) -> dict:
    gen = torch.Generator().manual_seed(seed)
    inputs = tiered_attention_inputs(gen, **case)
    return inputs if codec is None else warm_inputs(gen, inputs, codec)


def plugin_tensors(tensors: dict) -> dict:
    """The node's input types: the page mask as int32, warm pages as int32 words."""
    out = dict(tensors, page_mask=tensors["page_mask"].to(torch.int32))
    if "warm_pool" in out:
        out["warm_pool"] = as_words(out["warm_pool"])
    return out


def test_reference_takes_the_plugin_input_types():
    """int32 masks and warm pages as int32 words give the reference's bool / uint8 results."""
    gen = torch.Generator().manual_seed(5)
    inputs = warm_inputs(gen, tiered_attention_inputs(gen, B=2, H=4, KVH=2, T=2, D=16, P=4, M=5, pad=1), "int4")
    want = tiered_attention(**inputs)
    got = tiered_attention(**plugin_tensors(inputs))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def run(impl: str, inputs: dict, scale: float, request) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, page_probs) of TieredAttention by ``impl`` (``inputs``: the reference's arguments)."""
    codec = inputs.get("warm_codec")
    tensors = {k: v for k, v in inputs.items() if k != "warm_codec"}
    _, kvh, p, d = inputs["k_pool"].shape
    if impl == "onnx":
        pytest.importorskip("onnx")
        from tieredkv.plugins.onnx_ops import tiered_attention_model

        if codec is not None and CODECS[codec].keyframe:
            pytest.skip(f"{codec}: the delta codec has no ONNX form")
        tensors = plugin_tensors(tensors)
        got = run_onnx(tiered_attention_model(scale, warm_codec=codec, page_shape=None if codec is None else (kvh, p, d)),
                       tensors)
        return got["out"], got["lse"], got["page_probs"]
    from tieredkv.plugins import cuda_ops

    lib = request.getfixturevalue("kernels")
    dev = on_cuda(tensors)
    if codec is None:
        got = cuda_ops.tiered_attention(**dev, scale=scale, lib=lib)
    else:
        warm = dict(warm_pool=dev.pop("warm_pool"), warm_row=dev.pop("warm_row"))
        got = cuda_ops.tiered_attention_warm(**dev, **warm, desc=cuda_ops.codec_desc(codec, kvh, p, d, lib=lib),
                                             scale=scale, lib=lib)
    torch.cuda.synchronize()
    return tuple(x.cpu() for x in got)


def assert_matches(got, ref, atol: float) -> None:
    (out, lse, probs), (ref_out, ref_lse, ref_probs) = got, ref
    assert_close(out, ref_out, atol, "out")
    assert_close(probs, ref_probs, atol, "page_probs")
    assert_close_lse(lse, ref_lse, atol)
    seen = torch.isfinite(lse)
    assert torch.allclose(probs.sum(-1)[seen], torch.ones(int(seen.sum())), atol=1e-5)


# ----------------------------------------------------------------------------- the reference


def naive(q, keys, values, positions, past):
    """q [H, T, D]; keys/values [KVH, S, D]; positions [S]; causal by position."""
    h, t, d = q.shape
    g = h // keys.shape[0]
    k, v = keys.repeat_interleave(g, 0), values.repeat_interleave(g, 0)
    logits = q @ k.transpose(1, 2) / math.sqrt(d)
    allowed = positions.view(1, -1) <= (past + torch.arange(t)).view(-1, 1)
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, -1) @ v, torch.logsumexp(logits, -1)


@pytest.mark.parametrize("h,kvh,d,p,t", [(4, 2, 8, 4, 1), (6, 3, 12, 5, 3), (9, 3, 64, 16, 1), (2, 1, 6, 3, 7)])
def test_reference_equals_naive_attention(h, kvh, d, p, t):
    gen = torch.Generator().manual_seed(h * 100 + d)
    n_pages, pool = 7, 11
    seq_len = n_pages * p - 2  # last page partly filled
    past = seq_len - t
    k_pool = torch.randn(pool, kvh, p, d, generator=gen)
    v_pool = torch.randn(pool, kvh, p, d, generator=gen)
    table = torch.randperm(pool, generator=gen)[:n_pages]
    mask = torch.tensor([True, False, True, True, False, True, True])  # pages 1 and 4 masked out
    q = torch.randn(1, h, t, d, generator=gen)
    out, lse, probs = tiered_attention(q, k_pool, v_pool, table[None], mask[None], torch.arange(n_pages)[None],
                                       torch.tensor([seq_len]), torch.tensor([past]))
    keep = mask.nonzero().flatten()
    keys = k_pool[table[keep]].permute(1, 0, 2, 3).reshape(kvh, -1, d)
    vals = v_pool[table[keep]].permute(1, 0, 2, 3).reshape(kvh, -1, d)
    pos = (keep.view(-1, 1) * p + torch.arange(p)).flatten()
    valid = pos < seq_len
    ref_out, ref_lse = naive(q[0], keys[:, valid], vals[:, valid], pos[valid], past)
    assert torch.allclose(out[0], ref_out, atol=1e-5)
    assert torch.allclose(lse[0], ref_lse, atol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(1, h, t), atol=1e-5)
    assert (probs[..., ~mask] == 0).all()


def test_merge_of_blocks_equals_one_call():
    gen = torch.Generator().manual_seed(0)
    h, kvh, d, p, n = 6, 2, 8, 4, 9
    k_pool, v_pool = torch.randn(n, kvh, p, d, generator=gen), torch.randn(n, kvh, p, d, generator=gen)
    q = torch.randn(1, h, 2, d, generator=gen)
    args = (torch.tensor([n * p]), torch.tensor([n * p - 2]))
    full_out, full_lse, full_probs = tiered_attention(q, k_pool, v_pool, torch.arange(n)[None],
                                                      torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None], *args)
    outs, lses, probs = [], [], []
    for block in torch.arange(n).split(4):
        o, l, pp = tiered_attention(q, k_pool, v_pool, block[None], torch.ones(1, len(block), dtype=torch.bool),
                                    block[None], *args)
        outs.append(o), lses.append(l), probs.append(pp)
    out, lse, weights = merge_attention(outs, lses)
    assert torch.allclose(out, full_out, atol=1e-5) and torch.allclose(lse, full_lse, atol=1e-5)
    merged = torch.cat([pp * w.unsqueeze(-1) for pp, w in zip(probs, weights)], dim=-1)
    assert torch.allclose(merged, full_probs, atol=1e-5)


def test_nothing_visible_gives_zeros():
    q = torch.randn(1, 2, 1, 4)
    pool = torch.randn(3, 1, 2, 4)
    out, lse, probs = tiered_attention(q, pool, pool, torch.tensor([[0, 1]]), torch.tensor([[False, False]]),
                                       torch.tensor([[0, 1]]), torch.tensor([4]), torch.tensor([3]))
    assert (out == 0).all() and torch.isinf(lse).all() and (probs == 0).all()


def test_the_awkward_cases_happen():
    """The input builder's options do what they say: the blind sequence and the empty row see
    nothing, a partial sequence's first queries see nothing and its later ones see keys."""
    _, lse, _ = tiered_attention(**make(CASES[3], seed=1))
    assert torch.isneginf(lse[-1]).all()  # blind
    assert torch.isneginf(lse[0, :, :3]).all() and torch.isfinite(lse[0, :, 3:]).all()  # partial
    _, lse, _ = tiered_attention(**make(CASES[7], seed=1))
    assert torch.isneginf(lse[0]).all()  # empty row


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_reference_reads_warm_pages_from_their_bytes(codec):
    """Warm pages decode as codec.decode_pages decodes them; reading their (wrong) pool pages
    instead gives another answer, so the warm path is what the implementations are tested on."""
    inputs = make(CASES[3], seed=5, codec=codec)
    out, _, _ = tiered_attention(**inputs, scale=12 ** -0.5)
    plain, _, _ = tiered_attention(**{k: v for k, v in inputs.items() if not k.startswith("warm")}, scale=12 ** -0.5)
    assert (plain - out).abs().max() > 1e-3
    with pytest.raises(ValueError, match="all three or none"):
        tiered_attention(**{k: v for k, v in inputs.items() if k != "warm_row"})


# ----------------------------------------------------------------------------- implementations


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_implementation_matches_reference(impl, case, request):
    inputs = make(case, seed=sum(case[k] for k in ("B", "H", "T", "M")))
    scale = case["D"] ** -0.5
    assert_matches(run(impl, inputs, scale, request), tiered_attention(**inputs, scale=scale), TOLERANCE[impl])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", WARM_CASES, ids=case_id)
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_warm_implementation_matches_reference(impl, codec, case, request):
    inputs = make(case, seed=case["M"] + case["D"], codec=codec)
    scale = case["D"] ** -0.5
    assert_matches(run(impl, inputs, scale, request), tiered_attention(**inputs, scale=scale), TOLERANCE[impl])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_warm_implementation_without_kept_warm_pages(impl, request):
    """No kept warm page (every warm page masked): nothing to decode; equals the plain op."""
    inputs = make(CASES[2], seed=4, codec="int4")
    inputs["page_mask"] = inputs["page_mask"] & (inputs["warm_row"] < 0)
    plain = tiered_attention(**{k: v for k, v in inputs.items() if not k.startswith("warm")}, scale=0.3)
    assert_matches(run(impl, inputs, 0.3, request), plain, TOLERANCE[impl])


@pytest.mark.cuda
@pytest.mark.parametrize("codec", ["int4", "fp8-r2"])
def test_cuda_warm_rows_outside_the_pool(kernels, codec):
    """The kernel's defined behaviour beyond the spec: a warm row >= W is masked, any negative row
    reads the pools like -1."""
    from tieredkv.plugins import cuda_ops

    inputs = make(CASES[9], seed=3, codec=codec)
    w = inputs["warm_pool"].shape[0]
    gen = torch.Generator().manual_seed(8)
    u = torch.rand(inputs["warm_row"].shape, generator=gen)
    row = torch.where(u > 0.8, w + torch.randint(0, 3, u.shape, generator=gen), inputs["warm_row"])
    row = torch.where((u > 0.7) & (u <= 0.8) & (row < 0), -torch.randint(2, 9, u.shape, generator=gen), row)
    ref_row = torch.where((row < 0) | (row >= w), -1, row)
    ref = tiered_attention(**{**inputs, "page_mask": inputs["page_mask"] & (row < w), "warm_row": ref_row}, scale=0.1)
    _, kvh, p, d = inputs["k_pool"].shape
    dev = on_cuda({k: v for k, v in inputs.items() if k not in ("warm_codec", "warm_row", "warm_pool")})
    got = cuda_ops.tiered_attention_warm(**dev, warm_pool=inputs["warm_pool"].cuda(), warm_row=row.cuda(),
                                         desc=cuda_ops.codec_desc(codec, kvh, p, d, lib=kernels), scale=0.1,
                                         lib=kernels)
    torch.cuda.synchronize()
    assert_matches(tuple(x.cpu() for x in got), ref, TOLERANCE["cuda"])


# ----------------------------------------------------------------------------- the ONNX node


def test_onnx_node_form():
    onnx = pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_ops import TIERED_ATTENTION, tiered_attention_model

    model = tiered_attention_model(0.125)
    node = check_node(model, TIERED_ATTENTION)
    assert next(a for a in node.attribute if a.name == "scale").f == pytest.approx(0.125)
    warm = tiered_attention_model(0.125, warm_codec="fp8-r2", page_shape=(3, 16, 64))
    onnx.checker.check_model(warm, full_check=True)
    (node,) = warm.graph.node
    assert node.op_type == TIERED_ATTENTION and len(node.input) == 10
    assert next(a for a in node.attribute if a.name == "warm_codec").s.decode() == "fp8-r2"
    assert [f.name for f in warm.functions] == [TIERED_ATTENTION, "KVDecodePages_fp8_r2"]
    with pytest.raises(ValueError, match="delta coding"):
        tiered_attention_model(0.125, warm_codec="fp8-r2-delta", page_shape=(3, 16, 64))


def test_onnx_reference_evaluator_agrees():
    """onnx.reference (the spec's own evaluator) runs the TieredAttention body too."""
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_ops import tiered_attention_model

    inputs = make(CASES[3], seed=7)
    got = run_onnx(tiered_attention_model(12 ** -0.5), inputs, evaluator="reference")
    out, _, page_probs = tiered_attention(**inputs, scale=12 ** -0.5)
    assert_close(got["out"], out, 1e-5)
    assert_close(got["page_probs"], page_probs, 1e-5)


@pytest.mark.parametrize("h,kvh,t", [(6, 3, 1), (9, 3, 2), (4, 1, 1), (8, 8, 3)])
def test_a_mask_per_kv_head_equals_each_group_alone(h, kvh, t):
    """page_mask [B, KVH, M] (the kv-head selection): each kv head's query group gets exactly
    what a call over that kv head alone with its own [B, M] mask gives (out, lse, page masses)."""
    gen = torch.Generator().manual_seed(h * 10 + kvh + t)
    b, d, p, m, pool = 2, 12, 5, 9, 13
    k_pool, v_pool = torch.randn(pool, kvh, p, d, generator=gen), torch.randn(pool, kvh, p, d, generator=gen)
    table = torch.stack([torch.randperm(pool, generator=gen)[:m] for _ in range(b)])
    index = torch.arange(m).expand(b, -1)
    seq_len, past = torch.tensor([m * p - 3, m * p - 1]), torch.tensor([m * p - 3 - t, m * p - 1 - t])
    mask = torch.rand(b, kvh, m, generator=gen) > 0.4
    mask[1, 0] = False  # one kv head of one sequence sees nothing
    q = torch.randn(b, h, t, d, generator=gen)
    out, lse, probs = tiered_attention(q, k_pool, v_pool, table, mask, index, seq_len, past)
    g = h // kvh
    for j in range(kvh):
        heads = slice(j * g, (j + 1) * g)
        o, l, pp = tiered_attention(q[:, heads], k_pool[:, j : j + 1], v_pool[:, j : j + 1], table,
                                    mask[:, j].to(torch.int32), index, seq_len, past)
        assert torch.allclose(out[:, heads], o, atol=1e-6) and torch.equal(lse[:, heads], l)
        assert torch.allclose(probs[:, heads], pp, atol=1e-6)
    assert (out[1, :g] == 0).all() and torch.isneginf(lse[1, :g]).all()
    every = tiered_attention(q, k_pool, v_pool, table, torch.ones(b, kvh, m, dtype=torch.bool), index, seq_len, past)
    plain = tiered_attention(q, k_pool, v_pool, table, torch.ones(b, m, dtype=torch.bool), index, seq_len, past)
    assert all(torch.equal(x, y) for x, y in zip(every, plain))


def test_a_mask_per_kv_head_decodes_the_warm_pages_any_head_keeps():
    """With warm pages, a per-kv-head mask decodes every page some kv head keeps: the same as
    the pools holding those pages decoded."""
    from tieredkv.plugins.codec import CODECS, decode_pages

    gen = torch.Generator().manual_seed(5)
    inputs = warm_inputs(gen, make(CASES[3], seed=5), "int4")
    b, m = inputs["page_table"].shape
    kvh = inputs["k_pool"].shape[1]
    mask = (torch.rand(b, kvh, m, generator=gen) > 0.5) & inputs["page_mask"].bool().unsqueeze(1)
    out = tiered_attention(**{**inputs, "page_mask": mask})
    k_pages, v_pages = inputs["k_pool"][inputs["page_table"]], inputs["v_pool"][inputs["page_table"]]
    warm = inputs["warm_row"] >= 0
    k_dec, v_dec = decode_pages(inputs["warm_pool"][inputs["warm_row"][warm]], CODECS["int4"], tuple(k_pages.shape[2:]))
    k_pages[warm], v_pages[warm] = k_dec, v_dec
    ref = attention_over_pages(inputs["q"], k_pages, v_pages, mask, inputs["page_index"], inputs["seq_len"],
                               inputs["past"])
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(out, ref))


@pytest.mark.parametrize("codec", [None, "int4"])
@pytest.mark.parametrize("case", [CASES[3], CASES[9]], ids=case_id)
def test_onnx_reads_float16_pools_as_the_plugin_does(case, codec):
    """The ONNX function on float16 pools (a float16 engine's graph; q and the outputs stay
    float32, as the plugin takes them): the reference on the same pools, warm pages decoded and
    rounded to the pools' type."""
    pytest.importorskip("onnx")
    from onnx import TensorProto

    from tieredkv.plugins.onnx_ops import tiered_attention_model

    inputs = make(case, seed=3, codec=codec)
    inputs["k_pool"], inputs["v_pool"] = inputs["k_pool"].half(), inputs["v_pool"].half()
    scale = case["D"] ** -0.5
    tensors = plugin_tensors({k: v for k, v in inputs.items() if k != "warm_codec"})
    _, kvh, p, d = inputs["k_pool"].shape
    model = tiered_attention_model(scale, warm_codec=codec, page_shape=None if codec is None else (kvh, p, d),
                                   pool_dtype=TensorProto.FLOAT16)
    check_node(model, "TieredAttention")
    got = run_onnx(model, tensors)
    want = tiered_attention(**inputs, scale=scale)
    assert got["out"].dtype == torch.float32
    assert_matches((got["out"], got["lse"], got["page_probs"]), want, TOLERANCE["onnx"])
