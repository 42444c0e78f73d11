#include "plugin_common.h"

#include <atomic>
#include <cstring>

namespace tieredkv {
namespace trt {

namespace {
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};
}  // namespace

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept {
    nvinfer1::ILoggerFinder* expected = nullptr;
    gLoggerFinder.compare_exchange_strong(expected, finder);
}

void log_message(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept {
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger == nullptr) return;
    try {
        logger->log(severity, ("[tieredkv] " + message).c_str());
    } catch (...) {  // out of memory while formatting: drop the message
    }
}

bool read_float_field(nvinfer1::PluginFieldCollection const* fc, char const* plugin, char const* name, float* dst,
                      int32_t count) noexcept {
    if (fc != nullptr) {
        for (int32_t i = 0; i < fc->nbFields; ++i) {
            nvinfer1::PluginField const& field = fc->fields[i];
            if (field.name == nullptr || std::strcmp(field.name, name) != 0) continue;
            if (field.length != count || field.data == nullptr) break;
            if (field.type == nvinfer1::PluginFieldType::kFLOAT32) {
                std::memcpy(dst, field.data, sizeof(float) * static_cast<size_t>(count));
                return true;
            }
            if (field.type == nvinfer1::PluginFieldType::kFLOAT64) {
                double const* src = static_cast<double const*>(field.data);
                for (int32_t j = 0; j < count; ++j) dst[j] = static_cast<float>(src[j]);
                return true;
            }
            break;
        }
    }
    log_error(std::string(plugin) + ": attribute '" + name + "' must be " + std::to_string(count) +
              " float value(s) (kFLOAT32)");
    return false;
}

bool read_string_field(nvinfer1::PluginFieldCollection const* fc, char const* plugin, char const* name,
                       std::string& dst) noexcept {
    try {
        dst.clear();
        if (fc == nullptr) return true;
        for (int32_t i = 0; i < fc->nbFields; ++i) {
            nvinfer1::PluginField const& field = fc->fields[i];
            if (field.name == nullptr || std::strcmp(field.name, name) != 0) continue;
            if (field.type != nvinfer1::PluginFieldType::kCHAR) {
                log_error(std::string(plugin) + ": attribute '" + name + "' must be a string (kCHAR)");
                return false;
            }
            if (field.data == nullptr || field.length == 0) return true;
            char const* data = static_cast<char const*>(field.data);
            dst = field.length < 0 ? std::string(data) : std::string(data, static_cast<size_t>(field.length));
            dst = dst.substr(0, dst.find('\0'));
            return true;
        }
        return true;
    } catch (...) {  // out of memory while copying the string
        return false;
    }
}

int64_t volume(nvinfer1::Dims const& dims) noexcept {
    int64_t n = 1;
    for (int32_t i = 0; i < dims.nbDims; ++i) n *= dims.d[i];
    return n;
}

nvinfer1::IPluginCapability* PluginBase::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept {
    switch (type) {
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuildV2*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

int32_t PluginBase::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* /* in */, int32_t nbInputs,
                                    nvinfer1::DynamicPluginTensorDesc const* /* out */, int32_t nbOutputs) noexcept {
    if (nbInputs != expectedInputs() || nbOutputs != getNbOutputs()) {
        return fail("expected " + std::to_string(expectedInputs()) + " inputs and " + std::to_string(getNbOutputs()) +
                    " outputs, got " + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
    }
    return 0;
}

nvinfer1::IPluginV3* PluginBase::attachToContext(nvinfer1::IPluginResourceContext* /* context */) noexcept {
    return clone();
}

int32_t PluginBase::fail(std::string const& message) const noexcept {
    try {
        log_error(std::string(mName) + ": " + message);
    } catch (...) {  // out of memory while formatting: still report the failure code
    }
    return 1;
}

CreatorBase::CreatorBase(char const* name, std::vector<nvinfer1::PluginField> fields) noexcept
    : mName(name), mFields(std::move(fields)) {
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

}  // namespace trt
}  // namespace tieredkv
