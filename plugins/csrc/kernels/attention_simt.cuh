// TieredAttention's CUDA-core split kernel: float32 pools, and 16-bit pools whose head dim or
// alignment the tensor-core kernel (attention_mma.cuh) does not take. Overview: tiered_attention.cuh.
//
// Inside a warp, `row_lanes` lanes hold one key row (a lane: up to 8 elements in chunks of one
// 16-byte vector, or single elements where D or the pointers do not allow vectors) and 32 /
// row_lanes keys are processed at once, one per row group. Per key: the logits of every query of
// the block (butterfly sum over the row's lanes), an online softmax (running max m, sum l, output
// accumulator) and the page's own softmax sum; at the end of each page the page's log-sum-exp per
// query goes into page_probs. At the end the row groups, then the warps (shared memory) combine.
#pragma once

#include "attention_common.cuh"

namespace tieredkv {
namespace kernels {
namespace attention {

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

//! kVec elements of a pool row at `src` (16-byte aligned when kVec > 1) as floats into dst[at..].
template <typename Elem, int kVec>
__device__ __forceinline__ void load_chunk(const Elem* __restrict__ src, float (&dst)[kPerLane], int at) {
    if constexpr (kVec == 1) {
        dst[at] = to_float(src[0]);
    } else {
        static_assert(kVec == 4 && sizeof(Elem) == 4, "vectors: float32, 4 per 16 bytes");
        const float4 v = __ldg(reinterpret_cast<const float4*>(src));
        dst[at] = v.x;
        dst[at + 1] = v.y;
        dst[at + 2] = v.z;
        dst[at + 3] = v.w;
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

//! Occupancy asked of ptxas: 3 blocks per SM (<= 168 registers) for the plain kQ = 4 kernels,
//! which load the next key while computing the current one; the others up to 255 registers.
template <int kQ, bool kWarm>
constexpr int kSimtMinBlocks = (kQ <= 4 && !kWarm) ? 3 : 1;

//! The CUDA-core split kernel. `Warm` is NoWarmPages or WarmPages; kQ (4 or 8) the queries a block
//! holds at most (plan.queries_per_block <= kQ).
template <typename Elem, int kVec, int kQ, typename Warm>
__global__ void __launch_bounds__(kThreads, (kSimtMinBlocks<kQ, Warm::kEnabled>))
simt_split_kernel(const Problem p, const SplitPlan plan, const LaneLayout L, float* __restrict__ workspace,
                  const Warm warm) {
    __shared__ float s_acc[kWarps * kMaxQueries * kMaxHeadDim];
    __shared__ float s_m[kWarps * kMaxQueries];
    __shared__ float s_l[kWarps * kMaxQueries];
    __shared__ float s_lse2[kMaxQueries];
    __shared__ PageList list;
    __shared__ int32_t warp_sums[kWarps];

    wait_prior_grid();
    allow_dependent_grid();
    const BlockCoords at = block_coords(blockIdx.x, plan, p.KVH);
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int rg = lane >> L.row_shift;        // row group: the key this lane works on
    const int r = lane & (L.row_lanes - 1);    // lane within the row
    const int32_t G = plan.group;
    const int32_t P = static_cast<int32_t>(p.P);
    const int32_t D = static_cast<int32_t>(p.D);
    const int32_t j0 = at.qg * plan.queries_per_block;
    const int32_t nq = min(plan.queries_per_block, G * static_cast<int32_t>(p.T) - j0);

    // the block's queries in the lane's elements, scaled into the log2 domain
    float qr[kQ][kPerLane];
    const float qscale = p.scale * kLog2e;
#pragma unroll
    for (int i = 0; i < kQ; ++i) {
        const float* q_row = p.q + (i < nq ? query_row(at.b, at.kvh, G, j0 + i, p.H, p.T) : 0) * D;
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

    const int64_t len = p.seq_len[at.b];
    const int64_t past = p.past[at.b];
    const Elem* k_pool = static_cast<const Elem*>(p.k_pool);
    const Elem* v_pool = static_cast<const Elem*>(p.v_pool);
    const int kpw = L.keys_per_warp;
    const int32_t kvh32 = static_cast<int32_t>(at.kvh);

    ScanChunk chunk;
    const int64_t kept = count_kept(p.page_mask + at.b * p.M, p.M, warp_sums, chunk);
    const RankRange ranks = split_ranks(kept, plan.splits, at.split);
    for (int64_t round_lo = ranks.lo; round_lo < ranks.hi; round_lo += kListCap) {
        const int64_t round_hi = min(ranks.hi, round_lo + kListCap);
        fill_round(list, chunk, p, warm, at.b, at.kvh, round_lo, round_hi, warp_sums);
        const int n_entries = static_cast<int>(round_hi - round_lo);
        for (int e = warp; e < n_entries; e += kWarps) {
            const int64_t code = list.src[e];
            const int64_t first = list.first[e];
            int32_t cnt[kQ];
            int32_t n_any = 0;
#pragma unroll
            for (int i = 0; i < kQ; ++i) {
                cnt[i] = (code != kNoSource && i < nq) ? visible_keys(first, len, past, (j0 + i) / G, P) : 0;
                n_any = max(n_any, cnt[i]);
                pm[i] = 0.f;
            }
            const Elem* k_page = nullptr;
            const Elem* v_page = nullptr;
            const uint8_t* enc = nullptr;
            if (code >= 0) {
                k_page = k_pool + code;
                v_page = v_pool + code;
            } else if constexpr (Warm::kEnabled) {
                if (code <= -2) enc = warm.pool + (-2 - code) * warm.page_bytes;
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
                    for (int e2 = 0; e2 < kPerLane; ++e2) sc[i] = fmaf(qr[i][e2], kf[e2], sc[i]);
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
                            for (int e2 = 0; e2 < kPerLane; ++e2) acc[i][e2] *= w.rescale;
                        }
#pragma unroll
                        for (int e2 = 0; e2 < kPerLane; ++e2) acc[i][e2] = fmaf(w.prob, vf[e2], acc[i][e2]);
                    }
                }
                if constexpr (kPrefetch) {
#pragma unroll
                    for (int e2 = 0; e2 < kPerLane; ++e2) {
                        kf[e2] = kn[e2];
                        vf[e2] = vn[e2];
                    }
                }
            }
            // the page's log-sum-exp per query: combine the row groups' (m, pm)
            const int32_t col = list.col[e];
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
                    p.page_probs[query_row(at.b, at.kvh, G, j0 + i, p.H, p.T) * p.M + col] = lse2_of(pmax, psum);
                }
            }
        }
        __syncthreads();  // the list is refilled by the next round
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
                const int chunk_i = r + L.row_lanes * c;
#pragma unroll
                for (int v = 0; v < kVec; ++v) {
                    const int d = chunk_i * kVec + v;
                    if (c < L.per_lane && chunk_i < L.chunks && d < D) {
                        s_acc[(warp * kMaxQueries + i) * D + d] = acc[i][c * kVec + v];
                    }
                }
            }
            if (lane == 0) {
                s_m[warp * kMaxQueries + i] = m[i];
                s_l[warp * kMaxQueries + i] = l[i];
            }
        }
    }
    __syncthreads();
    finish_block(p, plan, at, j0, nq, s_m, s_l, s_acc, s_lse2, workspace);
}

}  // namespace attention
}  // namespace kernels
}  // namespace tieredkv
