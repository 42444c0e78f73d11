// The host emulation of TieredAttention (tkv_tiered_attention_host): the kernels' algorithm run on
// the CPU block by block, through the same __host__ __device__ functions, so that the split plan,
// the page lists, the online softmax, the page log-sum-exps and the merges are tested without a
// GPU. It runs the split kernel the device would run for the call (choose_kernel with aligned
// pools): for the tensor-core kernel the tiles of 16 keys, the per-tile softmax and the two-term
// (hi + lo) operands with their roundings; for the CUDA-core kernel the lane layout, the row groups
// and the butterfly reductions in their order. Only the float32 summation order inside an mma and
// the device-only parts (loads, shuffles, shared memory, launches) differ.
#pragma once

#include <algorithm>
#include <bitset>
#include <limits>
#include <vector>

#include "attention_mma.cuh"
#include "attention_simt.cuh"

namespace tieredkv {
namespace kernels {
namespace attention {

//! The kept columns of split `split` of sequence b, one vector per round of at most kListCap (the
//! page lists fill_round builds), walked as the device walks them: the mask scanned in chunks of
//! kScanColumns columns, kScanPerThread bits per thread, ranks from the threads' prefix sums. Sets
//! *ok to false when the walk's lists differ from the split's kept columns in rank order (counted
//! directly).
inline std::vector<std::vector<int64_t>> split_rounds(const Problem& p, const SplitPlan& plan, int64_t b,
                                                      int32_t split, bool* ok) {
    struct HostChunk {  // the chunk as all threads hold it
        int64_t begin = 0, rank = 0;
        int32_t total = 0;
        std::vector<uint32_t> bits = std::vector<uint32_t>(kThreads);
        std::vector<int32_t> prefix = std::vector<int32_t>(kThreads);
    };
    const int32_t* mask_row = p.page_mask + b * p.M;
    const auto scan = [&](HostChunk& c) {
        c.total = 0;
        for (int tid = 0; tid < kThreads; ++tid) {
            uint32_t bits = 0;
            for (int j = 0; j < kScanPerThread; ++j) {
                const int64_t m = c.begin + static_cast<int64_t>(kScanPerThread) * tid + j;
                if (m < p.M && mask_row[m] != 0) bits |= 1u << j;
            }
            c.bits[tid] = bits;
            c.prefix[tid] = c.total;
            c.total += static_cast<int32_t>(std::bitset<32>(bits).count());
        }
    };
    std::vector<int64_t> kept_columns;
    for (int64_t m = 0; m < p.M; ++m) {
        if (mask_row[m] != 0) kept_columns.push_back(m);
    }
    const int64_t kept = static_cast<int64_t>(kept_columns.size());
    HostChunk chunk;
    scan(chunk);
    const RankRange ranks = split_ranks(kept, plan.splits, split);
    std::vector<std::vector<int64_t>> rounds;
    for (int64_t round_lo = ranks.lo; round_lo < ranks.hi; round_lo += kListCap) {
        const int64_t round_hi = std::min(ranks.hi, round_lo + kListCap);
        std::vector<int64_t> list(static_cast<size_t>(round_hi - round_lo), -1);
        walk_round(chunk, round_lo, round_hi, scan, [&](const HostChunk& c) {
            for (int tid = 0; tid < kThreads; ++tid) {
                const ScanChunk mine{c.begin, c.rank, c.bits[tid], c.prefix[tid], c.total};
                chunk_entries(mine, tid, round_lo, round_hi, [&](int64_t e, int64_t m) { list[e] = m; });
            }
        });
        if (!std::equal(list.begin(), list.end(), kept_columns.begin() + round_lo)) *ok = false;
        rounds.push_back(std::move(list));
    }
    return rounds;
}

//! The columns warp w reads, in its order: entries w, w + kWarps, ... of each round.
inline std::vector<int64_t> warp_columns(const std::vector<std::vector<int64_t>>& rounds, int w) {
    std::vector<int64_t> out;
    for (const std::vector<int64_t>& list : rounds) {
        for (size_t e = w; e < list.size(); e += kWarps) out.push_back(list[e]);
    }
    return out;
}

//! A warp's final state per query: max, sum, accumulator [D].
struct WarpState {
    std::vector<float> m, l, acc;
};

//! The block's end on the CPU (finish_block): the warps combined, then the outputs (one split) or
//! the partials (workspace).
inline void emulate_finish(const Problem& p, const SplitPlan& plan, const BlockCoords& at, int32_t j0, int32_t nq,
                           const std::vector<WarpState>& warps, float* ws) {
    const int32_t D = static_cast<int32_t>(p.D);
    const int64_t queries = p.B * p.H * p.T;
    std::vector<float> lse2s(nq);
    for (int i = 0; i < nq; ++i) {
        float M = -INFINITY;
        for (const WarpState& w : warps) M = std::fmax(M, w.m[i]);
        const int64_t row = query_row(at.b, at.kvh, plan.group, j0 + i, p.H, p.T);
        for (int d = 0; d < D; ++d) {
            float sum = 0.f, a = 0.f;
            for (const WarpState& w : warps) {
                const float wt = rescale(w.m[i], M);
                sum += w.l[i] * wt;
                a += w.acc[static_cast<size_t>(i) * D + d] * wt;
            }
            if (plan.splits == 1) {
                p.out[row * D + d] = out_of(a, sum);
                if (d == 0) {
                    lse2s[i] = lse2_of(M, sum);
                    p.lse[row] = lse2s[i] * kLn2;
                }
            } else {
                const int64_t at_row = static_cast<int64_t>(at.split) * queries + row;
                ws[2 * plan.splits * queries + at_row * D + d] = a;
                if (d == 0) {
                    ws[at_row] = M;
                    ws[plan.splits * queries + at_row] = sum;
                }
            }
        }
    }
    if (plan.splits != 1) return;
    for (int i = 0; i < nq; ++i) {
        float* probs = p.page_probs + query_row(at.b, at.kvh, plan.group, j0 + i, p.H, p.T) * p.M;
        for (int64_t m = 0; m < p.M; ++m) {
            probs[m] = p.page_mask[at.b * p.M + m] != 0 ? page_mass(probs[m], lse2s[i]) : 0.f;
        }
    }
}

//! Key o of a list entry's page (its source code), K and V as the kernels see them: pool elements,
//! or decoded warm values rounded to the pools' type.
template <typename Elem, typename Warm>
inline void host_key(const Problem& p, const Warm& warm, int64_t code, int32_t kvh, int32_t o, float* kf, float* vf) {
    const int32_t D = static_cast<int32_t>(p.D);
    if constexpr (Warm::kEnabled) {
        if (code <= -2) {
            const uint8_t* enc = warm.pool + (-2 - code) * warm.page_bytes;
            for (int d = 0; d < D; ++d) {
                kf[d] = round_to<Elem>(codec::decode_value32(warm.reader, enc, codec::kRoleK, kvh, o, d));
                vf[d] = round_to<Elem>(codec::decode_value32(warm.reader, enc, codec::kRoleV, kvh, o, d));
            }
            return;
        }
    }
    const Elem* k = static_cast<const Elem*>(p.k_pool) + code + static_cast<int64_t>(o) * D;
    const Elem* v = static_cast<const Elem*>(p.v_pool) + code + static_cast<int64_t>(o) * D;
    for (int d = 0; d < D; ++d) {
        kf[d] = to_float(k[d]);
        vf[d] = to_float(v[d]);
    }
}

//! One block of mma_split_kernel on the CPU: warps over the split's entries round-robin, tiles of
//! 16 keys, the per-tile softmax, the hi / lo operand terms; then the block's end.
template <typename Elem, typename Warm>
inline void emulate_mma_block(const Problem& p, const SplitPlan& plan, const Warm& warm, int64_t block, float* ws,
                              bool* ok) {
    const BlockCoords at = block_coords(block, plan, p.KVH);
    const int32_t G = plan.group;
    const int32_t D = static_cast<int32_t>(p.D);
    const int32_t j0 = at.qg * plan.queries_per_block;
    const int32_t nq = std::min(plan.queries_per_block, G * static_cast<int32_t>(p.T) - j0);
    const float qscale = p.scale * kLog2e;
    // each query's row: scaled, times 2^k, as hi and lo terms; 2^-k
    std::vector<float> qhi(static_cast<size_t>(nq) * D), qlo(qhi.size()), inv(nq);
    for (int i = 0; i < nq; ++i) {
        const float* q_row = p.q + query_row(at.b, at.kvh, G, j0 + i, p.H, p.T) * D;
        float amax = 0.f;
        for (int d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(q_row[d] * qscale));
        const int32_t k = q_shift(amax);
        for (int d = 0; d < D; ++d) {
            const HiLo x = split_hi_lo<Elem>(q_row[d] * qscale * pow2(k));
            qhi[static_cast<size_t>(i) * D + d] = x.hi;
            qlo[static_cast<size_t>(i) * D + d] = x.lo;
        }
        inv[i] = pow2(-k);
    }
    TileStream s;
    s.len = p.seq_len[at.b];
    s.past = p.past[at.b];
    s.P = static_cast<int32_t>(p.P);
    s.D = D;
    s.t_last = (j0 + nq - 1) / G;
    s.tiles_per_page = (s.P + kTileKeys - 1) / kTileKeys;
    const std::vector<std::vector<int64_t>> rounds = split_rounds(p, plan, at.b, at.split, ok);
    if (!*ok) return;
    std::vector<WarpState> warps(kWarps);
    std::vector<float> kf(static_cast<size_t>(kTileKeys) * D), vf(kf.size());
    for (int w = 0; w < kWarps; ++w) {
        std::vector<float> m(nq, -INFINITY), l(nq, 0.f), pm(nq, 0.f), o(static_cast<size_t>(nq) * D, 0.f);
        const std::vector<int64_t> columns = warp_columns(rounds, w);
        for (size_t e = 0; e < columns.size(); ++e) {
            const int64_t column = at.b * p.M + columns[e];
            const PageSource src = resolve_page(1, p.page_table[column], p.C, warm.row_of(column), warm.rows());
            const int64_t code = source_code(src, at.kvh, p.KVH, p.P, p.D);
            const int64_t first = p.page_index[column] * p.P;
            for (int32_t sub = 0; sub < s.tiles_per_page; ++sub) {
                const int32_t rows = tile_rows(s, code, first, sub);
                for (int r = 0; r < rows; ++r) {
                    host_key<Elem>(p, warm, code, static_cast<int32_t>(at.kvh), sub * kTileKeys + r,
                                   &kf[static_cast<size_t>(r) * D], &vf[static_cast<size_t>(r) * D]);
                }
                for (int i = 0; i < nq && rows > 0; ++i) {
                    const int32_t cnt = visible_keys(first, s.len, s.past, (j0 + i) / G, s.P) - sub * kTileKeys;
                    float x[kTileKeys], pr[kTileKeys];
                    float mx = -INFINITY;
                    for (int r = 0; r < kTileKeys; ++r) {
                        x[r] = -INFINITY;
                        if (r < cnt) {
                            float hi = 0.f, lo = 0.f;
                            for (int d = 0; d < D; ++d) {
                                hi += qhi[static_cast<size_t>(i) * D + d] * kf[static_cast<size_t>(r) * D + d];
                                lo += qlo[static_cast<size_t>(i) * D + d] * kf[static_cast<size_t>(r) * D + d];
                            }
                            x[r] = (hi + lo) * inv[i];
                        }
                        mx = std::fmax(mx, x[r]);
                    }
                    const float mn = std::fmax(m[i], mx);
                    const float alpha = rescale(m[i], mn);
                    float ps = 0.f;
                    for (int r = 0; r < kTileKeys; ++r) {
                        pr[r] = x[r] == -INFINITY ? 0.f : exp2_(x[r] - mn);
                        ps += pr[r];
                    }
                    m[i] = mn;
                    l[i] = l[i] * alpha + ps;
                    pm[i] = pm[i] * alpha + ps;
                    HiLo ph[kTileKeys];
                    for (int r = 0; r < kTileKeys; ++r) ph[r] = split_hi_lo<Elem>(pr[r]);
                    for (int d = 0; d < D; ++d) {
                        float hi = 0.f, lo = 0.f;
                        for (int r = 0; r < rows; ++r) {
                            hi += ph[r].hi * vf[static_cast<size_t>(r) * D + d];
                            lo += ph[r].lo * vf[static_cast<size_t>(r) * D + d];
                        }
                        float& a = o[static_cast<size_t>(i) * D + d];
                        a = a * alpha + hi + lo;
                    }
                }
                if (sub == s.tiles_per_page - 1) {
                    for (int i = 0; i < nq; ++i) {
                        const int64_t row = query_row(at.b, at.kvh, G, j0 + i, p.H, p.T);
                        p.page_probs[row * p.M + columns[e]] = lse2_of(m[i], pm[i]);
                        pm[i] = 0.f;
                    }
                }
            }
        }
        warps[w] = WarpState{m, l, o};
    }
    emulate_finish(p, plan, at, j0, nq, warps, ws);
}

//! One block of simt_split_kernel on the CPU, structure for structure: warps over the split's
//! entries round-robin, row groups over keys, the lanes' elements (the same chunk layout), the
//! butterfly sums in their order, the same state updates; then the block's end.
template <typename Elem, typename Warm>
inline void emulate_simt_block(const Problem& p, const SplitPlan& plan, const LaneLayout& L, const Warm& warm,
                               int64_t block, float* ws, bool* ok) {
    const BlockCoords at = block_coords(block, plan, p.KVH);
    const int32_t G = plan.group;
    const int32_t P = static_cast<int32_t>(p.P);
    const int32_t D = static_cast<int32_t>(p.D);
    const int32_t j0 = at.qg * plan.queries_per_block;
    const int32_t nq = std::min(plan.queries_per_block, G * static_cast<int32_t>(p.T) - j0);
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
        const float* q_row = p.q + query_row(at.b, at.kvh, G, j0 + i, p.H, p.T) * D;
        for (int d = 0; d < D; ++d) qs[static_cast<size_t>(i) * D + d] = q_row[d] * qscale;
    }
    const int64_t len = p.seq_len[at.b];
    const int64_t past = p.past[at.b];
    const std::vector<std::vector<int64_t>> rounds = split_rounds(p, plan, at.b, at.split, ok);
    if (!*ok) return;
    std::vector<WarpState> warps(kWarps);
    std::vector<float> kf(D), vf(D), partial(L.row_lanes);
    for (int warp = 0; warp < kWarps; ++warp) {
        // state per row group and query; acc over all dims (each lane of the row updates its own)
        std::vector<float> m(static_cast<size_t>(kpw) * nq, -INFINITY), l(m.size(), 0.f), pm(m.size(), 0.f);
        std::vector<float> acc(m.size() * D, 0.f);
        const std::vector<int64_t> columns = warp_columns(rounds, warp);
        for (size_t e = 0; e < columns.size(); ++e) {
            const int64_t column = at.b * p.M + columns[e];
            const PageSource src = resolve_page(1, p.page_table[column], p.C, warm.row_of(column), warm.rows());
            const int64_t code = source_code(src, at.kvh, p.KVH, p.P, p.D);
            const int64_t first = p.page_index[column] * p.P;
            std::vector<int32_t> cnt(nq, 0);
            int32_t n_any = 0;
            for (int i = 0; i < nq; ++i) {
                cnt[i] = code != kNoSource ? visible_keys(first, len, past, (j0 + i) / G, P) : 0;
                n_any = std::max(n_any, cnt[i]);
            }
            std::fill(pm.begin(), pm.end(), 0.f);
            const int iters = (n_any + kpw - 1) / kpw;
            for (int it = 0; it < iters; ++it) {
                for (int rg = 0; rg < kpw; ++rg) {
                    const int o = it * kpw + rg;
                    if (o >= n_any) continue;  // the device lanes of this row group compute zeros and skip
                    host_key<Elem>(p, warm, code, static_cast<int32_t>(at.kvh), o, kf.data(), vf.data());
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
                        const size_t at_i = static_cast<size_t>(rg) * nq + i;
                        const KeyWeights w = add_key(m[at_i], l[at_i], pm[at_i], partial[0]);
                        float* a = &acc[at_i * D];
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
                p.page_probs[query_row(at.b, at.kvh, G, j0 + i, p.H, p.T) * p.M + columns[e]] =
                    lse2_of(pmax[owner], psum[owner]);
            }
        }
        // row-group combine (butterfly); row group 0 keeps the result
        WarpState state{std::vector<float>(nq), std::vector<float>(nq), std::vector<float>(static_cast<size_t>(nq) * D)};
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
            state.m[i] = m[i];
            state.l[i] = l[i];
            std::copy(&acc[static_cast<size_t>(i) * D], &acc[static_cast<size_t>(i) * D] + D,
                      &state.acc[static_cast<size_t>(i) * D]);
        }
        warps[warp] = state;
    }
    emulate_finish(p, plan, at, j0, nq, warps, ws);
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
    const int64_t b = row / (p.H * p.T);
    for (int64_t mi = 0; mi < p.M; ++mi) {
        float& pp = p.page_probs[row * p.M + mi];
        pp = p.page_mask[b * p.M + mi] != 0 ? page_mass(pp, lse2) : 0.f;
    }
}

template <typename Elem, typename Warm>
inline cudaError_t attention_host_typed(const Problem& p, const Warm& warm, int32_t sm_count, int32_t blocks_per_sm,
                                        int32_t num_splits) {
    const int64_t queries = p.B * p.H * p.T;
    // the workspace is allocated here for the plan: a forced split count is not limited by it
    const SplitPlan plan = make_split_plan(p.B, p.H, p.T, p.D, p.KVH, p.M, sm_count, blocks_per_sm, num_splits,
                                           std::numeric_limits<int64_t>::max());
    const int64_t per_kv = p.H / p.KVH * p.T;
    const KernelChoice choice = choose_kernel(static_cast<int32_t>(sizeof(Elem)), p.D, true,
                                              static_cast<int32_t>(std::min<int64_t>(per_kv, kMaxQueries)));
    const LaneLayout L = lane_layout(static_cast<int32_t>(p.D), choice.vec);
    std::vector<float> ws(plan.splits > 1 ? static_cast<size_t>(split_bytes(plan.splits, queries, p.D) / 4) : 0);
    bool ok = true;  // the page lists walked as the device walks them are the kept columns
    for (int64_t block = 0; block < plan.row_blocks * plan.splits && ok; ++block) {
        if (choice.mma) {
            emulate_mma_block<Elem, Warm>(p, plan, warm, block, ws.data(), &ok);
        } else {
            emulate_simt_block<Elem, Warm>(p, plan, L, warm, block, ws.data(), &ok);
        }
    }
    if (!ok) return cudaErrorAssert;
    if (plan.splits > 1) {
        for (int64_t row = 0; row < queries; ++row) emulate_merge(p, plan, ws.data(), row);
    }
    return cudaSuccess;
}

//! tkv_tiered_attention_host (warm: null for the plain op).
inline cudaError_t attention_host(const Problem& p, int32_t kv_dtype, const WarmPages* warm, int32_t sm_count,
                                  int32_t blocks_per_sm, int32_t num_splits) {
    if (!sizes_valid(p.B, p.H, p.T, p.D, p.C, p.KVH, p.P, p.M) || kv_elem_bytes(kv_dtype) == 0 || num_splits < 0 ||
        sm_count < 0 || blocks_per_sm < 0) {
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
            return warm ? attention_host_typed<float>(p, *warm, sm_count, blocks_per_sm, num_splits)
                        : attention_host_typed<float>(p, NoWarmPages{}, sm_count, blocks_per_sm, num_splits);
        case TKV_DTYPE_F16:
            return warm ? attention_host_typed<__half>(p, *warm, sm_count, blocks_per_sm, num_splits)
                        : attention_host_typed<__half>(p, NoWarmPages{}, sm_count, blocks_per_sm, num_splits);
        default:
            return warm ? attention_host_typed<__nv_bfloat16>(p, *warm, sm_count, blocks_per_sm, num_splits)
                        : attention_host_typed<__nv_bfloat16>(p, NoWarmPages{}, sm_count, blocks_per_sm, num_splits);
    }
}

}  // namespace attention
}  // namespace kernels
}  // namespace tieredkv
