"""KVAppend — reference semantics: write the new tokens' K/V into a paged pool.

The ONNX function (``onnx_ops.kv_append_function``), the CUDA kernel
(``csrc/kernels/kv_append.cuh``, behind the TensorRT plugin and ``cuda_ops.kv_append``) and
the runtime's own writes (``TierManager.write_tokens``) all compute this.
"""

from __future__ import annotations

import torch


def kv_append(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              slot: torch.Tensor, offset: torch.Tensor, *,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write N new tokens into the page pool.

    * ``k_pool``, ``v_pool`` [C, KVH, P, D] — the page pool (any dtype);
    * ``k_new``, ``v_new`` [N, KVH, D] — the new tokens' keys / values (cast to the pool dtype);
    * ``slot`` [N] int64 — pool page of token n, in ``[0, C)``;
    * ``offset`` [N] int64 — slot inside the page of token n, in ``[0, P)``;
    * ``out`` — (k_pool_out, v_pool_out) to write into; the pools themselves write in place.
      Default: new tensors (the pools are not modified).

    Returns ``k_pool_out``, ``v_pool_out`` [C, KVH, P, D] equal to the pools except
    ``pool_out[slot[n], :, offset[n], :] = new[n]``. The (slot, offset) pairs must be distinct
    (which of two writes to one place wins is unspecified, as for ONNX ScatterND).
    """
    if out is None:
        out = (k_pool.clone(), v_pool.clone())
    else:
        for dst, src in zip(out, (k_pool, v_pool)):
            if dst is not src:
                dst.copy_(src)
    k_out, v_out = out
    k_out[slot, :, offset] = k_new.to(k_out.device, k_out.dtype)
    v_out[slot, :, offset] = v_new.to(v_out.device, v_out.dtype)
    return k_out, v_out
