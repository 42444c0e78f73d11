// TensorRT IPluginV3 "TieredAttention" (namespace "tieredkv", version "1"); enqueue runs
// tkv_tiered_attention (kernels/tiered_attention.cuh). Attribute: scale (kFLOAT32 x 1).
//   inputs  q [B,H,T,D] f32, k_pool [C,KVH,P,D] f32, v_pool [C,KVH,P,D] f32, page_table [B,M] i64,
//           page_mask [B,M] bool, page_index [B,M] i64, seq_len [B] i64, past [B] i64
//   outputs out [B,H,T,D] f32, lse [B,H,T] f32, page_probs [B,H,T,M] f32
#include "plugin_common.h"
#include "tieredkv_kernels.h"

#include <new>

namespace tieredkv {
namespace trt {
namespace {

using nvinfer1::DataType;

constexpr char kName[] = "TieredAttention";
constexpr char kScaleField[] = "scale";
constexpr int32_t kInputs = 8;
constexpr int32_t kOutputs = 3;
//! input / output types by position (inputs, then outputs)
constexpr DataType kTypes[kInputs + kOutputs] = {
    DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64, DataType::kBOOL, DataType::kINT64,
    DataType::kINT64, DataType::kINT64, DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};

class TieredAttentionPlugin final : public PluginBase {
public:
    explicit TieredAttentionPlugin(float scale) noexcept : PluginBase(kName), mScale(scale) {}
    TieredAttentionPlugin(TieredAttentionPlugin const& other) noexcept : PluginBase(other), mScale(other.mScale) {}

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
        if (nbInputs != kInputs || nbOutputs != kOutputs || inputs[0].nbDims != 4 || inputs[3].nbDims != 2) {
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
        return nbInputs == kInputs && nbOutputs == kOutputs && pos >= 0 && pos < kInputs + kOutputs &&
               is_linear(inOut[pos], kTypes[pos]);
    }

    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::PluginTensorDesc const* /* out */, int32_t nbOutputs) noexcept override {
        if (nbInputs != kInputs || nbOutputs != kOutputs) return fail("wrong number of inputs / outputs");
        nvinfer1::Dims const& q = in[0].dims;
        nvinfer1::Dims const& pool = in[1].dims;
        if (q.nbDims != 4 || pool.nbDims != 4 || in[2].dims.nbDims != 4 || in[3].dims.nbDims != 2) {
            return fail("expected q [B,H,T,D], pools [C,KVH,P,D], page_table [B,M]");
        }
        if (pool.d[3] != q.d[3] || pool.d[1] <= 0 || q.d[1] % pool.d[1] != 0) {
            return fail("pools must be [C, KVH, P, D] with the query's D and H a multiple of KVH");
        }
        if (q.d[3] > 256) return fail("head dim " + std::to_string(q.d[3]) + " > 256 is not supported");
        return 0;
    }

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* /* outputDesc */,
                    void const* const* inputs, void* const* outputs, void* /* workspace */,
                    cudaStream_t stream) noexcept override {
        nvinfer1::Dims const& q = inputDesc[0].dims;     // [B, H, T, D]
        nvinfer1::Dims const& pool = inputDesc[1].dims;  // [C, KVH, P, D]
        int64_t const m = inputDesc[3].dims.d[1];        // page_table [B, M]
        int const status = tkv_tiered_attention(
            static_cast<float const*>(inputs[0]), static_cast<float const*>(inputs[1]),
            static_cast<float const*>(inputs[2]), static_cast<int64_t const*>(inputs[3]),
            static_cast<uint8_t const*>(inputs[4]), static_cast<int64_t const*>(inputs[5]),
            static_cast<int64_t const*>(inputs[6]), static_cast<int64_t const*>(inputs[7]),
            static_cast<float*>(outputs[0]), static_cast<float*>(outputs[1]), static_cast<float*>(outputs[2]),
            q.d[0], q.d[1], q.d[2], q.d[3], pool.d[0], pool.d[1], pool.d[2], m, mScale, stream);
        return status == 0 ? 0 : fail(std::string("kernel launch failed: ") + tkv_error_string(status));
    }

    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override {
        mSerialized = {nvinfer1::PluginField(kScaleField, &mScale, nvinfer1::PluginFieldType::kFLOAT32, 1)};
        mSerializedCollection.nbFields = static_cast<int32_t>(mSerialized.size());
        mSerializedCollection.fields = mSerialized.data();
        return &mSerializedCollection;
    }

protected:
    int32_t expectedInputs() const noexcept override { return kInputs; }

private:
    float mScale;
    std::vector<nvinfer1::PluginField> mSerialized;
    nvinfer1::PluginFieldCollection mSerializedCollection{};
};

class TieredAttentionCreator final : public CreatorBase {
public:
    TieredAttentionCreator() noexcept
        : CreatorBase(kName, {nvinfer1::PluginField(kScaleField, nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1)}) {}

    nvinfer1::IPluginV3* createPlugin(char const* /* name */, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase /* phase */) noexcept override {
        float scale = 0.f;
        if (!read_float_field(fc, kName, kScaleField, &scale, 1)) return nullptr;
        return new (std::nothrow) TieredAttentionPlugin(scale);
    }
};

}  // namespace

nvinfer1::IPluginCreatorV3One* tiered_attention_creator() noexcept {
    static TieredAttentionCreator creator;
    return &creator;
}

}  // namespace trt
}  // namespace tieredkv
