// KVAppend kernel: scatter new tokens' keys / values into the page pool.
// Spec: docs/plugins.md "KVAppend"; reference: tieredkv.plugins.kv_append.kv_append.
#pragma once

#include "common.cuh"

namespace tieredkv {
namespace kernels {

//! pool[slot[n], h, offset[n], :] = fresh[n, h, :] for every (n, h), each row of D elements moved
//! as `words` words of type `Word` (an unsigned integer or uint2 / uint4 vector: the copy is
//! bit-exact whatever the element type). Grid-stride over the N * KVH * words words; a token
//! whose slot or offset is out of range is skipped.
template <typename Word>
__global__ void kv_scatter_kernel(Word* __restrict__ pool, const Word* __restrict__ fresh,
                                  const int64_t* __restrict__ slot, const int64_t* __restrict__ offset, int64_t N,
                                  int64_t C, int64_t KVH, int64_t P, int64_t words) {
    const int64_t total = N * KVH * words;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t w = i % words;
        const int64_t h = (i / words) % KVH;
        const int64_t n = i / (words * KVH);
        const int64_t c = slot[n];
        const int64_t o = offset[n];
        if (c < 0 || c >= C || o < 0 || o >= P) continue;
        pool[((c * KVH + h) * P + o) * words + w] = fresh[i];
    }
}

template <typename Word>
inline cudaError_t launch_kv_scatter(void* pool, const void* fresh, const int64_t* slot, const int64_t* offset,
                                     int64_t N, int64_t C, int64_t KVH, int64_t P, int64_t row_bytes,
                                     cudaStream_t stream) {
    constexpr int kThreads = 256;
    const int64_t words = row_bytes / static_cast<int64_t>(sizeof(Word));
    kv_scatter_kernel<Word><<<grid_for(N * KVH * words, kThreads), kThreads, 0, stream>>>(
        static_cast<Word*>(pool), static_cast<const Word*>(fresh), slot, offset, N, C, KVH, P, words);
    return cudaGetLastError();
}

//! The widest word (16, 8, 4, 2 or 1 bytes) that divides the row size and the alignment of
//! every pointer.
inline int scatter_word_bytes(int64_t row_bytes, const void* pool, const void* fresh) {
    const uintptr_t misaligned = reinterpret_cast<uintptr_t>(pool) | reinterpret_cast<uintptr_t>(fresh);
    for (int bytes = 16; bytes > 1; bytes /= 2) {
        if (row_bytes % bytes == 0 && misaligned % bytes == 0) return bytes;
    }
    return 1;
}

//! KVAppend (contiguous row-major tensors on the device, any element type of `elem_bytes`
//! bytes: 1, 2, 4 or 8 — e.g. 4 for float32, 2 for float16 / bfloat16):
//!   k_pool, v_pool         [C, KVH, P, D]  input pools (read only when they differ from the outputs)
//!   k_new, v_new           [N, KVH, D]     the new tokens' keys / values
//!   slot                   [N] int64       pool page of token n, in [0, C)
//!   offset                 [N] int64       slot inside the page of token n, in [0, P)
//!   k_pool_out, v_pool_out [C, KVH, P, D]  outputs: a copy of the pools (cudaMemcpyAsync,
//!                                          skipped when out == in: in-place append, only the
//!                                          N new rows are written) with
//!                                          out[slot[n], :, offset[n], :] = new[n]
//! Rows of D elements move as the widest word (16 / 8 / 4 / 2 / 1 bytes) dividing the row size
//! and the pointers' alignment.
//! (slot, offset) pairs must be distinct (which of two writes to one place wins is unspecified);
//! a token with slot or offset out of range is skipped. Returns the first CUDA error, or
//! cudaErrorInvalidValue for bad sizes.
inline cudaError_t launch_kv_append(const void* k_pool, const void* v_pool, const void* k_new, const void* v_new,
                                    const int64_t* slot, const int64_t* offset, void* k_pool_out, void* v_pool_out,
                                    int64_t C, int64_t KVH, int64_t P, int64_t D, int64_t N, int elem_bytes,
                                    cudaStream_t stream) {
    if (C < 0 || KVH < 0 || P < 0 || D < 0 || N < 0) return cudaErrorInvalidValue;
    if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4 && elem_bytes != 8) return cudaErrorInvalidValue;
    const size_t pool_bytes = static_cast<size_t>(C * KVH * P * D) * static_cast<size_t>(elem_bytes);
    cudaError_t err = cudaSuccess;
    if (k_pool_out != k_pool && pool_bytes > 0) {
        err = cudaMemcpyAsync(k_pool_out, k_pool, pool_bytes, cudaMemcpyDeviceToDevice, stream);
        if (err != cudaSuccess) return err;
    }
    if (v_pool_out != v_pool && pool_bytes > 0) {
        err = cudaMemcpyAsync(v_pool_out, v_pool, pool_bytes, cudaMemcpyDeviceToDevice, stream);
        if (err != cudaSuccess) return err;
    }
    if (N * KVH * D == 0) return cudaSuccess;
    const int64_t row = D * elem_bytes;  // bytes of one token's row
    for (int which = 0; which < 2; ++which) {
        void* pool = which == 0 ? k_pool_out : v_pool_out;
        const void* fresh = which == 0 ? k_new : v_new;
        switch (scatter_word_bytes(row, pool, fresh)) {
            case 16: err = launch_kv_scatter<uint4>(pool, fresh, slot, offset, N, C, KVH, P, row, stream); break;
            case 8: err = launch_kv_scatter<uint2>(pool, fresh, slot, offset, N, C, KVH, P, row, stream); break;
            case 4: err = launch_kv_scatter<uint32_t>(pool, fresh, slot, offset, N, C, KVH, P, row, stream); break;
            case 2: err = launch_kv_scatter<uint16_t>(pool, fresh, slot, offset, N, C, KVH, P, row, stream); break;
            default: err = launch_kv_scatter<uint8_t>(pool, fresh, slot, offset, N, C, KVH, P, row, stream);
        }
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}

}  // namespace kernels
}  // namespace tieredkv
