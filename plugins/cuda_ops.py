"""tieredkv.plugins.cuda_ops: the CUDA kernels of ``libtieredkv_kernels.so`` as PyTorch ops.

The kernels (``plugins/csrc``) sit behind a plain C ABI (``plugins/csrc/tieredkv_kernels.h``),
the same functions the TensorRT plugins' ``enqueue`` calls. This module binds that ABI with
ctypes: each op takes torch CUDA tensors, checks them, allocates its outputs (or writes the
``out=`` tensors it is given) and enqueues the kernel on torch's current stream of the
tensors' device; it returns without synchronizing. The semantics are those of the PyTorch
references of ``tieredkv.plugins`` (docs/plugins.md); each op's test module in tests/plugins
compares the op with its reference on a GPU (``cuda`` marker, run by ``tools/gpu_check.sh``).

Imports need only torch and ctypes (plus ``tieredkv.errors``, which imports nothing), and
loading the library needs no GPU, so the host codec functions run on any machine. Loading
and the argument checks live in :mod:`tieredkv.plugins.cuda_lib`; the public names are
re-exported here.

Library: every function takes ``lib=``, a ``ctypes.CDLL`` returned by :func:`load_library` or
the path of the library; without it, the path in ``$TIEREDKV_KERNELS``, else
``build/plugins/libtieredkv_kernels.so`` under the checkout root (``cmake -S plugins/csrc -B
build/plugins && cmake --build build/plugins``). A library that is missing, cannot be loaded
or does not match this binding raises :class:`tieredkv.errors.KernelLibraryError`.

Errors: a tensor of the wrong dtype or shape, not contiguous, or not on one CUDA device (the
host functions: not on the CPU) raises ``ValueError`` naming the argument, before the
library is loaded; so do sizes outside the kernels' limits (head dim 0 < D <= 256, H a
multiple of KVH). A nonzero status of the C call (a launch error; execution errors surface
when the stream is synchronized) raises ``RuntimeError`` with ``tkv_error_string``'s text.

Input types follow the TensorRT plugins where those differ from the references: page masks
are int32 (nonzero = kept; a bool mask is converted, one small copy), warm pools are the
encoded bytes as uint8 [W, NB] or as int32 words [W, NB / 4] (``codec.as_words``), and the
TieredAttention pools may be float32, float16 or bfloat16.

TieredAttention is split-K flash-decoding (docs/plugins.md, "CUDA kernels"): the split plan
comes from the library (:func:`attention_plan`); the ops allocate its workspace
(:func:`attention_workspace_bytes`) through torch's caching allocator unless ``workspace=`` is
given. :func:`tiered_attention_host` runs the same algorithm on the CPU (the library's host
emulation), so the split / merge arithmetic is tested without a GPU.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

from tieredkv.errors import KernelLibraryError

__all__ = ["CODEC_SECTIONS", "DEFAULT_LIBRARY", "ENV_VAR", "KV_DTYPES", "MAX_HEAD_DIM", "MAX_SPLITS", "CodecDesc",
           "KernelLibraryError", "attention_occupancy", "attention_plan", "attention_workspace_bytes", "codec_desc",
           "decode_pages", "decode_pages_host", "encode_pages", "encode_pages_host", "importance_score",
           "importance_score_workspace_bytes", "kv_append",
           "library_path", "load_library", "tiered_attention", "tiered_attention_host", "tiered_attention_warm"]

from tieredkv.plugins.cuda_lib import (CODEC_SECTIONS, DEFAULT_LIBRARY, ENV_VAR, KV_DTYPES, MAX_HEAD_DIM, MAX_SPLITS,
                                          CodecDesc, _arg, _desc, _device, _heads, _launch, _library,
                                          _outputs, _raise_for_status, library_path, load_library)

# --- descriptors and host codec ---------------------------------------------------------------


def codec_desc(name: str, kvh: int, p: int, d: int, *, lib: ctypes.CDLL | str | os.PathLike | None = None
               ) -> CodecDesc:
    """The library's descriptor of codec ``name`` (a key of ``tieredkv.plugins.codec.CODECS``)
    for pages K, V [kvh, p, d]; ``page_bytes`` equals ``codec.page_bytes``. Runs on the host.
    Raises ValueError when the library refuses the name or the sizes."""
    lib = _library(lib)
    desc = CodecDesc()
    status = lib.tkv_codec_desc(name.encode(), kvh, p, d, ctypes.byref(desc))
    if status != 0:
        raise ValueError(f"tkv_codec_desc({name!r}, {kvh}, {p}, {d}): {lib.tkv_error_string(status).decode()} "
                         "(a name of codec.CODECS and sizes > 0 expected)")
    return desc


def _encode_args(k, v, desc, out, *, host: bool) -> tuple[torch.Tensor, int]:
    desc = _desc(desc)
    n = _arg("k", k, torch.float32, "[N, KVH, P, D]", (None, desc.kvh, desc.p, desc.d))[0]
    _arg("v", v, torch.float32, "[N, KVH, P, D]", k.shape)
    if out is None:
        out = torch.empty(n, desc.page_bytes, dtype=torch.uint8, device=k.device)
    _arg("out", out, torch.uint8, "[N, page_bytes]", (n, desc.page_bytes))
    _device(("k", k), ("v", v), ("out", out), host=host)
    return out, n


def _decode_args(data, desc, out, *, host: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    desc = _desc(desc)
    n = _arg("data", data, torch.uint8, "[N, page_bytes]", (None, desc.page_bytes))[0]
    shape = (n, desc.kvh, desc.p, desc.d)
    if out is None:
        out = (torch.empty(shape, device=data.device), torch.empty(shape, device=data.device))
    k, v = _outputs(out, ("k", "v"))
    _arg("out[0] (k)", k, torch.float32, "[N, KVH, P, D]", shape)
    _arg("out[1] (v)", v, torch.float32, "[N, KVH, P, D]", shape)
    _device(("data", data), ("out[0] (k)", k), ("out[1] (v)", v), host=host)
    return (k, v), n


def encode_pages_host(k: torch.Tensor, v: torch.Tensor, desc: CodecDesc, *, out: torch.Tensor | None = None,
                      lib: ctypes.CDLL | str | os.PathLike | None = None) -> torch.Tensor:
    """:func:`encode_pages` on the CPU (``tkv_encode_pages_host``: CPU loops over the same
    element functions the kernel runs; synchronous), bit-exact with ``codec.encode_pages``.

    k, v: [N, KVH, P, D] float32, CPU, contiguous, [KVH, P, D] = ``desc``'s page shape.
    Returns (or writes ``out``): [N, desc.page_bytes] uint8, CPU."""
    out, n = _encode_args(k, v, desc, out, host=True)
    lib = _library(lib)
    _raise_for_status(lib, "tkv_encode_pages_host",
                      lib.tkv_encode_pages_host(k.data_ptr(), v.data_ptr(), out.data_ptr(), n, ctypes.byref(desc)))
    return out


def decode_pages_host(data: torch.Tensor, desc: CodecDesc, *,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      lib: ctypes.CDLL | str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_pages` on the CPU (``tkv_decode_pages_host``; synchronous), bit-exact
    with ``codec.decode_pages``.

    data: [N, desc.page_bytes] uint8, CPU, contiguous.
    Returns (or writes ``out``): K, V [N, KVH, P, D] float32, CPU ([KVH, P, D] = ``desc``'s)."""
    (k, v), n = _decode_args(data, desc, out, host=True)
    lib = _library(lib)
    _raise_for_status(lib, "tkv_decode_pages_host",
                      lib.tkv_decode_pages_host(data.data_ptr(), k.data_ptr(), v.data_ptr(), n, ctypes.byref(desc)))
    return k, v


# --- the ops on CUDA tensors ------------------------------------------------------------------


def encode_pages(k: torch.Tensor, v: torch.Tensor, desc: CodecDesc, *, out: torch.Tensor | None = None,
                 lib: ctypes.CDLL | str | os.PathLike | None = None) -> torch.Tensor:
    """KV page encode (``tkv_encode_pages``), bit-exact with ``codec.encode_pages``.

    k, v: [N, KVH, P, D] float32, CUDA, contiguous; [KVH, P, D] = ``desc``'s page shape.
    desc: :func:`codec_desc` of the codec and that page shape.
    Returns (or writes ``out``): [N, desc.page_bytes] uint8 on k's device, the encoded pages
    (alignment padding zeroed)."""
    out, n = _encode_args(k, v, desc, out, host=False)
    lib = _library(lib)
    _launch(lib, "tkv_encode_pages", k.device, k.data_ptr(), v.data_ptr(), out.data_ptr(), n, ctypes.byref(desc))
    return out


def decode_pages(data: torch.Tensor, desc: CodecDesc, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 lib: ctypes.CDLL | str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KV page decode (``tkv_decode_pages``), bit-exact with ``codec.decode_pages``.

    data: [N, desc.page_bytes] uint8, CUDA, contiguous (pages from :func:`encode_pages`).
    Returns (or writes ``out``): K, V [N, KVH, P, D] float32 on data's device, [KVH, P, D] =
    ``desc``'s page shape."""
    (k, v), n = _decode_args(data, desc, out, host=False)
    lib = _library(lib)
    _launch(lib, "tkv_decode_pages", data.device, data.data_ptr(), k.data_ptr(), v.data_ptr(), n, ctypes.byref(desc))
    return k, v


def _mask(name: str, mask, shape: tuple[int, ...]) -> torch.Tensor:
    """A page mask as the kernels take it: int32 [B, M] (nonzero = kept); a bool mask is converted."""
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        _arg(name, mask, torch.bool, "[B, M]", shape)
        return mask.to(torch.int32)
    _arg(name, mask, torch.int32, "[B, M]", shape)
    return mask


def _pools(k_pool, v_pool, d: int) -> tuple[int, int, int]:
    """The TieredAttention pools: one dtype of :data:`KV_DTYPES`, [C, KVH, P, D]; (C, KVH, P)."""
    if isinstance(k_pool, torch.Tensor) and k_pool.dtype not in KV_DTYPES:
        raise ValueError(f"k_pool: expected dtype float32, float16 or bfloat16, got {k_pool.dtype}")
    dtype = k_pool.dtype if isinstance(k_pool, torch.Tensor) else torch.float32
    c, kvh, p, _ = _arg("k_pool", k_pool, dtype, "[C, KVH, P, D]", (None, None, None, d))
    _arg("v_pool", v_pool, dtype, "[C, KVH, P, D]", k_pool.shape)
    return c, kvh, p


def _attention_args(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, *, host: bool = False):
    """Checks TieredAttention's tensors but their device; returns (sizes (B, H, T, D, C, KVH, P, M),
    the int32 page mask, (out, lse, page_probs), the (name, tensor) pairs for :func:`_device`)."""
    b, h, t, d = _arg("q", q, torch.float32, "[B, H, T, D]", (None,) * 4)
    c, kvh, p = _pools(k_pool, v_pool, d)
    m = _arg("page_table", page_table, torch.int64, "[B, M]", (b, None))[1]
    mask = _mask("page_mask", page_mask, (b, m))
    _arg("page_index", page_index, torch.int64, "[B, M]", (b, m))
    _arg("seq_len", seq_len, torch.int64, "[B]", (b,))
    _arg("past", past, torch.int64, "[B]", (b,))
    _heads(h, kvh, d)
    if p <= 0:
        raise ValueError(f"k_pool: page size P = {p}; expected P > 0")
    if out is None:
        out = (torch.empty_like(q), torch.empty(b, h, t, device=q.device), torch.empty(b, h, t, m, device=q.device))
    o, lse, probs = _outputs(out, ("out", "lse", "page_probs"))
    _arg("out[0] (out)", o, torch.float32, "[B, H, T, D]", q.shape)
    _arg("out[1] (lse)", lse, torch.float32, "[B, H, T]", (b, h, t))
    _arg("out[2] (page_probs)", probs, torch.float32, "[B, H, T, M]", (b, h, t, m))
    named = (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("page_table", page_table), ("page_mask", page_mask),
             ("page_index", page_index), ("seq_len", seq_len), ("past", past), ("out[0] (out)", o),
             ("out[1] (lse)", lse), ("out[2] (page_probs)", probs))
    return (b, h, t, d, c, kvh, p, m), mask, (o, lse, probs), named


def _warm_args(warm_pool, warm_row, desc, sizes) -> tuple[int, tuple]:
    """Checks the warm inputs against the pools' sizes; returns (W, (name, tensor) pairs). The pool
    is uint8 bytes [W, page_bytes] or int32 words [W, page_bytes / 4] (the same bytes)."""
    b, _, _, d, _, kvh, p, m = sizes
    _desc(desc, kvh, p, d, of="the pools [C, KVH, P, D]")
    if isinstance(warm_pool, torch.Tensor) and warm_pool.dtype not in (torch.uint8, torch.int32):
        raise ValueError(f"warm_pool: expected uint8 bytes [W, page_bytes] or int32 words [W, page_bytes / 4], "
                         f"got {warm_pool.dtype}")
    if isinstance(warm_pool, torch.Tensor) and warm_pool.dtype == torch.int32:
        if desc.page_bytes % 4:
            raise ValueError(f"warm_pool: int32 words need pages of a multiple of 4 bytes, the codec's are "
                             f"{desc.page_bytes}")
        w = _arg("warm_pool", warm_pool, torch.int32, "[W, page_bytes / 4]", (None, desc.page_bytes // 4))[0]
    else:
        w = _arg("warm_pool", warm_pool, torch.uint8, "[W, page_bytes]", (None, desc.page_bytes))[0]
    _arg("warm_row", warm_row, torch.int64, "[B, M]", (b, m))
    return w, (("warm_pool", warm_pool), ("warm_row", warm_row))


def _splits(num_splits: int) -> int:
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 0 <= num_splits:
        raise ValueError(f"num_splits: expected an int >= 0 (0: the library chooses), got {num_splits!r}")
    return num_splits


def attention_plan(B: int, H: int, T: int, D: int, KVH: int, M: int, *, sm_count: int, blocks_per_sm: int,
                   num_splits: int = 0, workspace_bytes: int | None = None,
                   lib: ctypes.CDLL | str | os.PathLike | None = None) -> tuple[int, int]:
    """The TieredAttention split plan (``tkv_tiered_attention_plan``) for these sizes on a device of
    ``sm_count`` SMs where the split kernel keeps ``blocks_per_sm`` blocks resident
    (:func:`attention_occupancy` on a GPU; ``tools/kernel_occupancy.py`` from ptxas): (splits, the
    most kept pages a split reads). ``num_splits`` 0 lets the library choose, else asks for that
    many; ``workspace_bytes`` (default: unlimited) lowers the count to what it holds. Runs on the
    host."""
    lib = _library(lib)
    splits, per_split = ctypes.c_int32(), ctypes.c_int32()
    ws = (1 << 62) if workspace_bytes is None else workspace_bytes
    status = lib.tkv_tiered_attention_plan(B, H, T, D, KVH, M, sm_count, blocks_per_sm, _splits(num_splits), ws,
                                           ctypes.byref(splits), ctypes.byref(per_split))
    if status != 0:
        raise ValueError(f"tkv_tiered_attention_plan({B}, {H}, {T}, {D}, {KVH}, {M}, sm_count={sm_count}, "
                         f"blocks_per_sm={blocks_per_sm}): {lib.tkv_error_string(status).decode()}")
    return splits.value, per_split.value


def attention_occupancy(H: int, T: int, D: int, KVH: int, kv_dtype: torch.dtype, *, warm: bool = False,
                        lib: ctypes.CDLL | str | os.PathLike | None = None) -> tuple[int, bool]:
    """The TieredAttention split kernel the ops run for these sizes and pools of ``kv_dtype`` on the
    current CUDA device (``tkv_tiered_attention_occupancy``): (resident blocks per SM, whether it
    is the tensor-core kernel). ``warm``: the kernel of :func:`tiered_attention_warm`. Needs a
    GPU."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: expected float32, float16 or bfloat16, got {kv_dtype}")
    lib = _library(lib)
    blocks, tensor = ctypes.c_int32(), ctypes.c_int32()
    _raise_for_status(lib, "tkv_tiered_attention_occupancy",
                      lib.tkv_tiered_attention_occupancy(H, T, D, KVH, KV_DTYPES[kv_dtype], int(warm),
                                                         ctypes.byref(blocks), ctypes.byref(tensor)))
    return blocks.value, bool(tensor.value)


def attention_workspace_bytes(B: int, H: int, T: int, D: int, KVH: int, M: int, *, num_splits: int = 0,
                              lib: ctypes.CDLL | str | os.PathLike | None = None) -> int:
    """Bytes of workspace TieredAttention needs: with ``num_splits`` 0 the library's bound of every
    plan (``tkv_tiered_attention_workspace``, non-decreasing in every size); else what that many
    splits take (splits * B*H*T * (D + 2) * 4, 0 for one split)."""
    lib = _library(lib)
    if _splits(num_splits) == 0:
        return int(lib.tkv_tiered_attention_workspace(B, H, T, D, KVH, M))
    splits, _ = attention_plan(B, H, T, D, KVH, M, sm_count=1, blocks_per_sm=1, num_splits=num_splits, lib=lib)
    return 0 if splits == 1 else splits * B * H * T * (D + 2) * 4


def _workspace(workspace, sizes, num_splits: int, device: torch.device, lib: ctypes.CDLL) -> tuple[int, int]:
    """(pointer, bytes) of the op's workspace: the given uint8 tensor, else a fresh one from torch's
    caching allocator of :func:`attention_workspace_bytes`."""
    b, h, t, d, _, kvh, _, m = sizes
    if workspace is None:
        nbytes = attention_workspace_bytes(b, h, t, d, kvh, m, num_splits=num_splits, lib=lib)
        if nbytes == 0:
            return 0, 0
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _arg("workspace", workspace, torch.uint8, "[bytes]", (None,))
    if workspace.device != device:
        raise ValueError(f"workspace: expected a tensor on {device}, got one on {workspace.device}")
    return workspace.data_ptr(), workspace.numel()


def tiered_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                     page_mask: torch.Tensor, page_index: torch.Tensor, seq_len: torch.Tensor, past: torch.Tensor,
                     *, scale: float | None = None, num_splits: int = 0, workspace: torch.Tensor | None = None,
                     out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     lib: ctypes.CDLL | str | os.PathLike | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TieredAttention (``tkv_tiered_attention``): paged attention over the listed pages that
    ``page_mask`` keeps; the reference is ``tieredkv.plugins.tiered_attention.tiered_attention``.

    All tensors CUDA, on one device, contiguous (B sequences, H query heads, KVH kv heads, T
    queries per sequence, D head dim <= 256, C pool pages, P page size, M listed pages):

    * q [B, H, T, D] float32: query t of sequence b sits at position ``past[b] + t``; query
      head h reads kv head ``h // (H // KVH)`` (H a multiple of KVH);
    * k_pool, v_pool [C, KVH, P, D] float32, float16 or bfloat16 (both one dtype; accumulated in
      float32): the page pool; slot o of a page holds one token;
    * page_table [B, M] int64: pool page of each listed page (outside [0, C): treated as masked);
    * page_mask [B, M] int32 (nonzero = kept) or bool;
    * page_index [B, M] int64: logical page index; slot o holds position ``page_index * P + o``;
    * seq_len [B] int64: positions >= seq_len are empty;
    * past [B] int64: query t sees position p iff ``p <= past + t``;
    * scale: logit scale (default D ** -0.5);
    * num_splits: 0 lets the library choose the split-K plan from M and the device's SMs, else
      the number of splits asked for (see :func:`attention_plan`);
    * workspace: a uint8 CUDA tensor for the splits' partials (default: allocated here, of
      :func:`attention_workspace_bytes`); a smaller one lowers the split count.

    Returns (or writes ``out``) float32 on q's device: out [B, H, T, D] (zeros for a query that
    sees no key), lse [B, H, T] (log-sum-exp of the scaled logits; -inf when nothing is seen),
    page_probs [B, H, T, M] (softmax mass on each listed page)."""
    sizes, mask, outs, named = _attention_args(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past,
                                               out)
    num_splits = _splits(num_splits)
    device = _device(*named)
    scale = sizes[3] ** -0.5 if scale is None else scale
    lib = _library(lib)
    ws, ws_bytes = _workspace(workspace, sizes, num_splits, device, lib)
    ptrs = [x.data_ptr() for x in (q, k_pool, v_pool, page_table, mask, page_index, seq_len, past, *outs)]
    _launch(lib, "tkv_tiered_attention", device, *ptrs, *sizes, scale, KV_DTYPES[k_pool.dtype], ws, ws_bytes,
            num_splits)
    return outs


def tiered_attention_warm(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                          page_mask: torch.Tensor, page_index: torch.Tensor, seq_len: torch.Tensor,
                          past: torch.Tensor, warm_pool: torch.Tensor, warm_row: torch.Tensor, desc: CodecDesc, *,
                          scale: float | None = None, num_splits: int = 0, workspace: torch.Tensor | None = None,
                          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                          lib: ctypes.CDLL | str | os.PathLike | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TieredAttention over the pools and warm (encoded) pages (``tkv_tiered_attention_warm``);
    the reference is ``tiered_attention(..., warm_pool=, warm_row=, warm_codec=)``.

    The arguments and returns of :func:`tiered_attention`, plus (CUDA, q's device, contiguous):

    * warm_pool: W pages encoded as by :func:`encode_pages`, as bytes [W, desc.page_bytes]
      uint8 or as int32 words [W, desc.page_bytes / 4] (``codec.as_words``; the plugin's form);
    * warm_row [B, M] int64: warm-pool row of listed page m; < 0: the page is read from the
      pools through page_table; >= W: treated as masked. A kept page with a row in [0, W) is
      decoded per element on the fly (bit-exact with ``codec.decode_pages``);
    * desc: :func:`codec_desc` of the warm codec for the pools' [KVH, P, D]."""
    sizes, mask, outs, named = _attention_args(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past,
                                               out)
    w, warm_named = _warm_args(warm_pool, warm_row, desc, sizes)
    num_splits = _splits(num_splits)
    device = _device(*named, *warm_named)
    scale = sizes[3] ** -0.5 if scale is None else scale
    lib = _library(lib)
    ws, ws_bytes = _workspace(workspace, sizes, num_splits, device, lib)
    ptrs = [x.data_ptr() for x in (q, k_pool, v_pool, page_table, mask, page_index, seq_len, past, *outs)]
    _launch(lib, "tkv_tiered_attention_warm", device, *ptrs, *sizes, scale, KV_DTYPES[k_pool.dtype],
            warm_pool.data_ptr(), warm_row.data_ptr(), w, ctypes.byref(desc), ws, ws_bytes, num_splits)
    return outs


def tiered_attention_host(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                          page_mask: torch.Tensor, page_index: torch.Tensor, seq_len: torch.Tensor,
                          past: torch.Tensor, *, warm_pool: torch.Tensor | None = None,
                          warm_row: torch.Tensor | None = None, desc: CodecDesc | None = None, sm_count: int,
                          blocks_per_sm: int, num_splits: int = 0, scale: float | None = None,
                          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                          lib: ctypes.CDLL | str | os.PathLike | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TieredAttention by the library's host emulation (``tkv_tiered_attention_host``; CPU,
    synchronous): the algorithm of the split kernel the device would run (split plan for
    ``sm_count`` SMs of ``blocks_per_sm`` resident blocks, or ``num_splits``; each split's kept
    pages; the tensor-core kernel's tiles and two-term 16-bit operands, or the CUDA-core kernel's
    lane layout; online softmax, page log-sum-exps, warp and split merges) run block by block
    through the same ``__host__ __device__`` functions. Arguments as :func:`tiered_attention` /
    :func:`tiered_attention_warm` (warm_pool, warm_row and desc all three or none), on the CPU."""
    sizes, mask, outs, named = _attention_args(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past,
                                               out)
    if (warm_pool is None) != (desc is None) or (warm_row is None) != (desc is None):
        raise ValueError("warm_pool, warm_row and desc go together: pass all three or none")
    w, warm_named = _warm_args(warm_pool, warm_row, desc, sizes) if desc is not None else (0, ())
    _device(*named, *warm_named, host=True)
    for name, value in (("sm_count", sm_count), ("blocks_per_sm", blocks_per_sm)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    num_splits = _splits(num_splits)
    scale = sizes[3] ** -0.5 if scale is None else scale
    lib = _library(lib)
    ptrs = [x.data_ptr() for x in (q, k_pool, v_pool, page_table, mask, page_index, seq_len, past, *outs)]
    warm = (warm_pool.data_ptr(), warm_row.data_ptr(), w, ctypes.byref(desc)) if desc is not None else (None, None, 0,
                                                                                                         None)
    _raise_for_status(lib, "tkv_tiered_attention_host",
                      lib.tkv_tiered_attention_host(*ptrs, *sizes, scale, KV_DTYPES[k_pool.dtype], *warm, sm_count,
                                                    blocks_per_sm, num_splits))
    return outs


def kv_append(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              slot: torch.Tensor, offset: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
              lib: ctypes.CDLL | str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KVAppend (``tkv_kv_append``): the pools with token n written at
    ``[slot[n], :, offset[n], :]``, bit-exact; the reference is ``tieredkv.plugins.kv_append``.

    All tensors CUDA, on one device, contiguous, one dtype of 1, 2, 4 or 8 bytes for the pools
    and new tokens (float32, float16, bfloat16, ...):

    * k_pool, v_pool [C, KVH, P, D];
    * k_new, v_new [N, KVH, D] (k_pool's dtype);
    * slot, offset [N] int64: page and slot of token n (out of range: the token is skipped).

    Returns (or writes ``out``) k_pool_out, v_pool_out [C, KVH, P, D]: by default fresh copies of
    the pools, then the scatter; ``out=(k_pool, v_pool)`` appends in place: only the N new rows
    are written (the TensorRT plugin's form when its outputs alias its pools)."""
    c, kvh, p, d = _arg("k_pool", k_pool, None, "[C, KVH, P, D]", (None,) * 4)
    _arg("v_pool", v_pool, k_pool.dtype, "[C, KVH, P, D]", k_pool.shape)
    n = _arg("k_new", k_new, k_pool.dtype, "[N, KVH, D]", (None, kvh, d))[0]
    _arg("v_new", v_new, k_pool.dtype, "[N, KVH, D]", k_new.shape)
    _arg("slot", slot, torch.int64, "[N]", (n,))
    _arg("offset", offset, torch.int64, "[N]", (n,))
    if out is None:
        out = (torch.empty_like(k_pool), torch.empty_like(v_pool))
    k_out, v_out = _outputs(out, ("k_pool_out", "v_pool_out"))
    _arg("out[0] (k_pool_out)", k_out, k_pool.dtype, "[C, KVH, P, D]", k_pool.shape)
    _arg("out[1] (v_pool_out)", v_out, k_pool.dtype, "[C, KVH, P, D]", k_pool.shape)
    device = _device(("k_pool", k_pool), ("v_pool", v_pool), ("k_new", k_new), ("v_new", v_new), ("slot", slot),
                     ("offset", offset), ("out[0] (k_pool_out)", k_out), ("out[1] (v_pool_out)", v_out))
    lib = _library(lib)
    ptrs = [x.data_ptr() for x in (k_pool, v_pool, k_new, v_new, slot, offset, k_out, v_out)]
    _launch(lib, "tkv_kv_append", device, *ptrs, c, kvh, p, d, n, k_pool.element_size())
    return k_out, v_out


def importance_score_workspace_bytes(B: int, H: int, M: int, *,
                                     lib: ctypes.CDLL | str | os.PathLike | None = None) -> int:
    """Bytes of workspace :func:`importance_score` needs (``tkv_importance_score_workspace``:
    the bounds of every head and page and each head's softmax statistics per 64 pages;
    non-decreasing in every size)."""
    nbytes = int(_library(lib).tkv_importance_score_workspace(B, H, M))
    if nbytes < 0:
        raise ValueError(f"tkv_importance_score_workspace({B}, {H}, {M}): sizes must be >= 0")
    return nbytes


def importance_score(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_tokens: torch.Tensor,
                     distance: torch.Tensor, saliency: torch.Tensor, page_mask: torch.Tensor,
                     position_table: torch.Tensor, weights: Sequence[float], *, scale: float | None = None,
                     workspace: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     lib: ctypes.CDLL | str | os.PathLike | None = None) -> torch.Tensor:
    """ImportanceScore (``tkv_importance_score_ex``: one pass over the page summaries per kv head):
    the mixed importance of each listed page; the reference is
    ``tieredkv.plugins.importance_score.importance_score``.

    All tensors CUDA, on one device, contiguous (D <= 256, H a multiple of KVH):

    * q [B, H, D] float32, float16 or bfloat16: the query the step attends with (the last new token's);
    * kmin, kmax [B, M, KVH, D] float32, float16 or bfloat16 (one dtype; the pools' dtype holds
      the min / max of its keys exactly): per-channel key bounds of each page;
    * page_tokens [B, M] int64: tokens written in the page;
    * distance [B, M] int64: query position minus the page's last token position;
    * saliency [B, M] float32 in [0, 1];
    * page_mask [B, M] int32 (nonzero: the page competes) or bool;
    * position_table [NB] float32, NB > 0: the position value of each distance bucket;
    * weights: (relevance, position, saliency), three floats;
    * scale: logit scale of the relevance (default D ** -0.5);
    * workspace: a uint8 CUDA tensor of at least :func:`importance_score_workspace_bytes` (default:
      allocated here through torch's caching allocator).

    Returns (or writes ``out``): score [B, M] float32 on q's device (0 where page_mask is 0)."""
    if isinstance(q, torch.Tensor) and q.dtype not in KV_DTYPES:
        raise ValueError(f"q: expected dtype float32, float16 or bfloat16, got {q.dtype}")
    if isinstance(kmin, torch.Tensor) and kmin.dtype not in KV_DTYPES:
        raise ValueError(f"kmin: expected dtype float32, float16 or bfloat16, got {kmin.dtype}")
    b, h, d = _arg("q", q, q.dtype if isinstance(q, torch.Tensor) else torch.float32, "[B, H, D]", (None,) * 3)
    summary = kmin.dtype if isinstance(kmin, torch.Tensor) else torch.float32
    m, kvh = _arg("kmin", kmin, summary, "[B, M, KVH, D]", (b, None, None, d))[1:3]
    _arg("kmax", kmax, summary, "[B, M, KVH, D]", kmin.shape)
    _arg("page_tokens", page_tokens, torch.int64, "[B, M]", (b, m))
    _arg("distance", distance, torch.int64, "[B, M]", (b, m))
    _arg("saliency", saliency, torch.float32, "[B, M]", (b, m))
    mask = _mask("page_mask", page_mask, (b, m))
    nb = _arg("position_table", position_table, torch.float32, "[NB]", (None,))[0]
    if nb <= 0:
        raise ValueError("position_table: expected at least one bucket, got an empty tensor")
    _heads(h, kvh, d)
    if len(weights) != 3:
        raise ValueError(f"weights: expected (relevance, position, saliency), got {len(weights)} values")
    scale = d ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty(b, m, device=q.device)
    _arg("out", out, torch.float32, "[B, M]", (b, m))
    device = _device(("q", q), ("kmin", kmin), ("kmax", kmax), ("page_tokens", page_tokens), ("distance", distance),
                     ("saliency", saliency), ("page_mask", page_mask), ("position_table", position_table),
                     ("out", out))
    lib = _library(lib)
    if workspace is None:
        workspace = torch.empty(importance_score_workspace_bytes(b, h, m, lib=lib), dtype=torch.uint8, device=device)
    _arg("workspace", workspace, torch.uint8, "[bytes]", (None,))
    if workspace.device != device:
        raise ValueError(f"workspace: expected a tensor on {device}, got one on {workspace.device}")
    ptrs = [x.data_ptr() for x in (q, kmin, kmax, page_tokens, distance, saliency, mask, position_table, out)]
    _launch(lib, "tkv_importance_score_ex", device, *ptrs, b, h, d, m, kvh, nb, *(float(w) for w in weights), scale,
            KV_DTYPES[q.dtype], KV_DTYPES[kmin.dtype], workspace.data_ptr(), workspace.numel())
    return out
