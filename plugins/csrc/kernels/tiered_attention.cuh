// TieredAttention kernel: paged attention over a masked selection of pages.
// Spec: docs/plugins.md "TieredAttention"; reference: tieredkv.plugins.attention.tiered_attention.
#pragma once

#include "codec.cuh"
#include "common.cuh"

namespace tieredkv {
namespace kernels {

constexpr int kAttentionWarps = 8;

//! The plain op: every listed page is read from the float pools.
struct NoWarmPages {
    static constexpr bool kEnabled = false;
};

//! Warm (encoded) pages: listed page m of sequence b with row[b * M + m] >= 0 is read from
//! pool + row * desc.page_bytes (decoded per element); a row >= W is masked.
struct WarmPages {
    static constexpr bool kEnabled = true;
    const uint8_t* pool;  //!< [W, desc.page_bytes] uint8
    const int64_t* row;   //!< [B, M] int64
    int64_t W;
    tkv_codec_desc_t desc;
};

//! warp_dot of the lane's query slice with key o of an encoded page (kv head kvh), each key
//! element decoded on the fly (codec::decode_value, bit-exact with codec.decode_pages).
__device__ __forceinline__ float warp_dot_encoded(const float (&a)[kMaxPerLane], const tkv_codec_desc_t& desc,
                                                  const uint8_t* page, int64_t kvh, int64_t o, int D, int lane) {
    float partial = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + kWarpSize * i;
        if (d < D) partial += a[i] * codec::decode_value(desc, page, codec::kRoleK, kvh, o, d);
    }
    return warp_sum(partial);
}

//! One block per query (b, h, t); warps take listed pages round-robin, lanes split the head dim.
//! Pass 1 computes the softmax max / denominator over the visible keys (online, per warp,
//! then merged), pass 2 recomputes each logit and accumulates out, page mass and lse.
//! `Warm` is NoWarmPages (the plain op, no warm code compiled in) or WarmPages.
template <typename Warm>
__global__ void __launch_bounds__(kAttentionWarps * kWarpSize)
tiered_attention_kernel(const float* __restrict__ q, const float* __restrict__ k_pool,
                        const float* __restrict__ v_pool, const int64_t* __restrict__ page_table,
                        const uint8_t* __restrict__ page_mask, const int64_t* __restrict__ page_index,
                        const int64_t* __restrict__ seq_len, const int64_t* __restrict__ past,
                        float* __restrict__ out, float* __restrict__ lse, float* __restrict__ page_probs,
                        int64_t H, int64_t T, int D, int64_t C, int64_t KVH, int64_t P, int64_t M, float scale,
                        Warm warm) {
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
    // pool slot (or warm row) is in range, and position < seq_len and <= past + t. Positions grow
    // with o, so the visible slots of a page are a prefix [0, n_visible).
    // `enc` is set to the encoded page of a warm page (else nullptr; always for NoWarmPages).
    auto visible_slots = [&](int64_t m, int64_t& pool_page, const uint8_t*& enc) -> int64_t {
        pool_page = table_row[m];
        enc = nullptr;
        if constexpr (Warm::kEnabled) {
            if (!mask_row[m]) return 0;
            const int64_t row = warm.row[b * M + m];
            if (row >= warm.W) return 0;
            if (row >= 0) {
                enc = warm.pool + row * warm.desc.page_bytes;
            } else if (pool_page < 0 || pool_page >= C) {
                return 0;
            }
        } else {
            if (!mask_row[m] || pool_page < 0 || pool_page >= C) return 0;
        }
        const int64_t first = index_row[m] * P;
        const int64_t end = min(len, last_visible + 1);  // exclusive bound on positions
        if (end <= first) return 0;
        return min(P, end - first);
    };
    auto logit_of = [&](const float* k_page, const uint8_t* enc, int64_t o) -> float {
        if constexpr (Warm::kEnabled) {
            if (enc != nullptr) return warp_dot_encoded(qreg, warm.desc, enc, kvh, o, D, lane);
        }
        return warp_dot(qreg, k_page + o * D, D, lane);
    };

    // Pass 1: online max / denominator of exp(logit) per warp.
    float run_max = -INFINITY;
    float run_den = 0.f;
    for (int64_t m = warp; m < M; m += kAttentionWarps) {
        int64_t pool_page;
        const uint8_t* enc;
        const int64_t n_visible = visible_slots(m, pool_page, enc);
        const float* k_page = k_pool + (pool_page * KVH + kvh) * P * D;
        for (int64_t o = 0; o < n_visible; ++o) softmax_merge(run_max, run_den, logit_of(k_page, enc, o), 1.f);
    }
    float mx, den;  // 0 when the query sees no key
    block_softmax_stats<kAttentionWarps>(run_max, run_den, warp, lane, mx, den);

    // Pass 2: probabilities, page mass, output.
    float acc[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) acc[i] = 0.f;
    float* probs_row = page_probs + query * M;
    for (int64_t m = warp; m < M; m += kAttentionWarps) {
        int64_t pool_page;
        const uint8_t* enc;
        const int64_t n_visible = visible_slots(m, pool_page, enc);
        const float* k_page = k_pool + (pool_page * KVH + kvh) * P * D;
        const float* v_page = v_pool + (pool_page * KVH + kvh) * P * D;
        float mass = 0.f;
        for (int64_t o = 0; o < n_visible; ++o) {
            const float p = expf(logit_of(k_page, enc, o) - mx) / den;
            mass += p;
            if constexpr (Warm::kEnabled) {
                if (enc != nullptr) {
#pragma unroll
                    for (int i = 0; i < kMaxPerLane; ++i) {
                        const int d = lane + kWarpSize * i;
                        if (d < D) acc[i] += p * codec::decode_value(warm.desc, enc, codec::kRoleV, kvh, o, d);
                    }
                    continue;
                }
            }
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

//! Checks the sizes and launches one block per query (shared by both launchers).
template <typename Warm>
inline cudaError_t launch_attention(const float* q, const float* k_pool, const float* v_pool,
                                    const int64_t* page_table, const uint8_t* page_mask, const int64_t* page_index,
                                    const int64_t* seq_len, const int64_t* past, float* out, float* lse,
                                    float* page_probs, int64_t B, int64_t H, int64_t T, int64_t D, int64_t C,
                                    int64_t KVH, int64_t P, int64_t M, float scale, const Warm& warm,
                                    cudaStream_t stream) {
    if (B < 0 || H < 0 || T < 0 || C < 0 || M < 0 || KVH <= 0 || P <= 0 || D <= 0 || D > kMaxHeadDim ||
        H % KVH != 0) {
        return cudaErrorInvalidValue;
    }
    const int64_t queries = B * H * T;
    if (queries == 0) return cudaSuccess;
    if (queries > 0x7fffffffLL) return cudaErrorInvalidValue;
    tiered_attention_kernel<Warm><<<static_cast<unsigned int>(queries), kAttentionWarps * kWarpSize, 0, stream>>>(
        q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, lse, page_probs, H, T,
        static_cast<int>(D), C, KVH, P, M, scale, warm);
    return cudaGetLastError();
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
    return launch_attention(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, lse,
                            page_probs, B, H, T, D, C, KVH, P, M, scale, NoWarmPages{}, stream);
}

//! TieredAttention with warm pages: launch_tiered_attention's tensors, plus
//!   warm_pool  [W, desc.page_bytes] uint8  pages encoded with desc's codec (codec.encode_pages
//!                                           layout; page shape [KVH, P, D], the pools')
//!   warm_row   [B, M] int64   warm-pool row of listed page m; < 0: the page is read from the
//!                             pools through page_table; >= W: treated as masked
//!   desc       codec descriptor (make_codec_desc) with desc.kvh, p, d == KVH, P, D
//! A kept page with warm_row in [0, W) reads its K and V by decoding the encoded page per
//! element (bit-exact with codec.decode_pages; its page_table entry is ignored), as
//! tiered_attention(..., warm_pool=, warm_row=, warm_codec=). Returns the launch status, or
//! cudaErrorInvalidValue for bad sizes, a bad descriptor, W < 0 or a null warm_row.
inline cudaError_t launch_tiered_attention_warm(const float* q, const float* k_pool, const float* v_pool,
                                                const int64_t* page_table, const uint8_t* page_mask,
                                                const int64_t* page_index, const int64_t* seq_len,
                                                const int64_t* past, float* out, float* lse, float* page_probs,
                                                int64_t B, int64_t H, int64_t T, int64_t D, int64_t C, int64_t KVH,
                                                int64_t P, int64_t M, float scale, const uint8_t* warm_pool,
                                                const int64_t* warm_row, int64_t W, const tkv_codec_desc_t& desc,
                                                cudaStream_t stream) {
    if (!codec::codec_desc_valid(&desc) || desc.kvh != KVH || desc.p != P || desc.d != D || W < 0 ||
        (B * M > 0 && warm_row == nullptr) || (W > 0 && warm_pool == nullptr)) {
        return cudaErrorInvalidValue;
    }
    const WarmPages warm{warm_pool, warm_row, W, desc};
    return launch_attention(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, lse,
                            page_probs, B, H, T, D, C, KVH, P, M, scale, warm, stream);
}

}  // namespace kernels
}  // namespace tieredkv
