// The tieredkv TensorRT plugins driven the way TensorRT drives them, without TensorRT: a small
// shared library (libtieredkv_trt_harness.so, C ABI in trt_harness.h) that loads the plugin
// library with dlopen, hands it a logger (setLoggerFinder), takes its creators (getCreators)
// and runs one plugin through both phases of an engine's life:
//   build    creator->createPlugin(fields, kBUILD): the core capability's names, the build
//            capability (IPluginV3OneBuildV2): getNbOutputs, getOutputDataTypes,
//            getOutputShapes (through an IExprBuilder of constants), supportsFormatCombination
//            at every position for the given types (a strongly typed network asks exactly
//            these), configurePlugin, getWorkspaceSize, getAliasedInput
//   runtime  the build plugin's getFieldsToSerialize (deep-copied, as an engine stores them)
//            -> creator->createPlugin(fields, kRUNTIME) -> attachToContext -> onShapeChange
//            -> enqueue(inputs, outputs, workspace, stream) on the caller's device buffers
// TensorRT itself is not needed: the plugin interfaces are pure virtual classes of the headers,
// and what TensorRT would implement for a plugin (ILogger / ILoggerFinder, IExprBuilder and
// IDimensionExpr through their apiv:: implementation classes, IPluginResourceContext) is
// implemented here. No CUDA call is made here: the buffers and the stream are the caller's
// (tests/trt_harness.py passes torch CUDA tensors and torch's stream).
#include "trt_harness.h"

#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using namespace nvinfer1;

std::mutex gMutex;  // the log and the open library are process-wide
std::string gLog;

void note(std::string const& line) {
    std::lock_guard<std::mutex> lock(gMutex);
    gLog += line;
    gLog += '\n';
}

char const* severity_name(ILogger::Severity s) {
    switch (s) {
        case ILogger::Severity::kINTERNAL_ERROR: return "internal error";
        case ILogger::Severity::kERROR: return "error";
        case ILogger::Severity::kWARNING: return "warning";
        case ILogger::Severity::kINFO: return "info";
        case ILogger::Severity::kVERBOSE: return "verbose";
    }
    return "?";
}

class Logger final : public ILogger {
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override {
        try {
            note(std::string(severity_name(severity)) + ": " + (msg != nullptr ? msg : ""));
        } catch (...) {  // out of memory: drop the message
        }
    }
};

class LoggerFinder final : public ILoggerFinder {
public:
    ILogger* findLogger() override { return &mLogger; }

private:
    Logger mLogger;
};

LoggerFinder gFinder;

//! A dimension expression that is a build-time constant (every shape the harness gives is known).
class ConstantExpr final : public IDimensionExpr {
public:
    explicit ConstantExpr(int64_t value) {
        mStore.value = value;
        mImpl = &mStore;
    }
    ~ConstantExpr() noexcept override = default;

private:
    struct Store final : apiv::VDimensionExpr {
        int64_t value = 0;
        bool isConstant() const override { return true; }
        int64_t getConstantValue() const override { return value; }
        bool isSizeTensor() const override { return false; }
    } mStore;
};

//! IExprBuilder over constants: operations are evaluated at once (DimensionOperation semantics).
class ExprBuilder final : public IExprBuilder {
public:
    ExprBuilder() { mImpl = &mStore; }
    ~ExprBuilder() noexcept override = default;

private:
    struct Store final : apiv::VExprBuilder {
        std::vector<std::unique_ptr<ConstantExpr>> exprs;

        IDimensionExpr const* constant(int64_t value) override {
            exprs.push_back(std::make_unique<ConstantExpr>(value));
            return exprs.back().get();
        }
        IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& first,
                                        IDimensionExpr const& second) override {
            int64_t const a = first.getConstantValue(), b = second.getConstantValue();
            switch (op) {
                case DimensionOperation::kSUM: return constant(a + b);
                case DimensionOperation::kPROD: return constant(a * b);
                case DimensionOperation::kMAX: return constant(a > b ? a : b);
                case DimensionOperation::kMIN: return constant(a < b ? a : b);
                case DimensionOperation::kSUB: return constant(a - b);
                case DimensionOperation::kEQUAL: return constant(a == b ? 1 : 0);
                case DimensionOperation::kLESS: return constant(a < b ? 1 : 0);
                case DimensionOperation::kFLOOR_DIV:
                    return b == 0 ? nullptr : constant(a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0));
                case DimensionOperation::kCEIL_DIV:
                    return b == 0 ? nullptr : constant(a / b + ((a % b != 0) && ((a < 0) == (b < 0)) ? 1 : 0));
            }
            return nullptr;
        }
        IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override {
            return nullptr;  // no tieredkv plugin has a data-dependent output shape
        }
    } mStore;
};

//! What TensorRT hands attachToContext: no allocator and no error recorder of its own here.
class ResourceContext final : public IPluginResourceContext {
public:
    IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
    IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
};

void* gLibrary = nullptr;
std::vector<IPluginCreatorV3One*> gCreators;

Dims to_dims(tkvh_tensor_t const& t) {
    Dims d{};
    d.nbDims = t.nb_dims;
    for (int32_t i = 0; i < t.nb_dims && i < Dims::MAX_DIMS; ++i) d.d[i] = t.dims[i];
    return d;
}

//! A deep copy of a field collection (names and data), as an engine keeps a plugin's fields.
struct FieldCopy {
    std::vector<std::string> names;
    std::vector<std::vector<char>> data;
    std::vector<PluginField> fields;
    PluginFieldCollection collection{};

    //! Bytes of one element of a field (kINT4 / kFP4 fields are not copied: no tieredkv plugin has one).
    static size_t element_bytes(PluginFieldType type) {
        switch (type) {
            case PluginFieldType::kFLOAT64:
            case PluginFieldType::kINT64: return 8;
            case PluginFieldType::kFLOAT32:
            case PluginFieldType::kINT32: return 4;
            case PluginFieldType::kDIMS: return sizeof(Dims);
            case PluginFieldType::kFLOAT16:
            case PluginFieldType::kBF16:
            case PluginFieldType::kINT16: return 2;
            case PluginFieldType::kINT8:
            case PluginFieldType::kCHAR:
            case PluginFieldType::kFP8: return 1;
            default: return 0;
        }
    }

    explicit FieldCopy(PluginFieldCollection const& src) {
        names.reserve(static_cast<size_t>(src.nbFields));
        data.reserve(static_cast<size_t>(src.nbFields));
        for (int32_t i = 0; i < src.nbFields; ++i) {
            PluginField const& f = src.fields[i];
            names.emplace_back(f.name != nullptr ? f.name : "");
            size_t const bytes = f.data != nullptr && f.length > 0 ? element_bytes(f.type) * f.length : 0;
            char const* p = static_cast<char const*>(f.data);
            data.emplace_back(p, p + bytes);
        }
        for (int32_t i = 0; i < src.nbFields; ++i) {
            PluginField const& f = src.fields[i];
            fields.emplace_back(names[i].c_str(), data[i].empty() ? nullptr : data[i].data(), f.type, f.length);
        }
        collection.nbFields = static_cast<int32_t>(fields.size());
        collection.fields = fields.data();
    }
};

struct Case {
    std::string op;
    IPluginCreatorV3One* creator = nullptr;
    std::unique_ptr<IPluginV3> plugin;  // the build-phase plugin
    int64_t workspace = 0;
};

template <typename T>
T* capability(IPluginV3* plugin, PluginCapabilityType type, char const* kind) {
    auto* cap = plugin->getCapabilityInterface(type);
    if (cap == nullptr) return nullptr;
    if (std::strcmp(cap->getInterfaceInfo().kind, kind) != 0) {
        note(std::string("harness: capability is a ") + cap->getInterfaceInfo().kind + ", expected " + kind);
        return nullptr;
    }
    return static_cast<T*>(cap);
}

int fail(std::string const& what) {
    note("harness: " + what);
    return 1;
}

}  // namespace

int tkvh_open(char const* plugin_library) {
    std::lock_guard<std::mutex> lock(gMutex);
    if (gLibrary != nullptr) return static_cast<int>(gCreators.size());
    void* lib = dlopen(plugin_library, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        gLog += std::string("harness: dlopen failed: ") + dlerror() + "\n";
        return -1;
    }
    // the entry points IPluginRegistry::loadLibrary looks up, called in its order
    auto set_finder = reinterpret_cast<void (*)(ILoggerFinder*)>(dlsym(lib, "setLoggerFinder"));
    auto get = reinterpret_cast<IPluginCreatorInterface* const* (*)(int32_t&)>(dlsym(lib, "getCreators"));
    if (set_finder == nullptr || get == nullptr) {
        gLog += "harness: the library exports no setLoggerFinder / getCreators\n";
        dlclose(lib);
        return -1;
    }
    set_finder(&gFinder);
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = get(n);
    for (int32_t i = 0; i < n; ++i) {
        if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0) {
            gLog += std::string("harness: creator of kind ") + creators[i]->getInterfaceInfo().kind + "\n";
            continue;
        }
        gCreators.push_back(static_cast<IPluginCreatorV3One*>(creators[i]));
    }
    gLibrary = lib;
    return static_cast<int>(gCreators.size());
}

int64_t tkvh_creators(char* out, int64_t out_len) {
    std::string text;
    for (IPluginCreatorV3One* c : gCreators) {
        text += std::string(c->getPluginName()) + " " + c->getPluginVersion() + " " + c->getPluginNamespace();
        PluginFieldCollection const* names = c->getFieldNames();
        for (int32_t f = 0; names != nullptr && f < names->nbFields; ++f) {
            text += std::string(" ") + names->fields[f].name + ":" +
                    std::to_string(static_cast<int>(names->fields[f].type)) + ":" +
                    std::to_string(names->fields[f].length);
        }
        text += "\n";
    }
    if (out != nullptr && out_len > 0) {
        size_t const n = text.size() < static_cast<size_t>(out_len - 1) ? text.size() : static_cast<size_t>(out_len - 1);
        std::memcpy(out, text.data(), n);
        out[n] = '\0';
    }
    return static_cast<int64_t>(text.size());
}

void* tkvh_create(char const* op, tkvh_field_t const* fields, int32_t nb_fields) {
    try {
        IPluginCreatorV3One* creator = nullptr;
        for (IPluginCreatorV3One* c : gCreators) {  // the registry's lookup: name, version, namespace
            if (std::strcmp(c->getPluginName(), op) == 0 && std::strcmp(c->getPluginVersion(), "1") == 0 &&
                std::strcmp(c->getPluginNamespace(), "tieredkv") == 0) {
                creator = c;
            }
        }
        if (creator == nullptr) {
            note(std::string("harness: no creator ") + op + " version 1 namespace tieredkv");
            return nullptr;
        }
        std::vector<PluginField> fs;
        for (int32_t i = 0; i < nb_fields; ++i) {
            fs.emplace_back(fields[i].name, fields[i].data, static_cast<PluginFieldType>(fields[i].type),
                            fields[i].length);
        }
        PluginFieldCollection fc{static_cast<int32_t>(fs.size()), fs.data()};
        IPluginV3* plugin = creator->createPlugin(op, &fc, TensorRTPhase::kBUILD);
        if (plugin == nullptr) {
            note(std::string("harness: ") + op + ": createPlugin(kBUILD) returned null");
            return nullptr;
        }
        auto c = std::make_unique<Case>();
        c->op = op;
        c->creator = creator;
        c->plugin.reset(plugin);
        return c.release();
    } catch (...) {
        return nullptr;
    }
}

int tkvh_build(void* handle, tkvh_tensor_t const* inputs, int32_t nb_inputs, tkvh_tensor_t* outputs,
               int32_t max_outputs, int32_t* nb_outputs, int32_t* aliases, int64_t* workspace_bytes) {
    auto* c = static_cast<Case*>(handle);
    try {
        auto* core = capability<IPluginV3OneCore>(c->plugin.get(), PluginCapabilityType::kCORE, "PLUGIN_V3ONE_CORE");
        auto* build = capability<IPluginV3OneBuildV2>(c->plugin.get(), PluginCapabilityType::kBUILD,
                                                      "PLUGIN_V3ONE_BUILD");
        if (core == nullptr || build == nullptr) return fail(c->op + ": no V3One core / build capability");
        if (build->getInterfaceInfo().major != 2) return fail(c->op + ": the build capability is not version 2");
        if (std::strcmp(core->getPluginName(), c->creator->getPluginName()) != 0 ||
            std::strcmp(core->getPluginVersion(), c->creator->getPluginVersion()) != 0 ||
            std::strcmp(core->getPluginNamespace(), c->creator->getPluginNamespace()) != 0) {
            return fail(c->op + ": the plugin's name, version or namespace differ from its creator's");
        }
        int32_t const nout = build->getNbOutputs();
        if (nout > max_outputs || nout <= 0) return fail(c->op + ": " + std::to_string(nout) + " outputs");
        *nb_outputs = nout;
        std::vector<DataType> in_types(static_cast<size_t>(nb_inputs)), out_types(static_cast<size_t>(nout));
        for (int32_t i = 0; i < nb_inputs; ++i) in_types[i] = static_cast<DataType>(inputs[i].type);
        if (build->getOutputDataTypes(out_types.data(), nout, in_types.data(), nb_inputs) != 0) {
            return fail(c->op + ": getOutputDataTypes failed");
        }
        ExprBuilder exprs;
        std::vector<DimsExprs> in_exprs(static_cast<size_t>(nb_inputs)), out_exprs(static_cast<size_t>(nout));
        for (int32_t i = 0; i < nb_inputs; ++i) {
            in_exprs[i].nbDims = inputs[i].nb_dims;
            for (int32_t k = 0; k < inputs[i].nb_dims; ++k) in_exprs[i].d[k] = exprs.constant(inputs[i].dims[k]);
        }
        if (build->getOutputShapes(in_exprs.data(), nb_inputs, nullptr, 0, out_exprs.data(), nout, exprs) != 0) {
            return fail(c->op + ": getOutputShapes failed");
        }
        std::vector<DynamicPluginTensorDesc> io(static_cast<size_t>(nb_inputs + nout));
        for (int32_t i = 0; i < nb_inputs + nout; ++i) {
            DynamicPluginTensorDesc& d = io[i];
            if (i < nb_inputs) {
                d.desc.dims = to_dims(inputs[i]);
                d.desc.type = in_types[i];
            } else {
                int32_t const o = i - nb_inputs;
                d.desc.dims.nbDims = out_exprs[o].nbDims;
                for (int32_t k = 0; k < out_exprs[o].nbDims; ++k) {
                    if (out_exprs[o].d[k] == nullptr || !out_exprs[o].d[k]->isConstant()) {
                        return fail(c->op + ": output " + std::to_string(o) + " has a non-constant dimension");
                    }
                    d.desc.dims.d[k] = out_exprs[o].d[k]->getConstantValue();
                }
                d.desc.type = out_types[o];
                outputs[o].type = static_cast<int32_t>(out_types[o]);
                outputs[o].nb_dims = d.desc.dims.nbDims;
                for (int32_t k = 0; k < d.desc.dims.nbDims; ++k) outputs[o].dims[k] = d.desc.dims.d[k];
            }
            d.desc.format = TensorFormat::kLINEAR;
            d.desc.scale = 1.f;
            d.min = d.max = d.opt = d.desc.dims;
        }
        for (int32_t pos = 0; pos < nb_inputs + nout; ++pos) {
            if (!build->supportsFormatCombination(pos, io.data(), nb_inputs, nout)) {
                return fail(c->op + ": position " + std::to_string(pos) + " refuses type " +
                            std::to_string(static_cast<int>(io[pos].desc.type)) + " (linear)");
            }
        }
        if (build->configurePlugin(io.data(), nb_inputs, io.data() + nb_inputs, nout) != 0) {
            return fail(c->op + ": configurePlugin failed");
        }
        c->workspace = static_cast<int64_t>(build->getWorkspaceSize(io.data(), nb_inputs, io.data() + nb_inputs, nout));
        *workspace_bytes = c->workspace;
        for (int32_t o = 0; o < nout; ++o) aliases[o] = build->getAliasedInput(o);
        return 0;
    } catch (...) {
        return fail(c->op + ": exception in the build phase");
    }
}

int tkvh_enqueue(void* handle, tkvh_tensor_t const* inputs, int32_t nb_inputs, tkvh_tensor_t const* outputs,
                 int32_t nb_outputs, void* workspace, int64_t workspace_bytes, void* stream) {
    auto* c = static_cast<Case*>(handle);
    try {
        if (workspace_bytes < c->workspace) {
            return fail(c->op + ": a workspace of " + std::to_string(workspace_bytes) + " bytes, the plugin asked " +
                        std::to_string(c->workspace));
        }
        auto* rt = capability<IPluginV3OneRuntime>(c->plugin.get(), PluginCapabilityType::kRUNTIME,
                                                   "PLUGIN_V3ONE_RUNTIME");
        if (rt == nullptr) return fail(c->op + ": no V3One runtime capability");
        PluginFieldCollection const* serialized = rt->getFieldsToSerialize();
        if (serialized == nullptr) return fail(c->op + ": getFieldsToSerialize returned null");
        FieldCopy stored(*serialized);  // what an engine keeps of the plugin
        std::unique_ptr<IPluginV3> loaded(c->creator->createPlugin(c->op.c_str(), &stored.collection,
                                                                   TensorRTPhase::kRUNTIME));
        if (!loaded) return fail(c->op + ": createPlugin(kRUNTIME) from the serialized fields returned null");
        auto* loaded_rt = capability<IPluginV3OneRuntime>(loaded.get(), PluginCapabilityType::kRUNTIME,
                                                          "PLUGIN_V3ONE_RUNTIME");
        if (loaded_rt == nullptr) return fail(c->op + ": the runtime plugin has no runtime capability");
        ResourceContext context;
        std::unique_ptr<IPluginV3> attached(loaded_rt->attachToContext(&context));
        if (!attached) return fail(c->op + ": attachToContext returned null");
        auto* run = capability<IPluginV3OneRuntime>(attached.get(), PluginCapabilityType::kRUNTIME,
                                                    "PLUGIN_V3ONE_RUNTIME");
        if (run == nullptr) return fail(c->op + ": the attached plugin has no runtime capability");
        std::vector<PluginTensorDesc> in(static_cast<size_t>(nb_inputs)), out(static_cast<size_t>(nb_outputs));
        std::vector<void const*> in_ptrs(static_cast<size_t>(nb_inputs));
        std::vector<void*> out_ptrs(static_cast<size_t>(nb_outputs));
        for (int32_t i = 0; i < nb_inputs; ++i) {
            in[i] = PluginTensorDesc{to_dims(inputs[i]), static_cast<DataType>(inputs[i].type), TensorFormat::kLINEAR,
                                     1.f};
            in_ptrs[i] = inputs[i].data;
        }
        for (int32_t o = 0; o < nb_outputs; ++o) {
            out[o] = PluginTensorDesc{to_dims(outputs[o]), static_cast<DataType>(outputs[o].type),
                                      TensorFormat::kLINEAR, 1.f};
            out_ptrs[o] = outputs[o].data;
        }
        if (run->onShapeChange(in.data(), nb_inputs, out.data(), nb_outputs) != 0) {
            return fail(c->op + ": onShapeChange failed");
        }
        int const status = run->enqueue(in.data(), out.data(), in_ptrs.data(), out_ptrs.data(), workspace,
                                        static_cast<cudaStream_t>(stream));
        return status == 0 ? 0 : fail(c->op + ": enqueue returned " + std::to_string(status));
    } catch (...) {
        return fail(c->op + ": exception in the runtime phase");
    }
}

void tkvh_destroy(void* handle) { delete static_cast<Case*>(handle); }

int64_t tkvh_log(char* out, int64_t out_len) {
    std::lock_guard<std::mutex> lock(gMutex);
    int64_t const size = static_cast<int64_t>(gLog.size());
    if (out != nullptr && out_len > 0) {
        size_t const n = gLog.size() < static_cast<size_t>(out_len - 1) ? gLog.size() : static_cast<size_t>(out_len - 1);
        std::memcpy(out, gLog.data(), n);
        out[n] = '\0';
        gLog.clear();
    }
    return size;
}
