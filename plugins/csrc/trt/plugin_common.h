// Shared glue of the tieredkv TensorRT plugins (IPluginV3 with the V3One core / build /
// runtime capabilities): names, field parsing, logging, and a base class holding the
// boilerplate every plugin repeats. Uses only the TensorRT header interfaces.
#pragma once

#include <NvInferRuntime.h>

#include "tieredkv_kernels.h"

#include <cstdint>
#include <string>
#include <vector>

namespace tieredkv {
namespace trt {

//! Must equal tieredkv.plugins.onnx_codec.PLUGIN_NAMESPACE / PLUGIN_VERSION (the ONNX nodes carry them).
constexpr char kPluginNamespace[] = "tieredkv";
constexpr char kPluginVersion[] = "1";

//! Log through the logger TensorRT handed over with setLoggerFinder (nothing before that).
void log_message(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept;
inline void log_error(std::string const& message) noexcept {
    log_message(nvinfer1::ILogger::Severity::kERROR, message);
}
inline void log_warning(std::string const& message) noexcept {
    log_message(nvinfer1::ILogger::Severity::kWARNING, message);
}
void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;

//! Reads `count` floats of field `name` (kFLOAT32 or kFLOAT64) from `fc` into `dst`; false (and an
//! error logged for `plugin`) when it is missing or has another length or type.
bool read_float_field(nvinfer1::PluginFieldCollection const* fc, char const* plugin, char const* name, float* dst,
                      int32_t count) noexcept;

//! Reads the optional string field `name` (kCHAR, `length` bytes, cut at a NUL; a negative
//! length means NUL-terminated) from `fc` into `dst`; an absent field leaves `dst` empty. False
//! (and an error logged for `plugin`) when the field has another type.
bool read_string_field(nvinfer1::PluginFieldCollection const* fc, char const* plugin, char const* name,
                       std::string& dst) noexcept;

//! Product of the dims (the element count of a linear tensor).
int64_t volume(nvinfer1::Dims const& dims) noexcept;

inline bool is_linear(nvinfer1::DynamicPluginTensorDesc const& d, nvinfer1::DataType type) noexcept {
    return d.desc.format == nvinfer1::TensorFormat::kLINEAR && d.desc.type == type;
}

//! The floating types the kernels read K/V, queries and page summaries in (TKV_DTYPE_*).
constexpr nvinfer1::DataType kPoolTypes[] = {nvinfer1::DataType::kFLOAT, nvinfer1::DataType::kHALF,
                                             nvinfer1::DataType::kBF16};

//! TKV_DTYPE_* of one of kPoolTypes, -1 for another type.
inline int32_t kv_dtype(nvinfer1::DataType type) noexcept {
    switch (type) {
        case nvinfer1::DataType::kFLOAT: return TKV_DTYPE_F32;
        case nvinfer1::DataType::kHALF: return TKV_DTYPE_F16;
        case nvinfer1::DataType::kBF16: return TKV_DTYPE_BF16;
        default: return -1;
    }
}

//! Linear and one of kPoolTypes.
inline bool is_linear_float(nvinfer1::DynamicPluginTensorDesc const& d) noexcept {
    return kv_dtype(d.desc.type) >= 0 && d.desc.format == nvinfer1::TensorFormat::kLINEAR;
}

//! The boilerplate of a V3One plugin: capability lookup, names, no tactics, no workspace (unless
//! the plugin overrides getWorkspaceSize), attachToContext = clone. A plugin adds its
//! attributes, shapes, types and enqueue. The build capability is IPluginV3OneBuildV2 (TensorRT
//! >= 10.3): no output aliases an input (getAliasedInput = -1) unless the plugin says so
//! (KVAppend; TensorRT calls it only with PreviewFeature::kALIASED_PLUGIN_IO_10_03).
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuildV2,
                   public nvinfer1::IPluginV3OneRuntime {
public:
    explicit PluginBase(char const* name) noexcept : mName(name) {}
    PluginBase(PluginBase const&) = default;
    ~PluginBase() override = default;

    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override { return mName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // IPluginV3OneBuild (the rest is per plugin)
    int32_t getAliasedInput(int32_t /* outputIndex */) noexcept override { return -1; }
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

    // IPluginV3OneRuntime
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;

protected:
    //! Number of inputs the op takes (outputs: getNbOutputs()).
    virtual int32_t expectedInputs() const noexcept = 0;

    //! Logs "<name>: <message>" and returns 1 (an enqueue / configure failure code).
    int32_t fail(std::string const& message) const noexcept;

    char const* mName;
};

//! The boilerplate of a V3One creator; a plugin's creator passes its name and field list and
//! implements createPlugin.
class CreatorBase : public nvinfer1::IPluginCreatorV3One {
public:
    CreatorBase(char const* name, std::vector<nvinfer1::PluginField> fields) noexcept;
    ~CreatorBase() override = default;

    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldCollection; }
    char const* getPluginName() const noexcept override { return mName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

protected:
    char const* mName;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

//! The creators of this library (static instances), for getCreators.
nvinfer1::IPluginCreatorV3One* tiered_attention_creator() noexcept;
nvinfer1::IPluginCreatorV3One* kv_append_creator() noexcept;
nvinfer1::IPluginCreatorV3One* importance_score_creator() noexcept;

}  // namespace trt
}  // namespace tieredkv
