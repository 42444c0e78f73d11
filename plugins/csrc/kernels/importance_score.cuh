// ImportanceScore kernels: per-page importance from query relevance, position and saliency.
// Spec: docs/plugins.md "ImportanceScore"; reference: tieredkv.plugins.importance_score.importance_score.
#pragma once

#include "common.cuh"

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

}  // namespace kernels
}  // namespace tieredkv
