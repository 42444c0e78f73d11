/* C ABI of libtieredkv_kernels.so: the tieredkv CUDA kernels behind plain C functions
 * (raw device pointers, int64 sizes, a cudaStream_t passed as void*). Every function only
 * enqueues work on `stream` and returns a cudaError_t as int (0 = success; launch errors only:
 * synchronize the stream to see execution errors). All tensors are contiguous, row-major,
 * on the current device. Shapes and semantics: the kernels/ headers and docs/plugins.md. */
#ifndef TIEREDKV_KERNELS_H
#define TIEREDKV_KERNELS_H

#include <stdint.h>

#if defined(_WIN32)
#define TKV_API __declspec(dllexport)
#else
#define TKV_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- KV page codecs (docs/codec.md; reference tieredkv.plugins.codec) ---------------------- */

/* tkv_codec_desc_t.base */
#define TKV_CODEC_FP8 0 /* FP8 E4M3 codes */
#define TKV_CODEC_INT 1 /* n-bit integer codes */
/* tkv_codec_desc_t.axis[role] (role 0 = K, 1 = V) */
#define TKV_AXIS_TOKEN 0   /* groups of gcd(group, D) values of one token and kv head */
#define TKV_AXIS_CHANNEL 1 /* groups of the P values of one channel and kv head */
/* sections of an encoded page, in layout order (index of offset[role][.] and bytes[role][.]) */
#define TKV_SECTION_CODES 0
#define TKV_SECTION_SCALE 1
#define TKV_SECTION_ZERO 2
#define TKV_SECTION_RCODES 3
#define TKV_SECTION_RSCALE 4
#define TKV_SECTION_KEYFRAMES 5
#define TKV_CODEC_SECTIONS 6

/* A codec (an entry of codec.CODECS) for pages of one layer, K and V [KVH, P, D] each, and the
 * byte layout of such a page (codec.page_layout). Build it with tkv_codec_desc; the functions
 * taking one refuse a descriptor that differs from what that builds. Plain C, no holes: 10 int32
 * then 33 int64 (304 bytes). */
typedef struct tkv_codec_desc_t {
    int32_t codec;              /* index of the codec in codec.CODECS order: fp8, fp8-r2, int6-r2,
                                   int4, int4-g16, int2, fp8-r2-delta */
    int32_t base;               /* TKV_CODEC_FP8 or TKV_CODEC_INT */
    int32_t bits;               /* code bits: 8 (fp8), 6, 4 or 2 */
    int32_t asym;               /* 1: min/max scale + fp16 zero point (KIVI); 0: symmetric absmax */
    int32_t residual_bits;      /* 0, or 2: a 2-bit residual code per value + a bf16 scale per group */
    int32_t keyframe;           /* delta coding along tokens, fp16 keyframe every `keyframe` tokens; 0: none */
    int32_t group;              /* the codec's per-token group size (used as gcd(group, D)) */
    int32_t axis[2];            /* grouping of K ([0]) and V ([1]): TKV_AXIS_TOKEN / TKV_AXIS_CHANNEL */
    int32_t keyframes_per_page; /* ceil(P / keyframe), 0 without keyframes */
    int64_t kvh, p, d;          /* page shape [KVH, P, D] of K and of V */
    int64_t values;             /* KVH * P * D */
    int64_t group_size[2];      /* values per group, K and V */
    int64_t groups[2];          /* groups per page, K and V (values / group_size) */
    int64_t offset[2][TKV_CODEC_SECTIONS]; /* byte offset of each section of K / V in the page; -1 absent */
    int64_t bytes[2][TKV_CODEC_SECTIONS];  /* bytes of each section (before alignment); 0 absent */
    int64_t page_bytes;         /* bytes of one encoded page (K + V, alignment padding included) */
} tkv_codec_desc_t;

/* Fills *out for codec `name` (a key of codec.CODECS) and pages [kvh, p, d]. Returns 0, or
 * cudaErrorInvalidValue (1) for an unknown name, a size <= 0 (or absurdly large) or a null pointer.
 * Runs on the host only (no device, no CUDA call). */
TKV_API int tkv_codec_desc(const char* name, int64_t kvh, int64_t p, int64_t d, tkv_codec_desc_t* out);

/* sizeof(tkv_codec_desc_t), for bindings that mirror the struct. */
TKV_API int64_t tkv_codec_desc_sizeof(void);

/* KV page encode: k, v [N,KVH,P,D] f32 -> out [N, desc->page_bytes] u8 (codec.encode_pages,
 * bit-exact; alignment padding zeroed). Device pointers; one block per (page, K or V). */
TKV_API int tkv_encode_pages(const float* k, const float* v, uint8_t* out, int64_t N, const tkv_codec_desc_t* desc,
                             void* stream);

/* KV page decode: data [N, desc->page_bytes] u8 -> k, v [N,KVH,P,D] f32 (codec.decode_pages,
 * bit-exact). Device pointers. */
TKV_API int tkv_decode_pages(const uint8_t* data, float* k, float* v, int64_t N, const tkv_codec_desc_t* desc,
                             void* stream);

/* tkv_encode_pages on HOST memory: plain CPU loops over the same __host__ __device__ element
 * functions the kernels run (no device needed). Synchronous; returns 0 or cudaErrorInvalidValue. */
TKV_API int tkv_encode_pages_host(const float* k, const float* v, uint8_t* out, int64_t N,
                                  const tkv_codec_desc_t* desc);

/* tkv_decode_pages on HOST memory, likewise. */
TKV_API int tkv_decode_pages_host(const uint8_t* data, float* k, float* v, int64_t N, const tkv_codec_desc_t* desc);

/* ---- the ops -------------------------------------------------------------------------------- */

/* element types of the K / V pools of TieredAttention (kv_dtype) */
#define TKV_DTYPE_F32 0  /* float32 */
#define TKV_DTYPE_F16 1  /* float16 */
#define TKV_DTYPE_BF16 2 /* bfloat16 */

/* TieredAttention is split-K flash-decoding: one block per (sequence b, kv head, group of at most
 * 8 of the kv head's G x T queries, split) runs one pass with an online softmax over its pages; the
 * splits of a sequence share its kept pages (page_mask != 0) evenly by rank, and with more than one
 * split a second kernel merges them by log-sum-exp (docs/plugins.md, "CUDA kernels"). Float16 /
 * bfloat16 pools with D a multiple of 16 run on tensor cores, the rest on CUDA cores. The partial
 * results of the splits live in a device workspace the caller provides
 * (tkv_tiered_attention_workspace bytes); without one (workspace NULL or workspace_bytes 0) the op
 * runs as a single split, which is exact too but uses only B * KVH * ceil(G * T / 8) blocks. */

/* Workspace bytes that tkv_tiered_attention and tkv_tiered_attention_warm may use at these
 * sizes: min(min(ceil(M / 4), 128) * B*H*T, 32768) * (D + 2) * 4, an upper bound of every chosen
 * split plan, non-decreasing in every size (so the bound at the largest sizes serves any smaller
 * call, as TensorRT's getWorkspaceSize requires); 0 when M <= 4 (never split). -1 for sizes the ops
 * refuse (see tkv_tiered_attention). Host only. */
TKV_API int64_t tkv_tiered_attention_workspace(int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t M);

/* The split plan the ops use: *splits (>= 1) and *pages_per_split (ceil(M / splits): the most kept
 * pages a split reads; 0 when M = 0) for these sizes on a device with sm_count SMs on which the
 * split kernel keeps blocks_per_sm blocks resident (the device ops ask the current device and the
 * kernel: tkv_tiered_attention_occupancy), given workspace_bytes of workspace (a plan never needs
 * more). num_splits = 0 chooses the count s in 1 .. min(128, ceil(M / 4), 4096 / R) of least
 * ceil(R s / (sm_count * blocks_per_sm)) * (ceil(M / s) + 4) + (s > 1 ? 8 : 0), R = B * KVH *
 * ceil(G * T / min(G * T, 8)) blocks per split: whole waves of blocks, each wave as long as its
 * pages plus a block's fixed work, and the merge (ties: fewer splits); num_splits > 0 asks for that
 * many (clamped to [1, max(M, 1)] and 128). Then the count is lowered to what the workspace holds
 * (splits * B*H*T * (D + 2) * 4 bytes for splits > 1). Returns 0, or cudaErrorInvalidValue (1) for
 * bad sizes or null outputs. Host only. */
TKV_API int tkv_tiered_attention_plan(int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t M,
                                      int32_t sm_count, int32_t blocks_per_sm, int32_t num_splits,
                                      int64_t workspace_bytes, int32_t* splits, int32_t* pages_per_split);

/* The split kernel tkv_tiered_attention (warm = 0) or tkv_tiered_attention_warm (warm != 0) runs for
 * these sizes and pools of kv_dtype (16-byte aligned, as allocators give), on the current device:
 * *blocks_per_sm, its resident blocks per SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor), and
 * *tensor_cores, 1 for the tensor-core kernel, 0 for the CUDA-core one. Returns 0, a CUDA error
 * (no device), or cudaErrorInvalidValue for bad sizes or null outputs. */
TKV_API int tkv_tiered_attention_occupancy(int64_t H, int64_t T, int64_t D, int64_t KVH, int32_t kv_dtype,
                                           int32_t warm, int32_t* blocks_per_sm, int32_t* tensor_cores);

/* TieredAttention: q [B,H,T,D] f32; k_pool, v_pool [C,KVH,P,D] of kv_dtype (TKV_DTYPE_*, both
 * pools one type); page_table [B,M] i64; page_mask [B,M] i32 (nonzero = kept); page_index [B,M]
 * i64; seq_len [B] i64; past [B] i64 -> out [B,H,T,D] f32, lse [B,H,T] f32, page_probs
 * [B,H,T,M] f32 (every element written; accumulation in f32). Query t of sequence b sits at
 * position past[b] + t and sees slot o of listed page m (position page_index * P + o) iff the
 * page is kept, its pool page is in [0, C), the position is < seq_len[b] and <= past[b] + t.
 * Query head h reads kv head h / (H / KVH). A query that sees nothing gets out = 0, lse = -inf,
 * page_probs = 0. workspace: device memory of workspace_bytes bytes (see above; may be NULL
 * with 0); num_splits: 0 = choose (tkv_tiered_attention_plan), else the count asked for.
 * Requires H % KVH == 0, 0 < D <= 256, every size below 2^31 and B*H*T*M below 2^62. */
TKV_API int tkv_tiered_attention(const float* q, const void* k_pool, const void* v_pool, const int64_t* page_table,
                                 const int32_t* page_mask, const int64_t* page_index, const int64_t* seq_len,
                                 const int64_t* past, float* out, float* lse, float* page_probs, int64_t B, int64_t H,
                                 int64_t T, int64_t D, int64_t C, int64_t KVH, int64_t P, int64_t M, float scale,
                                 int32_t kv_dtype, void* workspace, int64_t workspace_bytes, int32_t num_splits,
                                 void* stream);

/* TieredAttention over pools and warm (encoded) pages: the arguments of tkv_tiered_attention up
 * to kv_dtype, then warm_pool [W, desc->page_bytes] bytes (pages encoded as by
 * tkv_encode_pages, page shape [KVH,P,D] = the pools'; the TensorRT plugin's int32 words
 * [W, page_bytes / 4] are the same bytes), warm_row [B,M] i64 (warm-pool row of listed page m;
 * < 0: read the pools through page_table; >= W: masked), W, desc (host pointer, from
 * tkv_codec_desc with the pools' KVH, P, D; pages of 2^28 values or more are refused), then
 * workspace, workspace_bytes, num_splits, stream as above. Warm pages are decoded per element
 * on the fly, bit-exact with codec.decode_pages. */
TKV_API int tkv_tiered_attention_warm(const float* q, const void* k_pool, const void* v_pool,
                                      const int64_t* page_table, const int32_t* page_mask, const int64_t* page_index,
                                      const int64_t* seq_len, const int64_t* past, float* out, float* lse,
                                      float* page_probs, int64_t B, int64_t H, int64_t T, int64_t D, int64_t C,
                                      int64_t KVH, int64_t P, int64_t M, float scale, int32_t kv_dtype,
                                      const void* warm_pool, const int64_t* warm_row, int64_t W,
                                      const tkv_codec_desc_t* desc, void* workspace, int64_t workspace_bytes,
                                      int32_t num_splits, void* stream);

/* The host emulation of TieredAttention (HOST pointers; synchronous; no device needed): the
 * arguments of tkv_tiered_attention_warm (warm_pool NULL, warm_row NULL, W 0 and desc NULL for
 * the plain op), then sm_count, blocks_per_sm and num_splits in place of the workspace and stream.
 * It runs the algorithm of the split kernel the device would run (16-byte aligned pools) on the
 * CPU block by block: the split plan of tkv_tiered_attention_plan (its workspace allocated here),
 * each split's kept pages by rank and the warps' share of them; for the tensor-core kernel its
 * tiles of 16 keys, per-tile softmax and two-term (hi + lo) 16-bit operands, for the CUDA-core
 * kernel its lane layout and butterfly reductions in their order; the page log-sum-exps, the block
 * combine and the merge of the splits, through the same __host__ __device__ functions the kernels
 * call. Returns 0 or cudaErrorInvalidValue. */
TKV_API int tkv_tiered_attention_host(const float* q, const void* k_pool, const void* v_pool,
                                      const int64_t* page_table, const int32_t* page_mask, const int64_t* page_index,
                                      const int64_t* seq_len, const int64_t* past, float* out, float* lse,
                                      float* page_probs, int64_t B, int64_t H, int64_t T, int64_t D, int64_t C,
                                      int64_t KVH, int64_t P, int64_t M, float scale, int32_t kv_dtype,
                                      const void* warm_pool, const int64_t* warm_row, int64_t W,
                                      const tkv_codec_desc_t* desc, int32_t sm_count, int32_t blocks_per_sm,
                                      int32_t num_splits);

/* KVAppend: k_pool, v_pool [C,KVH,P,D]; k_new, v_new [N,KVH,D]; slot, offset [N] i64
 * -> k_pool_out, v_pool_out [C,KVH,P,D] with out[slot[n], :, offset[n], :] = new[n]. In place
 * when k_pool_out == k_pool and v_pool_out == v_pool (only the N new rows are written; what the
 * TensorRT plugin does when its outputs alias its inputs), else the pools are first copied to the
 * outputs. Elements of elem_bytes bytes (1, 2, 4, 8); rows move in 16-, 8- or 4-byte words when
 * their size and the pointers allow. A token whose slot or offset is out of range is skipped. */
TKV_API int tkv_kv_append(const void* k_pool, const void* v_pool, const void* k_new, const void* v_new,
                          const int64_t* slot, const int64_t* offset, void* k_pool_out, void* v_pool_out, int64_t C,
                          int64_t KVH, int64_t P, int64_t D, int64_t N, int32_t elem_bytes, void* stream);

/* ImportanceScore: q [B,H,D] f32; kmin, kmax [B,M,KVH,D] f32; page_tokens, distance [B,M] i64;
 * saliency [B,M] f32; page_mask [B,M] i32 (nonzero = the page competes); position_table [NB] f32
 * -> score [B,M] f32. weights = (w_rel, w_pos, w_sal). No workspace: one block per (b, h) reads all
 * its pages' summaries twice; tkv_importance_score_ex is the one-pass form. */
TKV_API int tkv_importance_score(const float* q, const float* kmin, const float* kmax, const int64_t* page_tokens,
                                 const int64_t* distance, const float* saliency, const int32_t* page_mask,
                                 const float* position_table, float* score, int64_t B, int64_t H, int64_t D,
                                 int64_t M, int64_t KVH, int64_t NB, float w_rel, float w_pos, float w_sal,
                                 float scale, void* stream);

/* Workspace bytes tkv_importance_score_ex needs: 4 * B * H * (M + 2 * ceil(M / 64)) (the bounds of
 * every head and page, and each head's softmax statistics per chunk of 64 pages); non-decreasing
 * in every size. -1 for negative sizes. Host only. */
TKV_API int64_t tkv_importance_score_workspace(int64_t B, int64_t H, int64_t M);

/* ImportanceScore with one pass over the page summaries per kv head: the op of
 * tkv_importance_score, with q [B,H,D] of q_dtype and kmin, kmax [B,M,KVH,D] of summary_dtype
 * (TKV_DTYPE_F32 / _F16 / _BF16: the pools' type holds the min / max of its keys exactly), and a
 * device workspace of tkv_importance_score_workspace bytes (required when w_rel != 0; unused, may
 * be NULL, otherwise). A bound kernel per (b, kv head, 64 pages) reads each competing page's
 * summaries once for all H / KVH query heads of the kv head; a mix kernel per (b, 256 pages)
 * merges the heads' softmax statistics and mixes. Masked pages are not read. Also requires
 * H / KVH * (D + 64) * 4 <= 227 KB (the kv head's queries in shared memory). */
TKV_API int tkv_importance_score_ex(const void* q, const void* kmin, const void* kmax, const int64_t* page_tokens,
                                    const int64_t* distance, const float* saliency, const int32_t* page_mask,
                                    const float* position_table, float* score, int64_t B, int64_t H, int64_t D,
                                    int64_t M, int64_t KVH, int64_t NB, float w_rel, float w_pos, float w_sal,
                                    float scale, int32_t q_dtype, int32_t summary_dtype, void* workspace,
                                    int64_t workspace_bytes, void* stream);

/* Name of a status code returned above (cudaGetErrorString). */
TKV_API const char* tkv_error_string(int status);

#ifdef __cplusplus
}
#endif

#endif /* TIEREDKV_KERNELS_H */
