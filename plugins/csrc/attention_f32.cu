// The TieredAttention split kernels of float pools (kernels/tiered_attention.cuh), one translation
// unit per pool element type so that they compile in parallel.
#define TKV_ATTENTION_INSTANTIATE
#define TKV_CODEC_FUNCTIONS_ONLY
#include "kernels/tiered_attention.cuh"

namespace tieredkv {
namespace kernels {
namespace attention {
TKV_ATTENTION_INSTANCES(, float)
}  // namespace attention
}  // namespace kernels
}  // namespace tieredkv
