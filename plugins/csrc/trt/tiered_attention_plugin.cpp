// TensorRT IPluginV3 "TieredAttention" (namespace "tieredkv", version "1"); enqueue runs
// tkv_tiered_attention, or with a warm codec tkv_tiered_attention_warm
// (kernels/tiered_attention.cuh: split-K flash-decoding, its partials in the plugin's workspace).
// Attributes: scale (kFLOAT32 x 1), warm_codec (kCHAR, optional: absent or empty = the plain
// 8-input op; else a codec name of tieredkv.plugins.codec.CODECS).
//   inputs  q [B,H,T,D] f32, k_pool [C,KVH,P,D] f32 / f16 / bf16, v_pool [C,KVH,P,D] (k_pool's
//           type), page_table [B,M] i64, page_mask [B,M] i32 (nonzero = kept), page_index [B,M]
//           i64, seq_len [B] i64, past [B] i64
//           (+ with warm_codec: warm_pool [W,NB/4] i32 = the encoded pages' bytes as little-endian
//            words, NB = the codec's page bytes for [KVH,P,D] (a multiple of 128); warm_row [B,M] i64)
//   outputs out [B,H,T,D] f32, lse [B,H,T] f32, page_probs [B,H,T,M] f32
// Workspace: tkv_tiered_attention_workspace of the largest sizes (non-decreasing in every size,
// so it serves every smaller call).
#include "plugin_common.h"
#include "tieredkv_kernels.h"

#include <cstring>
#include <new>

namespace tieredkv {
namespace trt {
namespace {

using nvinfer1::DataType;

constexpr char kName[] = "TieredAttention";
constexpr char kScaleField[] = "scale";
constexpr char kWarmCodecField[] = "warm_codec";
constexpr int32_t kPlainInputs = 8;
constexpr int32_t kWarmInputs = 10;  //!< + warm_pool, warm_row
constexpr int32_t kOutputs = 3;
//! input types by position (the warm inputs last; the pools, positions 1 and 2, are any of
//! kPoolTypes, both one type), then the output types
constexpr DataType kInputTypes[kWarmInputs] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64,
                                               DataType::kINT32, DataType::kINT64, DataType::kINT64, DataType::kINT64,
                                               DataType::kINT32, DataType::kINT64};
constexpr DataType kOutputType = DataType::kFLOAT;
//! Longest codec name kept (the names of codec.CODECS are far shorter).
constexpr size_t kMaxCodecName = 31;

class TieredAttentionPlugin final : public PluginBase {
public:
    //! `warm_codec`: "" for the plain op, else a codec name tkv_codec_desc accepts.
    TieredAttentionPlugin(float scale, char const* warm_codec) noexcept : PluginBase(kName), mScale(scale) {
        std::strncpy(mWarmCodec, warm_codec, kMaxCodecName);
    }
    TieredAttentionPlugin(TieredAttentionPlugin const& other) noexcept : PluginBase(other), mScale(other.mScale) {
        std::memcpy(mWarmCodec, other.mWarmCodec, sizeof(mWarmCodec));
    }

    nvinfer1::IPluginV3* clone() noexcept override { return new (std::nothrow) TieredAttentionPlugin(*this); }

    int32_t getNbOutputs() const noexcept override { return kOutputs; }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* /* inputTypes */,
                               int32_t /* nbInputs */) const noexcept override {
        if (nbOutputs != kOutputs) return 1;
        for (int32_t i = 0; i < kOutputs; ++i) outputTypes[i] = DataType::kFLOAT;
        return 0;
    }

    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                            nvinfer1::DimsExprs const* /* shapeInputs */, int32_t /* nbShapeInputs */,
                            nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& /* exprBuilder */) noexcept override {
        if (nbInputs != expectedInputs() || nbOutputs != kOutputs || inputs[0].nbDims != 4 || inputs[3].nbDims != 2) {
            return fail("expected q [B,H,T,D] and page_table [B,M]");
        }
        nvinfer1::DimsExprs const& q = inputs[0];
        outputs[0] = q;  // out [B, H, T, D]
        outputs[1].nbDims = 3;  // lse [B, H, T]
        outputs[2].nbDims = 4;  // page_probs [B, H, T, M]
        for (int32_t i = 0; i < 3; ++i) {
            outputs[1].d[i] = q.d[i];
            outputs[2].d[i] = q.d[i];
        }
        outputs[2].d[3] = inputs[3].d[1];
        return 0;
    }

    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        int32_t const nin = expectedInputs();
        if (nbInputs != nin || nbOutputs != kOutputs || pos < 0 || pos >= nin + kOutputs) return false;
        if (pos == 1) return is_linear_float(inOut[1]);
        if (pos == 2) return is_linear(inOut[2], inOut[1].desc.type);
        return is_linear(inOut[pos], pos < nin ? kInputTypes[pos] : kOutputType);
    }

    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::PluginTensorDesc const* /* out */, int32_t nbOutputs) noexcept override {
        if (nbInputs != expectedInputs() || nbOutputs != kOutputs) return fail("wrong number of inputs / outputs");
        nvinfer1::Dims const& q = in[0].dims;
        nvinfer1::Dims const& pool = in[1].dims;
        if (q.nbDims != 4 || pool.nbDims != 4 || in[2].dims.nbDims != 4 || in[3].dims.nbDims != 2) {
            return fail("expected q [B,H,T,D], pools [C,KVH,P,D], page_table [B,M]");
        }
        if (pool.d[3] != q.d[3] || pool.d[1] <= 0 || q.d[1] % pool.d[1] != 0) {
            return fail("pools must be [C, KVH, P, D] with the query's D and H a multiple of KVH");
        }
        for (int32_t k = 0; k < 4; ++k) {
            if (in[2].dims.d[k] != pool.d[k]) return fail("k_pool and v_pool must have one shape [C, KVH, P, D]");
        }
        if (q.d[3] > 256) return fail("head dim " + std::to_string(q.d[3]) + " > 256 is not supported");
        if (!warm()) return 0;
        nvinfer1::Dims const& warm_pool = in[8].dims;
        nvinfer1::Dims const& warm_row = in[9].dims;
        nvinfer1::Dims const& table = in[3].dims;
        if (warm_pool.nbDims != 2 || warm_row.nbDims != 2 || warm_row.d[0] != table.d[0] ||
            warm_row.d[1] != table.d[1]) {
            return fail("expected warm_pool [W,NB] and warm_row [B,M] (page_table's shape)");
        }
        tkv_codec_desc_t desc;
        if (tkv_codec_desc(mWarmCodec, pool.d[1], pool.d[2], pool.d[3], &desc) != 0) {
            return fail(std::string("warm_codec '") + mWarmCodec + "' does not take pages [" +
                        std::to_string(pool.d[1]) + "," + std::to_string(pool.d[2]) + "," + std::to_string(pool.d[3]) +
                        "]");
        }
        if (warm_pool.d[1] * 4 != desc.page_bytes) {
            return fail("warm_pool rows must be " + std::to_string(desc.page_bytes / 4) + " int32 words (" +
                        std::to_string(desc.page_bytes) + " bytes of " + mWarmCodec +
                        " pages [KVH,P,D] of the pools), got " + std::to_string(warm_pool.d[1]));
        }
        return 0;
    }

    //! Partials of the split plan: tkv_tiered_attention_workspace of the largest sizes.
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* /* outputs */,
                            int32_t /* nbOutputs */) const noexcept override {
        if (nbInputs < kPlainInputs || inputs[0].max.nbDims != 4 || inputs[1].max.nbDims != 4 ||
            inputs[3].max.nbDims != 2) {
            return 0;
        }
        nvinfer1::Dims const& q = inputs[0].max;
        int64_t const bytes = tkv_tiered_attention_workspace(q.d[0], q.d[1], q.d[2], q.d[3], inputs[1].max.d[1],
                                                             inputs[3].max.d[1]);
        return bytes > 0 ? static_cast<size_t>(bytes) : 0;
    }

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* /* outputDesc */,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override {
        nvinfer1::Dims const& q = inputDesc[0].dims;     // [B, H, T, D]
        nvinfer1::Dims const& pool = inputDesc[1].dims;  // [C, KVH, P, D]
        int64_t const m = inputDesc[3].dims.d[1];        // page_table [B, M]
        int32_t const dtype = kv_dtype(inputDesc[1].type);
        // getWorkspaceSize gave the bound at the largest sizes, which is at least this (monotone)
        int64_t const ws_bytes = tkv_tiered_attention_workspace(q.d[0], q.d[1], q.d[2], q.d[3], pool.d[1], m);
        // inputs 0-7 and the three outputs are the same for both variants (docs/plugins.md)
        auto const* qv = static_cast<float const*>(inputs[0]);
        void const* k_pool = inputs[1];
        void const* v_pool = inputs[2];
        auto const* page_table = static_cast<int64_t const*>(inputs[3]);
        auto const* page_mask = static_cast<int32_t const*>(inputs[4]);
        auto const* page_index = static_cast<int64_t const*>(inputs[5]);
        auto const* seq_len = static_cast<int64_t const*>(inputs[6]);
        auto const* past = static_cast<int64_t const*>(inputs[7]);
        auto* out = static_cast<float*>(outputs[0]);
        auto* lse = static_cast<float*>(outputs[1]);
        auto* page_probs = static_cast<float*>(outputs[2]);
        int status = 0;
        if (warm()) {
            tkv_codec_desc_t desc;  // a few integer ops: built per call, the plugin keeps no shape state
            status = tkv_codec_desc(mWarmCodec, pool.d[1], pool.d[2], pool.d[3], &desc);
            if (status != 0) return fail(std::string("warm_codec '") + mWarmCodec + "': bad page shape");
            // warm_pool [W, NB / 4] int32: the encoded bytes, read as bytes by the kernel
            status = tkv_tiered_attention_warm(qv, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past,
                                               out, lse, page_probs, q.d[0], q.d[1], q.d[2], q.d[3], pool.d[0],
                                               pool.d[1], pool.d[2], m, mScale, dtype, inputs[8],
                                               static_cast<int64_t const*>(inputs[9]), inputDesc[8].dims.d[0], &desc,
                                               workspace, ws_bytes, 0, stream);
        } else {
            status = tkv_tiered_attention(qv, k_pool, v_pool, page_table, page_mask, page_index, seq_len, past, out,
                                          lse, page_probs, q.d[0], q.d[1], q.d[2], q.d[3], pool.d[0], pool.d[1],
                                          pool.d[2], m, mScale, dtype, workspace, ws_bytes, 0, stream);
        }
        return status == 0 ? 0 : fail(std::string("kernel launch failed: ") + tkv_error_string(status));
    }

    //! scale, and warm_codec as kCHAR of its length (0: the plain op), no terminating NUL.
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override {
        mSerialized = {nvinfer1::PluginField(kScaleField, &mScale, nvinfer1::PluginFieldType::kFLOAT32, 1),
                       nvinfer1::PluginField(kWarmCodecField, mWarmCodec, nvinfer1::PluginFieldType::kCHAR,
                                             static_cast<int32_t>(std::strlen(mWarmCodec)))};
        mSerializedCollection.nbFields = static_cast<int32_t>(mSerialized.size());
        mSerializedCollection.fields = mSerialized.data();
        return &mSerializedCollection;
    }

protected:
    int32_t expectedInputs() const noexcept override { return warm() ? kWarmInputs : kPlainInputs; }

private:
    bool warm() const noexcept { return mWarmCodec[0] != '\0'; }

    float mScale;
    char mWarmCodec[kMaxCodecName + 1] = {};
    std::vector<nvinfer1::PluginField> mSerialized;
    nvinfer1::PluginFieldCollection mSerializedCollection{};
};

class TieredAttentionCreator final : public CreatorBase {
public:
    TieredAttentionCreator() noexcept
        : CreatorBase(kName, {nvinfer1::PluginField(kScaleField, nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1),
                              nvinfer1::PluginField(kWarmCodecField, nullptr, nvinfer1::PluginFieldType::kCHAR, 0)}) {}

    //! scale is required; warm_codec optional (absent or empty: the plain op). An unknown codec
    //! name fails with a logged error.
    nvinfer1::IPluginV3* createPlugin(char const* /* name */, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase /* phase */) noexcept override {
        float scale = 0.f;
        if (!read_float_field(fc, kName, kScaleField, &scale, 1)) return nullptr;
        std::string codec;
        if (!read_string_field(fc, kName, kWarmCodecField, codec)) return nullptr;
        if (!codec.empty()) {
            tkv_codec_desc_t desc;  // the name alone is checked here (any valid page shape will do)
            if (codec.size() > kMaxCodecName || tkv_codec_desc(codec.c_str(), 1, 1, 1, &desc) != 0) {
                log_error(std::string(kName) + ": unknown warm_codec '" + codec +
                          "' (expected a codec of tieredkv.plugins.codec.CODECS, e.g. 'int4', 'fp8-r2')");
                return nullptr;
            }
        }
        return new (std::nothrow) TieredAttentionPlugin(scale, codec.c_str());
    }
};

}  // namespace

nvinfer1::IPluginCreatorV3One* tiered_attention_creator() noexcept {
    static TieredAttentionCreator creator;
    return &creator;
}

}  // namespace trt
}  // namespace tieredkv
