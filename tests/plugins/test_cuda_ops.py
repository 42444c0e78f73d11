"""``tieredkv.plugins.cuda_ops``, the PyTorch binding of libtieredkv_kernels.so, on the CPU.

Without a GPU and without the library: every op checks its tensors (dtype, shape, contiguity,
device) and raises ValueError naming the argument before the library is loaded (the calls
here name a library that does not exist, so reaching it would raise KernelLibraryError
instead), and takes the plugin input types (int32 masks, int32-word warm pools, 16-bit pools);
the library is found at ``lib=``, ``$TIEREDKV_KERNELS`` or the default path, and a missing one
raises KernelLibraryError; the module imports with torch only (as on a bare GPU machine). With
nvcc (the csrc_build library): the host codec functions found through ``$TIEREDKV_KERNELS``
equal the reference bit for bit. The ops on CUDA tensors are compared with the references by
each op's test module (``cuda`` marker; tools/gpu_check.sh on a GPU); the TieredAttention host
emulation by test_tiered_attention_kernel.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from csrc_build import ROOT, build_plugins, load_kernels, needs_nvcc

from tieredkv.errors import KernelLibraryError, TieredKVError
from tieredkv.plugins import codec, cuda_lib, cuda_ops
from tieredkv.plugins.inputs import importance_score_inputs, kv_append_inputs, tiered_attention_inputs

MISSING = Path("/nonexistent/libtieredkv_kernels.so")  # reaching the library raises KernelLibraryError


def _desc(kvh: int, p: int, d: int, page_bytes: int) -> cuda_ops.CodecDesc:
    """A descriptor with only the fields the Python checks read (the library would refuse it)."""
    desc = cuda_ops.CodecDesc()
    desc.kvh, desc.p, desc.d, desc.page_bytes = kvh, p, d, page_bytes
    return desc


B, H, KVH, T, D, C, P, M, N, NB, W, BYTES = 2, 4, 2, 1, 8, 3, 4, 2, 3, 4, 2, 64


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _attention() -> dict:
    return tiered_attention_inputs(_gen(), B=B, H=H, KVH=KVH, T=T, D=D, P=P, M=M, C=C)


def _warm() -> dict:
    return _attention() | dict(warm_pool=torch.zeros(W, BYTES, dtype=torch.uint8),
                               warm_row=torch.full((B, M), -1, dtype=torch.int64))


def _attention_host() -> dict:
    """The plugin's input types: an int32 page mask, fp16 pools, warm pages as int32 words."""
    inputs = _warm()
    return inputs | dict(page_mask=inputs["page_mask"].to(torch.int32), k_pool=inputs["k_pool"].half(),
                         v_pool=inputs["v_pool"].half(), warm_pool=inputs["warm_pool"].view(torch.int32))


def _kv_append() -> dict:
    return kv_append_inputs(_gen(), C=C, KVH=KVH, P=P, D=D, N=N)


def _importance() -> dict:
    inputs = importance_score_inputs(_gen(), B=B, H=H, KVH=KVH, D=D, M=M, NB=NB, P=P)
    del inputs["weights"]  # an argument of its own (Op.extra)
    return inputs


def _pages() -> dict:
    return dict(k=torch.randn(N, KVH, P, D), v=torch.randn(N, KVH, P, D))


def _data() -> dict:
    return dict(data=torch.zeros(N, BYTES, dtype=torch.uint8))


@dataclass
class Op:
    fn: object
    tensors: object  # () -> {name: valid CPU tensor}, in argument order
    extra: dict = field(default_factory=dict)  # the other arguments
    sets_sizes: tuple[str, ...] = ()  # tensors whose last dim fixes a size: changing it blames a later one
    host: bool = False  # a host function: tensors must be on the CPU


OPS = {
    "tiered_attention": Op(cuda_ops.tiered_attention, _attention, dict(scale=0.5), ("q", "page_table")),
    "tiered_attention_warm": Op(cuda_ops.tiered_attention_warm, _warm, dict(desc=_desc(KVH, P, D, BYTES)),
                                ("q", "page_table")),
    "tiered_attention_host": Op(cuda_ops.tiered_attention_host, _attention_host,
                                dict(desc=_desc(KVH, P, D, BYTES), sm_count=132, blocks_per_sm=3), ("q", "page_table"),
                                host=True),
    "kv_append": Op(cuda_ops.kv_append, _kv_append, {}, ("k_pool",)),
    "importance_score": Op(cuda_ops.importance_score, _importance, dict(weights=(0.4, 0.3, 0.3)),
                           ("q", "position_table")),
    "encode_pages": Op(cuda_ops.encode_pages, _pages, dict(desc=_desc(KVH, P, D, BYTES))),
    "decode_pages": Op(cuda_ops.decode_pages, _data, dict(desc=_desc(KVH, P, D, BYTES))),
    "encode_pages_host": Op(cuda_ops.encode_pages_host, _pages, dict(desc=_desc(KVH, P, D, BYTES)), host=True),
    "decode_pages_host": Op(cuda_ops.decode_pages_host, _data, dict(desc=_desc(KVH, P, D, BYTES)), host=True),
}

_OTHER_DTYPE = {torch.float32: torch.float64, torch.int64: torch.int32, torch.bool: torch.uint8,
                torch.uint8: torch.int8, torch.int32: torch.int16, torch.float16: torch.float64}


def _broken(t: torch.Tensor, how: str, op: str, name: str) -> torch.Tensor:
    if how == "dtype":  # kv_append's k_pool may be any real dtype: a complex one is refused
        return t.to(torch.complex64) if (op, name) == ("kv_append", "k_pool") else t.to(_OTHER_DTYPE[t.dtype])
    if how == "ndim":
        return t.unsqueeze(0)
    if how == "size":  # the last dim one longer
        return torch.cat([t, t[..., :1]], dim=-1)
    strided = torch.empty(*t.shape, 2, dtype=t.dtype)[..., 0]  # same shape and dtype, not contiguous
    strided.copy_(t)
    assert not strided.is_contiguous()
    return strided


def _call(op: Op, tensors: dict, **kwargs):
    return op.fn(**tensors, **(op.extra | kwargs), lib=MISSING)


CASES = [(op, name, how) for op, spec in OPS.items() for name in spec.tensors()
         for how in ("dtype", "ndim", "size", "strided") if not (how == "size" and name in spec.sets_sizes)]


@pytest.mark.parametrize(("op", "name", "how"), CASES, ids=["-".join(c) for c in CASES])
def test_a_bad_tensor_is_a_value_error_naming_it(op, name, how):
    spec = OPS[op]
    tensors = spec.tensors()
    tensors[name] = _broken(tensors[name], how, op, name)
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: "):
        _call(spec, tensors)


@pytest.mark.parametrize("op", [op for op, spec in OPS.items() if not spec.host])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_cuda_ops_refuse_tensors_off_a_cuda_device(op, device):
    spec = OPS[op]
    tensors = {k: t.to(device) for k, t in spec.tensors().items()}
    first = next(iter(tensors))
    with pytest.raises(ValueError, match=rf"^{first}: expected a CUDA tensor, got one on {device}"):
        _call(spec, tensors)


@pytest.mark.parametrize("op", [op for op, spec in OPS.items() if spec.host])
def test_the_host_codec_refuses_tensors_off_the_cpu(op):
    spec = OPS[op]
    tensors = spec.tensors()
    last = list(tensors)[-1]
    tensors[last] = tensors[last].to("meta")
    with pytest.raises(ValueError, match=rf"^{last}: expected a tensor on the CPU"):
        _call(spec, tensors)


@pytest.mark.parametrize("op", [op for op, spec in OPS.items() if spec.host])
def test_valid_host_arguments_reach_the_library(op):
    """The checks pass on valid CPU tensors: the missing library is what stops the call."""
    spec = OPS[op]
    with pytest.raises(KernelLibraryError, match=re.escape(str(MISSING))):
        _call(spec, spec.tensors())


def test_attention_takes_the_plugin_input_types():
    """int32 page masks, uint8 or int32-word warm pools and float32 / float16 / bfloat16 pools pass
    the checks (the missing library is what stops the call); other dtypes name the argument."""
    host = OPS["tiered_attention_host"]
    for pool in (torch.float32, torch.float16, torch.bfloat16):
        for mask in (torch.bool, torch.int32):
            for words in (False, True):
                t = _warm()
                t = t | dict(k_pool=t["k_pool"].to(pool), v_pool=t["v_pool"].to(pool),
                             page_mask=t["page_mask"].to(mask),
                             warm_pool=t["warm_pool"].view(torch.int32) if words else t["warm_pool"])
                with pytest.raises(KernelLibraryError):
                    _call(host, t)
    t = _attention_host()
    with pytest.raises(ValueError, match=r"^v_pool: expected dtype torch.float16, got torch.float32"):
        _call(host, t | dict(v_pool=t["v_pool"].float()))
    with pytest.raises(ValueError, match=r"^k_pool: expected dtype float32, float16 or bfloat16, got torch.int8"):
        _call(host, t | dict(k_pool=t["k_pool"].to(torch.int8), v_pool=t["v_pool"].to(torch.int8)))
    with pytest.raises(ValueError, match=r"^warm_pool: expected shape \[W, page_bytes / 4\] = \[\*, 16\]"):
        _call(host, t | dict(warm_pool=torch.zeros(W, BYTES, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"^warm_pool, warm_row and desc go together"):
        _call(host, {k: v for k, v in t.items() if k != "warm_row"})
    with pytest.raises(ValueError, match=r"^num_splits: expected an int >= 0"):
        _call(host, t, num_splits=-1)
    with pytest.raises(ValueError, match=r"^sm_count: expected an int >= 0"):
        _call(host, t, sm_count=-2)
    with pytest.raises(ValueError, match=r"^blocks_per_sm: expected an int >= 0"):
        _call(host, t, blocks_per_sm=1.5)
    with pytest.raises(ValueError, match=r"^num_splits: expected an int >= 0"):
        _call(OPS["tiered_attention"], _attention(), num_splits=1.5)


def test_importance_takes_16_bit_queries_and_summaries():
    """q and the page summaries may be float32, float16 or bfloat16 (the summaries one dtype): such
    calls pass the dtype and shape checks (on the CPU, the device check is what stops them)."""
    score = OPS["importance_score"]
    for q_dtype in (torch.float32, torch.float16, torch.bfloat16):
        for s_dtype in (torch.float32, torch.float16, torch.bfloat16):
            t = _importance()
            t |= dict(q=t["q"].to(q_dtype), kmin=t["kmin"].to(s_dtype), kmax=t["kmax"].to(s_dtype))
            with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor, got one on cpu"):
                _call(score, t)
    t = _importance()
    with pytest.raises(ValueError, match=r"^kmax: expected dtype torch.float16, got torch.float32"):
        _call(score, t | dict(kmin=t["kmin"].half()))
    with pytest.raises(ValueError, match=r"^q: expected dtype float32, float16 or bfloat16, got torch.int32"):
        _call(score, t | dict(q=t["q"].to(torch.int32)))


def test_outputs_are_checked_like_inputs():
    attention = OPS["tiered_attention"]
    q = attention.tensors()["q"]
    with pytest.raises(ValueError, match=r"^out: expected a tuple of 3 tensors"):
        _call(attention, attention.tensors(), out=(q, q))
    with pytest.raises(ValueError, match=r"^out\[1\] \(lse\): expected shape \[B, H, T\]"):
        _call(attention, attention.tensors(), out=(torch.empty(B, H, T, D), torch.empty(B, H), torch.empty(B, H, T, M)))
    kv = OPS["kv_append"]
    pools = kv.tensors()
    with pytest.raises(ValueError, match=r"^out\[0\] \(k_pool_out\): expected dtype torch.float32"):
        _call(kv, pools, out=(pools["k_pool"].half(), pools["v_pool"]))
    score = OPS["importance_score"]
    with pytest.raises(ValueError, match=r"^out: expected shape \[B, M\]"):
        _call(score, score.tensors(), out=torch.empty(B, M + 1))
    pages = OPS["encode_pages_host"]
    with pytest.raises(ValueError, match=r"^out: expected dtype torch.uint8"):
        _call(pages, pages.tensors(), out=torch.empty(N, BYTES))
    data = OPS["decode_pages_host"]
    with pytest.raises(ValueError, match=r"^out\[0\] \(k\): expected shape"):
        _call(data, data.tensors(), out=(torch.empty(N, KVH, P, D + 1), torch.empty(N, KVH, P, D)))


def test_sizes_beyond_the_kernels_and_bad_arguments_are_value_errors():
    attention, score = OPS["tiered_attention"], OPS["importance_score"]
    wide = attention.tensors() | dict(q=torch.randn(B, H, T, 300), k_pool=torch.randn(C, KVH, P, 300),
                                      v_pool=torch.randn(C, KVH, P, 300))
    with pytest.raises(ValueError, match=r"^q: head dim D = 300; the kernels take 0 < D <= 256"):
        _call(attention, wide)
    three = attention.tensors() | dict(q=torch.randn(B, 3, T, D))
    with pytest.raises(ValueError, match=r"^q: H = 3 query heads is not a multiple of KVH = 2"):
        _call(attention, three)
    with pytest.raises(ValueError, match=r"^weights: expected \(relevance, position, saliency\)"):
        _call(score, score.tensors(), weights=(0.5, 0.5))
    with pytest.raises(ValueError, match=r"^position_table: expected at least one bucket"):
        _call(score, score.tensors() | dict(position_table=torch.empty(0)))
    for op in ("tiered_attention_warm", "encode_pages", "decode_pages_host"):
        with pytest.raises(ValueError, match=r"^desc: expected a CodecDesc from codec_desc\(\), got str"):
            _call(OPS[op], OPS[op].tensors(), desc="int4")
    with pytest.raises(ValueError, match=r"^desc: page shape \[KVH, P, D\] = \[2, 4, 16\], the pools"):
        _call(OPS["tiered_attention_warm"], _warm(), desc=_desc(KVH, P, 16, BYTES))
    with pytest.raises(ValueError, match=r"^k: expected shape \[N, KVH, P, D\] = \[\*, 2, 5, 8\]"):
        _call(OPS["encode_pages_host"], _pages(), desc=_desc(KVH, 5, D, BYTES))
    with pytest.raises(ValueError, match=r"^data: expected shape \[N, page_bytes\] = \[\*, 128\]"):
        _call(OPS["decode_pages"], _data(), desc=_desc(KVH, P, D, 128))


# --- finding the library ------------------------------------------------------------------------


def test_the_library_is_the_argument_else_the_environment_else_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv(cuda_ops.ENV_VAR, raising=False)
    monkeypatch.setattr(cuda_lib, "DEFAULT_LIBRARY", tmp_path / "default.so")  # where library_path reads it
    assert cuda_ops.library_path() == tmp_path / "default.so"
    with pytest.raises(KernelLibraryError, match=r"default\.so \(the default; set \$TIEREDKV_KERNELS"):
        cuda_ops.load_library()
    monkeypatch.setenv(cuda_ops.ENV_VAR, str(tmp_path / "env.so"))
    assert cuda_ops.library_path() == tmp_path / "env.so"
    with pytest.raises(KernelLibraryError, match=r"env\.so \(from \$TIEREDKV_KERNELS\): no such file"):
        cuda_ops.codec_desc("int4", 3, 16, 64)
    assert cuda_ops.library_path(tmp_path / "given.so") == tmp_path / "given.so"
    with pytest.raises(KernelLibraryError, match=r"given\.so \(given\): no such file; build"):
        cuda_ops.load_library(tmp_path / "given.so")


def test_a_file_that_is_not_a_library_is_a_kernel_library_error(tmp_path):
    fake = tmp_path / "libtieredkv_kernels.so"
    fake.write_text("not an ELF file")
    with pytest.raises(KernelLibraryError, match="cannot be loaded") as info:
        cuda_ops.load_library(fake)
    assert isinstance(info.value, TieredKVError)


def _run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_module_imports_with_torch_only():
    out = _run_python("import sys, tieredkv.plugins.cuda_ops\n"
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime')))")
    assert out.strip() == "[]"


# --- with the library (nvcc + cmake, no GPU) -----------------------------------------------------


@needs_nvcc
def test_host_codec_through_the_environment_matches_the_reference(tmp_path_factory, monkeypatch):
    """encode_pages_host / decode_pages_host with no ``lib=`` use ``$TIEREDKV_KERNELS`` and equal
    codec.encode_pages / decode_pages bit for bit, for every codec, also into given ``out=``."""
    lib = load_kernels(tmp_path_factory)
    monkeypatch.setenv(cuda_ops.ENV_VAR, str(build_plugins(tmp_path_factory) / "libtieredkv_kernels.so"))
    assert cuda_ops.load_library() is lib  # loaded once per path
    gen = torch.Generator().manual_seed(11)
    shape = (2, 7, 12)
    for name, spec in codec.CODECS.items():
        k, v = (torch.randn(3, *shape, generator=gen) * 3 for _ in range(2))
        desc = cuda_ops.codec_desc(name, *shape)
        assert desc.page_bytes == codec.page_bytes(spec, *shape)
        ref = codec.encode_pages(k, v, spec)
        assert torch.equal(cuda_ops.encode_pages_host(k, v, desc), ref), name
        out = torch.full_like(ref, 0xAB)
        assert cuda_ops.encode_pages_host(k, v, desc, out=out) is out and torch.equal(out, ref), name
        ref_k, ref_v = codec.decode_pages(ref, spec, shape)
        dec_k, dec_v = cuda_ops.decode_pages_host(ref, desc)
        assert torch.equal(dec_k, ref_k) and torch.equal(dec_v, ref_v), name


@needs_nvcc
def test_a_refused_descriptor_is_a_value_error(tmp_path_factory):
    lib = load_kernels(tmp_path_factory)
    with pytest.raises(ValueError, match=r"tkv_codec_desc\('int3', 3, 16, 64\): invalid argument"):
        cuda_ops.codec_desc("int3", 3, 16, 64, lib=lib)
    with pytest.raises(ValueError, match=r"tkv_codec_desc\('int4', 0, 16, 64\)"):
        cuda_ops.codec_desc("int4", 0, 16, 64, lib=lib)


@needs_nvcc
def test_a_nonzero_status_is_a_runtime_error_with_the_library_message(tmp_path_factory):
    """A descriptor that passes the Python checks (its page shape and size are right) but is not
    what tkv_codec_desc builds is refused by the library: its status becomes a RuntimeError."""
    lib = load_kernels(tmp_path_factory)
    tampered = cuda_ops.codec_desc("fp8-r2", KVH, P, D, lib=lib)
    tampered.offset[1][0] += 128
    k, v = torch.randn(N, KVH, P, D), torch.randn(N, KVH, P, D)
    with pytest.raises(RuntimeError, match=r"^tkv_encode_pages_host: invalid argument \(status 1\)$"):
        cuda_ops.encode_pages_host(k, v, tampered, lib=lib)
    data = torch.zeros(N, tampered.page_bytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"^tkv_decode_pages_host: invalid argument \(status 1\)$"):
        cuda_ops.decode_pages_host(data, tampered, lib=lib)


@needs_nvcc
def test_the_importance_workspace_and_the_entry_checks(tmp_path_factory):
    """tkv_importance_score_workspace is the documented size and never shrinks as a size grows; the
    one-pass entry refuses what it cannot run before touching a device (no GPU here): a relevance
    weight without a workspace (or with too small a one), unknown dtype codes, H not a multiple of
    KVH; an empty call is a no-op."""
    lib = load_kernels(tmp_path_factory)
    for b, h, m in ((1, 64, 2048), (3, 9, 1), (2, 8, 65), (1, 1, 0)):
        want = 4 * b * h * (m + 2 * -(-m // 64))
        assert cuda_ops.importance_score_workspace_bytes(b, h, m, lib=lib) == want
        for grown in ((b + 1, h, m), (b, h + 1, m), (b, h, m + 1)):
            assert cuda_ops.importance_score_workspace_bytes(*grown, lib=lib) >= want
    with pytest.raises(ValueError, match=r"sizes must be >= 0"):
        cuda_ops.importance_score_workspace_bytes(1, -1, 4, lib=lib)

    def call(b=1, h=8, m=4, kvh=2, w_rel=0.4, q_dtype=0, s_dtype=1, ws_bytes=0):
        return lib.tkv_importance_score_ex(*([None] * 9), b, h, 64, m, kvh, 16, w_rel, 0.3, 0.3, 0.125, q_dtype,
                                           s_dtype, None, ws_bytes, None)

    assert call(ws_bytes=0) == 1 and call(ws_bytes=4 * 8 * (4 + 2) - 1) == 1  # relevance needs the workspace
    assert call(q_dtype=3) == 1 and call(s_dtype=-1) == 1 and call(h=7) == 1
    assert call(b=0) == 0 and call(m=0) == 0  # nothing to score
