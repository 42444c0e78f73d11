"""Build plugins/csrc with CMake + nvcc (no GPU needed) and check what the libraries export.

Skipped unless ``nvcc`` and ``cmake`` are on PATH. The build must be free of compiler warnings
(csrc_build). The TensorRT plugin library is built and checked only when the ``TRT_INCLUDE_DIR``
environment variable names a directory holding ``NvInfer.h`` (run it against every TensorRT
header set supported: 10.x and 11.x); then a small C++ probe (compiled here against the same
headers) loads it without TensorRT and checks each creator's name, version, namespace and
attribute fields against the ONNX nodes of ``tieredkv.plugins.onnx_ops``, the dtypes each plugin
accepts (no bool or uint8 plugin tensor; TieredAttention also with a warm codec: 10 inputs), the
IPluginV3OneBuildV2 build capability and its aliases (KVAppend appends in place), and the
TieredAttention workspace request, and that the harness (plugins/csrc/trt_harness, run by
test_trt_plugins.py) needs no TensorRT or CUDA library. The ctypes binding of the C ABI, ``tieredkv.plugins.cuda_ops``,
is checked against every declaration of the header. The build is shared with test_codec.py and
test_cuda_ops.py (csrc_build)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
from csrc_build import SOURCE, build_plugins, needs_nvcc
from csrc_build import run as _run
from csrc_build import trt_include as _trt_include

from tieredkv.plugins import cuda_ops

C_ABI = ["tkv_tiered_attention", "tkv_tiered_attention_warm", "tkv_tiered_attention_host",
         "tkv_tiered_attention_workspace", "tkv_tiered_attention_plan", "tkv_tiered_attention_occupancy",
         "tkv_kv_append", "tkv_importance_score", "tkv_importance_score_ex", "tkv_importance_score_workspace",
         "tkv_codec_desc", "tkv_codec_desc_sizeof", "tkv_encode_pages", "tkv_decode_pages", "tkv_encode_pages_host",
         "tkv_decode_pages_host", "tkv_error_string"]

pytestmark = needs_nvcc


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    return build_plugins(tmp_path_factory)


def _exported(lib: Path) -> set[str]:
    if not shutil.which("nm"):
        pytest.skip("needs nm (binutils)")
    out = _run(["nm", "-D", "--defined-only", str(lib)]).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["T"]}


def test_kernels_library_exports_the_c_abi(build_dir):
    lib = build_dir / "libtieredkv_kernels.so"
    assert lib.is_file()
    assert set(C_ABI) <= _exported(lib)


#: ctypes types a C parameter type may be bound with (pointers: any pointer type)
_SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int, "float": ctypes.c_float}
_RESULTS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "const char*": ctypes.c_char_p}


def _binds(c_param: str, argtype) -> bool:
    if "*" in c_param:
        return argtype in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(argtype, ctypes._Pointer)
    c_type = " ".join(c_param.replace("const", "").split()[:-1])
    return _SCALARS.get(c_type) is argtype


def test_cuda_ops_binds_the_c_abi_with_the_header_signatures(build_dir):
    """tieredkv.plugins.cuda_ops calls the kernels through ctypes: its argument lists must match
    the C declarations in tieredkv_kernels.h (a mismatch only shows on the GPU machine): count, and
    per parameter a pointer for a pointer, the C scalar's ctypes type otherwise."""
    import re

    lib = cuda_ops.load_library(build_dir / "libtieredkv_kernels.so")  # loads without a GPU
    header = (SOURCE / "tieredkv_kernels.h").read_text()
    declared = re.findall(r"TKV_API\s+([^;(]*?)\s*\b(tkv_\w+)\(([^)]*)\)", header)
    assert sorted(name for _, name, _ in declared) == sorted(C_ABI)  # every declaration is bound and listed
    for result, name, params in declared:
        params = [] if params.strip() in ("", "void") else [x.strip() for x in params.split(",")]
        argtypes = getattr(lib, name).argtypes
        assert len(argtypes) == len(params), name
        for c_param, argtype in zip(params, argtypes):
            assert _binds(c_param, argtype), (name, c_param, argtype)
        assert getattr(lib, name).restype is _RESULTS[" ".join(result.split())], (name, result)
    assert lib.tkv_codec_desc_sizeof() == ctypes.sizeof(cuda_ops.CodecDesc)


def test_plugin_library_is_skipped_without_tensorrt_headers(build_dir):
    if _trt_include() is not None:
        pytest.skip("TRT_INCLUDE_DIR is set")
    assert not (build_dir / "libtieredkv_trt_plugins.so").exists()


@pytest.fixture(scope="module")
def plugin_lib(build_dir) -> Path:
    if _trt_include() is None:
        pytest.skip("set TRT_INCLUDE_DIR to a TensorRT include directory to build the plugins")
    lib = build_dir / "libtieredkv_trt_plugins.so"
    assert lib.is_file()
    return lib


def test_plugin_library_exports_get_creators(plugin_lib):
    assert {"getCreators", "setLoggerFinder"} <= _exported(plugin_lib)


def test_harness_needs_no_tensorrt_or_cuda_library(plugin_lib):
    """libtieredkv_trt_harness.so (built with the plugins) exports its C ABI and depends on the C
    and C++ runtimes only: what TensorRT would implement for a plugin, it implements itself."""
    harness = plugin_lib.parent / "libtieredkv_trt_harness.so"
    header = (SOURCE / "trt_harness" / "trt_harness.h").read_text()
    import re

    declared = set(re.findall(r"TKVH_API\s+[^;(]*?\b(tkvh_\w+)\(", header))
    assert declared and declared <= _exported(harness)
    if not shutil.which("readelf"):
        pytest.skip("needs readelf (binutils)")
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run(["readelf", "-d", str(harness)]).stdout)
    assert needed and all(re.match(r"lib(c|m|dl|gcc_s|stdc\+\+)\.so", n) for n in needed), needed


# Loads the plugin library with dlopen (no TensorRT, no GPU needed) and prints, per creator:
#   creator <name> <version> <namespace> <nb fields>
#   field <name> <type> <length>            (one per field)
#   check <what> ok|FAIL
#   alias <getAliasedInput of each output>
#   accepts <pos> <dtype codes accepted at pos, given earlier positions at their first accepted dtype>
# (each creator is made with every field: floats 0.25, 0.5, ...; strings empty), then for the
# TieredAttention variant with warm_codec "int4":
#   variant <name> <warm_codec>, then check / accepts lines as above (10 inputs), then
#   workspace <getWorkspaceSize at the largest sizes of a 70B-like decode>
_PROBE = r"""
#include <NvInferRuntime.h>
#include <dlfcn.h>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
using namespace nvinfer1;

// For each position: the dtypes accepted there, given earlier positions at their first accepted dtype.
static void print_accepts(IPluginV3OneBuild* build, DynamicPluginTensorDesc* io, int32_t nin, int32_t nout) {
    DataType candidates[] = {DataType::kFLOAT, DataType::kHALF, DataType::kINT8, DataType::kINT32,
                             DataType::kBOOL, DataType::kUINT8, DataType::kBF16, DataType::kINT64};
    for (int32_t pos = 0; pos < nin + nout; ++pos) {
        std::printf("accepts %d", pos);
        int first = -1;
        for (DataType t : candidates) {
            io[pos].desc.format = TensorFormat::kLINEAR;
            io[pos].desc.type = t;
            if (build->supportsFormatCombination(pos, io, nin, nout)) {
                std::printf(" %d", static_cast<int>(t));
                if (first < 0) first = static_cast<int>(t);
            }
        }
        std::printf("\n");
        io[pos].desc.type = static_cast<DataType>(first < 0 ? 0 : first);
    }
}

int main(int argc, char** argv) {
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) { std::printf("dlopen failed: %s\n", dlerror()); return 2; }
    auto get = reinterpret_cast<IPluginCreatorInterface* const* (*)(int32_t&)>(dlsym(lib, "getCreators"));
    if (get == nullptr) return 3;
    std::map<std::string, int32_t> inputs{{"TieredAttention", 8}, {"KVAppend", 6}, {"ImportanceScore", 8}};
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = get(n);
    for (int32_t i = 0; i < n; ++i) {
        if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0) return 4;
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        PluginFieldCollection const* names = c->getFieldNames();
        std::printf("creator %s %s %s %d\n", c->getPluginName(), c->getPluginVersion(), c->getPluginNamespace(),
                    names->nbFields);
        float values[8] = {0.25f, 0.5f, 0.25f, 0.125f, 0.f, 0.f, 0.f, 0.f};
        PluginField fields[8];
        for (int32_t f = 0; f < names->nbFields && f < 8; ++f) {
            PluginField const& x = names->fields[f];
            std::printf("field %s %d %d\n", x.name, static_cast<int>(x.type), x.length);
            bool text = x.type == PluginFieldType::kCHAR;  // optional strings: passed empty
            fields[f] = PluginField(x.name, text ? static_cast<void const*>("") : values, x.type, text ? 0 : x.length);
        }
        PluginFieldCollection fc{names->nbFields, fields};
        IPluginV3* p = c->createPlugin("probe", &fc, TensorRTPhase::kBUILD);
        std::printf("check create %s\n", p ? "ok" : "FAIL");
        if (p == nullptr) continue;
        PluginFieldCollection empty{0, nullptr};
        IPluginV3* missing = c->createPlugin("probe", &empty, TensorRTPhase::kBUILD);
        std::printf("check refuses_missing_fields %s\n", (names->nbFields == 0 || missing == nullptr) ? "ok" : "FAIL");
        delete missing;
        auto* core = static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
        auto* build = static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
        auto* rt = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        bool same = std::strcmp(core->getPluginName(), c->getPluginName()) == 0 &&
                    std::strcmp(core->getPluginVersion(), c->getPluginVersion()) == 0 &&
                    std::strcmp(core->getPluginNamespace(), c->getPluginNamespace()) == 0 &&
                    std::strcmp(build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0 &&
                    std::strcmp(rt->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0;
        std::printf("check capabilities %s\n", same ? "ok" : "FAIL");
        // the build capability is IPluginV3OneBuildV2 (version 2): it can alias outputs to inputs
        std::printf("check build_v2 %s\n", build->getInterfaceInfo().major == 2 ? "ok" : "FAIL");
        auto* build2 = static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
        std::printf("alias");
        for (int32_t o = 0; o < build->getNbOutputs(); ++o) std::printf(" %d", build2->getAliasedInput(o));
        std::printf("\n");
        PluginFieldCollection const* ser = rt->getFieldsToSerialize();
        bool values_kept = ser->nbFields == names->nbFields;
        for (int32_t f = 0; values_kept && f < ser->nbFields; ++f) {
            PluginField const& got = ser->fields[f];
            size_t elem = got.type == PluginFieldType::kCHAR ? 1 : sizeof(float);
            values_kept = std::strcmp(got.name, fields[f].name) == 0 && got.type == fields[f].type &&
                          got.length == fields[f].length &&
                          std::memcmp(got.data, fields[f].data, elem * got.length) == 0;
        }
        IPluginV3* again = c->createPlugin("probe", ser, TensorRTPhase::kRUNTIME);
        std::printf("check serialize_roundtrip %s\n", (values_kept && again != nullptr) ? "ok" : "FAIL");
        IPluginV3* copy = p->clone();
        std::printf("check clone %s\n", copy ? "ok" : "FAIL");
        int32_t nin = inputs[c->getPluginName()];
        int32_t nout = build->getNbOutputs();
        DynamicPluginTensorDesc io[16] = {};
        print_accepts(build, io, nin, nout);
        delete again;
        delete copy;
        delete p;
    }
    for (int32_t i = 0; i < n; ++i) {
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        if (std::strcmp(c->getPluginName(), "TieredAttention") != 0) continue;
        std::printf("variant TieredAttention int4\n");
        float scale = 0.125f;
        // a string of length 4, not NUL-terminated (as the ONNX parser passes string attributes)
        char const text[] = "int4xyz";
        PluginField wf[2] = {PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1),
                             PluginField("warm_codec", text, PluginFieldType::kCHAR, 4)};
        PluginFieldCollection wfc{2, wf};
        IPluginV3* p = c->createPlugin("probe", &wfc, TensorRTPhase::kBUILD);
        std::printf("check create %s\n", p ? "ok" : "FAIL");
        if (p == nullptr) break;
        PluginField unknown[2] = {wf[0], PluginField("warm_codec", "int3", PluginFieldType::kCHAR, 4)};
        PluginFieldCollection ufc{2, unknown};
        IPluginV3* refused = c->createPlugin("probe", &ufc, TensorRTPhase::kBUILD);
        std::printf("check refuses_unknown_codec %s\n", refused == nullptr ? "ok" : "FAIL");
        delete refused;
        PluginField typed[2] = {wf[0], PluginField("warm_codec", &scale, PluginFieldType::kFLOAT32, 1)};
        PluginFieldCollection tfc{2, typed};
        refused = c->createPlugin("probe", &tfc, TensorRTPhase::kBUILD);
        std::printf("check refuses_non_string_codec %s\n", refused == nullptr ? "ok" : "FAIL");
        delete refused;
        auto* build = static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
        auto* rt = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        PluginFieldCollection const* ser = rt->getFieldsToSerialize();
        bool kept = ser->nbFields == 2;
        for (int32_t f = 0; kept && f < ser->nbFields; ++f) {
            PluginField const& x = ser->fields[f];
            if (std::strcmp(x.name, "scale") == 0) {
                kept = x.type == PluginFieldType::kFLOAT32 && x.length == 1 && *static_cast<float const*>(x.data) == scale;
            } else {
                kept = std::strcmp(x.name, "warm_codec") == 0 && x.type == PluginFieldType::kCHAR && x.length == 4 &&
                       std::memcmp(x.data, "int4", 4) == 0;
            }
        }
        std::printf("check serialize_fields %s\n", kept ? "ok" : "FAIL");
        IPluginV3* again = c->createPlugin("probe", ser, TensorRTPhase::kRUNTIME);
        bool again_warm = false;
        DynamicPluginTensorDesc io[16] = {};
        if (again != nullptr) {
            auto* b2 = static_cast<IPluginV3OneBuild*>(again->getCapabilityInterface(PluginCapabilityType::kBUILD));
            io[8].desc.format = TensorFormat::kLINEAR;
            io[8].desc.type = DataType::kINT32;
            again_warm = b2->supportsFormatCombination(8, io, 10, 3) && !b2->supportsFormatCombination(0, io, 8, 3);
        }
        std::printf("check serialize_roundtrip %s\n", again_warm ? "ok" : "FAIL");
        IPluginV3* copy = p->clone();
        std::printf("check clone %s\n", copy ? "ok" : "FAIL");
        std::printf("check outputs %s\n", build->getNbOutputs() == 3 ? "ok" : "FAIL");
        io[0].desc.format = TensorFormat::kLINEAR;
        io[0].desc.type = DataType::kFLOAT;
        std::printf("check refuses_8_inputs %s\n", !build->supportsFormatCombination(0, io, 8, 3) ? "ok" : "FAIL");
        PluginFieldCollection plain_fc{1, wf};  // scale only: the plain op
        IPluginV3* plain = c->createPlugin("probe", &plain_fc, TensorRTPhase::kBUILD);
        bool plain_refuses = plain != nullptr &&
            !static_cast<IPluginV3OneBuild*>(plain->getCapabilityInterface(PluginCapabilityType::kBUILD))
                 ->supportsFormatCombination(0, io, 10, 3);
        std::printf("check plain_refuses_10_inputs %s\n", plain_refuses ? "ok" : "FAIL");
        delete plain;
        print_accepts(build, io, 10, build->getNbOutputs());
        // workspace at the largest sizes: q [2,64,3,128], pools [100,8,16,128], page_table [2,2048]
        DynamicPluginTensorDesc ws[13] = {};
        int64_t const q[4] = {2, 64, 3, 128}, pool[4] = {100, 8, 16, 128}, table[2] = {2, 2048};
        ws[0].max.nbDims = 4;
        ws[1].max.nbDims = 4;
        ws[2].max.nbDims = 4;
        ws[3].max.nbDims = 2;
        for (int32_t k = 0; k < 4; ++k) {
            ws[0].max.d[k] = q[k];
            ws[1].max.d[k] = pool[k];
            ws[2].max.d[k] = pool[k];
        }
        ws[3].max.d[0] = table[0];
        ws[3].max.d[1] = table[1];
        std::printf("workspace %zu\n", build->getWorkspaceSize(ws, 10, ws + 10, 3));
        delete again;
        delete copy;
        delete p;
    }
    return 0;
}
"""

# DataType codes (NvInferRuntimeBase.h): kFLOAT 0, kHALF 1, kINT32 3, kBF16 7, kINT64 8 (no plugin
# tensor is kBOOL 4 or kUINT8 5: TensorRT refuses those for plugin I/O);
# field types (NvInferPluginBase.h): kFLOAT32 1, kCHAR 6
_F32, _F16, _I32, _BF16, _I64 = 0, 1, 3, 7, 8
_FIELD_F32, _FIELD_CHAR = 1, 6
# TieredAttention: q f32, k_pool f32 / f16 / bf16 (v_pool: k_pool's type), page_table i64,
# page_mask i32, page_index / seq_len / past i64, outputs f32
_ATTENTION = [[_F32], [_F32, _F16, _BF16], [_F32], [_I64], [_I32], [_I64], [_I64], [_I64]]
_EXPECTED_TYPES = {
    "TieredAttention": _ATTENTION + [[_F32]] * 3,
    # with warm_codec: + warm_pool int32 words [W, NB / 4], warm_row int64 [B, M]
    "TieredAttention int4": _ATTENTION + [[_I32], [_I64]] + [[_F32]] * 3,
    "KVAppend": [[_F32, _F16, _BF16]] + [[_F32]] * 3 + [[_I64], [_I64]] + [[_F32]] * 2,
    # q, kmin: float32 / float16 / bfloat16; kmax: kmin's type (the probe gives kmin its first, float32)
    "ImportanceScore": [[_F32, _F16, _BF16]] * 2 + [[_F32]] + [[_I64], [_I64], [_F32], [_I32], [_F32], [_F32]],
}
#: getAliasedInput of each output: KVAppend appends in place (k_pool_out -> k_pool, v_pool_out -> v_pool)
_EXPECTED_ALIASES = {"TieredAttention": [-1, -1, -1], "KVAppend": [0, 1], "ImportanceScore": [-1]}
_EXPECTED_FIELDS = {
    "TieredAttention": [("scale", _FIELD_F32, 1), ("warm_codec", _FIELD_CHAR, 0)],  # warm_codec: any length
    "KVAppend": [],
    "ImportanceScore": [("weights", _FIELD_F32, 3), ("scale", _FIELD_F32, 1)],
}
_VARIANT_CHECKS = {"create", "refuses_unknown_codec", "refuses_non_string_codec", "serialize_fields",
                   "serialize_roundtrip", "clone", "outputs", "refuses_8_inputs", "plain_refuses_10_inputs"}


def test_plugin_creators_match_the_onnx_nodes(plugin_lib, tmp_path):
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_codec import PLUGIN_NAMESPACE, PLUGIN_VERSION
    from tieredkv.plugins.onnx_ops import IMPORTANCE_SCORE, KV_APPEND, TIERED_ATTENTION

    src = tmp_path / "probe.cpp"
    src.write_text(_PROBE)
    exe = tmp_path / "probe"
    # nvcc hands the host C++ file to the host compiler with the CUDA include path (the TensorRT
    # headers include cuda_runtime_api.h)
    _run(["nvcc", "-std=c++17", "-isystem", str(_trt_include()), str(src), "-o", str(exe), "-ldl"])
    out = _run([str(exe), str(plugin_lib)], timeout=60).stdout

    creators: dict[str, dict] = {}
    variants: dict[str, dict] = {}
    current = None
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "creator":
            current = creators[rest[0]] = {"version": rest[1], "namespace": rest[2], "fields": [], "checks": {},
                                           "accepts": []}
        elif kind == "variant":
            current = variants[" ".join(rest)] = {"checks": {}, "accepts": []}
        elif kind == "field":
            current["fields"].append((rest[0], int(rest[1]), int(rest[2])))
        elif kind == "check":
            current["checks"][rest[0]] = rest[1]
        elif kind == "accepts":
            current["accepts"].append([int(x) for x in rest[1:]])
        elif kind == "alias":
            current["alias"] = [int(x) for x in rest]
        elif kind == "workspace":
            current["workspace"] = int(rest[0])

    assert set(creators) == {TIERED_ATTENTION, KV_APPEND, IMPORTANCE_SCORE}
    for name, info in creators.items():
        assert (info["version"], info["namespace"]) == (PLUGIN_VERSION, PLUGIN_NAMESPACE), name
        assert info["fields"] == _EXPECTED_FIELDS[name], name
        assert info["checks"] and set(info["checks"].values()) == {"ok"}, (name, info["checks"])
        assert info["accepts"] == _EXPECTED_TYPES[name], name
        assert info["alias"] == _EXPECTED_ALIASES[name], name
    assert set(variants) == {"TieredAttention int4"}, out
    for name, info in variants.items():
        assert info["checks"] == {check: "ok" for check in _VARIANT_CHECKS}, (name, info["checks"])
        assert info["accepts"] == _EXPECTED_TYPES[name], name
    # the plugin asks TensorRT for the kernels' workspace bound at the largest sizes (split partials)
    kernels = cuda_ops.load_library(plugin_lib.parent / "libtieredkv_kernels.so")
    want = cuda_ops.attention_workspace_bytes(2, 64, 3, 128, 8, 2048, lib=kernels)
    assert want > 0 and variants["TieredAttention int4"]["workspace"] == want


def test_tiered_attention_warm_inputs_follow_the_onnx_node():
    """The warm TieredAttention plugin takes the ONNX node's 10 inputs in order, with the
    node's string attribute warm_codec (plugin field kCHAR)."""
    pytest.importorskip("onnx")
    from tieredkv.plugins.onnx_ops import tiered_attention_function

    fn = tiered_attention_function("int4", (3, 16, 64))
    assert list(fn.input)[8:] == ["warm_pool", "warm_row"] and len(fn.input) == 10
    assert "warm_codec" in list(fn.attribute)
