"""tieredkv.plugins.cuda_lib: loading ``libtieredkv_kernels.so`` and the argument checks of
its ops (:mod:`tieredkv.plugins.cuda_ops`, which re-exports the public names).

:func:`load_library` binds the C ABI (``plugins/csrc/tieredkv_kernels.h``) with ctypes and
checks that the library matches this binding; the ``_arg`` family checks a tensor's dtype,
shape, contiguity and device and names the argument in the ``ValueError`` it raises. Imports
need only torch and ctypes (plus ``tieredkv.errors``); loading needs no GPU.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from tieredkv.errors import KernelLibraryError

#: environment variable naming the library when no ``lib=`` is given
ENV_VAR = "TIEREDKV_KERNELS"
#: the library built in the checkout (plugins/csrc/README.md, "Build")
DEFAULT_LIBRARY = Path(__file__).resolve().parents[1] / "build" / "plugins" / "libtieredkv_kernels.so"
#: the kernels' largest head dim (kMaxHeadDim of plugins/csrc/kernels/common.cuh)
MAX_HEAD_DIM = 256
#: TieredAttention pool element types -> TKV_DTYPE_* of tieredkv_kernels.h
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: most splits of the TieredAttention split plan (kMaxSplits of kernels/tiered_attention.cuh)
MAX_SPLITS = 128
#: sections of an encoded page in layout order: the index of ``CodecDesc.offset[role][.]`` and
#: ``CodecDesc.bytes[role][.]`` (TKV_SECTION_* of tieredkv_kernels.h)
CODEC_SECTIONS = ("codes", "scale", "zero", "rcodes", "rscale", "keyframes")


class CodecDesc(ctypes.Structure):
    """``tkv_codec_desc_t`` of tieredkv_kernels.h (10 int32, then 33 int64; no holes): a codec
    for pages K, V [kvh, p, d] and the byte layout of one encoded page (``page_bytes`` bytes).
    Build it with :func:`codec_desc`; the library refuses a descriptor that differs from what
    that builds."""

    _i32, _i64 = ctypes.c_int32, ctypes.c_int64
    _fields_ = [("codec", _i32), ("base", _i32), ("bits", _i32), ("asym", _i32), ("residual_bits", _i32),
                ("keyframe", _i32), ("group", _i32), ("axis", _i32 * 2), ("keyframes_per_page", _i32),
                ("kvh", _i64), ("p", _i64), ("d", _i64), ("values", _i64), ("group_size", _i64 * 2),
                ("groups", _i64 * 2), ("offset", (_i64 * len(CODEC_SECTIONS)) * 2),
                ("bytes", (_i64 * len(CODEC_SECTIONS)) * 2), ("page_bytes", _i64)]


# --- the library ------------------------------------------------------------------------------

_loaded: dict[Path, ctypes.CDLL] = {}


def library_path(path: str | os.PathLike | None = None) -> Path:
    """Where the library is looked for: ``path``, else ``$TIEREDKV_KERNELS``, else
    :data:`DEFAULT_LIBRARY` (whether or not the file exists)."""
    if path is not None:
        return Path(path)
    return Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else DEFAULT_LIBRARY


def load_library(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """``libtieredkv_kernels.so`` (at :func:`library_path` of ``path``) with every C ABI
    function's argument and result types set; loaded once per path. Needs no GPU.

    Raises :class:`KernelLibraryError` when the file is missing, cannot be loaded, or its
    ``tkv_codec_desc_t`` is not the size of :class:`CodecDesc`."""
    where = library_path(path)
    if where in _loaded:
        return _loaded[where]
    source = ("given" if path is not None else f"from ${ENV_VAR}" if os.environ.get(ENV_VAR)
              else f"the default; set ${ENV_VAR} or pass lib= to use another")
    if not where.is_file():
        raise KernelLibraryError(f"{where} ({source}): no such file; build libtieredkv_kernels.so with "
                                 "`cmake -S plugins/csrc -B build/plugins && cmake --build build/plugins`")
    try:
        lib = ctypes.CDLL(str(where))
    except OSError as exc:
        raise KernelLibraryError(f"{where} ({source}): cannot be loaded: {exc}") from exc
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
    desc = ctypes.POINTER(CodecDesc)
    try:
        # q .. page_probs, B H T D C KVH P M, scale, kv_dtype, ...
        attention = [p] * 11 + [i64] * 8 + [f32, i32]
        lib.tkv_tiered_attention.argtypes = attention + [p, i64, i32, p]  # workspace, bytes, num_splits, stream
        lib.tkv_tiered_attention.restype = ctypes.c_int
        # ... warm_pool, warm_row, W, desc, then as above
        lib.tkv_tiered_attention_warm.argtypes = attention + [p, p, i64, desc, p, i64, i32, p]
        lib.tkv_tiered_attention_warm.restype = ctypes.c_int
        # ..., sm_count, blocks_per_sm, num_splits
        lib.tkv_tiered_attention_host.argtypes = attention + [p, p, i64, desc, i32, i32, i32]
        lib.tkv_tiered_attention_host.restype = ctypes.c_int
        lib.tkv_tiered_attention_workspace.argtypes = [i64] * 6
        lib.tkv_tiered_attention_workspace.restype = i64
        lib.tkv_tiered_attention_plan.argtypes = [i64] * 6 + [i32, i32, i32, i64, p, p]
        lib.tkv_tiered_attention_plan.restype = ctypes.c_int
        lib.tkv_tiered_attention_occupancy.argtypes = [i64] * 4 + [i32, i32, p, p]
        lib.tkv_tiered_attention_occupancy.restype = ctypes.c_int
        lib.tkv_codec_desc.argtypes = [ctypes.c_char_p, i64, i64, i64, desc]
        lib.tkv_codec_desc.restype = ctypes.c_int
        lib.tkv_codec_desc_sizeof.argtypes = []
        lib.tkv_codec_desc_sizeof.restype = i64
        for name in ("tkv_encode_pages", "tkv_decode_pages"):  # (in, out, out | in, in, out), N, desc, stream
            getattr(lib, name).argtypes = [p, p, p, i64, desc, p]
            getattr(lib, name).restype = ctypes.c_int
        for name in ("tkv_encode_pages_host", "tkv_decode_pages_host"):
            getattr(lib, name).argtypes = [p, p, p, i64, desc]
            getattr(lib, name).restype = ctypes.c_int
        lib.tkv_kv_append.argtypes = [p] * 8 + [i64] * 5 + [i32, p]
        lib.tkv_kv_append.restype = ctypes.c_int
        lib.tkv_importance_score.argtypes = [p] * 9 + [i64] * 6 + [f32] * 4 + [p]  # w_rel, w_pos, w_sal, scale, stream
        lib.tkv_importance_score.restype = ctypes.c_int
        # ..., scale, q_dtype, summary_dtype, workspace, workspace_bytes, stream
        lib.tkv_importance_score_ex.argtypes = [p] * 9 + [i64] * 6 + [f32] * 4 + [i32, i32, p, i64, p]
        lib.tkv_importance_score_ex.restype = ctypes.c_int
        lib.tkv_importance_score_workspace.argtypes = [i64] * 3
        lib.tkv_importance_score_workspace.restype = i64
        lib.tkv_error_string.argtypes = [ctypes.c_int]
        lib.tkv_error_string.restype = ctypes.c_char_p
    except AttributeError as exc:
        raise KernelLibraryError(f"{where}: not libtieredkv_kernels.so, or an older one: {exc}") from exc
    if lib.tkv_codec_desc_sizeof() != ctypes.sizeof(CodecDesc):
        raise KernelLibraryError(f"{where}: tkv_codec_desc_t is {lib.tkv_codec_desc_sizeof()} bytes, CodecDesc "
                                 f"{ctypes.sizeof(CodecDesc)}: the binding does not match the header")
    _loaded[where] = lib
    return lib


def _library(lib: ctypes.CDLL | str | os.PathLike | None) -> ctypes.CDLL:
    return lib if isinstance(lib, ctypes.CDLL) else load_library(lib)


def _raise_for_status(lib: ctypes.CDLL, name: str, status: int) -> None:
    if status != 0:
        raise RuntimeError(f"{name}: {lib.tkv_error_string(status).decode()} (status {status})")


def _launch(lib: ctypes.CDLL, name: str, device: torch.device, *args) -> None:
    """Calls C ABI function ``name`` with ``args`` and torch's current stream of ``device``
    (that device current during the call)."""
    with torch.cuda.device(device):
        _raise_for_status(lib, name, getattr(lib, name)(*args, torch.cuda.current_stream(device).cuda_stream))


# --- argument checks --------------------------------------------------------------------------


def _describe(dims: str, shape: Sequence[int | None]) -> str:
    return f"{dims} = [{', '.join('*' if s is None else str(s) for s in shape)}]"


def _arg(name: str, t, dtype: torch.dtype | None, dims: str, shape: tuple[int | None, ...]) -> torch.Size:
    """Checks argument ``name``: a contiguous tensor of ``dtype`` (None: any dtype of 1, 2, 4 or
    8 bytes) and ``shape`` (None: any size there); ``dims`` names the dims for the message.
    Returns its shape; raises ValueError naming ``name`` otherwise. The device is checked by
    :func:`_device`, once all arguments are."""
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape and t.is_contiguous():
        return t.shape  # the common case, checked quickly
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor {dims}, got {type(t).__name__}")
    if dtype is None:
        if t.element_size() not in (1, 2, 4, 8) or t.is_complex():
            raise ValueError(f"{name}: expected a real dtype of 1, 2, 4 or 8 bytes, got {t.dtype}")
    elif t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        raise ValueError(f"{name}: expected shape {_describe(dims, shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous (row-major) tensor; call .contiguous()")
    return t.shape


def _device(*named: tuple[str, torch.Tensor], host: bool = False) -> torch.device:
    """The one CUDA device of all ``(name, tensor)`` (``host``: the CPU); ValueError naming the
    first tensor elsewhere."""
    first_name, first = named[0]
    device = torch.device("cpu") if host else first.device
    if not host and device.type != "cuda":
        raise ValueError(f"{first_name}: expected a CUDA tensor, got one on {device}")
    for name, t in named:
        if t.device != device:
            where = "on the CPU (a host function)" if host else f"on {device}, like {first_name}"
            raise ValueError(f"{name}: expected a tensor {where}, got one on {t.device}")
    return device


def _heads(q_heads: int, kv_heads: int, head_dim: int) -> None:
    """The kernels' limits: 0 < D <= MAX_HEAD_DIM, KVH > 0 and H a multiple of KVH."""
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D = {head_dim}; the kernels take 0 < D <= {MAX_HEAD_DIM}")
    if kv_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"q: H = {q_heads} query heads is not a multiple of KVH = {kv_heads} kv heads")


def _desc(desc, kvh: int | None = None, p: int | None = None, d: int | None = None, *, of: str = "") -> CodecDesc:
    if not isinstance(desc, CodecDesc):
        raise ValueError(f"desc: expected a CodecDesc from codec_desc(), got {type(desc).__name__}")
    if kvh is not None and (desc.kvh, desc.p, desc.d) != (kvh, p, d):
        raise ValueError(f"desc: page shape [KVH, P, D] = [{desc.kvh}, {desc.p}, {desc.d}], {of} has "
                         f"[{kvh}, {p}, {d}]")
    return desc


def _outputs(out, names: Sequence[str]) -> tuple[torch.Tensor, ...]:
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise ValueError(f"out: expected a tuple of {len(names)} tensors ({', '.join(names)}), got {out!r:.80}")
    return tuple(out)
