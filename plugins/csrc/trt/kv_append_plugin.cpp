// TensorRT IPluginV3 "KVAppend" (namespace "tieredkv", version "1"); enqueue runs tkv_kv_append
// (kernels/kv_append.cuh): it scatters the N new tokens into the output pools, after copying the
// pools to the outputs only when they are other buffers. The outputs alias the pools
// (IPluginV3OneBuildV2::getAliasedInput: k_pool_out -> k_pool, v_pool_out -> v_pool), so with
// PreviewFeature::kALIASED_PLUGIN_IO_10_03 TensorRT hands the same buffers and the append is in
// place (no pool copy); without it TensorRT ignores the alias and the plugin copies, and says so
// once per plugin (a warning through TensorRT's logger: every call then moves both pools). The
// TensorRT backend of the runtime checks after a step that the bound pools hold the new rows
// (runtime/engine.py, layers_not_appended_in_place). No attributes.
//   inputs  k_pool, v_pool [C,KVH,P,D], k_new, v_new [N,KVH,D] (all one type: f32, f16 or bf16),
//           slot [N] i64, offset [N] i64
//   outputs k_pool_out, v_pool_out [C,KVH,P,D] (the pools' type)
#include "plugin_common.h"
#include "tieredkv_kernels.h"

#include <new>

namespace tieredkv {
namespace trt {
namespace {

using nvinfer1::DataType;

constexpr char kName[] = "KVAppend";
constexpr int32_t kInputs = 6;
constexpr int32_t kOutputs = 2;

int32_t element_bytes(DataType type) noexcept {
    switch (type) {
        case DataType::kFLOAT: return 4;
        case DataType::kHALF:
        case DataType::kBF16: return 2;
        default: return 0;
    }
}

class KVAppendPlugin final : public PluginBase {
public:
    KVAppendPlugin() noexcept : PluginBase(kName) {}
    KVAppendPlugin(KVAppendPlugin const& other) noexcept : PluginBase(other) {}  // a clone warns afresh

    nvinfer1::IPluginV3* clone() noexcept override { return new (std::nothrow) KVAppendPlugin(*this); }

    int32_t getNbOutputs() const noexcept override { return kOutputs; }

    //! k_pool_out is k_pool (input 0), v_pool_out is v_pool (input 1): an in-place append.
    int32_t getAliasedInput(int32_t outputIndex) noexcept override {
        return outputIndex == 0 || outputIndex == 1 ? outputIndex : -1;
    }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                               int32_t nbInputs) const noexcept override {
        if (nbOutputs != kOutputs || nbInputs != kInputs) return 1;
        outputTypes[0] = inputTypes[0];
        outputTypes[1] = inputTypes[1];
        return 0;
    }

    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                            nvinfer1::DimsExprs const* /* shapeInputs */, int32_t /* nbShapeInputs */,
                            nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& /* exprBuilder */) noexcept override {
        if (nbInputs != kInputs || nbOutputs != kOutputs || inputs[0].nbDims != 4 || inputs[1].nbDims != 4) {
            return fail("expected pools [C,KVH,P,D]");
        }
        outputs[0] = inputs[0];
        outputs[1] = inputs[1];
        return 0;
    }

    //! Pools, new tokens and outputs share one type (f32, f16 or bf16; chosen at position 0);
    //! slot and offset are int64.
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (nbInputs != kInputs || nbOutputs != kOutputs || pos < 0 || pos >= kInputs + kOutputs) return false;
        if (pos == 4 || pos == 5) return is_linear(inOut[pos], DataType::kINT64);
        if (pos == 0) {
            return inOut[0].desc.format == nvinfer1::TensorFormat::kLINEAR && element_bytes(inOut[0].desc.type) > 0;
        }
        return is_linear(inOut[pos], inOut[0].desc.type);
    }

    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::PluginTensorDesc const* /* out */, int32_t nbOutputs) noexcept override {
        if (nbInputs != kInputs || nbOutputs != kOutputs) return fail("wrong number of inputs / outputs");
        nvinfer1::Dims const& pool = in[0].dims;
        nvinfer1::Dims const& fresh = in[2].dims;
        if (pool.nbDims != 4 || fresh.nbDims != 3 || fresh.d[1] != pool.d[1] || fresh.d[2] != pool.d[3]) {
            return fail("expected pools [C,KVH,P,D] and new tokens [N,KVH,D]");
        }
        return 0;
    }

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* /* outputDesc */,
                    void const* const* inputs, void* const* outputs, void* /* workspace */,
                    cudaStream_t stream) noexcept override {
        nvinfer1::Dims const& pool = inputDesc[0].dims;  // [C, KVH, P, D]
        int64_t const n = inputDesc[2].dims.d[0];        // k_new [N, KVH, D]
        if ((outputs[0] != inputs[0] || outputs[1] != inputs[1]) && !mWarnedCopy) {
            mWarnedCopy = true;
            try {
                log_warning(std::string(kName) + ": the outputs are not the input pools (TensorRT did not alias "
                            "them: PreviewFeature::kALIASED_PLUGIN_IO_10_03 is off), so every call copies both "
                            "pools (" + std::to_string(2 * volume(pool) * element_bytes(inputDesc[0].type)) +
                            " bytes) before appending");
            } catch (...) {  // out of memory while formatting: no warning
            }
        }
        int const status = tkv_kv_append(inputs[0], inputs[1], inputs[2], inputs[3],
                                         static_cast<int64_t const*>(inputs[4]),
                                         static_cast<int64_t const*>(inputs[5]), outputs[0], outputs[1], pool.d[0],
                                         pool.d[1], pool.d[2], pool.d[3], n, element_bytes(inputDesc[0].type), stream);
        return status == 0 ? 0 : fail(std::string("kernel launch failed: ") + tkv_error_string(status));
    }

    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &mNoFields; }

protected:
    int32_t expectedInputs() const noexcept override { return kInputs; }

private:
    nvinfer1::PluginFieldCollection mNoFields{};
    bool mWarnedCopy = false;
};

class KVAppendCreator final : public CreatorBase {
public:
    KVAppendCreator() noexcept : CreatorBase(kName, {}) {}

    nvinfer1::IPluginV3* createPlugin(char const* /* name */, nvinfer1::PluginFieldCollection const* /* fc */,
                                      nvinfer1::TensorRTPhase /* phase */) noexcept override {
        return new (std::nothrow) KVAppendPlugin();
    }
};

}  // namespace

nvinfer1::IPluginCreatorV3One* kv_append_creator() noexcept {
    static KVAppendCreator creator;
    return &creator;
}

}  // namespace trt
}  // namespace tieredkv
