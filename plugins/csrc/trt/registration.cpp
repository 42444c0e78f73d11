// Entry points IPluginRegistry::loadLibrary (and trtexec --dynamicPlugins) look up in a plugin
// shared library: getCreators (the creators of this library) and setLoggerFinder.
#include "plugin_common.h"

// TENSORRTAPI only exports when building TensorRT itself; these must always be exported.
#define TKV_PLUGIN_EXPORT __attribute__((visibility("default")))

extern "C" TKV_PLUGIN_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static nvinfer1::IPluginCreatorInterface* const creators[] = {
        tieredkv::trt::tiered_attention_creator(),
        tieredkv::trt::kv_append_creator(),
        tieredkv::trt::importance_score_creator(),
    };
    nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
    return creators;
}

extern "C" TKV_PLUGIN_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
    tieredkv::trt::set_logger_finder(finder);
}
