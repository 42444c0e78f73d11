// ImportanceScore kernels: per-page importance from query relevance, position and saliency.
// Spec: docs/plugins.md "ImportanceScore"; reference: tieredkv.plugins.importance_score.importance_score.
//
// Two implementations of one op:
//   * launch_importance_score_ex (tkv_importance_score_ex; with a workspace): one pass over the
//     page summaries per kv head. A bound block per (b, kv head, 64 pages) reads each competing
//     page's key min / max once (float32, float16 or bfloat16, 16-byte vectors), computes the bound
//     of every query head of the kv head from it, and writes the bounds and, per head, the chunk's
//     (max, sum of exp) to the workspace; a mix block per (b, 256 pages) merges the chunks'
//     statistics per head and turns each page's bounds into its share, then mixes the score.
//   * launch_importance_score (tkv_importance_score; float32, no workspace): one block per (b, h)
//     over all pages, twice (the softmax statistics, then the shares).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "tieredkv_kernels.h"

namespace tieredkv {
namespace kernels {

constexpr int kScoreWarps = 8;
//! distances below this many tokens share bucket 0 (importance.EXACT_TOKENS)
constexpr double kExactTokens = 16.0;

//! The lane's elements of a row of D floats: chunks of kVec floats (one float4, or one float),
//! chunk lane + 32 * c for c < kMaxPerLane / kVec; zeros where the lane holds none.
template <int kVec>
__device__ __forceinline__ void load_lane_floats(const float* __restrict__ row, int D, int lane,
                                                 float (&dst)[kMaxPerLane]) {
#pragma unroll
    for (int c = 0; c < kMaxPerLane / kVec; ++c) {
        const int d = (lane + kWarpSize * c) * kVec;
        if constexpr (kVec == 4) {
            const float4 v = d < D ? __ldg(reinterpret_cast<const float4*>(row + d)) : make_float4(0.f, 0.f, 0.f, 0.f);
            dst[4 * c] = v.x;
            dst[4 * c + 1] = v.y;
            dst[4 * c + 2] = v.z;
            dst[4 * c + 3] = v.w;
        } else {
            dst[c] = d < D ? __ldg(row + d) : 0.f;
        }
    }
}

//! Quest upper bound of page m for the query slice `qreg` (already multiplied by scale; the
//! lane's elements as load_lane_floats holds them) plus log(max(page_tokens, 1)); every lane of
//! the warp gets the value.
template <int kVec>
__device__ __forceinline__ float page_upper_bound(const float (&qreg)[kMaxPerLane], const float* __restrict__ lo,
                                                  const float* __restrict__ hi, int64_t tokens, int D, int lane) {
    float lo_r[kMaxPerLane], hi_r[kMaxPerLane];
    load_lane_floats<kVec>(lo, D, lane, lo_r);
    load_lane_floats<kVec>(hi, D, lane, hi_r);
    float partial = 0.f;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) partial += fmaxf(qreg[e] * lo_r[e], qreg[e] * hi_r[e]);
    return warp_sum(partial) + logf(fmaxf(static_cast<float>(tokens), 1.f));
}

//! Relevance share: one block per (b, h); softmax over the kept pages m of the upper bound,
//! folded into share[b, m] with a max over heads. Shares are >= 0, so the float max is an
//! integer atomicMax on the bit patterns; `share` must be zeroed before the launch. kVec = 4:
//! rows read as float4 (D % 4 == 0 and 16-byte aligned kmin / kmax), else 1.
template <int kVec>
__global__ void __launch_bounds__(kScoreWarps * kWarpSize)
relevance_share_kernel(const float* __restrict__ q, const float* __restrict__ kmin, const float* __restrict__ kmax,
                       const int64_t* __restrict__ page_tokens, const int32_t* __restrict__ page_mask,
                       float* __restrict__ share, int64_t H, int D, int64_t M, int64_t KVH, float scale) {

    const int64_t b = blockIdx.x / H;
    const int64_t h = blockIdx.x % H;
    const int64_t kvh = h / (H / KVH);
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;

    float qreg[kMaxPerLane];
    const float* q_row = q + blockIdx.x * static_cast<int64_t>(D);
#pragma unroll
    for (int c = 0; c < kMaxPerLane / kVec; ++c) {
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
            const int d = (lane + kWarpSize * c) * kVec + v;
            qreg[c * kVec + v] = d < D ? q_row[d] * scale : 0.f;  // scale folded into q
        }
    }
    const int32_t* mask_row = page_mask + b * M;
    const int64_t* tokens_row = page_tokens + b * M;
    auto summary = [&](const float* base, int64_t m) { return base + ((b * M + m) * KVH + kvh) * D; };

    float run_max = -INFINITY;
    float run_den = 0.f;
    for (int64_t m = warp; m < M; m += kScoreWarps) {
        if (mask_row[m] == 0) continue;
        const float ub = page_upper_bound<kVec>(qreg, summary(kmin, m), summary(kmax, m), tokens_row[m], D, lane);
        softmax_merge(run_max, run_den, ub, 1.f);
    }
    float mx, den;
    block_softmax_stats<kScoreWarps>(run_max, run_den, warp, lane, mx, den);
    if (den <= 0.f) return;  // no kept page: every share stays 0
    for (int64_t m = warp; m < M; m += kScoreWarps) {
        if (mask_row[m] == 0) continue;
        const float ub = page_upper_bound<kVec>(qreg, summary(kmin, m), summary(kmax, m), tokens_row[m], D, lane);
        const float p = expf(ub - mx) / den;
        if (lane == 0) atomicMax(reinterpret_cast<int*>(share + b * M + m), __float_as_int(p));
    }
}

//! Log-spaced bucket of a token distance: #{i in 1..NB-1 : distance >= 16 * 2^(i-1)}
//! (float64 comparison, as the reference; negative distances fall in bucket 0).
__device__ __forceinline__ int64_t distance_bucket(int64_t distance, int64_t num_buckets) {
    const double d = static_cast<double>(distance);
    int64_t bucket = 0;
    double threshold = kExactTokens;
    for (int64_t i = 1; i < num_buckets && d >= threshold; ++i) {
        ++bucket;
        threshold *= 2.0;
    }
    return bucket;
}

//! Mix: one block per sequence b. score[b, :] holds the relevance shares on entry when
//! `with_relevance` (normalized here by their max, clamped to 1e-30) and is overwritten.
__global__ void __launch_bounds__(kScoreWarps * kWarpSize)
importance_mix_kernel(const int64_t* __restrict__ distance, const float* __restrict__ saliency,
                      const int32_t* __restrict__ page_mask, const float* __restrict__ position_table,
                      float* __restrict__ score, int64_t M, int64_t NB, float w_rel, float w_pos, float w_sal,
                      bool with_relevance) {
    __shared__ float warp_best[kScoreWarps];
    const int64_t b = blockIdx.x;
    float* row = score + b * M;
    float best = 1e-30f;
    if (with_relevance) {
        float local = 0.f;
        for (int64_t m = threadIdx.x; m < M; m += blockDim.x) local = fmaxf(local, row[m]);
        for (int delta = kWarpSize / 2; delta > 0; delta /= 2) {
            local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, delta));
        }
        if (threadIdx.x % kWarpSize == 0) warp_best[threadIdx.x / kWarpSize] = local;
        __syncthreads();
        for (int w = 0; w < kScoreWarps; ++w) best = fmaxf(best, warp_best[w]);
    }
    for (int64_t m = threadIdx.x; m < M; m += blockDim.x) {
        const int64_t i = b * M + m;
        const float rel = with_relevance ? row[m] / best : 0.f;
        const float pos = fminf(fmaxf(position_table[distance_bucket(distance[i], NB)], 0.f), 1.f);
        const float value = w_rel * rel + w_pos * pos + w_sal * saliency[i];
        row[m] = page_mask[i] != 0 ? value : 0.f;
    }
}

//! ImportanceScore (float32, contiguous row-major tensors on the device):
//!   q              [B, H, D]        float32  the query the step attends with
//!   kmin, kmax     [B, M, KVH, D]   float32  element-wise min / max of each page's keys
//!   page_tokens    [B, M] int64     tokens written in the page
//!   distance       [B, M] int64     query position minus the page's last token position
//!   saliency       [B, M] float32
//!   page_mask      [B, M] int32     nonzero: the page competes
//!   position_table [NB]   float32   learned value per log-spaced distance bucket (NB >= 1)
//! Output: score [B, M] float32 = w_rel * rel + w_pos * clip(position_table[bucket], 0, 1)
//!   + w_sal * saliency, 0 where page_mask is 0. rel = per head h, softmax over kept m of
//!   scale * sum_d max(q_d * kmin_d, q_d * kmax_d) + log(max(page_tokens, 1)) (query head h
//!   reads kv head h / (H / KVH)), max over heads, divided by its max over m clamped to 1e-30;
//!   skipped (0) when w_rel == 0. Requires H % KVH == 0, 0 < D <= 256. Returns the first CUDA
//!   error, or cudaErrorInvalidValue for bad sizes.
inline cudaError_t launch_importance_score(const float* q, const float* kmin, const float* kmax,
                                           const int64_t* page_tokens, const int64_t* distance,
                                           const float* saliency, const int32_t* page_mask,
                                           const float* position_table, float* score, int64_t B, int64_t H,
                                           int64_t D, int64_t M, int64_t KVH, int64_t NB, float w_rel, float w_pos,
                                           float w_sal, float scale, cudaStream_t stream) {
    if (B < 0 || H < 0 || M < 0 || KVH <= 0 || NB <= 0 || D <= 0 || D > kMaxHeadDim || H % KVH != 0) {
        return cudaErrorInvalidValue;
    }
    if (B * M == 0) return cudaSuccess;
    if (B * H > 0x7fffffffLL) return cudaErrorInvalidValue;
    constexpr int kThreads = kScoreWarps * kWarpSize;
    const bool with_relevance = w_rel != 0.f && H > 0;
    if (with_relevance) {
        cudaError_t err = cudaMemsetAsync(score, 0, static_cast<size_t>(B * M) * sizeof(float), stream);
        if (err != cudaSuccess) return err;
        const bool vec4 = D % 4 == 0 && reinterpret_cast<uintptr_t>(kmin) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(kmax) % 16 == 0;
        if (vec4) {
            relevance_share_kernel<4><<<static_cast<unsigned int>(B * H), kThreads, 0, stream>>>(
                q, kmin, kmax, page_tokens, page_mask, score, H, static_cast<int>(D), M, KVH, scale);
        } else {
            relevance_share_kernel<1><<<static_cast<unsigned int>(B * H), kThreads, 0, stream>>>(
                q, kmin, kmax, page_tokens, page_mask, score, H, static_cast<int>(D), M, KVH, scale);
        }
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;
    }
    importance_mix_kernel<<<static_cast<unsigned int>(B), kThreads, 0, stream>>>(
        distance, saliency, page_mask, position_table, score, M, NB, w_rel, w_pos, w_sal, with_relevance);
    return cudaGetLastError();
}

// ------------------------------------------------------------------------------ one pass per kv head
namespace importance {

constexpr int kChunkPages = 64;   //!< pages of one (b, kv head) a bound block scores
constexpr int kBoundWarps = 4;
constexpr int kBoundThreads = kBoundWarps * kWarpSize;
constexpr int kHeadsPerPass = 8;  //!< query heads whose q a lane holds in registers at once
constexpr int kMixThreads = 256;  //!< pages a mix block mixes
constexpr int64_t kMaxSmem = 227 * 1024;

//! Chunks of kChunkPages pages of a row of M pages.
__host__ __device__ inline int64_t chunks_of(int64_t M) { return (M + kChunkPages - 1) / kChunkPages; }

//! tkv_importance_score_workspace: the bounds [B, H, M], then per (b, h, chunk) the chunk's max and
//! sum of exp (float32 each).
inline int64_t workspace_bytes(int64_t B, int64_t H, int64_t M) { return 4 * B * H * (M + 2 * chunks_of(M)); }

//! Element i of a tensor of TKV_DTYPE_* `dtype`, as a float.
__device__ __forceinline__ float load_as_float(const void* base, int64_t i, int32_t dtype) {
    switch (dtype) {
        case TKV_DTYPE_F16: return __half2float(static_cast<const __half*>(base)[i]);
        case TKV_DTYPE_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
        default: return static_cast<const float*>(base)[i];
    }
}

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

//! kVec summary elements at `src` (16-byte aligned when kVec > 1) as floats into dst[0..kVec).
template <typename SumT, int kVec>
__device__ __forceinline__ void load_summary(const SumT* __restrict__ src, float* dst) {
    if constexpr (kVec == 1) {
        dst[0] = as_float(src[0]);
    } else if constexpr (sizeof(SumT) == 4) {
        static_assert(kVec == 4, "float32: 4 per 16-byte vector");
        const float4 v = __ldg(reinterpret_cast<const float4*>(src));
        dst[0] = v.x;
        dst[1] = v.y;
        dst[2] = v.z;
        dst[3] = v.w;
    } else {
        static_assert(kVec == 8, "16-bit types: 8 per 16-byte vector");
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            SumT pair[2];
            memcpy(pair, &words[k], sizeof(pair));
            dst[2 * k] = as_float(pair[0]);
            dst[2 * k + 1] = as_float(pair[1]);
        }
    }
}

//! Bound block per (b, kv head, chunk of kChunkPages pages): lanes hold a page's summary row in
//! chunks of kVec elements (row_lanes lanes per row, 32 / row_lanes pages per warp step); each
//! competing page's kmin / kmax is read once per kHeadsPerPass query heads (once for G <= 8), the
//! bound of each head is a butterfly sum over the row's lanes. Writes ub[b, h, m] (-inf for masked
//! pages) and the chunk's (max, sum exp(ub - max)) per head. Dynamic shared memory: q of the G
//! heads, scaled ([G][D]), and the bounds [G][kChunkPages].
template <typename SumT, int kVec>
__global__ void __launch_bounds__(kBoundThreads)
bound_kernel(const void* __restrict__ q, int32_t q_dtype, const SumT* __restrict__ kmin,
             const SumT* __restrict__ kmax, const int64_t* __restrict__ page_tokens,
             const int32_t* __restrict__ page_mask, float* __restrict__ ub, float* __restrict__ stats, int64_t H,
             int32_t D, int64_t M, int64_t KVH, float scale) {
    extern __shared__ float smem[];
    wait_prior_grid();
    const int64_t nchunks = chunks_of(M);
    const int64_t chunk = blockIdx.x % nchunks;
    const int64_t bk = blockIdx.x / nchunks;
    const int64_t kvh = bk % KVH;
    const int64_t b = bk / KVH;
    const int32_t G = static_cast<int32_t>(H / KVH);
    float* q_s = smem;
    float* s_ub = smem + G * D;
    for (int i = threadIdx.x; i < G * D; i += kBoundThreads) {
        q_s[i] = load_as_float(q, (b * H + kvh * G) * D + i, q_dtype) * scale;  // the kv head's rows are adjacent
    }
    __syncthreads();

    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int chunks = (D + kVec - 1) / kVec;
    int row_lanes = 1;
    while (row_lanes < chunks && row_lanes < kWarpSize) row_lanes *= 2;
    const int per_lane = (chunks + row_lanes - 1) / row_lanes;
    const int rows = kWarpSize / row_lanes;  // pages per warp step
    const int rg = lane / row_lanes;
    const int r = lane % row_lanes;
    const int64_t m0 = chunk * kChunkPages;
    const int n_pages = static_cast<int>(min(static_cast<int64_t>(kChunkPages), M - m0));
    constexpr int kSlots = kMaxPerLane / kVec;  // chunks a lane may hold (per_lane <= kSlots for D <= 256)

    for (int hg = 0; hg < G; hg += kHeadsPerPass) {
        float qr[kHeadsPerPass][kMaxPerLane];
#pragma unroll
        for (int h = 0; h < kHeadsPerPass; ++h) {
#pragma unroll
            for (int c = 0; c < kSlots; ++c) {
#pragma unroll
                for (int v = 0; v < kVec; ++v) {
                    const int d = (r + row_lanes * c) * kVec + v;
                    qr[h][c * kVec + v] = (hg + h < G && c < per_lane && d < D) ? q_s[(hg + h) * D + d] : 0.f;
                }
            }
        }
        for (int base = warp * rows; base < n_pages; base += kBoundWarps * rows) {  // warp-uniform bounds
            const int pi = base + rg;
            const int64_t m = m0 + pi;
            const bool kept = pi < n_pages && page_mask[b * M + m] != 0;
            float lo[kMaxPerLane], hi[kMaxPerLane];
            const int64_t row_at = ((b * M + m) * KVH + kvh) * D;
#pragma unroll
            for (int c = 0; c < kSlots; ++c) {
                const int d = (r + row_lanes * c) * kVec;
                if (kept && c < per_lane && d < D) {
                    load_summary<SumT, kVec>(kmin + row_at + d, lo + c * kVec);
                    load_summary<SumT, kVec>(kmax + row_at + d, hi + c * kVec);
                } else {
#pragma unroll
                    for (int v = 0; v < kVec; ++v) lo[c * kVec + v] = hi[c * kVec + v] = 0.f;
                }
            }
            const float log_tokens = kept ? logf(fmaxf(static_cast<float>(page_tokens[b * M + m]), 1.f)) : 0.f;
#pragma unroll
            for (int h = 0; h < kHeadsPerPass; ++h) {
                if (hg + h >= G) break;  // uniform
                float partial = 0.f;
#pragma unroll
                for (int e = 0; e < kMaxPerLane; ++e) partial += fmaxf(qr[h][e] * lo[e], qr[h][e] * hi[e]);
                for (int off = 1; off < row_lanes; off <<= 1) partial += __shfl_xor_sync(0xffffffffu, partial, off);
                if (r == 0 && pi < n_pages) s_ub[(hg + h) * kChunkPages + pi] = kept ? partial + log_tokens : -INFINITY;
            }
        }
    }
    __syncthreads();
    for (int h = warp; h < G; h += kBoundWarps) {
        float mx = -INFINITY;
        for (int i = lane; i < n_pages; i += kWarpSize) mx = fmaxf(mx, s_ub[h * kChunkPages + i]);
        for (int off = kWarpSize / 2; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float sum = 0.f;
        const int64_t row = b * H + kvh * G + h;
        for (int i = lane; i < n_pages; i += kWarpSize) {
            const float x = s_ub[h * kChunkPages + i];
            if (x != -INFINITY) sum += expf(x - mx);
            ub[row * M + m0 + i] = x;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            stats[(row * nchunks + chunk) * 2] = mx;
            stats[(row * nchunks + chunk) * 2 + 1] = sum;
        }
    }
}

//! Mix block per (b, kMixThreads pages): with relevance, per head h the chunks' statistics merged
//! into (max_h, den_h) (dynamic shared memory [2][H]), each page's share max_h exp(ub - max_h) / den_h
//! divided by the row's largest share max_h 1 / den_h (clamped to 1e-30); then the mix.
__global__ void __launch_bounds__(kMixThreads)
mix_kernel(const float* __restrict__ ub, const float* __restrict__ stats, const int64_t* __restrict__ distance,
           const float* __restrict__ saliency, const int32_t* __restrict__ page_mask,
           const float* __restrict__ position_table, float* __restrict__ score, int64_t H, int64_t M, int64_t NB,
           float w_rel, float w_pos, float w_sal, bool with_relevance) {
    extern __shared__ float s_head[];  // [H] max, then [H] den
    __shared__ float s_best;
    wait_prior_grid();
    const int64_t col_blocks = (M + kMixThreads - 1) / kMixThreads;
    const int64_t b = blockIdx.x / col_blocks;
    const int64_t m = (blockIdx.x % col_blocks) * kMixThreads + threadIdx.x;
    if (with_relevance) {
        const int64_t nchunks = chunks_of(M);
        for (int64_t h = threadIdx.x; h < H; h += kMixThreads) {
            float mx = -INFINITY, den = 0.f;
            const float* st = stats + (b * H + h) * nchunks * 2;
            for (int64_t c = 0; c < nchunks; ++c) softmax_merge(mx, den, st[2 * c], st[2 * c + 1]);
            s_head[h] = mx;
            s_head[H + h] = den;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float best = 1e-30f;
            for (int64_t h = 0; h < H; ++h) {
                if (s_head[H + h] > 0.f) best = fmaxf(best, 1.f / s_head[H + h]);
            }
            s_best = best;
        }
        __syncthreads();
    }
    if (m >= M) return;
    const int64_t i = b * M + m;
    float rel = 0.f;
    if (with_relevance && page_mask[i] != 0) {
        float share = 0.f;
        for (int64_t h = 0; h < H; ++h) {
            const float x = ub[(b * H + h) * M + m];
            if (x != -INFINITY) share = fmaxf(share, expf(x - s_head[h]) / s_head[H + h]);
        }
        rel = share / s_best;
    }
    const float pos = fminf(fmaxf(position_table[distance_bucket(distance[i], NB)], 0.f), 1.f);
    const float value = w_rel * rel + w_pos * pos + w_sal * saliency[i];
    score[i] = page_mask[i] != 0 ? value : 0.f;
}

//! Sets a kernel's dynamic shared memory limit to `bytes` when above the default 48 KB (once per
//! device and size class).
template <typename Kernel>
inline cudaError_t allow_smem(Kernel kernel, int64_t bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <typename SumT>
inline cudaError_t launch_bound(const void* q, int32_t q_dtype, const void* kmin, const void* kmax,
                                const int64_t* page_tokens, const int32_t* page_mask, float* ub, float* stats,
                                int64_t B, int64_t H, int64_t D, int64_t M, int64_t KVH, float scale,
                                cudaStream_t stream) {
    constexpr int kVector = static_cast<int>(16 / sizeof(SumT));
    const bool vec = D % kVector == 0 && reinterpret_cast<uintptr_t>(kmin) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(kmax) % 16 == 0;
    const int64_t G = H / KVH;
    const int64_t smem = 4 * G * (D + kChunkPages);
    const unsigned int grid = static_cast<unsigned int>(B * KVH * chunks_of(M));
    const auto* lo = static_cast<const SumT*>(kmin);
    const auto* hi = static_cast<const SumT*>(kmax);
    const int32_t d = static_cast<int32_t>(D);
    cudaError_t err;
    if (vec) {
        err = allow_smem(bound_kernel<SumT, kVector>, smem);
        if (err == cudaSuccess) {
            err = launch_kernel(bound_kernel<SumT, kVector>, grid, kBoundThreads, static_cast<size_t>(smem), stream, q,
                                q_dtype, lo, hi, page_tokens, page_mask, ub, stats, H, d, M, KVH, scale);
        }
    } else {
        err = allow_smem(bound_kernel<SumT, 1>, smem);
        if (err == cudaSuccess) {
            err = launch_kernel(bound_kernel<SumT, 1>, grid, kBoundThreads, static_cast<size_t>(smem), stream, q,
                                q_dtype, lo, hi, page_tokens, page_mask, ub, stats, H, d, M, KVH, scale);
        }
    }
    return err;
}

}  // namespace importance

//! ImportanceScore with a workspace (tkv_importance_score_ex): the op of launch_importance_score,
//! q [B, H, D] of q_dtype and kmin, kmax [B, M, KVH, D] of summary_dtype (TKV_DTYPE_*), one pass
//! over the summaries per kv head. The workspace must hold importance::workspace_bytes(B, H, M) bytes
//! when w_rel != 0 (else it is not used). Requires H % KVH == 0, 0 < D <= 256 and the q rows of a
//! kv head's query group in shared memory (H / KVH * (D + 64) * 4 bytes <= 227 KB).
inline cudaError_t launch_importance_score_ex(const void* q, int32_t q_dtype, const void* kmin, const void* kmax,
                                              int32_t summary_dtype, const int64_t* page_tokens,
                                              const int64_t* distance, const float* saliency,
                                              const int32_t* page_mask, const float* position_table, float* score,
                                              int64_t B, int64_t H, int64_t D, int64_t M, int64_t KVH, int64_t NB,
                                              float w_rel, float w_pos, float w_sal, float scale, void* workspace,
                                              int64_t ws_bytes, cudaStream_t stream) {
    const auto known = [](int32_t t) { return t == TKV_DTYPE_F32 || t == TKV_DTYPE_F16 || t == TKV_DTYPE_BF16; };
    if (B < 0 || H < 0 || M < 0 || KVH <= 0 || NB <= 0 || D <= 0 || D > kMaxHeadDim || H % KVH != 0 ||
        !known(q_dtype) || !known(summary_dtype) || ws_bytes < 0 || H > 0x7fffffffLL || M > 0x7fffffffLL) {
        return cudaErrorInvalidValue;
    }
    if (B * M == 0) return cudaSuccess;
    const bool with_relevance = w_rel != 0.f && H > 0;
    const int64_t col_blocks = (M + importance::kMixThreads - 1) / importance::kMixThreads;
    const int64_t mix_smem = with_relevance ? 8 * H : 0;
    if (B * col_blocks > 0x7fffffffLL || mix_smem > importance::kMaxSmem) return cudaErrorInvalidValue;
    float* ub = static_cast<float*>(workspace);
    float* stats = ub + B * H * M;
    if (with_relevance) {
        if (workspace == nullptr || ws_bytes < importance::workspace_bytes(B, H, M) ||
            H / KVH * (D + importance::kChunkPages) * 4 > importance::kMaxSmem ||
            B * KVH * importance::chunks_of(M) > 0x7fffffffLL) {
            return cudaErrorInvalidValue;
        }
        cudaError_t err;
        switch (summary_dtype) {
            case TKV_DTYPE_F16:
                err = importance::launch_bound<__half>(q, q_dtype, kmin, kmax, page_tokens, page_mask, ub, stats, B, H, D,
                                                  M, KVH, scale, stream);
                break;
            case TKV_DTYPE_BF16:
                err = importance::launch_bound<__nv_bfloat16>(q, q_dtype, kmin, kmax, page_tokens, page_mask, ub, stats, B,
                                                         H, D, M, KVH, scale, stream);
                break;
            default:
                err = importance::launch_bound<float>(q, q_dtype, kmin, kmax, page_tokens, page_mask, ub, stats, B, H, D, M,
                                                 KVH, scale, stream);
        }
        if (err != cudaSuccess) return err;
    }
    cudaError_t err = importance::allow_smem(importance::mix_kernel, mix_smem);
    if (err != cudaSuccess) return err;
    return launch_kernel(importance::mix_kernel, static_cast<unsigned int>(B * col_blocks), importance::kMixThreads,
                         static_cast<size_t>(mix_smem), stream, static_cast<const float*>(ub),
                         static_cast<const float*>(stats), distance, saliency, page_mask, position_table, score, H, M,
                         NB, w_rel, w_pos, w_sal, with_relevance);
}

}  // namespace kernels
}  // namespace tieredkv
