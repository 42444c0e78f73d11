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

/* TieredAttention: q [B,H,T,D] f32; k_pool, v_pool [C,KVH,P,D] f32; page_table [B,M] i64;
 * page_mask [B,M] bool (1 byte); page_index [B,M] i64; seq_len [B] i64; past [B] i64
 * -> out [B,H,T,D] f32, lse [B,H,T] f32, page_probs [B,H,T,M] f32. */
TKV_API int tkv_tiered_attention(const float* q, const float* k_pool, const float* v_pool, const int64_t* page_table,
                                 const uint8_t* page_mask, const int64_t* page_index, const int64_t* seq_len,
                                 const int64_t* past, float* out, float* lse, float* page_probs, int64_t B, int64_t H,
                                 int64_t T, int64_t D, int64_t C, int64_t KVH, int64_t P, int64_t M, float scale,
                                 void* stream);

/* KVAppend: k_pool, v_pool [C,KVH,P,D]; k_new, v_new [N,KVH,D]; slot, offset [N] i64
 * -> k_pool_out, v_pool_out [C,KVH,P,D] (copies of the pools unless out == in, then in place)
 * with out[slot[n], :, offset[n], :] = new[n]. Elements of elem_bytes bytes (1, 2, 4, 8). */
TKV_API int tkv_kv_append(const void* k_pool, const void* v_pool, const void* k_new, const void* v_new,
                          const int64_t* slot, const int64_t* offset, void* k_pool_out, void* v_pool_out, int64_t C,
                          int64_t KVH, int64_t P, int64_t D, int64_t N, int32_t elem_bytes, void* stream);

/* ImportanceScore: q [B,H,D] f32; kmin, kmax [B,M,KVH,D] f32; page_tokens, distance [B,M] i64;
 * saliency [B,M] f32; page_mask [B,M] bool (1 byte); position_table [NB] f32 -> score [B,M] f32.
 * weights = (w_rel, w_pos, w_sal). */
TKV_API int tkv_importance_score(const float* q, const float* kmin, const float* kmax, const int64_t* page_tokens,
                                 const int64_t* distance, const float* saliency, const uint8_t* page_mask,
                                 const float* position_table, float* score, int64_t B, int64_t H, int64_t D,
                                 int64_t M, int64_t KVH, int64_t NB, float w_rel, float w_pos, float w_sal,
                                 float scale, void* stream);

/* Name of a status code returned above (cudaGetErrorString). */
TKV_API const char* tkv_error_string(int status);

#ifdef __cplusplus
}
#endif

#endif /* TIEREDKV_KERNELS_H */
