// TieredAttention kernel: paged attention over a masked selection of pages.
// Spec: docs/plugins.md "TieredAttention"; reference: tieredkv.plugins.attention.tiered_attention.
#pragma once

#include "common.cuh"

namespace tieredkv {
namespace kernels {

constexpr int kAttentionWarps = 8;

//! One block per query (b, h, t); warps take listed pages round-robin, lanes split the head dim.
//! Pass 1 computes the softmax max / denominator over the visible keys (online, per warp,
//! then merged), pass 2 recomputes each logit and accumulates out, page mass and lse.
__global__ void __launch_bounds__(kAttentionWarps * kWarpSize)
tiered_attention_kernel(const float* __restrict__ q, const float* __restrict__ k_pool,
                        const float* __restrict__ v_pool, const int64_t* __restrict__ page_table,
                        const uint8_t* __restrict__ page_mask, const int64_t* __restrict__ page_index,
                        const int64_t* __restrict__ seq_len, const int64_t* __restrict__ past,
                        float* __restrict__ out, float* __restrict__ lse, float* __restrict__ page_probs,
                        int64_t H, int64_t T, int D, int64_t C, int64_t KVH, int64_t P, int64_t M, float scale) {
    __shared__ float warp_max[kAttentionWarps];
    __shared__ float warp_den[kAttentionWarps];
    __shared__ float block_stats[2];
    __shared__ float partial_out[kAttentionWarps][kMaxHeadDim];

    const int64_t query = blockIdx.x;  // ((b * H) + h) * T + t
    const int64_t t = query % T;
    const int64_t h = (query / T) % H;
    const int64_t b = query / (T * H);
    const int64_t kvh = h / (H / KVH);
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;

    const int64_t len = seq_len[b];
    const int64_t last_visible = past[b] + t;  // causal: key position <= past + t
    const int64_t* table_row = page_table + b * M;
    const uint8_t* mask_row = page_mask + b * M;
    const int64_t* index_row = page_index + b * M;

    float qreg[kMaxPerLane];
    const float* q_row = q + query * D;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + kWarpSize * i;
        qreg[i] = d < D ? q_row[d] * scale : 0.f;  // scale folded into q
    }

    // Keys of listed page m: slot o (position index*P + o) is visible iff the page is kept, its
    // pool slot is in range, and position < seq_len and <= past + t. Positions grow with o, so
    // the visible slots of a page are a prefix [0, n_visible).
    auto visible_slots = [&](int64_t m, int64_t& pool_page) -> int64_t {
        pool_page = table_row[m];
        if (!mask_row[m] || pool_page < 0 || pool_page >= C) return 0;
        const int64_t first = index_row[m] * P;
        const int64_t end = min(len, last_visible + 1);  // exclusive bound on positions
        if (end <= first) return 0;
        return min(P, end - first);
    };

    // Pass 1: online max / denominator of exp(logit) per warp.
    float run_max = -INFINITY;
    float run_den = 0.f;
    for (int64_t m = warp; m < M; m += kAttentionWarps) {
        int64_t pool_page;
        const int64_t n_visible = visible_slots(m, pool_page);
        const float* k_page = k_pool + (pool_page * KVH + kvh) * P * D;
        for (int64_t o = 0; o < n_visible; ++o) {
            const float logit = warp_dot(qreg, k_page + o * D, D, lane);
            softmax_merge(run_max, run_den, logit, 1.f);
        }
    }
    if (lane == 0) {
        warp_max[warp] = run_max;
        warp_den[warp] = run_den;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mx = -INFINITY;
        float den = 0.f;
        for (int w = 0; w < kAttentionWarps; ++w) softmax_merge(mx, den, warp_max[w], warp_den[w]);
        block_stats[0] = mx;
        block_stats[1] = den;
    }
    __syncthreads();
    const float mx = block_stats[0];
    const float den = block_stats[1];  // 0 when the query sees no key

    // Pass 2: probabilities, page mass, output.
    float acc[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) acc[i] = 0.f;
    float* probs_row = page_probs + query * M;
    for (int64_t m = warp; m < M; m += kAttentionWarps) {
        int64_t pool_page;
        const int64_t n_visible = visible_slots(m, pool_page);
        const float* k_page = k_pool + (pool_page * KVH + kvh) * P * D;
        const float* v_page = v_pool + (pool_page * KVH + kvh) * P * D;
        float mass = 0.f;
        for (int64_t o = 0; o < n_visible; ++o) {
            const float logit = warp_dot(qreg, k_page + o * D, D, lane);
            const float p = expf(logit - mx) / den;
            mass += p;
            const float* v_row = v_page + o * D;
#pragma unroll
            for (int i = 0; i < kMaxPerLane; ++i) {
                const int d = lane + kWarpSize * i;
                if (d < D) acc[i] += p * v_row[d];
            }
        }
        if (lane == 0) probs_row[m] = mass;
    }
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + kWarpSize * i;
        if (d < D) partial_out[warp][d] = acc[i];
    }
    __syncthreads();
    float* out_row = out + query * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float sum = 0.f;
        for (int w = 0; w < kAttentionWarps; ++w) sum += partial_out[w][d];
        out_row[d] = sum;
    }
    if (threadIdx.x == 0) lse[query] = den > 0.f ? mx + logf(den) : -INFINITY;
}

//! TieredAttention (float32, contiguous row-major tensors on the device):
//!   q          [B, H, T, D]   float32  query t of sequence b sits at position past[b] + t
//!   k_pool     [C, KVH, P, D] float32  key page pool (slot o of page c holds one token)
//!   v_pool     [C, KVH, P, D] float32  value page pool
//!   page_table [B, M] int64   pool page of each listed page
//!   page_mask  [B, M] bool (1 byte)  0 removes the page
//!   page_index [B, M] int64   logical page index: slot o holds position page_index * P + o
//!   seq_len    [B]    int64   positions >= seq_len are empty
//!   past       [B]    int64   query t sees position p iff p <= past + t
//! Outputs (fully written):
//!   out        [B, H, T, D] float32  softmax(scale * q.k) @ v over the visible keys; 0 if none
//!   lse        [B, H, T]    float32  log-sum-exp of the scaled logits; -inf if nothing is seen
//!   page_probs [B, H, T, M] float32  softmax mass on each listed page
//! Query head h reads kv head h / (H / KVH). A listed page whose pool index is outside [0, C)
//! is treated as masked (the reference would fail on it). Requires H % KVH == 0, 0 < D <= 256.
//! Returns the launch status (cudaSuccess, or cudaErrorInvalidValue for bad sizes).
inline cudaError_t launch_tiered_attention(const float* q, const float* k_pool, const float* v_pool,
                                           const int64_t* page_table, const uint8_t* page_mask,
                                           const int64_t* page_index, const int64_t* seq_len, const int64_t* past,
                                           float* out, float* lse, float* page_probs, int64_t B, int64_t H,
                                           int64_t T, int64_t D, int64_t C, int64_t KVH, int64_t P, int64_t M,
                                           float scale, cudaStream_t stream) {
    if (B < 0 || H < 0 || T < 0 || C < 0 || M < 0 || KVH <= 0 || P <= 0 || D <= 0 || D > kMaxHeadDim ||
        H % KVH != 0) {
        return cudaErrorInvalidValue;
    }
    const int64_t queries = B * H * T;
    if (queries == 0) return cudaSuccess;
    if (queries > 0x7fffffffLL) return cudaErrorInvalidValue;
    tiered_attention_kernel<<<static_cast<unsigned int>(queries), kAttentionWarps * kWarpSize, 0, stream>>>(
        q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, lse, page_probs, H, T,
        static_cast<int>(D), C, KVH, P, M, scale);
    return cudaGetLastError();
}

}  // namespace kernels
}  // namespace tieredkv
