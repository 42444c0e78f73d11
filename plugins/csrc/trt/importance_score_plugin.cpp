// TensorRT IPluginV3 "ImportanceScore" (namespace "tieredkv", version "1"); enqueue runs
// tkv_importance_score_ex (kernels/importance_score.cuh: one pass over the page summaries per kv
// head). Attributes: weights (kFLOAT32 x 3: relevance, position, saliency), scale (kFLOAT32 x 1).
// Workspace: tkv_importance_score_workspace of the largest sizes (the bounds per head and page).
//   inputs  q [B,H,D] f32 / f16 / bf16, kmin and kmax [B,M,KVH,D] of one type, f32 / f16 / bf16 (a
//           strongly typed fp16 engine feeds the pools' own type: the min / max of fp16 keys are
//           fp16 values), page_tokens [B,M] i64,
//           distance [B,M] i64, saliency [B,M] f32, page_mask [B,M] i32 (nonzero = kept), position_table [NB] f32
//   output  score [B,M] f32
#include "plugin_common.h"
#include "tieredkv_kernels.h"

#include <new>

namespace tieredkv {
namespace trt {
namespace {

using nvinfer1::DataType;

constexpr char kName[] = "ImportanceScore";
constexpr char kWeightsField[] = "weights";
constexpr char kScaleField[] = "scale";
constexpr int32_t kInputs = 8;
constexpr int32_t kOutputs = 1;
constexpr DataType kTypes[kInputs + kOutputs] = {
    DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64, DataType::kINT64,
    DataType::kFLOAT, DataType::kINT32, DataType::kFLOAT, DataType::kFLOAT};

class ImportanceScorePlugin final : public PluginBase {
public:
    ImportanceScorePlugin(float const (&weights)[3], float scale) noexcept
        : PluginBase(kName), mWeights{weights[0], weights[1], weights[2]}, mScale(scale) {}
    ImportanceScorePlugin(ImportanceScorePlugin const& other) noexcept
        : PluginBase(other), mWeights{other.mWeights[0], other.mWeights[1], other.mWeights[2]}, mScale(other.mScale) {}

    nvinfer1::IPluginV3* clone() noexcept override { return new (std::nothrow) ImportanceScorePlugin(*this); }

    int32_t getNbOutputs() const noexcept override { return kOutputs; }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* /* inputTypes */,
                               int32_t /* nbInputs */) const noexcept override {
        if (nbOutputs != kOutputs) return 1;
        outputTypes[0] = DataType::kFLOAT;
        return 0;
    }

    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                            nvinfer1::DimsExprs const* /* shapeInputs */, int32_t /* nbShapeInputs */,
                            nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& /* exprBuilder */) noexcept override {
        if (nbInputs != kInputs || nbOutputs != kOutputs || inputs[6].nbDims != 2) {
            return fail("expected page_mask [B,M]");
        }
        outputs[0] = inputs[6];  // score [B, M], as page_mask
        return 0;
    }

    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (nbInputs != kInputs || nbOutputs != kOutputs || pos < 0 || pos >= kInputs + kOutputs) return false;
        if (pos == 0 || pos == 1) return is_linear_float(inOut[pos]);  // q; kmin: any float type
        if (pos == 2) return is_linear(inOut[2], inOut[1].desc.type);  // kmax: kmin's type
        return is_linear(inOut[pos], kTypes[pos]);
    }

    //! The heads' bounds and softmax statistics: tkv_importance_score_workspace of the largest sizes.
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* /* outputs */,
                            int32_t /* nbOutputs */) const noexcept override {
        if (nbInputs != kInputs || inputs[0].max.nbDims != 3 || inputs[6].max.nbDims != 2) return 0;
        int64_t const bytes = tkv_importance_score_workspace(inputs[0].max.d[0], inputs[0].max.d[1],
                                                             inputs[6].max.d[1]);
        return bytes > 0 ? static_cast<size_t>(bytes) : 0;
    }

    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::PluginTensorDesc const* /* out */, int32_t nbOutputs) noexcept override {
        if (nbInputs != kInputs || nbOutputs != kOutputs) return fail("wrong number of inputs / outputs");
        nvinfer1::Dims const& q = in[0].dims;
        nvinfer1::Dims const& kmin = in[1].dims;
        if (q.nbDims != 3 || kmin.nbDims != 4 || in[7].dims.nbDims != 1 || kmin.d[3] != q.d[2] || kmin.d[2] <= 0 ||
            q.d[1] % kmin.d[2] != 0) {
            return fail("expected q [B,H,D], kmin/kmax [B,M,KVH,D] with H a multiple of KVH, position_table [NB]");
        }
        if (q.d[2] > 256) return fail("head dim " + std::to_string(q.d[2]) + " > 256 is not supported");
        if (in[7].dims.d[0] < 1) return fail("position_table must have at least one bucket");
        return 0;
    }

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* /* outputDesc */,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override {
        nvinfer1::Dims const& q = inputDesc[0].dims;     // [B, H, D]
        nvinfer1::Dims const& kmin = inputDesc[1].dims;  // [B, M, KVH, D]
        int64_t const nb = inputDesc[7].dims.d[0];       // position_table [NB]
        // getWorkspaceSize gave the bound at the largest sizes, which is at least this (monotone)
        int64_t const ws_bytes = tkv_importance_score_workspace(q.d[0], q.d[1], kmin.d[1]);
        int const status = tkv_importance_score_ex(
            inputs[0], inputs[1], inputs[2], static_cast<int64_t const*>(inputs[3]),
            static_cast<int64_t const*>(inputs[4]), static_cast<float const*>(inputs[5]),
            static_cast<int32_t const*>(inputs[6]), static_cast<float const*>(inputs[7]),
            static_cast<float*>(outputs[0]), q.d[0], q.d[1], q.d[2], kmin.d[1], kmin.d[2], nb, mWeights[0],
            mWeights[1], mWeights[2], mScale, kv_dtype(inputDesc[0].type), kv_dtype(inputDesc[1].type), workspace,
            ws_bytes, stream);
        return status == 0 ? 0 : fail(std::string("kernel launch failed: ") + tkv_error_string(status));
    }

    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override {
        mSerialized = {nvinfer1::PluginField(kWeightsField, mWeights, nvinfer1::PluginFieldType::kFLOAT32, 3),
                       nvinfer1::PluginField(kScaleField, &mScale, nvinfer1::PluginFieldType::kFLOAT32, 1)};
        mSerializedCollection.nbFields = static_cast<int32_t>(mSerialized.size());
        mSerializedCollection.fields = mSerialized.data();
        return &mSerializedCollection;
    }

protected:
    int32_t expectedInputs() const noexcept override { return kInputs; }

private:
    float mWeights[3];
    float mScale;
    std::vector<nvinfer1::PluginField> mSerialized;
    nvinfer1::PluginFieldCollection mSerializedCollection{};
};

class ImportanceScoreCreator final : public CreatorBase {
public:
    ImportanceScoreCreator() noexcept
        : CreatorBase(kName, {nvinfer1::PluginField(kWeightsField, nullptr, nvinfer1::PluginFieldType::kFLOAT32, 3),
                              nvinfer1::PluginField(kScaleField, nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1)}) {}

    nvinfer1::IPluginV3* createPlugin(char const* /* name */, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase /* phase */) noexcept override {
        float weights[3] = {0.f, 0.f, 0.f};
        float scale = 0.f;
        if (!read_float_field(fc, kName, kWeightsField, weights, 3) ||
            !read_float_field(fc, kName, kScaleField, &scale, 1)) {
            return nullptr;
        }
        return new (std::nothrow) ImportanceScorePlugin(weights, scale);
    }
};

}  // namespace

nvinfer1::IPluginCreatorV3One* importance_score_creator() noexcept {
    static ImportanceScoreCreator creator;
    return &creator;
}

}  // namespace trt
}  // namespace tieredkv
