// TieredAttention's tensor-core split kernel: float16 / bfloat16 pools, D a multiple of 16, 16-byte
// aligned pools (sm_80+ instructions; built for sm_90). Overview: tiered_attention.cuh.
//
// Work unit: a tile of 16 keys of one kept page (a page of P keys is ceil(P / 16) tiles). Warp w
// of a block takes the round's page-list entries w, w + 4, ... and streams their tiles through its
// own ring of kMmaStages shared-memory buffers: cp.async (16-byte chunks, L2 only) fills the tile
// kMmaStages - 1 ahead of the one being computed; rows past the last visible key are zero-filled,
// never read; a warm page's rows are decoded into the buffer instead (pools' element type).
//
// The block's up to 8 queries are the N = 8 columns of mma.sync m16n8k16 (fp32 accumulate):
//   S^T [16 keys x 8 queries] = K [16 x D] . Q^T        (A = K from ldmatrix, B = Q in registers)
//   O^T [D x 8 queries]     += V^T [D x 16 keys] . P^T (A = V^T from ldmatrix.trans, B = P^T from
//                                                       the S^T fragment through movmatrix.trans)
// so a GQA group of 8 query heads (70B: 64 / 8 heads) fills the tile with no padding row. Each
// (key, query) logit and probability is computed once, by the one lane holding it; a query's max
// and sums are reduced over the 8 lanes holding its column (3 shuffles). The 16-bit operands carry
// float32 precision as two terms: Q = Q_hi + Q_lo and P = P_hi + P_lo (each term rounded to the
// pools' type; K and V are exact), so every product runs twice; the tensor cores have the
// throughput to spare (decode attention is far below their ridge point). Q is scaled per row by a
// power of two 2^k (amax in [2^14, 2^15)) so that its low term stays a normal 16-bit number; the
// logits are multiplied back by 2^-k (exact).
#pragma once

#include "attention_common.cuh"

namespace tieredkv {
namespace kernels {
namespace attention {

constexpr int kTileKeys = 16;
constexpr int kMmaStages = 2;  //!< shared-memory buffers per warp (cp.async ring)

//! Elements per shared-memory row of a tile (D + 8: rows 16 bytes apart in bank terms, so the
//! ldmatrix rows of a warp hit distinct banks).
TKV_HD int32_t mma_row_stride(int32_t mma_dim) { return mma_dim + 8; }

//! Dynamic shared memory of the tensor-core kernel: per warp kMmaStages tiles of K and V.
TKV_HD int64_t mma_smem_bytes(int32_t mma_dim, int32_t elem_bytes) {
    return int64_t{kWarps} * kMmaStages * 2 * kTileKeys * mma_row_stride(mma_dim) * elem_bytes;
}

//! The exponent k of the power-of-two scale of a query row with largest magnitude amax: amax * 2^k
//! in [2^14, 2^15) (0 for a zero or non-finite amax), within [-100, 100].
TKV_HD int32_t q_shift(float amax) {
    if (!(amax > 0.f) || !(amax < INFINITY)) return 0;
    int e = 0;
#ifdef __CUDA_ARCH__
    frexpf(amax, &e);
#else
    std::frexp(amax, &e);
#endif
    const int32_t k = 15 - e;
    return k < -100 ? -100 : (k > 100 ? 100 : k);
}

TKV_HD float pow2(int32_t k) {
#ifdef __CUDA_ARCH__
    return ldexpf(1.f, k);
#else
    return std::ldexp(1.f, k);
#endif
}

//! x as the sum of two values of the pools' element type: hi = round(x), lo = round(x - hi).
struct HiLo {
    float hi;
    float lo;
};
template <typename Elem>
TKV_HD HiLo split_hi_lo(float x) {
    const float hi = round_to<Elem>(x);
    return {hi, round_to<Elem>(x - hi)};
}

// ------------------------------------------------------------------------------ PTX wrappers
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

//! 16 bytes global -> shared, bypassing L1; src_bytes 0 writes 16 zero bytes (reads nothing).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
//! The transpose of an 8x8 matrix of 16-bit values held as a fragment (lane: row lane / 4, columns
//! 2 (lane % 4), +1).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

//! d += a . b for one m16n8k16 tile (A row-major, B column-major, float32 accumulate).
template <typename Elem>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same<Elem, __half>::value) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

//! Two values of the pools' type (exactly representable) in one 32-bit register, x in the low half.
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
    uint32_t u;
    if constexpr (std::is_same<Elem, __half>::value) {
        const __half2 h = __floats2half2_rn(x, y);
        memcpy(&u, &h, sizeof(u));
    } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        memcpy(&u, &h, sizeof(u));
    }
    return u;
}

template <typename Elem>
__device__ __forceinline__ Elem from_float(float x) {
    if constexpr (std::is_same<Elem, __half>::value) {
        return __float2half_rn(x);
    } else {
        return __float2bfloat16_rn(x);
    }
}

// ------------------------------------------------------------------------------ the kernel
//! Per-call constants of a warp's tile stream.
struct TileStream {
    int64_t len, past;
    int32_t P, D, t_last;  //!< t_last: the step of the block's last query (its visible keys cover all)
    int32_t tiles_per_page;
};

//! Keys of tile `sub` of a list entry that some query of the block sees (0: nothing to load).
TKV_HD int32_t tile_rows(const TileStream& s, int64_t code, int64_t first, int32_t sub) {
    if (code == kNoSource) return 0;
    const int32_t n = visible_keys(first, s.len, s.past, s.t_last, s.P) - sub * kTileKeys;
    return n <= 0 ? 0 : (n >= kTileKeys ? kTileKeys : n);
}

//! Fills a stage (K rows at sk, V rows at sv) with tile `sub` of a list entry: cp.async from the
//! pools, or decoded from a warm page; rows >= `rows` zeroed. Every lane calls it.
template <typename Elem, int kD, typename Warm>
__device__ __forceinline__ void fill_tile(const Problem& p, const Warm& warm, const TileStream& s, int64_t code,
                                          int32_t sub, int32_t rows, int32_t kvh, Elem* sk, Elem* sv, int lane) {
    constexpr int kStride = kD + 8;
    constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks of a shared-memory row
    const int32_t D = s.D;
    if constexpr (Warm::kEnabled) {
        if (code <= -2) {
            const uint8_t* enc = warm.pool + (-2 - code) * warm.page_bytes;
            for (int row = 0; row < kTileKeys; ++row) {
                const int32_t o = sub * kTileKeys + row;
                for (int d = lane; d < D; d += kWarpSize) {
                    float kx = 0.f, vx = 0.f;
                    if (row < rows) {
                        kx = round_to<Elem>(codec::decode_value32(warm.reader, enc, codec::kRoleK, kvh, o, d));
                        vx = round_to<Elem>(codec::decode_value32(warm.reader, enc, codec::kRoleV, kvh, o, d));
                    }
                    sk[row * kStride + d] = from_float<Elem>(kx);
                    sv[row * kStride + d] = from_float<Elem>(vx);
                }
            }
            return;
        }
    }
    const Elem* k_src = static_cast<const Elem*>(p.k_pool) + code + static_cast<int64_t>(sub) * kTileKeys * D;
    const Elem* v_src = static_cast<const Elem*>(p.v_pool) + code + static_cast<int64_t>(sub) * kTileKeys * D;
    for (int c = lane; c < kTileKeys * kChunksPerRow; c += kWarpSize) {
        const int row = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * 8;
        if (col >= D) continue;
        const bool valid = row < rows;
        const int64_t at = valid ? static_cast<int64_t>(row) * D + col : 0;  // zero fill reads nothing
        cp_async16(smem_u32(sk + row * kStride + col), k_src + at, valid ? 16 : 0);
        cp_async16(smem_u32(sv + row * kStride + col), v_src + at, valid ? 16 : 0);
    }
}

//! The tensor-core split kernel (see the top of the file); kD = the instantiation's largest D.
template <typename Elem, int kD, typename Warm>
__global__ void __launch_bounds__(kThreads)
mma_split_kernel(const Problem p, const SplitPlan plan, float* __restrict__ workspace, const Warm warm) {
    constexpr int kStride = kD + 8;
    constexpr int kTileElems = kTileKeys * kStride;
    constexpr int kSteps = kD / 16;  // k-steps of QK, m-tiles of PV
    extern __shared__ __align__(16) unsigned char dyn_smem[];
    __shared__ PageList list;
    __shared__ int32_t warp_sums[kWarps];
    __shared__ float s_m[kWarps * kMaxQueries];
    __shared__ float s_l[kWarps * kMaxQueries];
    __shared__ float s_lse2[kMaxQueries];

    wait_prior_grid();
    allow_dependent_grid();
    const BlockCoords at = block_coords(blockIdx.x, plan, p.KVH);
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int g = lane >> 2;  // fragment row group: key g (and g + 8) of S^T, query g of Q^T
    const int t4 = lane & 3;  // fragment column pair: queries 2 t4, 2 t4 + 1 of S^T / O^T
    const int32_t G = plan.group;
    const int32_t D = static_cast<int32_t>(p.D);
    const int32_t steps = D / 16;
    const int32_t j0 = at.qg * plan.queries_per_block;
    const int32_t nq = min(plan.queries_per_block, G * static_cast<int32_t>(p.T) - j0);

    // query g as the B operand of S^T = K Q^T: per k-step, dims 16 ks + 2 t4 (+1) and + 8 (+9)
    uint32_t qh[kSteps][2], ql[kSteps][2];
    float inv[2];  // 2^-k of the C fragment's queries 2 t4, 2 t4 + 1
    {
        float qv[kSteps][4];
        const float qscale = p.scale * kLog2e;
        const float* q_row = p.q + (g < nq ? query_row(at.b, at.kvh, G, j0 + g, p.H, p.T) : 0) * D;
        float amax = 0.f;
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int d = 16 * ks + 2 * t4 + (e & 1) + 8 * (e >> 1);
                qv[ks][e] = (g < nq && ks < steps) ? q_row[d] * qscale : 0.f;
                amax = fmaxf(amax, fabsf(qv[ks][e]));
            }
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const int32_t k = q_shift(amax);
        const float f = pow2(k);
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
            HiLo x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = split_hi_lo<Elem>(qv[ks][e] * f);
            qh[ks][0] = pack2<Elem>(x[0].hi, x[1].hi);
            qh[ks][1] = pack2<Elem>(x[2].hi, x[3].hi);
            ql[ks][0] = pack2<Elem>(x[0].lo, x[1].lo);
            ql[ks][1] = pack2<Elem>(x[2].lo, x[3].lo);
        }
        const float my_inv = pow2(-k);  // lanes 4 q .. 4 q + 3 hold query q
        inv[0] = __shfl_sync(0xffffffffu, my_inv, 8 * t4);
        inv[1] = __shfl_sync(0xffffffffu, my_inv, 8 * t4 + 4);
    }

    // per C-fragment query c: step, running max / sum / page sum; O^T fragments
    int32_t tq[2];
    bool live[2];
    float m[2], l[2], pm[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int32_t q = 2 * t4 + c;
        live[c] = q < nq;
        tq[c] = (j0 + q) / G;
        m[c] = -INFINITY;
        l[c] = 0.f;
        pm[c] = 0.f;
    }
    float o[kSteps][4];
#pragma unroll
    for (int mt = 0; mt < kSteps; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][e] = 0.f;
    }

    TileStream s;
    s.len = p.seq_len[at.b];
    s.past = p.past[at.b];
    s.P = static_cast<int32_t>(p.P);
    s.D = D;
    s.t_last = (j0 + nq - 1) / G;
    s.tiles_per_page = (s.P + kTileKeys - 1) / kTileKeys;
    const int32_t kvh32 = static_cast<int32_t>(at.kvh);
    Elem* ring = reinterpret_cast<Elem*>(dyn_smem) + static_cast<int64_t>(warp) * kMmaStages * 2 * kTileElems;
    // ldmatrix row addresses of this lane (matrix lane / 8, row lane % 8): K as A (keys 8 (i % 2) + r,
    // dims + 8 (i / 2)); V^T as A via .trans (keys 8 (i / 2) + r, dims + 8 (i % 2))
    const int mi = lane >> 3, mr = lane & 7;
    const int k_off = (8 * (mi & 1) + mr) * kStride + 8 * (mi >> 1);
    const int v_off = (8 * (mi >> 1) + mr) * kStride + 8 * (mi & 1);

    ScanChunk chunk;
    const int64_t kept = count_kept(p.page_mask + at.b * p.M, p.M, warp_sums, chunk);
    const RankRange ranks = split_ranks(kept, plan.splits, at.split);
    for (int64_t round_lo = ranks.lo; round_lo < ranks.hi; round_lo += kListCap) {
        const int64_t round_hi = min(ranks.hi, round_lo + kListCap);
        fill_round(list, chunk, p, warm, at.b, at.kvh, round_lo, round_hi, warp_sums);
        const int n_entries = static_cast<int>(round_hi - round_lo);
        const int n_mine = warp < n_entries ? (n_entries - warp + kWarps - 1) / kWarps : 0;
        const int n_items = n_mine * s.tiles_per_page;

        auto issue = [&](int item) {
            if (item < n_items) {
                const int e = warp + kWarps * (item / s.tiles_per_page);
                const int32_t sub = item % s.tiles_per_page;
                const int64_t code = list.src[e];
                const int32_t rows = tile_rows(s, code, list.first[e], sub);
                Elem* sk = ring + (item % kMmaStages) * 2 * kTileElems;
                if (rows > 0) fill_tile<Elem, kD>(p, warm, s, code, sub, rows, kvh32, sk, sk + kTileElems, lane);
            }
            cp_async_commit();  // one group per item (empty past the end), so wait_group counts items
        };
#pragma unroll
        for (int i = 0; i < kMmaStages - 1; ++i) issue(i);
        for (int item = 0; item < n_items; ++item) {
            issue(item + kMmaStages - 1);
            cp_async_wait<kMmaStages - 1>();
            __syncwarp();
            const int e = warp + kWarps * (item / s.tiles_per_page);
            const int32_t sub = item % s.tiles_per_page;
            const int64_t first = list.first[e];
            const int32_t rows = tile_rows(s, list.src[e], first, sub);
            const Elem* sk = ring + (item % kMmaStages) * 2 * kTileElems;
            const Elem* sv = sk + kTileElems;
            if (rows > 0) {  // warp-uniform
                float acc[4] = {0.f, 0.f, 0.f, 0.f};  // S^T: (key g, q 2t4), (g, 2t4+1), (g+8, 2t4), (g+8, 2t4+1)
                const uint32_t k_base = smem_u32(sk + k_off);
#pragma unroll
                for (int ks = 0; ks < kSteps; ++ks) {
                    if (ks < steps) {
                        uint32_t a[4];
                        ldmatrix_x4(a, k_base + ks * 32);  // 16 dims = 32 bytes further
                        mma16816<Elem>(acc, a, qh[ks][0], qh[ks][1]);
                        mma16816<Elem>(acc, a, ql[ks][0], ql[ks][1]);
                    }
                }
                float x[4], pr[4];
                float mx[2];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int32_t cnt = live[c] ? visible_keys(first, s.len, s.past, tq[c], s.P) - sub * kTileKeys : 0;
                    x[c] = g < cnt ? acc[c] * inv[c] : -INFINITY;
                    x[c + 2] = g + 8 < cnt ? acc[c + 2] * inv[c] : -INFINITY;
                    mx[c] = fmaxf(x[c], x[c + 2]);
                }
#pragma unroll
                for (int off = 4; off < kWarpSize; off <<= 1) {
                    mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], off));
                    mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], off));
                }
                float alpha[2], ps[2];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float mn = fmaxf(m[c], mx[c]);
                    alpha[c] = rescale(m[c], mn);
                    pr[c] = x[c] == -INFINITY ? 0.f : exp2_(x[c] - mn);
                    pr[c + 2] = x[c + 2] == -INFINITY ? 0.f : exp2_(x[c + 2] - mn);
                    ps[c] = pr[c] + pr[c + 2];
                    m[c] = mn;
                }
#pragma unroll
                for (int off = 4; off < kWarpSize; off <<= 1) {
                    ps[0] += __shfl_xor_sync(0xffffffffu, ps[0], off);
                    ps[1] += __shfl_xor_sync(0xffffffffu, ps[1], off);
                }
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    l[c] = l[c] * alpha[c] + ps[c];
                    pm[c] = pm[c] * alpha[c] + ps[c];
                }
#pragma unroll
                for (int mt = 0; mt < kSteps; ++mt) {
                    o[mt][0] *= alpha[0];
                    o[mt][1] *= alpha[1];
                    o[mt][2] *= alpha[0];
                    o[mt][3] *= alpha[1];
                }
                // P^T as the B operand: (keys 2 t4, 2 t4 + 1; query g) from the (key g; queries 2 t4, +1) layout
                HiLo h[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) h[e] = split_hi_lo<Elem>(pr[e]);
                const uint32_t b0h = movmatrix_trans(pack2<Elem>(h[0].hi, h[1].hi));
                const uint32_t b1h = movmatrix_trans(pack2<Elem>(h[2].hi, h[3].hi));
                const uint32_t b0l = movmatrix_trans(pack2<Elem>(h[0].lo, h[1].lo));
                const uint32_t b1l = movmatrix_trans(pack2<Elem>(h[2].lo, h[3].lo));
                const uint32_t v_base = smem_u32(sv + v_off);
#pragma unroll
                for (int mt = 0; mt < kSteps; ++mt) {
                    if (mt < steps) {
                        uint32_t a[4];
                        ldmatrix_x4_trans(a, v_base + mt * 32);
                        mma16816<Elem>(o[mt], a, b0h, b1h);
                        mma16816<Elem>(o[mt], a, b0l, b1l);
                    }
                }
            }
            if (sub == s.tiles_per_page - 1) {  // the page's log-sum-exp per query
                const int32_t col = list.col[e];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    if (g == 0 && live[c]) {
                        const int64_t row = query_row(at.b, at.kvh, G, j0 + 2 * t4 + c, p.H, p.T);
                        p.page_probs[row * p.M + col] = lse2_of(m[c], pm[c]);
                    }
                    pm[c] = 0.f;
                }
            }
            __syncwarp();  // the stage is refilled by the next issue
        }
        cp_async_wait<0>();
        __syncthreads();  // the list is refilled by the next round
    }

    // the warps' states to shared memory (the stage buffers are free): O^T fragment (dim 16 mt + g
    // (+8), query 2 t4 (+1)) -> s_acc[warp][query][dim]
    float* s_acc = reinterpret_cast<float*>(dyn_smem);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int32_t q = 2 * t4 + c;
        if (!live[c]) continue;
        float* dst = s_acc + (warp * kMaxQueries + q) * D;
#pragma unroll
        for (int mt = 0; mt < kSteps; ++mt) {
            if (mt < steps) {
                dst[16 * mt + g] = o[mt][c];
                dst[16 * mt + g + 8] = o[mt][c + 2];
            }
        }
        if (g == 0) {
            s_m[warp * kMaxQueries + q] = m[c];
            s_l[warp * kMaxQueries + q] = l[c];
        }
    }
    __syncthreads();
    finish_block(p, plan, at, j0, nq, s_m, s_l, s_acc, s_lse2, workspace);
}

}  // namespace attention
}  // namespace kernels
}  // namespace tieredkv
