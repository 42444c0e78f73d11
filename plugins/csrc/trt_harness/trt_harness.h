/* C ABI of libtieredkv_trt_harness.so: the tieredkv TensorRT plugins driven as TensorRT drives
 * them, without TensorRT (trt_harness.cpp). Types and field types are the values of
 * nvinfer1::DataType and nvinfer1::PluginFieldType. Every function but tkvh_log appends what
 * went wrong (and what the plugins logged through the harness's ILogger) to a process-wide log. */
#ifndef TIEREDKV_TRT_HARNESS_H
#define TIEREDKV_TRT_HARNESS_H

#include <stdint.h>

#define TKVH_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

/* A tensor: nvinfer1::DataType, dims (at most 8), and its device pointer (NULL for the build phase). */
typedef struct tkvh_tensor_t {
    int32_t type;
    int32_t nb_dims;
    int64_t dims[8];
    void* data;
} tkvh_tensor_t;

/* A plugin field as TensorRT's ONNX parser passes a node attribute: name, PluginFieldType, length, data. */
typedef struct tkvh_field_t {
    const char* name;
    int32_t type;
    int32_t length;
    const void* data;
} tkvh_field_t;

/* dlopen the plugin library, call its setLoggerFinder with the harness's logger, then getCreators.
 * Returns the number of IPluginCreatorV3One creators, or -1 (see the log). Once per process. */
TKVH_API int tkvh_open(const char* plugin_library);

/* One line per creator, "name version namespace field:type:length ...", into out (out_len bytes,
 * NUL-terminated); returns the full text's length. */
TKVH_API int64_t tkvh_creators(char* out, int64_t out_len);

/* The creator of op (version "1", namespace "tieredkv"): createPlugin(fields, kBUILD). An opaque
 * handle, or NULL when there is no such creator or it refuses the fields. */
TKVH_API void* tkvh_create(const char* op, const tkvh_field_t* fields, int32_t nb_fields);

/* The build phase for inputs of these types and dims (data unused): outputs[i] gets each
 * output's type and dims, *nb_outputs their number (at most max_outputs), aliases[i] each
 * output's getAliasedInput, *workspace_bytes getWorkspaceSize. 0, or 1 (see the log). */
TKVH_API int tkvh_build(void* handle, const tkvh_tensor_t* inputs, int32_t nb_inputs, tkvh_tensor_t* outputs,
                        int32_t max_outputs, int32_t* nb_outputs, int32_t* aliases, int64_t* workspace_bytes);

/* The runtime phase after tkvh_build: the serialized fields -> createPlugin(kRUNTIME) ->
 * attachToContext -> onShapeChange -> enqueue on these device buffers (an output whose data is
 * its aliased input's: in place), the workspace (at least what the build asked) and stream (a
 * cudaStream_t). Only enqueues: synchronize the stream before reading the outputs. 0, or 1. */
TKVH_API int tkvh_enqueue(void* handle, const tkvh_tensor_t* inputs, int32_t nb_inputs, const tkvh_tensor_t* outputs,
                          int32_t nb_outputs, void* workspace, int64_t workspace_bytes, void* stream);

TKVH_API void tkvh_destroy(void* handle);

/* The log since the last call into out (NUL-terminated; cleared when out is given); returns its length. */
TKVH_API int64_t tkvh_log(char* out, int64_t out_len);

#ifdef __cplusplus
}
#endif

#endif /* TIEREDKV_TRT_HARNESS_H */
