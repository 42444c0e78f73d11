// The C ABI of libtieredkv_kernels.so (declared in tieredkv_kernels.h): thin wrappers around
// the launch_* functions of kernels/*.cuh. The TensorRT plugins call these same functions.
#include "tieredkv_kernels.h"

#include "kernels/codec.cuh"
#include "kernels/attention_host.cuh"
#include "kernels/importance_score.cuh"
#include "kernels/kv_append.cuh"
#include "kernels/tiered_attention.cuh"

namespace {
cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }
int invalid() { return static_cast<int>(cudaErrorInvalidValue); }
}  // namespace

static_assert(sizeof(tkv_codec_desc_t) == 10 * 4 + 33 * 8, "tkv_codec_desc_t: 10 int32 then 33 int64, no holes");

extern "C" {

namespace attn = tieredkv::kernels::attention;

namespace {
attn::Problem problem(const float* q, const void* k_pool, const void* v_pool, const int64_t* page_table,
                      const int32_t* page_mask, const int64_t* page_index, const int64_t* seq_len, const int64_t* past,
                      float* out, float* lse, float* page_probs, int64_t B, int64_t H, int64_t T, int64_t D, int64_t C,
                      int64_t KVH, int64_t P, int64_t M, float scale) {
    return attn::Problem{q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, lse, page_probs,
                         B, H, T, D, C, KVH, P, M, scale};
}
}  // namespace

TKV_API int64_t tkv_tiered_attention_workspace(int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t M) {
    if (!attn::sizes_valid(B, H, T, D, 0, KVH, 1, M)) return -1;
    return attn::workspace_bytes(B, H, T, D, M);
}

TKV_API int tkv_tiered_attention_plan(int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t M,
                                      int32_t sm_count, int32_t blocks_per_sm, int32_t num_splits,
                                      int64_t workspace_bytes, int32_t* splits, int32_t* pages_per_split) {
    if (splits == nullptr || pages_per_split == nullptr || sm_count < 0 || blocks_per_sm < 0 || num_splits < 0 ||
        !attn::sizes_valid(B, H, T, D, 0, KVH, 1, M)) {
        return invalid();
    }
    const attn::SplitPlan plan =
        attn::make_split_plan(B, H, T, D, KVH, M, sm_count, blocks_per_sm, num_splits, workspace_bytes);
    *splits = plan.splits;
    *pages_per_split = plan.pages_per_split;
    return 0;
}

TKV_API int tkv_tiered_attention_occupancy(int64_t H, int64_t T, int64_t D, int64_t KVH, int32_t kv_dtype,
                                           int32_t warm, int32_t* blocks_per_sm, int32_t* tensor_cores) {
    if (blocks_per_sm == nullptr || tensor_cores == nullptr || attn::kv_elem_bytes(kv_dtype) == 0 ||
        !attn::sizes_valid(1, H, T, D, 0, KVH, 1, 0)) {
        return invalid();
    }
    attn::Problem p{};
    p.H = H;
    p.T = T;
    p.D = D;
    p.KVH = KVH;
    const attn::KernelChoice choice = attn::call_choice(p, kv_dtype, true);
    int n = 0;
    const cudaError_t err = warm != 0 ? attn::split_occupancy_of<attn::WarmPages>(kv_dtype, choice, &n)
                                      : attn::split_occupancy_of<attn::NoWarmPages>(kv_dtype, choice, &n);
    *blocks_per_sm = n;
    *tensor_cores = choice.mma ? 1 : 0;
    return static_cast<int>(err);
}

TKV_API int tkv_tiered_attention(const float* q, const void* k_pool, const void* v_pool, const int64_t* page_table,
                                 const int32_t* page_mask, const int64_t* page_index, const int64_t* seq_len,
                                 const int64_t* past, float* out, float* lse, float* page_probs, int64_t B, int64_t H,
                                 int64_t T, int64_t D, int64_t C, int64_t KVH, int64_t P, int64_t M, float scale,
                                 int32_t kv_dtype, void* workspace, int64_t workspace_bytes, int32_t num_splits,
                                 void* stream) {
    const attn::Problem p = problem(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, lse,
                                    page_probs, B, H, T, D, C, KVH, P, M, scale);
    return static_cast<int>(attn::launch(p, kv_dtype, workspace, workspace_bytes, num_splits,
                                         attn::NoWarmPages{}, as_stream(stream)));
}

TKV_API int tkv_tiered_attention_warm(const float* q, const void* k_pool, const void* v_pool,
                                      const int64_t* page_table, const int32_t* page_mask, const int64_t* page_index,
                                      const int64_t* seq_len, const int64_t* past, float* out, float* lse,
                                      float* page_probs, int64_t B, int64_t H, int64_t T, int64_t D, int64_t C,
                                      int64_t KVH, int64_t P, int64_t M, float scale, int32_t kv_dtype,
                                      const void* warm_pool, const int64_t* warm_row, int64_t W,
                                      const tkv_codec_desc_t* desc, void* workspace, int64_t workspace_bytes,
                                      int32_t num_splits, void* stream) {
    const attn::Problem p = problem(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, lse,
                                    page_probs, B, H, T, D, C, KVH, P, M, scale);
    attn::WarmPages warm;
    if (!attn::make_warm(p, warm_pool, warm_row, W, desc, &warm)) return invalid();
    return static_cast<int>(attn::launch(p, kv_dtype, workspace, workspace_bytes, num_splits, warm,
                                         as_stream(stream)));
}

TKV_API int tkv_tiered_attention_host(const float* q, const void* k_pool, const void* v_pool,
                                      const int64_t* page_table, const int32_t* page_mask, const int64_t* page_index,
                                      const int64_t* seq_len, const int64_t* past, float* out, float* lse,
                                      float* page_probs, int64_t B, int64_t H, int64_t T, int64_t D, int64_t C,
                                      int64_t KVH, int64_t P, int64_t M, float scale, int32_t kv_dtype,
                                      const void* warm_pool, const int64_t* warm_row, int64_t W,
                                      const tkv_codec_desc_t* desc, int32_t sm_count, int32_t blocks_per_sm,
                                      int32_t num_splits) {
    const attn::Problem p = problem(q, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out, lse,
                                    page_probs, B, H, T, D, C, KVH, P, M, scale);
    if (desc == nullptr) {
        if (warm_pool != nullptr || warm_row != nullptr || W != 0) return invalid();
        return static_cast<int>(attn::attention_host(p, kv_dtype, nullptr, sm_count, blocks_per_sm, num_splits));
    }
    attn::WarmPages warm;
    if (!attn::make_warm(p, warm_pool, warm_row, W, desc, &warm)) return invalid();
    return static_cast<int>(attn::attention_host(p, kv_dtype, &warm, sm_count, blocks_per_sm, num_splits));
}

TKV_API int tkv_codec_desc(const char* name, int64_t kvh, int64_t p, int64_t d, tkv_codec_desc_t* out) {
    return tieredkv::kernels::codec::make_codec_desc(name, kvh, p, d, out) ? 0 : invalid();
}

TKV_API int64_t tkv_codec_desc_sizeof(void) { return static_cast<int64_t>(sizeof(tkv_codec_desc_t)); }

TKV_API int tkv_encode_pages(const float* k, const float* v, uint8_t* out, int64_t N, const tkv_codec_desc_t* desc,
                             void* stream) {
    if (desc == nullptr) return invalid();
    return static_cast<int>(tieredkv::kernels::codec::launch_encode_pages(k, v, out, N, *desc, as_stream(stream)));
}

TKV_API int tkv_decode_pages(const uint8_t* data, float* k, float* v, int64_t N, const tkv_codec_desc_t* desc,
                             void* stream) {
    if (desc == nullptr) return invalid();
    return static_cast<int>(tieredkv::kernels::codec::launch_decode_pages(data, k, v, N, *desc, as_stream(stream)));
}

TKV_API int tkv_encode_pages_host(const float* k, const float* v, uint8_t* out, int64_t N,
                                  const tkv_codec_desc_t* desc) {
    if (desc == nullptr) return invalid();
    return static_cast<int>(tieredkv::kernels::codec::encode_pages_host(k, v, out, N, *desc));
}

TKV_API int tkv_decode_pages_host(const uint8_t* data, float* k, float* v, int64_t N, const tkv_codec_desc_t* desc) {
    if (desc == nullptr) return invalid();
    return static_cast<int>(tieredkv::kernels::codec::decode_pages_host(data, k, v, N, *desc));
}

TKV_API int tkv_kv_append(const void* k_pool, const void* v_pool, const void* k_new, const void* v_new,
                          const int64_t* slot, const int64_t* offset, void* k_pool_out, void* v_pool_out, int64_t C,
                          int64_t KVH, int64_t P, int64_t D, int64_t N, int32_t elem_bytes, void* stream) {
    return static_cast<int>(tieredkv::kernels::launch_kv_append(k_pool, v_pool, k_new, v_new, slot, offset,
                                                                k_pool_out, v_pool_out, C, KVH, P, D, N, elem_bytes,
                                                                as_stream(stream)));
}

TKV_API int tkv_importance_score(const float* q, const float* kmin, const float* kmax, const int64_t* page_tokens,
                                 const int64_t* distance, const float* saliency, const int32_t* page_mask,
                                 const float* position_table, float* score, int64_t B, int64_t H, int64_t D,
                                 int64_t M, int64_t KVH, int64_t NB, float w_rel, float w_pos, float w_sal,
                                 float scale, void* stream) {
    return static_cast<int>(tieredkv::kernels::launch_importance_score(
        q, kmin, kmax, page_tokens, distance, saliency, page_mask, position_table, score, B, H, D, M, KVH, NB, w_rel,
        w_pos, w_sal, scale, as_stream(stream)));
}

TKV_API int64_t tkv_importance_score_workspace(int64_t B, int64_t H, int64_t M) {
    if (B < 0 || H < 0 || M < 0) return -1;
    return tieredkv::kernels::importance::workspace_bytes(B, H, M);
}

TKV_API int tkv_importance_score_ex(const void* q, const void* kmin, const void* kmax, const int64_t* page_tokens,
                                    const int64_t* distance, const float* saliency, const int32_t* page_mask,
                                    const float* position_table, float* score, int64_t B, int64_t H, int64_t D,
                                    int64_t M, int64_t KVH, int64_t NB, float w_rel, float w_pos, float w_sal,
                                    float scale, int32_t q_dtype, int32_t summary_dtype, void* workspace,
                                    int64_t workspace_bytes, void* stream) {
    return static_cast<int>(tieredkv::kernels::launch_importance_score_ex(
        q, q_dtype, kmin, kmax, summary_dtype, page_tokens, distance, saliency, page_mask, position_table, score, B, H,
        D, M, KVH, NB, w_rel, w_pos, w_sal, scale, workspace, workspace_bytes, as_stream(stream)));
}

TKV_API const char* tkv_error_string(int status) { return cudaGetErrorString(static_cast<cudaError_t>(status)); }

}  // extern "C"
