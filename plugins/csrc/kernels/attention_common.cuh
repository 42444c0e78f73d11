// TieredAttention, the parts both split kernels share (kernels/tiered_attention.cuh has the overview):
// the float math of the online softmax (host + device), the split plan, the call's tensors, page
// resolution and visibility, and each block's list of the kept pages it reads (a scan of the page
// mask that balances the splits by kept pages, never by listed columns).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "codec.cuh"
#include "common.cuh"
#include "tieredkv_kernels.h"

namespace tieredkv {
namespace kernels {
namespace attention {

constexpr int kWarps = 4;                   //!< warps per split block
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kMaxQueries = 8;              //!< queries per block (of one kv head's G x T)
constexpr int kPerLane = kMaxPerLane;       //!< elements of a key row one lane holds, at most (CUDA-core kernel)
constexpr int kMaxSplits = 128;
constexpr int kMinPagesPerSplit = 4;
constexpr int kMaxSplitBlocks = 4096;       //!< split blocks of a launch with more than one split
constexpr int kBlockCostPages = 4;          //!< the plan's cost of a block's fixed work, in pages
constexpr int kMergeCostPages = 8;          //!< the plan's cost of the merge kernel, in pages
constexpr int kListCap = 256;               //!< kept pages a block resolves at once (one round)
constexpr int kScanPerThread = 16;          //!< mask columns a thread scans per pass
constexpr int kScanColumns = kThreads * kScanPerThread;
constexpr int kMergeThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;
static_assert(kListCap % kWarps == 0, "a round's entries go round-robin to the warps in rank order");
static_assert(kScanPerThread <= 32, "a thread's scanned columns are bits of one word");

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
    int32_t pages_per_split;    //!< ceil(M / splits): the most kept pages a split reads
    int64_t row_blocks;         //!< B * KVH * qgroups: blocks per split
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

//! Rows (queries) of partial results a plan may keep: 0 when M cannot be split, else
//! min(min(ceil(M / kMinPagesPerSplit), kMaxSplits) * B*H*T, kMaxSplitBlocks * kMaxQueries).
//! Non-decreasing in every size; every chosen plan fits (splits * B*H*T <= it).
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

//! The chooser's cost of `s` splits, in pages: whole waves of R * s blocks over `slots` resident
//! blocks, each wave as long as a block (ceil(M / s) pages and its fixed work), plus the merge.
inline int64_t plan_cost(int64_t R, int64_t slots, int64_t M, int64_t s) {
    return ceil_div(R * s, slots) * (ceil_div(M, s) + kBlockCostPages) + (s > 1 ? kMergeCostPages : 0);
}

//! The split count of least plan_cost among 1 .. min(kMaxSplits, ceil(M / kMinPagesPerSplit),
//! kMaxSplitBlocks / R) (ties: fewer splits).
inline int64_t choose_splits(int64_t R, int64_t slots, int64_t M) {
    const int64_t most = std::min<int64_t>({kMaxSplits, ceil_div(M, kMinPagesPerSplit), kMaxSplitBlocks / R});
    int64_t best = 1;
    int64_t cost = plan_cost(R, slots, M, 1);
    for (int64_t s = 2; s <= most; ++s) {
        const int64_t c = plan_cost(R, slots, M, s);
        if (c < cost) {
            best = s;
            cost = c;
        }
    }
    return best;
}

//! The split plan (tkv_tiered_attention_plan). Sizes must be valid (sizes_valid). blocks_per_sm:
//! the split kernel's occupancy (resident blocks per SM, cudaOccupancyMaxActiveBlocksPerMultiprocessor).
inline SplitPlan make_split_plan(int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t M, int32_t sm_count,
                                 int32_t blocks_per_sm, int32_t num_splits, int64_t ws_bytes) {
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
        const int64_t slots = int64_t{std::max(sm_count, 1)} * std::max(blocks_per_sm, 1);
        splits = choose_splits(plan.row_blocks, slots, M);
    }
    const int64_t queries = B * H * T;
    if (splits > 1 && queries > 0) {
        splits = std::min<int64_t>(splits, std::max<int64_t>(ws_bytes, 0) / split_bytes(1, queries, D));
    }
    plan.splits = static_cast<int32_t>(std::max<int64_t>(splits, 1));
    plan.pages_per_split = static_cast<int32_t>(ceil_div(M, plan.splits));
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

//! Kept ranks [lo, hi) of split s of S over K kept pages: floor(s K / S) .. floor((s + 1) K / S)
//! (sizes differ by at most one; a split is empty only when K < S).
struct RankRange {
    int64_t lo;
    int64_t hi;
};
TKV_HD RankRange split_ranks(int64_t kept, int32_t splits, int32_t s) {
    return {static_cast<int64_t>(s) * kept / splits, (static_cast<int64_t>(s) + 1) * kept / splits};
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

//! A page source in one int64 of a block's page list: >= 0 the element offset of the page's
//! (pool page, kv head) block in the pools; kNoSource nothing to read; <= -2 warm row -(code + 2).
constexpr int64_t kNoSource = -1;
TKV_HD int64_t source_code(const PageSource& src, int64_t kvh, int64_t KVH, int64_t P, int64_t D) {
    if (!src.kept) return kNoSource;
    if (src.warm >= 0) return -2 - src.warm;
    return (src.pool_page * KVH + kvh) * P * D;
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

//! Which split kernel runs a call: the tensor-core kernel (16-bit pools, D a multiple of 16,
//! 16-byte aligned pools; instantiated for D <= mma_dim = 64, 128 or 256) or the CUDA-core one
//! (float32 pools and the other shapes; `vec` elements per lane load, `queries` 4 or 8).
struct KernelChoice {
    bool mma;
    int32_t mma_dim;
    int32_t vec;
    int32_t queries;
};

inline int32_t kv_elem_bytes(int32_t kv_dtype) {
    switch (kv_dtype) {
        case TKV_DTYPE_F32: return 4;
        case TKV_DTYPE_F16:
        case TKV_DTYPE_BF16: return 2;
        default: return 0;
    }
}

inline KernelChoice choose_kernel(int32_t elem_bytes, int64_t D, bool aligned, int32_t queries_per_block) {
    KernelChoice c{false, 0, 1, queries_per_block <= 4 ? 4 : kMaxQueries};
    if (elem_bytes == 2 && D % 16 == 0 && aligned) {
        c.mma = true;
        c.mma_dim = D <= 64 ? 64 : (D <= 128 ? 128 : 256);
    } else if (elem_bytes == 4 && aligned && D % 4 == 0) {
        c.vec = 4;  // one float4 per lane load
    }
    return c;
}

// ------------------------------------------------------------------------------ a block's page list
//! The kept pages one round of a split block reads, in rank order: column, source_code, first
//! position (page_index * P). Warp w takes entries w, w + kWarps, ...
struct PageList {
    int32_t col[kListCap];
    int64_t src[kListCap];
    int64_t first[kListCap];
};

//! The columns [begin + kScanPerThread * tid, + kScanPerThread) of a mask row as bits (1 = kept;
//! columns >= M are 0).
__device__ __forceinline__ uint32_t scan_bits(const int32_t* __restrict__ mask_row, int64_t M, int64_t begin,
                                              int tid) {
    const int64_t c0 = begin + static_cast<int64_t>(kScanPerThread) * tid;
    uint32_t bits = 0;
#pragma unroll
    for (int j = 0; j < kScanPerThread; ++j) {
        if (c0 + j < M && mask_row[c0 + j] != 0) bits |= 1u << j;
    }
    return bits;
}

//! Exclusive prefix sum of `count` over the block's threads (in thread order) and the total;
//! every thread of the block must call it (two barriers).
__device__ __forceinline__ void block_scan(int32_t count, int32_t& prefix, int32_t& total, int32_t* warp_sums) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    int32_t x = count;
#pragma unroll
    for (int d = 1; d < kWarpSize; d <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == kWarpSize - 1) warp_sums[warp] = x;
    __syncthreads();
    int32_t before = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        if (w < warp) before += warp_sums[w];
        total += warp_sums[w];
    }
    prefix = before + x - count;
    __syncthreads();  // warp_sums is free again
}

//! One super-chunk of kScanColumns mask columns under scan, as one thread holds it: its first
//! column, the kept ranks before it, the thread's bits (its kScanPerThread columns), the kept
//! columns of the threads before it, and the chunk's kept total.
struct ScanChunk {
    int64_t begin;
    int64_t rank;
    uint32_t bits;
    int32_t prefix;
    int32_t total;
};

TKV_HD int lowest_bit(uint32_t bits) {
#ifdef __CUDA_ARCH__
    return __ffs(bits) - 1;
#else
    return __builtin_ctz(bits);
#endif
}

//! Calls emit(entry, column) for the kept columns thread `tid` holds in chunk c whose rank lies in
//! [round_lo, round_hi) (entry = rank - round_lo).
#pragma nv_exec_check_disable
template <typename Emit>
TKV_HD void chunk_entries(const ScanChunk& c, int tid, int64_t round_lo, int64_t round_hi, Emit&& emit) {
    int64_t r = c.rank + c.prefix;
    uint32_t bits = c.bits;
    while (bits != 0 && r < round_hi) {
        const int j = lowest_bit(bits);
        bits &= bits - 1;
        if (r >= round_lo) emit(r - round_lo, c.begin + static_cast<int64_t>(kScanPerThread) * tid + j);
        ++r;
    }
}

//! The walk of one round over the scanned chunks (the device's and the host emulation's): skip the
//! chunks before round_lo, then emit(chunk) for each chunk holding ranks of [round_lo, round_hi),
//! stopping on the chunk that holds round_hi - 1 (the next round may continue in it). scan(chunk)
//! scans the chunk at chunk.begin.
#pragma nv_exec_check_disable
template <typename Chunk, typename Scan, typename Emit>
TKV_HD void walk_round(Chunk& chunk, int64_t round_lo, int64_t round_hi, Scan&& scan, Emit&& emit) {
    while (chunk.rank + chunk.total <= round_lo) {
        chunk.rank += chunk.total;
        chunk.begin += kScanColumns;
        scan(chunk);
    }
    while (true) {
        emit(chunk);
        if (chunk.rank + chunk.total >= round_hi) return;
        chunk.rank += chunk.total;
        chunk.begin += kScanColumns;
        scan(chunk);
    }
}

__device__ __forceinline__ void scan_chunk(ScanChunk& c, const int32_t* __restrict__ mask_row, int64_t M,
                                           int32_t* warp_sums) {
    c.bits = scan_bits(mask_row, M, c.begin, threadIdx.x);
    block_scan(__popc(c.bits), c.prefix, c.total, warp_sums);
}

//! Kept pages of a mask row, and the first chunk scanned (all threads call it; the result in every
//! thread).
__device__ __forceinline__ int64_t count_kept(const int32_t* __restrict__ mask_row, int64_t M, int32_t* warp_sums,
                                             ScanChunk& first) {
    int32_t mine = 0;
    for (int64_t begin = kScanColumns; begin < M; begin += kScanColumns) {
        mine += __popc(scan_bits(mask_row, M, begin, threadIdx.x));
    }
    first.begin = 0;
    first.rank = 0;
    scan_chunk(first, mask_row, M, warp_sums);
    int32_t before, rest;
    block_scan(mine, before, rest, warp_sums);
    return static_cast<int64_t>(first.total) + rest;
}

//! Fills `list` with the entries of kept ranks [round_lo, round_hi) of sequence b (all threads call
//! it; `chunk` is the scan position, left where the next round continues). Ends with a barrier.
template <typename Warm>
__device__ __forceinline__ void fill_round(PageList& list, ScanChunk& chunk, const Problem& p, const Warm& warm,
                                           int64_t b, int64_t kvh, int64_t round_lo, int64_t round_hi,
                                           int32_t* warp_sums) {
    const int32_t* mask_row = p.page_mask + b * p.M;
    walk_round(
        chunk, round_lo, round_hi, [&](ScanChunk& c) { scan_chunk(c, mask_row, p.M, warp_sums); },
        [&](const ScanChunk& c) {
            chunk_entries(c, threadIdx.x, round_lo, round_hi, [&](int64_t e, int64_t m) {
                const int64_t column = b * p.M + m;
                const PageSource src = resolve_page(1, p.page_table[column], p.C, warm.row_of(column), warm.rows());
                list.col[e] = static_cast<int32_t>(m);
                list.src[e] = source_code(src, kvh, p.KVH, p.P, p.D);
                list.first[e] = p.page_index[column] * p.P;
            });
        });
    __syncthreads();
}

//! Block index -> (sequence b, kv head, split, query group): block = (bk * splits + split) * qgroups
//! + qg, so the query groups of one (b, kv head, split), which read the same pages, are neighbours.
struct BlockCoords {
    int64_t b;
    int64_t kvh;
    int32_t split;
    int32_t qg;
};
TKV_HD BlockCoords block_coords(int64_t block, const SplitPlan& plan, int64_t KVH) {
    BlockCoords c;
    c.qg = static_cast<int32_t>(block % plan.qgroups);
    const int64_t bks = block / plan.qgroups;
    c.split = static_cast<int32_t>(bks % plan.splits);
    const int64_t bk = bks / plan.splits;
    c.kvh = bk % KVH;
    c.b = bk / KVH;
    return c;
}

// ------------------------------------------------------------------------------ the block's end
//! Combines the warps' states (s_m, s_l [kWarps][kMaxQueries], s_acc [kWarps][kMaxQueries][D]) of the
//! block's nq queries j0.. of (b, kv head): one split writes out and lse and turns page_probs of
//! its rows into masses (0 for masked columns); more splits write this split's partials. Every
//! thread calls it after a barrier that published the states.
__device__ __forceinline__ void finish_block(const Problem& p, const SplitPlan& plan, const BlockCoords& at,
                                             int32_t j0, int32_t nq, const float* s_m, const float* s_l,
                                             const float* s_acc, float* s_lse2, float* __restrict__ workspace) {
    const int32_t D = static_cast<int32_t>(p.D);
    const int32_t G = plan.group;
    const int64_t queries = p.B * p.H * p.T;
    float* ws_m = workspace;
    float* ws_l = workspace + static_cast<int64_t>(plan.splits) * queries;
    float* ws_acc = workspace + 2 * static_cast<int64_t>(plan.splits) * queries;
    for (int idx = threadIdx.x; idx < nq * D; idx += kThreads) {
        const int i = idx / D;
        const int d = idx - i * D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_m[w * kMaxQueries + i]);
        float sum = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float wt = rescale(s_m[w * kMaxQueries + i], M);
            sum += s_l[w * kMaxQueries + i] * wt;
            a += s_acc[(w * kMaxQueries + i) * D + d] * wt;
        }
        const int64_t row = query_row(at.b, at.kvh, G, j0 + i, p.H, p.T);
        if (plan.splits == 1) {
            p.out[row * D + d] = out_of(a, sum);
            if (d == 0) {
                const float lse2 = lse2_of(M, sum);
                p.lse[row] = lse2 * kLn2;
                s_lse2[i] = lse2;
            }
        } else {
            const int64_t at_row = static_cast<int64_t>(at.split) * queries + row;
            ws_acc[at_row * D + d] = a;
            if (d == 0) {
                ws_m[at_row] = M;
                ws_l[at_row] = sum;
            }
        }
    }
    if (plan.splits != 1) return;
    __syncthreads();  // s_lse2, and the page log-sum-exps every warp wrote
    const int32_t* mask_row = p.page_mask + at.b * p.M;
    for (int64_t idx = threadIdx.x; idx < static_cast<int64_t>(nq) * p.M; idx += kThreads) {
        const int32_t i = static_cast<int32_t>(idx / p.M);
        const int64_t m = idx - static_cast<int64_t>(i) * p.M;
        float* pp = p.page_probs + query_row(at.b, at.kvh, G, j0 + i, p.H, p.T) * p.M + m;
        *pp = mask_row[m] != 0 ? page_mass(*pp, s_lse2[i]) : 0.f;
    }
}

}  // namespace attention
}  // namespace kernels
}  // namespace tieredkv
