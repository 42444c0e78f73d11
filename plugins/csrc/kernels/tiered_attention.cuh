// TieredAttention: split-K flash-decoding over a masked selection of pages of a paged K/V pool.
// Spec: docs/plugins.md "TieredAttention"; reference: tieredkv.plugins.tiered_attention.tiered_attention.
//
// Launch geometry (docs/plugins.md, "CUDA kernels"):
//   * split kernel: one block of 4 warps per (sequence b, kv head, query group, split). A query
//     group is up to 8 of the kv head's G x T queries (query j = t * G + g, head kvh * G + g), so
//     a block loads each K / V element of its pages once for all of them. The splits of a sequence
//     share its *kept* pages (page_mask != 0) evenly by rank: split s of S reads the kept pages of
//     ranks [s K / S, (s + 1) K / S) (attention_common.cuh, fill_round), so a clustered selection
//     spreads over every split and a masked column costs one bit of a mask scan, nothing more.
//     Two kernels implement it: the tensor-core kernel (attention_mma.cuh: 16-bit pools, cp.async
//     pipeline, mma.sync) and the CUDA-core kernel (attention_simt.cuh: float32 pools and shapes
//     the former does not take). The split count comes from the occupancy the chosen kernel has
//     on the device (cudaOccupancyMaxActiveBlocksPerMultiprocessor) and fills whole waves
//     (make_split_plan).
//   * one split: the block writes out and lse and turns its rows' page log-sum-exps into masses.
//     More splits: the block writes its unnormalized output, max and sum to the workspace and the
//     merge kernel (one block per query, launched as a programmatic dependent launch on sm_90)
//     combines the splits by log-sum-exp and turns every page's log-sum-exp into its mass.
// Arithmetic is float32 in the log2 domain (q is scaled by scale * log2(e); exp2 / log2).
//
// attention_host.cuh runs the kernels' algorithm on the CPU through the same __host__ __device__
// functions (tkv_tiered_attention_host), which is how it is tested without a GPU.
#pragma once

#include "attention_mma.cuh"
#include "attention_simt.cuh"

namespace tieredkv {
namespace kernels {
namespace attention {

//! Kernel choices a (pool type, warm) instantiation has: 3 tensor-core, 4 CUDA-core.
constexpr int kChoices = 7;

// ------------------------------------------------------------------------------ the split kernels
//! Index of a kernel choice in [0, kChoices).
inline int choice_index(const KernelChoice& c) {
    if (c.mma) return c.mma_dim == 64 ? 0 : (c.mma_dim == 128 ? 1 : 2);
    return 3 + (c.vec == 4 ? 2 : 0) + (c.queries > 4 ? 1 : 0);
}

//! Calls fn(kernel, dynamic shared memory bytes, std::bool_constant<tensor cores>) with the split
//! kernel of `choice` for pools of Elem.
template <typename Elem, typename Warm, typename Fn>
inline cudaError_t with_split_kernel(const KernelChoice& choice, Fn&& fn) {
    if constexpr (sizeof(Elem) == 2) {
        if (choice.mma) {
            const size_t smem = static_cast<size_t>(mma_smem_bytes(choice.mma_dim, 2));
            if (choice.mma_dim == 64) return fn(mma_split_kernel<Elem, 64, Warm>, smem, std::true_type{});
            if (choice.mma_dim == 128) return fn(mma_split_kernel<Elem, 128, Warm>, smem, std::true_type{});
            return fn(mma_split_kernel<Elem, 256, Warm>, smem, std::true_type{});
        }
    } else if (choice.vec == 4) {
        return choice.queries > 4 ? fn(simt_split_kernel<Elem, 4, kMaxQueries, Warm>, 0, std::false_type{})
                                  : fn(simt_split_kernel<Elem, 4, 4, Warm>, 0, std::false_type{});
    }
    return choice.queries > 4 ? fn(simt_split_kernel<Elem, 1, kMaxQueries, Warm>, 0, std::false_type{})
                              : fn(simt_split_kernel<Elem, 1, 4, Warm>, 0, std::false_type{});
}

//! Resident blocks per SM of the split kernel of `choice` on the current device (cached per device;
//! the first call also sets the kernel's dynamic shared memory limit and carveout).
template <typename Elem, typename Warm>
cudaError_t split_occupancy(const KernelChoice& choice, int* blocks_per_sm);

//! Launches the split kernel of `choice` for pools of Elem (split_occupancy must have run on this
//! device: it sets the kernel's shared memory attributes).
template <typename Elem, typename Warm>
cudaError_t launch_split_typed(const Problem& p, const SplitPlan& plan, const KernelChoice& choice, float* ws,
                               const Warm& warm, cudaStream_t stream);

#ifdef TKV_ATTENTION_INSTANTIATE  // the definitions: attention_<type>.cu
template <typename Elem, typename Warm>
cudaError_t split_occupancy(const KernelChoice& choice, int* blocks_per_sm) {
    static std::atomic<int> cache[kMaxDevices][kChoices];
    const int device = current_device();
    if (device < 0) return cudaErrorNoDevice;
    const int id = choice_index(choice);
    if (device < kMaxDevices) {
        const int known = cache[device][id].load(std::memory_order_relaxed);
        if (known > 0) {
            *blocks_per_sm = known;
            return cudaSuccess;
        }
    }
    return with_split_kernel<Elem, Warm>(choice, [&](auto kernel, size_t smem, auto) {
        cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
        if (err == cudaSuccess) {
            err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared);
        }
        int n = 0;
        if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem);
        if (err != cudaSuccess) return err;
        if (n <= 0) return cudaErrorInvalidConfiguration;  // the kernel does not fit an SM
        if (device < kMaxDevices) cache[device][id].store(n, std::memory_order_relaxed);
        *blocks_per_sm = n;
        return cudaSuccess;
    });
}

template <typename Elem, typename Warm>
cudaError_t launch_split_typed(const Problem& p, const SplitPlan& plan, const KernelChoice& choice, float* ws,
                               const Warm& warm, cudaStream_t stream) {
    const unsigned int grid = static_cast<unsigned int>(plan.row_blocks * plan.splits);
    return with_split_kernel<Elem, Warm>(choice, [&](auto kernel, size_t smem, auto mma) {
        if constexpr (decltype(mma)::value) {
            return launch_kernel(kernel, grid, kThreads, smem, stream, p, plan, ws, warm);
        } else {
            const LaneLayout L = lane_layout(static_cast<int32_t>(p.D), choice.vec);
            return launch_kernel(kernel, grid, kThreads, smem, stream, p, plan, L, ws, warm);
        }
    });
}
#endif

#define TKV_ATTENTION_INSTANCES(PREFIX, ELEM)                                                                   \
    PREFIX template cudaError_t split_occupancy<ELEM, NoWarmPages>(const KernelChoice&, int*);                 \
    PREFIX template cudaError_t split_occupancy<ELEM, WarmPages>(const KernelChoice&, int*);                   \
    PREFIX template cudaError_t launch_split_typed<ELEM, NoWarmPages>(const Problem&, const SplitPlan&,        \
                                                                       const KernelChoice&, float*,             \
                                                                       const NoWarmPages&, cudaStream_t);       \
    PREFIX template cudaError_t launch_split_typed<ELEM, WarmPages>(const Problem&, const SplitPlan&,          \
                                                                     const KernelChoice&, float*,               \
                                                                     const WarmPages&, cudaStream_t);

#ifndef TKV_ATTENTION_INSTANTIATE
// compiled in attention_f32.cu, attention_f16.cu, attention_bf16.cu (in parallel)
TKV_ATTENTION_INSTANCES(extern, float)
TKV_ATTENTION_INSTANCES(extern, __half)
TKV_ATTENTION_INSTANCES(extern, __nv_bfloat16)
#endif

#ifndef TKV_ATTENTION_INSTANTIATE  // the rest: in capi.cu only

//! Merge kernel (more than one split): one block per query row; the splits' (max, sum, acc) of
//! the workspace combined by log-sum-exp, then page_probs turned from page log-sum-exps into masses
//! (0 for masked columns).
__global__ void __launch_bounds__(kMergeThreads)
merge_kernel(const Problem p, const SplitPlan plan, const float* __restrict__ workspace) {
    __shared__ float s_w[kMaxSplits];
    __shared__ float s_stats[2];
    wait_prior_grid();
    const int64_t row = blockIdx.x;
    const int64_t queries = p.B * p.H * p.T;
    const int32_t S = plan.splits;
    const int32_t D = static_cast<int32_t>(p.D);
    const float* ws_m = workspace;
    const float* ws_l = workspace + static_cast<int64_t>(S) * queries;
    const float* ws_acc = workspace + 2 * static_cast<int64_t>(S) * queries;
    if (threadIdx.x < kWarpSize) {
        float M = -INFINITY;
        for (int s = threadIdx.x; s < S; s += kWarpSize) M = fmaxf(M, ws_m[s * queries + row]);
        for (int off = kWarpSize / 2; off > 0; off /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        float sum = 0.f;
        for (int s = threadIdx.x; s < S; s += kWarpSize) {
            const float w = rescale(ws_m[s * queries + row], M);
            s_w[s] = w;
            sum += ws_l[s * queries + row] * w;
        }
        sum = warp_sum(sum);
        if (threadIdx.x == 0) {
            s_stats[0] = M;
            s_stats[1] = sum;
        }
    }
    __syncthreads();
    const float sum = s_stats[1];
    const float lse2 = lse2_of(s_stats[0], sum);
    for (int d = threadIdx.x; d < D; d += kMergeThreads) {
        float a = 0.f;
        for (int s = 0; s < S; ++s) a += s_w[s] * ws_acc[(s * queries + row) * D + d];
        p.out[row * D + d] = out_of(a, sum);
    }
    if (threadIdx.x == 0) p.lse[row] = lse2 * kLn2;
    const int64_t b = row / (p.H * p.T);
    const int32_t* mask_row = p.page_mask + b * p.M;
    float* probs = p.page_probs + row * p.M;
    for (int64_t mi = threadIdx.x; mi < p.M; mi += kMergeThreads) {
        probs[mi] = mask_row[mi] != 0 ? page_mass(probs[mi], lse2) : 0.f;
    }
}

// ------------------------------------------------------------------------------ launchers
//! The split kernel a call runs, and its occupancy on the current device.
template <typename Warm>
inline cudaError_t split_occupancy_of(int32_t kv_dtype, const KernelChoice& choice, int* blocks_per_sm) {
    switch (kv_dtype) {
        case TKV_DTYPE_F32: return split_occupancy<float, Warm>(choice, blocks_per_sm);
        case TKV_DTYPE_F16: return split_occupancy<__half, Warm>(choice, blocks_per_sm);
        default: return split_occupancy<__nv_bfloat16, Warm>(choice, blocks_per_sm);
    }
}

//! The kernel choice of a call (pools 16-byte aligned or not).
inline KernelChoice call_choice(const Problem& p, int32_t kv_dtype, bool aligned) {
    const int64_t per_kv = p.H / p.KVH * p.T;
    const int32_t qpb = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(per_kv, kMaxQueries)));
    return choose_kernel(kv_elem_bytes(kv_dtype), p.D, aligned, qpb);
}

//! Checks, plans and launches (both ops).
template <typename Warm>
inline cudaError_t launch(const Problem& p, int32_t kv_dtype, void* workspace, int64_t ws_bytes, int32_t num_splits,
                          const Warm& warm, cudaStream_t stream) {
    if (!sizes_valid(p.B, p.H, p.T, p.D, p.C, p.KVH, p.P, p.M) || kv_elem_bytes(kv_dtype) == 0 || num_splits < 0 ||
        ws_bytes < 0) {
        return cudaErrorInvalidValue;
    }
    const int64_t queries = p.B * p.H * p.T;
    if (queries == 0) return cudaSuccess;
    const int sms = current_sm_count();
    if (sms <= 0) return cudaErrorNoDevice;
    const bool aligned =
        reinterpret_cast<uintptr_t>(p.k_pool) % 16 == 0 && reinterpret_cast<uintptr_t>(p.v_pool) % 16 == 0;
    const KernelChoice choice = call_choice(p, kv_dtype, aligned);
    int blocks_per_sm = 0;
    cudaError_t err = split_occupancy_of<Warm>(kv_dtype, choice, &blocks_per_sm);
    if (err != cudaSuccess) return err;
    const SplitPlan plan = make_split_plan(p.B, p.H, p.T, p.D, p.KVH, p.M, sms, blocks_per_sm, num_splits,
                                           workspace == nullptr ? 0 : ws_bytes);
    if (plan.row_blocks * plan.splits > 0x7fffffffLL || (plan.splits > 1 && queries > 0x7fffffffLL)) {
        return cudaErrorInvalidValue;
    }
    float* ws = static_cast<float*>(workspace);
    switch (kv_dtype) {
        case TKV_DTYPE_F32: err = launch_split_typed<float>(p, plan, choice, ws, warm, stream); break;
        case TKV_DTYPE_F16: err = launch_split_typed<__half>(p, plan, choice, ws, warm, stream); break;
        default: err = launch_split_typed<__nv_bfloat16>(p, plan, choice, ws, warm, stream); break;
    }
    if (err != cudaSuccess || plan.splits == 1) return err;
    return launch_kernel(merge_kernel, static_cast<unsigned int>(queries), kMergeThreads, 0, stream, p, plan,
                         static_cast<const float*>(ws));
}

//! The WarmPages of a call, or false for a bad descriptor, W < 0 or missing pointers.
inline bool make_warm(const Problem& p, const void* warm_pool, const int64_t* warm_row, int64_t W,
                      const tkv_codec_desc_t* desc, WarmPages* out) {
    if (desc == nullptr || !codec::codec_desc_valid(desc) || desc->kvh != p.KVH || desc->p != p.P || desc->d != p.D ||
        W < 0 || (p.B * p.M > 0 && warm_row == nullptr) || (W > 0 && warm_pool == nullptr)) {
        return false;
    }
    WarmPages warm;
    if (!codec::make_page_reader(*desc, &warm.reader)) return false;
    warm.pool = static_cast<const uint8_t*>(warm_pool);
    warm.row = warm_row;
    warm.W = W;
    warm.page_bytes = desc->page_bytes;
    *out = warm;
    return true;
}

#endif  // TKV_ATTENTION_INSTANTIATE

}  // namespace attention
}  // namespace kernels
}  // namespace tieredkv
