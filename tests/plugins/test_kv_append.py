"""KVAppend: the reference writes exactly the listed places (as a copy, into given outputs, or
in place), and every implementation (ONNX node in ONNX Runtime, CUDA kernel as a copy and in
place, also with rows and pointers that allow only narrow words) equals it bit for bit, for the
pool dtypes each supports."""

import pytest
import torch
from op_impls import IMPLEMENTATIONS, check_node, on_cuda, run_onnx

from tieredkv.plugins.inputs import kv_append_inputs
from tieredkv.plugins.kv_append import kv_append

CASES = [dict(C=9, KVH=3, P=5, D=12, N=4), dict(C=4, KVH=2, P=16, D=64, N=1), dict(C=6, KVH=2, P=16, D=64, N=13),
         dict(C=20, KVH=3, P=16, D=64, N=7), dict(C=11, KVH=2, P=5, D=80, N=30), dict(C=4, KVH=8, P=16, D=128, N=1)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def case_id(case: dict) -> str:
    return ",".join(f"{k}{v}" for k, v in case.items())


def make(case: dict, dtype: torch.dtype) -> dict:
    return kv_append_inputs(torch.Generator().manual_seed(case["C"] * 100 + case["N"]), **case, dtype=dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_writes_exactly_the_listed_places(case):
    inputs = make(case, torch.float32)
    before = {k: v.clone() for k, v in inputs.items()}
    k_out, v_out = kv_append(**inputs)
    assert all(torch.equal(inputs[k], before[k]) for k in inputs)  # pure by default
    slot, offset = inputs["slot"], inputs["offset"]
    for i in range(case["N"]):
        assert torch.equal(k_out[slot[i], :, offset[i]], inputs["k_new"][i])
        assert torch.equal(v_out[slot[i], :, offset[i]], inputs["v_new"][i])
    touched = torch.zeros(case["C"], case["P"], dtype=torch.bool)
    touched[slot, offset] = True
    assert torch.equal(k_out.permute(0, 2, 1, 3)[~touched], inputs["k_pool"].permute(0, 2, 1, 3)[~touched])
    assert torch.equal(v_out.permute(0, 2, 1, 3)[~touched], inputs["v_pool"].permute(0, 2, 1, 3)[~touched])


def test_reference_writes_into_given_outputs_and_in_place():
    inputs = make(CASES[2], torch.float32)
    want = kv_append(**inputs)
    out = (torch.empty_like(inputs["k_pool"]), torch.empty_like(inputs["v_pool"]))
    got = kv_append(**inputs, out=out)
    assert got[0] is out[0] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    pools = (inputs["k_pool"], inputs["v_pool"])
    got = kv_append(**inputs, out=pools)
    assert got[0] is pools[0] and torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])


def run(impl: str, inputs: dict, request) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The op's outputs by ``impl``: (copy,) for ONNX; (copy, in place) for CUDA (the plugin
    copies the pools to its outputs; the runtime appends in place)."""
    if impl == "onnx":
        pytest.importorskip("onnx")
        from onnx import TensorProto

        from tieredkv.plugins.onnx_ops import kv_append_model

        dtype = inputs["k_pool"].dtype
        if dtype == torch.bfloat16:
            pytest.skip("numpy (ONNX Runtime's Python API) has no bfloat16")
        got = run_onnx(kv_append_model({torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}[dtype]),
                       inputs)
        return ((got["k_pool_out"], got["v_pool_out"]),)
    from tieredkv.plugins import cuda_ops

    lib = request.getfixturevalue("kernels")
    dev = on_cuda(inputs)
    copy = cuda_ops.kv_append(**dev, lib=lib)
    pools = (dev["k_pool"].clone(), dev["v_pool"].clone())
    in_place = cuda_ops.kv_append(*pools, *(dev[k] for k in ("k_new", "v_new", "slot", "offset")), out=pools, lib=lib)
    torch.cuda.synchronize()
    assert torch.equal(dev["k_pool"].cpu(), inputs["k_pool"]) and torch.equal(dev["v_pool"].cpu(), inputs["v_pool"])
    return tuple((k.cpu(), v.cpu()) for k, v in (copy, in_place))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_implementation_is_bit_exact(impl, dtype, case, request):
    inputs = make(case, dtype)
    want_k, want_v = kv_append(**inputs)
    for k, v in run(impl, inputs, request):
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    out = flat.view(t.shape)
    out.copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16 != 0
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_rows_move_in_the_widest_words_the_pointers_allow(kernels, dtype):
    """Rows move in 16-byte words where the row size and the pointers allow, else 8, 4, 2 bytes:
    pools and new tokens one element off a 16-byte boundary (2- or 4-byte words) and rows of
    24 / 48 bytes (8 / 16), copied and in place, equal the reference bit for bit."""
    from tieredkv.plugins import cuda_ops

    for case in (dict(C=7, KVH=2, P=5, D=12, N=6), dict(C=5, KVH=3, P=4, D=64, N=9)):
        inputs = make(case, dtype)
        want_k, want_v = kv_append(**inputs)
        dev = on_cuda(inputs)
        for name in ("k_pool", "v_pool", "k_new", "v_new"):
            dev[name] = _unaligned(dev[name])
        copy = cuda_ops.kv_append(**dev, lib=kernels)
        pools = (dev["k_pool"], dev["v_pool"])
        cuda_ops.kv_append(**dev, out=pools, lib=kernels)
        torch.cuda.synchronize()
        for k, v in (copy, pools):
            assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)


def test_onnx_node_form():
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_ops import KV_APPEND, kv_append_model

    check_node(kv_append_model(), KV_APPEND)
