// TieredAttention: split-K flash-decoding over a masked selection of pages of a paged K/V pool.
// Spec: docs/plugins.md "TieredAttention"; reference: tieredkv.plugins.tiered_attention.tiered_attention.
//
// Launch geometry (docs/plugins.md, "CUDA kernels"):
//   * split kernel: one block of 4 warps per (sequence b, kv head, query group, split). A query
//     group is up to 8 of the kv head's G x T queries (query j = t * G + g, head kvh * G + g), so
//     a block loads each K / V element of its pages once for all of them. The listed pages are
//     cut into `splits` runs of `pages_per_split`; the warps of a block take the run's pages
//     round-robin. Inside a warp, `row_lanes` lanes hold one key row (a lane: up to 8 elements
//     in chunks of one 16-byte vector, or single elements where D or the pointers do not allow
//     vectors) and 32 / row_lanes keys are processed at once, one per row group. One pass: per
//     key the logits of every query (butterfly sum over the row's lanes), an online softmax
//     (running max m, sum l, output accumulator) and the page's own softmax sum; at the end of
//     each page the page's log-sum-exp per query is written into page_probs. At the end the row
//     groups, then the warps (shared memory) are combined.
//   * one split: the block writes out and lse and turns its pages' log-sum-exps into masses.
//     More splits: the block writes its unnormalized output, max and sum to the workspace and
//     the merge kernel (one block per query) combines the splits by log-sum-exp and turns every
//     page's log-sum-exp into its mass exp(page_lse - lse).
// Arithmetic is float32 in the log2 domain (q is scaled by scale * log2(e); exp2 / log2), the
// pools are float32, float16 or bfloat16.
//
// Everything but the loads and the warp / block reductions is a __host__ __device__ function of
// this file (the split plan, the lane layout, page resolution, visibility, the softmax updates,
// the combines, the merge); attention_host runs the kernels' algorithm on the CPU with them
// (tkv_tiered_attention_host), which is how it is tested without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "codec.cuh"
#include "common.cuh"
#include "tieredkv_kernels.h"

namespace tieredkv {
namespace kernels {
namespace attention {

constexpr int kWarps = 4;                   //!< warps per split block
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kMaxQueries = 8;              //!< queries per block (of one kv head's G x T)
constexpr int kPerLane = kMaxPerLane;       //!< elements of a key row one lane holds, at most
constexpr int kMaxSplits = 128;
constexpr int kMinPagesPerSplit = 4;
constexpr int kMaxSplitBlocks = 1024;       //!< split blocks of a launch with more than one split
constexpr int kTargetWaves = 2;             //!< blocks per SM the chooser aims for
constexpr int kMergeThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// ------------------------------------------------------------------------------ math (host + device)
TKV_HD float exp2_(float x) {
#ifdef __CUDA_ARCH__
    return exp2f(x);
#else
    return std::exp2(x);
#endif
}
TKV_HD float log2_(float x) {
#ifdef __CUDA_ARCH__
    return log2f(x);
#else
    return std::log2(x);
#endif
}

//! Raises the running max m to x when x is larger; returns the factor the sums kept relative to
//! m must be multiplied by (1 when m stays, 0 when m was -inf).
TKV_HD float raise_max(float& m, float x) {
    if (x > m) {
        const float a = exp2_(m - x);
        m = x;
        return a;
    }
    return 1.f;
}

//! One visible key with logit x (log2 domain) added to a query's running state: max m, softmax
//! sum l and the current page's sum pm, all relative to m. Returns {rescale, prob}: the output
//! accumulator becomes acc * rescale + prob * v (the caller skips the product when rescale is 1).
struct KeyWeights {
    float rescale;
    float prob;
};
TKV_HD KeyWeights add_key(float& m, float& l, float& pm, float x) {
    const float a = raise_max(m, x);
    const float p = exp2_(x - m);
    l = l * a + p;
    pm = pm * a + p;
    return {a, p};
}

//! exp2(m - M): the weight of a partial state of max m in a combination of max M >= m; 0 for an
//! empty state (m = -inf, whatever M).
TKV_HD float rescale(float m, float M) { return m == -INFINITY ? 0.f : exp2_(m - M); }

//! Merges the partial sum (m2, s2) into (m, s) (both relative to their max; -inf = empty).
TKV_HD void merge_sum(float& m, float& s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    s = s * rescale(m, M) + s2 * rescale(m2, M);
    m = M;
}

//! log2-domain log-sum-exp of a (max, sum) pair; -inf when the sum is 0 (nothing seen).
TKV_HD float lse2_of(float m, float s) { return s > 0.f ? m + log2_(s) : -INFINITY; }

//! Output element from the unnormalized accumulator and the sum (0 when nothing is seen).
TKV_HD float out_of(float acc, float l) { return l > 0.f ? acc / l : 0.f; }

//! Softmax mass of a page from its log2 log-sum-exp and the query's (0 when either is -inf).
TKV_HD float page_mass(float page_lse2, float lse2) {
    return (page_lse2 == -INFINITY || lse2 == -INFINITY) ? 0.f : exp2_(page_lse2 - lse2);
}

//! Element conversions of the pools.
TKV_HD float to_float(float x) { return x; }
TKV_HD float to_float(__half x) { return __half2float(x); }
TKV_HD float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

//! x rounded to the pools' element type (round to nearest even), as a float: a decoded warm
//! value takes the pools' precision, as the reference puts decoded pages into the pools' dtype.
template <typename Elem>
TKV_HD float round_to(float x) {
    if constexpr (std::is_same<Elem, __half>::value) {
        return __half2float(__float2half_rn(x));
    } else if constexpr (std::is_same<Elem, __nv_bfloat16>::value) {
        return __bfloat162float(__float2bfloat16_rn(x));
    } else {
        return x;
    }
}

// ------------------------------------------------------------------------------ layout and plan
//! How the lanes of a warp hold key rows of D elements: chunks of `vec` elements (vec = one
//! 16-byte vector, or 1), `row_lanes` lanes per row (a power of two), lane r of a row holding
//! chunks r + row_lanes * c for c < per_lane (those below `chunks`), and keys_per_warp = 32 /
//! row_lanes rows (keys) at once, one per row group. per_lane * vec <= kPerLane for D <= 256.
struct LaneLayout {
    int32_t dim;
    int32_t vec;
    int32_t chunks;
    int32_t row_lanes;
    int32_t row_shift;  //!< log2(row_lanes)
    int32_t per_lane;
    int32_t keys_per_warp;
};

TKV_HD LaneLayout lane_layout(int32_t D, int32_t vec) {
    LaneLayout l;
    l.dim = D;
    l.vec = vec;
    l.chunks = (D + vec - 1) / vec;
    l.row_lanes = 1;
    l.row_shift = 0;
    while (l.row_lanes < l.chunks && l.row_lanes < kWarpSize) {
        l.row_lanes *= 2;
        ++l.row_shift;
    }
    l.per_lane = (l.chunks + l.row_lanes - 1) / l.row_lanes;
    l.keys_per_warp = kWarpSize / l.row_lanes;
    return l;
}

//! Elements per 16-byte vector of a pool element of `elem_bytes`, when rows of D elements and
//! both pools allow 16-byte loads (`aligned`); else 1.
TKV_HD int32_t vector_width(int32_t D, int32_t elem_bytes, bool aligned) {
    const int32_t vec = 16 / elem_bytes;
    return (aligned && D % vec == 0) ? vec : 1;
}

//! Query j of a block's kv head: j = t * G + g, head kvh * G + g. Its row in q / out / lse.
TKV_HD int64_t query_row(int64_t b, int64_t kvh, int32_t G, int32_t j, int64_t H, int64_t T) {
    const int32_t t = j / G;
    const int32_t g = j - t * G;
    return (b * H + kvh * G + g) * T + t;
}

struct SplitPlan {
    int32_t group;              //!< G = H / KVH
    int32_t queries_per_block;  //!< min(G * T, kMaxQueries)
    int32_t qgroups;            //!< ceil(G * T / queries_per_block)
    int32_t splits;
    int32_t pages_per_split;
    int64_t row_blocks;         //!< B * KVH * qgroups: blocks per split
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

//! Rows (queries) of partial results a plan may keep: 0 when M cannot be split, else
//! min(min(ceil(M / kMinPagesPerSplit), kMaxSplits) * B*H*T, kMaxSplitBlocks * kMaxQueries).
//! Non-decreasing in every size; every plan of make_split_plan fits (splits * B*H*T <= it).
inline int64_t partial_rows_bound(int64_t B, int64_t H, int64_t T, int64_t M) {
    const int64_t by_pages = std::min<int64_t>(ceil_div(M, kMinPagesPerSplit), kMaxSplits);
    if (by_pages <= 1) return 0;
    constexpr int64_t kCap = int64_t{kMaxSplitBlocks} * kMaxQueries;
    const double rows = static_cast<double>(by_pages) * static_cast<double>(B) * static_cast<double>(H) *
                        static_cast<double>(T);  // exact below the cap; no int64 overflow above it
    return rows >= static_cast<double>(kCap) ? kCap : static_cast<int64_t>(rows);
}

//! Workspace bytes of `splits` splits: max and sum per query and split, then the accumulators.
inline int64_t split_bytes(int64_t splits, int64_t queries, int64_t D) { return splits * queries * (D + 2) * 4; }

//! tkv_tiered_attention_workspace.
inline int64_t workspace_bytes(int64_t B, int64_t H, int64_t T, int64_t D, int64_t M) {
    return partial_rows_bound(B, H, T, M) * (D + 2) * 4;
}

//! The split plan (tkv_tiered_attention_plan). Sizes must be valid (sizes_valid).
inline SplitPlan make_split_plan(int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t M, int32_t sm_count,
                                 int32_t num_splits, int64_t ws_bytes) {
    SplitPlan plan;
    plan.group = static_cast<int32_t>(H / KVH);
    const int64_t per_kv = static_cast<int64_t>(plan.group) * T;
    plan.queries_per_block = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(per_kv, kMaxQueries)));
    plan.qgroups = static_cast<int32_t>(ceil_div(per_kv, plan.queries_per_block));
    plan.row_blocks = B * KVH * plan.qgroups;
    int64_t splits = 1;
    if (num_splits > 0) {
        splits = std::min<int64_t>({num_splits, std::max<int64_t>(M, 1), kMaxSplits});
    } else if (plan.row_blocks > 0) {
        const int64_t target = int64_t{kTargetWaves} * std::max(sm_count, 1);
        splits = std::min<int64_t>({ceil_div(target, plan.row_blocks), ceil_div(M, kMinPagesPerSplit), kMaxSplits,
                                    kMaxSplitBlocks / plan.row_blocks});
    }
    const int64_t queries = B * H * T;
    if (splits > 1 && queries > 0) {
        splits = std::min<int64_t>(splits, std::max<int64_t>(ws_bytes, 0) / split_bytes(1, queries, D));
    }
    splits = std::max<int64_t>(splits, 1);
    plan.pages_per_split = static_cast<int32_t>(ceil_div(M, splits));
    plan.splits = plan.pages_per_split > 0 ? static_cast<int32_t>(ceil_div(M, plan.pages_per_split)) : 1;
    return plan;
}

//! The sizes the kernels take: H a multiple of KVH, 0 < D <= 256, P > 0, every size below 2^31,
//! B*H*T*M and C*KVH*P*D below 2^62.
inline bool sizes_valid(int64_t B, int64_t H, int64_t T, int64_t D, int64_t C, int64_t KVH, int64_t P, int64_t M) {
    constexpr int64_t kMax = 0x7fffffffLL;
    if (B < 0 || H < 0 || T < 0 || C < 0 || M < 0 || KVH <= 0 || P <= 0 || D <= 0 || D > kMaxHeadDim ||
        H % KVH != 0) {
        return false;
    }
    if (B > kMax || H > kMax || T > kMax || C > kMax || M > kMax || KVH > kMax || P > kMax) return false;
    const double rows = static_cast<double>(B) * H * T;
    return rows * (M + 1) < 4e18 && static_cast<double>(C) * KVH * P * D < 4e18 && static_cast<double>(H) * T < kMax;
}

// ------------------------------------------------------------------------------ pages and keys
//! What listed page m reads. kept: the page is masked in (mask != 0) and its source is in range:
//! a warm row in [0, W) (warm_row >= 0; then `warm`), else a pool page in [0, C) (`pool_page`).
struct PageSource {
    bool kept;
    int64_t pool_page;
    int64_t warm;  //!< warm-pool row, or -1
};

TKV_HD PageSource resolve_page(int32_t mask, int64_t table, int64_t C, int64_t warm_row, int64_t W) {
    PageSource src{false, -1, -1};
    if (mask == 0) return src;
    if (warm_row >= 0) {
        if (warm_row >= W) return src;
        src.warm = warm_row;
    } else {
        if (table < 0 || table >= C) return src;
        src.pool_page = table;
    }
    src.kept = true;
    return src;
}

//! Keys of a page visible to the query at step t: the slots [0, n) of the page (first position
//! `first` = page_index * P), n = clamp(min(seq_len, past + t + 1) - first, 0, P).
TKV_HD int32_t visible_keys(int64_t first, int64_t seq_len, int64_t past, int32_t t, int32_t P) {
    const int64_t end = (seq_len < past + t + 1 ? seq_len : past + t + 1) - first;
    return static_cast<int32_t>(end <= 0 ? 0 : (end >= P ? P : end));
}

//! The tensors and sizes of one call.
struct Problem {
    const float* q;
    const void* k_pool;
    const void* v_pool;
    const int64_t* page_table;
    const int32_t* page_mask;
    const int64_t* page_index;
    const int64_t* seq_len;
    const int64_t* past;
    float* out;
    float* lse;
    float* page_probs;
    int64_t B, H, T, D, C, KVH, P, M;
    float scale;
};

//! The plain op: every listed page is read from the pools.
struct NoWarmPages {
    static constexpr bool kEnabled = false;
    TKV_HD int64_t row_of(int64_t /* column */) const { return -1; }
    TKV_HD int64_t rows() const { return 0; }
};

//! Warm (encoded) pages: listed page (b, m) with row[b * M + m] in [0, W) is decoded from
//! pool + row * page_bytes (codec::decode_value32).
struct WarmPages {
    static constexpr bool kEnabled = true;
    const uint8_t* pool;  //!< [W, page_bytes]
    const int64_t* row;   //!< [B, M]
    int64_t W;
    int64_t page_bytes;
    codec::PageReader reader;
    TKV_HD int64_t row_of(int64_t column) const { return row[column]; }
    TKV_HD int64_t rows() const { return W; }
};

// ------------------------------------------------------------------------------ device code
//! kVec elements of a pool row at `src` (16-byte aligned when kVec > 1) as floats into dst[at..].
template <typename Elem, int kVec>
__device__ __forceinline__ void load_chunk(const Elem* __restrict__ src, float (&dst)[kPerLane], int at) {
    if constexpr (kVec == 1) {
        dst[at] = to_float(src[0]);
    } else if constexpr (sizeof(Elem) == 4) {
        static_assert(kVec == 4, "float32: 4 per 16-byte vector");
        const float4 v = __ldg(reinterpret_cast<const float4*>(src));
        dst[at] = v.x;
        dst[at + 1] = v.y;
        dst[at + 2] = v.z;
        dst[at + 3] = v.w;
    } else {
        static_assert(kVec == 8 && sizeof(Elem) == 2, "16-bit types: 8 per 16-byte vector");
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float2 f;
            if constexpr (std::is_same<Elem, __half>::value) {
                __half2 h;
                memcpy(&h, &words[k], sizeof(h));
                f = __half22float2(h);
            } else {
                __nv_bfloat162 h;
                memcpy(&h, &words[k], sizeof(h));
                f = __bfloat1622float2(h);
            }
            dst[at + 2 * k] = f.x;
            dst[at + 2 * k + 1] = f.y;
        }
    }
}

//! The lane's elements of key row `row` of a pool page (zeros where the lane holds none, or all
//! zeros when !valid).
template <typename Elem, int kVec>
__device__ __forceinline__ void load_row(const Elem* __restrict__ row, const LaneLayout& L, int r, bool valid,
                                         float (&dst)[kPerLane]) {
#pragma unroll
    for (int c = 0; c < kPerLane / kVec; ++c) {
        const int chunk = r + L.row_lanes * c;
        if (valid && c < L.per_lane && chunk < L.chunks) {
            load_chunk<Elem, kVec>(row + chunk * kVec, dst, c * kVec);
        } else {
#pragma unroll
            for (int v = 0; v < kVec; ++v) dst[c * kVec + v] = 0.f;
        }
    }
}

//! load_row of token o of kv head h of an encoded page (role K or V), decoded per element (and
//! rounded to the pools' element type).
template <typename Elem, int kVec>
__device__ __forceinline__ void decode_row(const WarmPages& warm, const uint8_t* page, int role, int32_t h,
                                           int32_t o, const LaneLayout& L, int r, bool valid,
                                           float (&dst)[kPerLane]) {
#pragma unroll
    for (int c = 0; c < kPerLane / kVec; ++c) {
        const int chunk = r + L.row_lanes * c;
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
            const int d = chunk * kVec + v;
            dst[c * kVec + v] = (valid && c < L.per_lane && chunk < L.chunks && d < L.dim)
                                    ? round_to<Elem>(codec::decode_value32(warm.reader, page, role, h, o, d))
                                    : 0.f;
        }
    }
}

//! K and V rows of key o of a page (pool page k_page / v_page, or encoded page enc) in the
//! lane's elements.
template <typename Elem, int kVec, typename Warm>
__device__ __forceinline__ void load_key(const Warm& warm, const Elem* k_page, const Elem* v_page,
                                         const uint8_t* enc, int32_t kvh, int o, bool valid, const LaneLayout& L,
                                         int r, float (&kf)[kPerLane], float (&vf)[kPerLane]) {
    if constexpr (Warm::kEnabled) {
        if (enc != nullptr) {
            decode_row<Elem, kVec>(warm, enc, codec::kRoleK, kvh, o, L, r, valid, kf);
            decode_row<Elem, kVec>(warm, enc, codec::kRoleV, kvh, o, L, r, valid, vf);
            return;
        }
    }
    load_row<Elem, kVec>(k_page + static_cast<int64_t>(o) * L.dim, L, r, valid, kf);
    load_row<Elem, kVec>(v_page + static_cast<int64_t>(o) * L.dim, L, r, valid, vf);
}

//! Split kernel: see the top of the file. `Warm` is NoWarmPages or WarmPages; kQ (4 or 8) the
//! queries a block holds at most (plan.queries_per_block <= kQ). With kQ = 4 and no warm pages
//! the lanes load the next key while computing the current one (registers allow it).
//! Occupancy asked of ptxas: 3 blocks per SM (<= 168 registers, no spills) for the plain kQ = 4
//! kernels; the others need up to 255 registers (2 blocks per SM).
template <int kQ, bool kWarm>
constexpr int kMinBlocks = (kQ <= 4 && !kWarm) ? 3 : 1;

template <typename Elem, int kVec, int kQ, typename Warm>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<kQ, Warm::kEnabled>))
split_kernel(const Problem p, const SplitPlan plan, const LaneLayout L, float* __restrict__ workspace,
             const Warm warm) {
    __shared__ float s_acc[kWarps][kMaxQueries][kMaxHeadDim];
    __shared__ float s_m[kWarps][kMaxQueries];
    __shared__ float s_l[kWarps][kMaxQueries];
    __shared__ float s_lse2[kMaxQueries];

    // block = (bk * splits + split) * qgroups + qg: the query groups of one (b, kv head, split),
    // which read the same pages, are neighbours (run together: the second read hits L2)
    const int32_t qg = static_cast<int32_t>(blockIdx.x % static_cast<uint32_t>(plan.qgroups));
    const int64_t bks = blockIdx.x / static_cast<uint32_t>(plan.qgroups);
    const int32_t split = static_cast<int32_t>(bks % plan.splits);
    const int64_t bk = bks / plan.splits;
    const int64_t kvh = bk % p.KVH;
    const int64_t b = bk / p.KVH;
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int rg = lane >> L.row_shift;        // row group: the key this lane works on
    const int r = lane & (L.row_lanes - 1);    // lane within the row
    const int32_t G = plan.group;
    const int32_t T = static_cast<int32_t>(p.T);
    const int32_t P = static_cast<int32_t>(p.P);
    const int32_t D = static_cast<int32_t>(p.D);
    const int32_t j0 = qg * plan.queries_per_block;
    const int32_t nq = min(plan.queries_per_block, G * T - j0);

    // the block's queries in the lane's elements, scaled into the log2 domain
    float qr[kQ][kPerLane];
    const float qscale = p.scale * kLog2e;
#pragma unroll
    for (int i = 0; i < kQ; ++i) {
        const float* q_row = p.q + (i < nq ? query_row(b, kvh, G, j0 + i, p.H, p.T) : 0) * D;
#pragma unroll
        for (int c = 0; c < kPerLane / kVec; ++c) {
            const int chunk = r + L.row_lanes * c;
#pragma unroll
            for (int v = 0; v < kVec; ++v) {
                const int d = chunk * kVec + v;
                qr[i][c * kVec + v] = (i < nq && c < L.per_lane && chunk < L.chunks && d < D) ? q_row[d] * qscale : 0.f;
            }
        }
    }

    float m[kQ], l[kQ], pm[kQ], acc[kQ][kPerLane];
#pragma unroll
    for (int i = 0; i < kQ; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.f;
        pm[i] = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[i][e] = 0.f;
    }

    const int64_t len = p.seq_len[b];
    const int64_t past = p.past[b];
    const int64_t m_begin = static_cast<int64_t>(split) * plan.pages_per_split;
    const int64_t m_end = min(p.M, m_begin + plan.pages_per_split);
    const int64_t head_stride = static_cast<int64_t>(P) * D;  // elements of one (page, kv head)
    const Elem* k_pool = static_cast<const Elem*>(p.k_pool);
    const Elem* v_pool = static_cast<const Elem*>(p.v_pool);
    const int kpw = L.keys_per_warp;
    const int32_t kvh32 = static_cast<int32_t>(kvh);

    for (int64_t mi = m_begin + warp; mi < m_end; mi += kWarps) {
        const int64_t column = b * p.M + mi;
        const PageSource src = resolve_page(p.page_mask[column], p.page_table[column], p.C, warm.row_of(column),
                                            warm.rows());
        const int64_t first = p.page_index[column] * p.P;
        int32_t cnt[kQ];
        int32_t n_any = 0;
#pragma unroll
        for (int i = 0; i < kQ; ++i) {
            cnt[i] = (src.kept && i < nq) ? visible_keys(first, len, past, (j0 + i) / G, P) : 0;
            n_any = max(n_any, cnt[i]);
            pm[i] = 0.f;
        }
        const Elem* k_page = nullptr;
        const Elem* v_page = nullptr;
        const uint8_t* enc = nullptr;
        if (src.kept) {
            if constexpr (Warm::kEnabled) {
                if (src.warm >= 0) enc = warm.pool + src.warm * warm.page_bytes;
            }
            if (enc == nullptr) {
                const int64_t base = (src.pool_page * p.KVH + kvh) * head_stride;
                k_page = k_pool + base;
                v_page = v_pool + base;
            }
        }
        const int iters = (n_any + kpw - 1) / kpw;
        constexpr bool kPrefetch = kQ <= 4 && !Warm::kEnabled;  // warm pages: decode-bound, no registers to spare
        float kf[kPerLane], vf[kPerLane];
        if constexpr (kPrefetch) {
            if (iters > 0) load_key<Elem, kVec>(warm, k_page, v_page, enc, kvh32, rg, rg < n_any, L, r, kf, vf);
        }
        for (int it = 0; it < iters; ++it) {
            const int o = it * kpw + rg;
            float kn[kPerLane], vn[kPerLane];
            if constexpr (kPrefetch) {  // the next key (zeros past the page's last)
                load_key<Elem, kVec>(warm, k_page, v_page, enc, kvh32, o + kpw, o + kpw < n_any, L, r, kn, vn);
            } else {
                load_key<Elem, kVec>(warm, k_page, v_page, enc, kvh32, o, o < n_any, L, r, kf, vf);
            }
            float sc[kQ];
#pragma unroll
            for (int i = 0; i < kQ; ++i) {
                sc[i] = 0.f;
#pragma unroll
                for (int e = 0; e < kPerLane; ++e) sc[i] = fmaf(qr[i][e], kf[e], sc[i]);
            }
            for (int off = 1; off < L.row_lanes; off <<= 1) {
#pragma unroll
                for (int i = 0; i < kQ; ++i) {
                    if (i < nq) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], off);
                }
            }
#pragma unroll
            for (int i = 0; i < kQ; ++i) {
                if (o < cnt[i]) {
                    const KeyWeights w = add_key(m[i], l[i], pm[i], sc[i]);
                    if (w.rescale != 1.f) {
#pragma unroll
                        for (int e = 0; e < kPerLane; ++e) acc[i][e] *= w.rescale;
                    }
#pragma unroll
                    for (int e = 0; e < kPerLane; ++e) acc[i][e] = fmaf(w.prob, vf[e], acc[i][e]);
                }
            }
            if constexpr (kPrefetch) {
#pragma unroll
                for (int e = 0; e < kPerLane; ++e) {
                    kf[e] = kn[e];
                    vf[e] = vn[e];
                }
            }
        }
        // the page's log-sum-exp per query: combine the row groups' (m, pm)
#pragma unroll
        for (int i = 0; i < kQ; ++i) {
            if (i >= nq) continue;
            float pmax = m[i], psum = pm[i];
            for (int off = L.row_lanes; off < kWarpSize; off <<= 1) {
                const float om = __shfl_xor_sync(0xffffffffu, pmax, off);
                const float os = __shfl_xor_sync(0xffffffffu, psum, off);
                merge_sum(pmax, psum, om, os);
            }
            if (lane == i) {
                p.page_probs[query_row(b, kvh, G, j0 + i, p.H, p.T) * p.M + mi] = lse2_of(pmax, psum);
            }
        }
    }

    // combine the row groups of the warp (butterfly over the row-group bits of the lane)
#pragma unroll
    for (int i = 0; i < kQ; ++i) {
        if (i >= nq) continue;
        for (int off = L.row_lanes; off < kWarpSize; off <<= 1) {
            const float om = __shfl_xor_sync(0xffffffffu, m[i], off);
            const float ol = __shfl_xor_sync(0xffffffffu, l[i], off);
            const float M = fmaxf(m[i], om);
            const float wa = rescale(m[i], M), wb = rescale(om, M);
            l[i] = l[i] * wa + ol * wb;
#pragma unroll
            for (int e = 0; e < kPerLane; ++e) {
                const float oa = __shfl_xor_sync(0xffffffffu, acc[i][e], off);
                acc[i][e] = acc[i][e] * wa + oa * wb;
            }
            m[i] = M;
        }
    }
    if (rg == 0) {
#pragma unroll
        for (int i = 0; i < kQ; ++i) {
            if (i >= nq) continue;
#pragma unroll
            for (int c = 0; c < kPerLane / kVec; ++c) {
                const int chunk = r + L.row_lanes * c;
#pragma unroll
                for (int v = 0; v < kVec; ++v) {
                    const int d = chunk * kVec + v;
                    if (c < L.per_lane && chunk < L.chunks && d < D) s_acc[warp][i][d] = acc[i][c * kVec + v];
                }
            }
            if (lane == 0) {
                s_m[warp][i] = m[i];
                s_l[warp][i] = l[i];
            }
        }
    }
    __syncthreads();

    // combine the warps; one split: the results, else this split's partials
    const int64_t queries = p.B * p.H * p.T;
    float* ws_m = workspace;
    float* ws_l = workspace + static_cast<int64_t>(plan.splits) * queries;
    float* ws_acc = workspace + 2 * static_cast<int64_t>(plan.splits) * queries;
    for (int idx = threadIdx.x; idx < nq * D; idx += kThreads) {
        const int i = idx / D;
        const int d = idx - i * D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_m[w][i]);
        float sum = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float wt = rescale(s_m[w][i], M);
            sum += s_l[w][i] * wt;
            a += s_acc[w][i][d] * wt;
        }
        const int64_t row = query_row(b, kvh, G, j0 + i, p.H, p.T);
        if (plan.splits == 1) {
            p.out[row * D + d] = out_of(a, sum);
            if (d == 0) {
                const float lse2 = lse2_of(M, sum);
                p.lse[row] = lse2 * kLn2;
                s_lse2[i] = lse2;
            }
        } else {
            const int64_t at = static_cast<int64_t>(split) * queries + row;
            ws_acc[at * D + d] = a;
            if (d == 0) {
                ws_m[at] = M;
                ws_l[at] = sum;
            }
        }
    }
    if (plan.splits != 1) return;
    __syncthreads();  // s_lse2, and the page log-sum-exps every warp wrote
    const int32_t count = static_cast<int32_t>(m_end - m_begin);
    for (int32_t idx = threadIdx.x; idx < nq * count; idx += kThreads) {
        const int32_t i = idx / count;
        float* pp = p.page_probs + query_row(b, kvh, G, j0 + i, p.H, p.T) * p.M + m_begin + (idx - i * count);
        *pp = page_mass(*pp, s_lse2[i]);
    }
}

template <typename Elem, int kVec, int kQ, typename Warm>
inline void launch_split(const Problem& p, const SplitPlan& plan, const LaneLayout& L, float* ws, const Warm& warm,
                         cudaStream_t stream) {
    const unsigned int grid = static_cast<unsigned int>(plan.row_blocks * plan.splits);
    split_kernel<Elem, kVec, kQ, Warm><<<grid, kThreads, 0, stream>>>(p, plan, L, ws, warm);
}

//! Launches the split kernel of the pools' element type for the vector width and query count
//! (not inline: instantiated once per element type in attention_<type>.cu, extern elsewhere).
template <typename Elem, typename Warm>
void launch_split_typed(const Problem& p, const SplitPlan& plan, const LaneLayout& L, float* ws, const Warm& warm,
                        cudaStream_t stream) {
    constexpr int kVector = static_cast<int>(16 / sizeof(Elem));
    if (plan.queries_per_block <= 4) {
        if (L.vec == 1) {
            launch_split<Elem, 1, 4, Warm>(p, plan, L, ws, warm, stream);
        } else {
            launch_split<Elem, kVector, 4, Warm>(p, plan, L, ws, warm, stream);
        }
    } else if (L.vec == 1) {
        launch_split<Elem, 1, kMaxQueries, Warm>(p, plan, L, ws, warm, stream);
    } else {
        launch_split<Elem, kVector, kMaxQueries, Warm>(p, plan, L, ws, warm, stream);
    }
}

#define TKV_ATTENTION_INSTANCES(PREFIX, ELEM)                                                                       \
    PREFIX template void launch_split_typed<ELEM, NoWarmPages>(const Problem&, const SplitPlan&, const LaneLayout&, \
                                                               float*, const NoWarmPages&, cudaStream_t);            \
    PREFIX template void launch_split_typed<ELEM, WarmPages>(const Problem&, const SplitPlan&, const LaneLayout&,   \
                                                             float*, const WarmPages&, cudaStream_t);

#ifndef TKV_ATTENTION_INSTANTIATE
// compiled in attention_f32.cu, attention_f16.cu, attention_bf16.cu (in parallel)
TKV_ATTENTION_INSTANCES(extern, float)
TKV_ATTENTION_INSTANCES(extern, __half)
TKV_ATTENTION_INSTANCES(extern, __nv_bfloat16)
#endif

#ifndef TKV_ATTENTION_INSTANTIATE  // the rest: in capi.cu only

//! Merge kernel (more than one split): one block per query row; the splits' (max, sum, acc) of
//! the workspace combined by log-sum-exp, then page_probs turned from page log-sum-exps into masses.
__global__ void __launch_bounds__(kMergeThreads)
merge_kernel(const Problem p, const SplitPlan plan, const float* __restrict__ workspace) {
    __shared__ float s_w[kMaxSplits];
    __shared__ float s_stats[2];
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
    float* probs = p.page_probs + row * p.M;
    for (int64_t mi = threadIdx.x; mi < p.M; mi += kMergeThreads) probs[mi] = page_mass(probs[mi], lse2);
}

// ------------------------------------------------------------------------------ launchers
constexpr int kMaxDevices = 64;

//! SMs of the current device (cached per device); 0 when the runtime cannot say.
inline int current_sm_count() {
    static std::atomic<int> cache[kMaxDevices];
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return 0;
    if (device >= 0 && device < kMaxDevices) {
        const int known = cache[device].load(std::memory_order_relaxed);
        if (known > 0) return known;
    }
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
    if (device >= 0 && device < kMaxDevices) cache[device].store(sms, std::memory_order_relaxed);
    return sms;
}

inline int32_t kv_elem_bytes(int32_t kv_dtype) {
    switch (kv_dtype) {
        case TKV_DTYPE_F32: return 4;
        case TKV_DTYPE_F16:
        case TKV_DTYPE_BF16: return 2;
        default: return 0;
    }
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
    const SplitPlan plan = make_split_plan(p.B, p.H, p.T, p.D, p.KVH, p.M, sms, num_splits,
                                           workspace == nullptr ? 0 : ws_bytes);
    if (plan.row_blocks * plan.splits > 0x7fffffffLL || (plan.splits > 1 && queries > 0x7fffffffLL)) {
        return cudaErrorInvalidValue;
    }
    const int32_t elem = kv_elem_bytes(kv_dtype);
    const bool aligned =
        reinterpret_cast<uintptr_t>(p.k_pool) % 16 == 0 && reinterpret_cast<uintptr_t>(p.v_pool) % 16 == 0;
    const LaneLayout L = lane_layout(static_cast<int32_t>(p.D), vector_width(static_cast<int32_t>(p.D), elem, aligned));
    float* ws = static_cast<float*>(workspace);
    switch (kv_dtype) {
        case TKV_DTYPE_F32: launch_split_typed<float>(p, plan, L, ws, warm, stream); break;
        case TKV_DTYPE_F16: launch_split_typed<__half>(p, plan, L, ws, warm, stream); break;
        default: launch_split_typed<__nv_bfloat16>(p, plan, L, ws, warm, stream); break;
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || plan.splits == 1) return err;
    merge_kernel<<<static_cast<unsigned int>(queries), kMergeThreads, 0, stream>>>(p, plan, ws);
    return cudaGetLastError();
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

// ------------------------------------------------------------------------------ host emulation
//! One split block of split_kernel on the CPU, structure for structure: warps over pages
//! round-robin, row groups over keys, the lanes' elements (the same chunk layout), the
//! butterfly sums in their order, the same state updates; then the warp combine and the outputs
//! (one split) or the partials (workspace).
template <typename Elem, typename Warm>
inline void emulate_block(const Problem& p, const SplitPlan& plan, const LaneLayout& L, const Warm& warm,
                          int64_t row_block, int32_t split, float* ws) {
    const int32_t qg = static_cast<int32_t>(row_block % plan.qgroups);  // row block = bk * qgroups + qg
    const int64_t bk = row_block / plan.qgroups;
    const int64_t kvh = bk % p.KVH;
    const int64_t b = bk / p.KVH;
    const int32_t G = plan.group;
    const int32_t T = static_cast<int32_t>(p.T);
    const int32_t P = static_cast<int32_t>(p.P);
    const int32_t D = static_cast<int32_t>(p.D);
    const int32_t j0 = qg * plan.queries_per_block;
    const int32_t nq = std::min(plan.queries_per_block, G * T - j0);
    const int kpw = L.keys_per_warp;
    const float qscale = p.scale * kLog2e;
    // the lanes' dims: dims[r] = the dims lane r of a row holds
    std::vector<std::vector<int32_t>> dims(L.row_lanes);
    for (int r = 0; r < L.row_lanes; ++r) {
        for (int c = 0; c < L.per_lane; ++c) {
            const int chunk = r + L.row_lanes * c;
            for (int v = 0; v < L.vec; ++v) {
                const int d = chunk * L.vec + v;
                if (chunk < L.chunks && d < D) dims[r].push_back(d);
            }
        }
    }
    std::vector<float> qs(static_cast<size_t>(nq) * D);
    for (int i = 0; i < nq; ++i) {
        const float* q_row = p.q + query_row(b, kvh, G, j0 + i, p.H, p.T) * D;
        for (int d = 0; d < D; ++d) qs[static_cast<size_t>(i) * D + d] = q_row[d] * qscale;
    }
    const int64_t len = p.seq_len[b];
    const int64_t past = p.past[b];
    const int64_t m_begin = static_cast<int64_t>(split) * plan.pages_per_split;
    const int64_t m_end = std::min(p.M, m_begin + plan.pages_per_split);
    const Elem* k_pool = static_cast<const Elem*>(p.k_pool);
    const Elem* v_pool = static_cast<const Elem*>(p.v_pool);

    // per warp, per query: (m, l, acc[D]) after the row-group combine
    std::vector<float> wm(static_cast<size_t>(kWarps) * nq, -INFINITY), wl(static_cast<size_t>(kWarps) * nq, 0.f);
    std::vector<float> wacc(static_cast<size_t>(kWarps) * nq * D, 0.f);
    std::vector<float> kf(D), vf(D), partial(L.row_lanes);
    for (int warp = 0; warp < kWarps; ++warp) {
        // state per row group and query; acc over all dims (each lane of the row updates its own)
        std::vector<float> m(static_cast<size_t>(kpw) * nq, -INFINITY), l(m.size(), 0.f), pm(m.size(), 0.f);
        std::vector<float> acc(m.size() * D, 0.f);
        for (int64_t mi = m_begin + warp; mi < m_end; mi += kWarps) {
            const int64_t column = b * p.M + mi;
            const PageSource src = resolve_page(p.page_mask[column], p.page_table[column], p.C, warm.row_of(column),
                                                warm.rows());
            const int64_t first = p.page_index[column] * p.P;
            std::vector<int32_t> cnt(nq, 0);
            int32_t n_any = 0;
            for (int i = 0; i < nq; ++i) {
                cnt[i] = src.kept ? visible_keys(first, len, past, (j0 + i) / G, P) : 0;
                n_any = std::max(n_any, cnt[i]);
            }
            std::fill(pm.begin(), pm.end(), 0.f);
            const uint8_t* enc = nullptr;
            if constexpr (Warm::kEnabled) {
                if (src.kept && src.warm >= 0) enc = warm.pool + src.warm * warm.page_bytes;
            }
            const int64_t base = (src.pool_page * p.KVH + kvh) * P * D;
            const int iters = (n_any + kpw - 1) / kpw;
            for (int it = 0; it < iters; ++it) {
                for (int rg = 0; rg < kpw; ++rg) {
                    const int o = it * kpw + rg;
                    if (o >= n_any) continue;  // the device lanes of this row group compute zeros and skip
                    for (int d = 0; d < D; ++d) {
                        if constexpr (Warm::kEnabled) {
                            if (enc != nullptr) {
                                const int32_t h = static_cast<int32_t>(kvh);
                                kf[d] = round_to<Elem>(codec::decode_value32(warm.reader, enc, codec::kRoleK, h, o, d));
                                vf[d] = round_to<Elem>(codec::decode_value32(warm.reader, enc, codec::kRoleV, h, o, d));
                                continue;
                            }
                        }
                        kf[d] = to_float(k_pool[base + static_cast<int64_t>(o) * D + d]);
                        vf[d] = to_float(v_pool[base + static_cast<int64_t>(o) * D + d]);
                    }
                    for (int i = 0; i < nq; ++i) {
                        for (int r = 0; r < L.row_lanes; ++r) {
                            float s = 0.f;
                            for (int32_t d : dims[r]) s += qs[static_cast<size_t>(i) * D + d] * kf[d];
                            partial[r] = s;
                        }
                        for (int off = 1; off < L.row_lanes; off <<= 1) {  // the butterfly, level by level
                            std::vector<float> next(partial);
                            for (int r = 0; r < L.row_lanes; ++r) next[r] = partial[r] + partial[r ^ off];
                            partial.swap(next);
                        }
                        if (o >= cnt[i]) continue;
                        const size_t at = static_cast<size_t>(rg) * nq + i;
                        const KeyWeights w = add_key(m[at], l[at], pm[at], partial[0]);
                        float* a = &acc[at * D];
                        for (int r = 0; r < L.row_lanes; ++r) {
                            for (int32_t d : dims[r]) {
                                if (w.rescale != 1.f) a[d] *= w.rescale;
                                a[d] = w.prob * vf[d] + a[d];
                            }
                        }
                    }
                }
            }
            // page log-sum-exp: the butterfly over row groups; query i's value from lane i's row group
            for (int i = 0; i < nq; ++i) {
                std::vector<float> pmax(kpw), psum(kpw);
                for (int rg = 0; rg < kpw; ++rg) {
                    pmax[rg] = m[static_cast<size_t>(rg) * nq + i];
                    psum[rg] = pm[static_cast<size_t>(rg) * nq + i];
                }
                for (int off = 1; off < kpw; off <<= 1) {
                    std::vector<float> nmax(pmax), nsum(psum);
                    for (int rg = 0; rg < kpw; ++rg) merge_sum(nmax[rg], nsum[rg], pmax[rg ^ off], psum[rg ^ off]);
                    pmax.swap(nmax);
                    psum.swap(nsum);
                }
                const int owner = i >> L.row_shift;
                p.page_probs[query_row(b, kvh, G, j0 + i, p.H, p.T) * p.M + mi] = lse2_of(pmax[owner], psum[owner]);
            }
        }
        // row-group combine (butterfly); row group 0 keeps the result
        for (int i = 0; i < nq; ++i) {
            for (int off = 1; off < kpw; off <<= 1) {
                std::vector<float> nm(kpw), nl(kpw), nacc(static_cast<size_t>(kpw) * D);
                for (int rg = 0; rg < kpw; ++rg) {
                    const size_t a = static_cast<size_t>(rg) * nq + i, o = static_cast<size_t>(rg ^ off) * nq + i;
                    const float M = std::fmax(m[a], m[o]);
                    const float wa = rescale(m[a], M), wb = rescale(m[o], M);
                    nm[rg] = M;
                    nl[rg] = l[a] * wa + l[o] * wb;
                    for (int d = 0; d < D; ++d) {
                        nacc[static_cast<size_t>(rg) * D + d] = acc[a * D + d] * wa + acc[o * D + d] * wb;
                    }
                }
                for (int rg = 0; rg < kpw; ++rg) {
                    const size_t a = static_cast<size_t>(rg) * nq + i;
                    m[a] = nm[rg];
                    l[a] = nl[rg];
                    std::copy(&nacc[static_cast<size_t>(rg) * D], &nacc[static_cast<size_t>(rg) * D] + D, &acc[a * D]);
                }
            }
            wm[static_cast<size_t>(warp) * nq + i] = m[i];
            wl[static_cast<size_t>(warp) * nq + i] = l[i];
            std::copy(&acc[static_cast<size_t>(i) * D], &acc[static_cast<size_t>(i) * D] + D,
                      &wacc[(static_cast<size_t>(warp) * nq + i) * D]);
        }
    }
    // warp combine, then the outputs or the partials
    const int64_t queries = p.B * p.H * p.T;
    std::vector<float> lse2s(nq);
    for (int i = 0; i < nq; ++i) {
        float M = -INFINITY;
        for (int w = 0; w < kWarps; ++w) M = std::fmax(M, wm[static_cast<size_t>(w) * nq + i]);
        const int64_t row = query_row(b, kvh, G, j0 + i, p.H, p.T);
        for (int d = 0; d < D; ++d) {
            float sum = 0.f, a = 0.f;
            for (int w = 0; w < kWarps; ++w) {
                const float wt = rescale(wm[static_cast<size_t>(w) * nq + i], M);
                sum += wl[static_cast<size_t>(w) * nq + i] * wt;
                a += wacc[(static_cast<size_t>(w) * nq + i) * D + d] * wt;
            }
            if (plan.splits == 1) {
                p.out[row * D + d] = out_of(a, sum);
                if (d == 0) {
                    lse2s[i] = lse2_of(M, sum);
                    p.lse[row] = lse2s[i] * kLn2;
                }
            } else {
                const int64_t at = static_cast<int64_t>(split) * queries + row;
                ws[2 * plan.splits * queries + at * D + d] = a;
                if (d == 0) {
                    ws[at] = M;
                    ws[plan.splits * queries + at] = sum;
                }
            }
        }
    }
    if (plan.splits != 1) return;
    for (int i = 0; i < nq; ++i) {
        float* probs = p.page_probs + query_row(b, kvh, G, j0 + i, p.H, p.T) * p.M;
        for (int64_t mi = m_begin; mi < m_end; ++mi) probs[mi] = page_mass(probs[mi], lse2s[i]);
    }
}

//! merge_kernel of one query row on the CPU.
inline void emulate_merge(const Problem& p, const SplitPlan& plan, const float* ws, int64_t row) {
    const int64_t queries = p.B * p.H * p.T;
    const int32_t S = plan.splits;
    const int64_t D = p.D;
    float M = -INFINITY;
    for (int s = 0; s < S; ++s) M = std::fmax(M, ws[s * queries + row]);
    std::vector<float> w(S);
    float sum = 0.f;
    for (int s = 0; s < S; ++s) {
        w[s] = rescale(ws[s * queries + row], M);
        sum += ws[S * queries + s * queries + row] * w[s];
    }
    const float lse2 = lse2_of(M, sum);
    for (int64_t d = 0; d < D; ++d) {
        float a = 0.f;
        for (int s = 0; s < S; ++s) a += w[s] * ws[2 * S * queries + (s * queries + row) * D + d];
        p.out[row * D + d] = out_of(a, sum);
    }
    p.lse[row] = lse2 * kLn2;
    for (int64_t mi = 0; mi < p.M; ++mi) p.page_probs[row * p.M + mi] = page_mass(p.page_probs[row * p.M + mi], lse2);
}

template <typename Elem, typename Warm>
inline cudaError_t attention_host_typed(const Problem& p, const Warm& warm, int32_t sm_count, int32_t num_splits) {
    const int64_t queries = p.B * p.H * p.T;
    // the workspace is allocated here for the plan: a forced split count is not limited by it
    const SplitPlan plan = make_split_plan(p.B, p.H, p.T, p.D, p.KVH, p.M, sm_count, num_splits,
                                           std::numeric_limits<int64_t>::max());
    const LaneLayout L = lane_layout(static_cast<int32_t>(p.D),
                                     vector_width(static_cast<int32_t>(p.D), static_cast<int32_t>(sizeof(Elem)), true));
    std::vector<float> ws(plan.splits > 1 ? static_cast<size_t>(split_bytes(plan.splits, queries, p.D) / 4) : 0);
    for (int64_t rb = 0; rb < plan.row_blocks; ++rb) {
        for (int32_t s = 0; s < plan.splits; ++s) emulate_block<Elem, Warm>(p, plan, L, warm, rb, s, ws.data());
    }
    if (plan.splits > 1) {
        for (int64_t row = 0; row < queries; ++row) emulate_merge(p, plan, ws.data(), row);
    }
    return cudaSuccess;
}

//! tkv_tiered_attention_host (warm: null for the plain op).
inline cudaError_t attention_host(const Problem& p, int32_t kv_dtype, const WarmPages* warm, int32_t sm_count,
                                  int32_t num_splits) {
    if (!sizes_valid(p.B, p.H, p.T, p.D, p.C, p.KVH, p.P, p.M) || kv_elem_bytes(kv_dtype) == 0 || num_splits < 0 ||
        sm_count < 0) {
        return cudaErrorInvalidValue;
    }
    if (p.B * p.H * p.T == 0) return cudaSuccess;
    if (p.q == nullptr || p.out == nullptr || p.lse == nullptr || (p.B * p.M > 0 && p.page_table == nullptr) ||
        (p.M > 0 && (p.page_probs == nullptr || p.page_mask == nullptr || p.page_index == nullptr)) ||
        p.seq_len == nullptr || p.past == nullptr) {
        return cudaErrorInvalidValue;
    }
    switch (kv_dtype) {
        case TKV_DTYPE_F32:
            return warm ? attention_host_typed<float>(p, *warm, sm_count, num_splits)
                        : attention_host_typed<float>(p, NoWarmPages{}, sm_count, num_splits);
        case TKV_DTYPE_F16:
            return warm ? attention_host_typed<__half>(p, *warm, sm_count, num_splits)
                        : attention_host_typed<__half>(p, NoWarmPages{}, sm_count, num_splits);
        default:
            return warm ? attention_host_typed<__nv_bfloat16>(p, *warm, sm_count, num_splits)
                        : attention_host_typed<__nv_bfloat16>(p, NoWarmPages{}, sm_count, num_splits);
    }
}

#endif  // TKV_ATTENTION_INSTANTIATE

}  // namespace attention
}  // namespace kernels
}  // namespace tieredkv
