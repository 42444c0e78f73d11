"""Build plugins/csrc with CMake + nvcc (no GPU needed) and check what the libraries export.

Skipped unless ``nvcc`` and ``cmake`` are on PATH. The TensorRT plugin library is built and
checked only when the ``TRT_INCLUDE_DIR`` environment variable names a directory holding
``NvInfer.h``; then a small C++ probe (compiled here against the same headers) loads it without
TensorRT and checks each creator's name, version, namespace and attribute fields against the
ONNX nodes of ``tieredkv.plugins.onnx_ops``, and the dtypes each plugin accepts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "plugins" / "csrc"
C_ABI = ["tkv_tiered_attention", "tkv_kv_append", "tkv_importance_score", "tkv_error_string"]

pytestmark = pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("cmake")),
                                reason="needs nvcc and cmake on PATH")


def _trt_include() -> Path | None:
    value = os.environ.get("TRT_INCLUDE_DIR")
    if value and (Path(value) / "NvInfer.h").is_file():
        return Path(value)
    return None


def _run(cmd: list[str], timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("plugins_build")
    cmd = ["cmake", "-S", str(SOURCE), "-B", str(build)]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    if _trt_include() is not None:
        cmd.append(f"-DTRT_INCLUDE_DIR={_trt_include()}")
    configure = _run(cmd)
    if _trt_include() is None:
        assert "skipping tieredkv_trt_plugins" in configure.stdout
    _run(["cmake", "--build", str(build), "-j2"])
    return build


def _exported(lib: Path) -> set[str]:
    if not shutil.which("nm"):
        pytest.skip("needs nm (binutils)")
    out = _run(["nm", "-D", "--defined-only", str(lib)]).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["T"]}


def test_kernels_library_exports_the_c_abi(build_dir):
    lib = build_dir / "libtieredkv_kernels.so"
    assert lib.is_file()
    assert set(C_ABI) <= _exported(lib)


def test_gpu_check_binds_the_c_abi_with_the_header_signatures(build_dir):
    """tools/gpu_check.py calls the kernels through ctypes: its argument lists must match the
    C declarations in tieredkv_kernels.h (a mismatch only shows on the GPU machine)."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    lib = gpu_check.load_library(build_dir / "libtieredkv_kernels.so")  # loads without a GPU
    header = (SOURCE / "tieredkv_kernels.h").read_text()
    for name in C_ABI:
        params = re.search(rf"\b{name}\(([^)]*)\)", header).group(1)
        assert len(getattr(lib, name).argtypes) == len(params.split(",")), name


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


# Loads the plugin library with dlopen (no TensorRT, no GPU needed) and prints, per creator:
#   creator <name> <version> <namespace> <nb fields>
#   field <name> <type> <length>            (one per field)
#   check <what> ok|FAIL
#   accepts <pos> <dtype codes accepted at pos, given earlier positions at their first accepted dtype>
_PROBE = r"""
#include <NvInferRuntime.h>
#include <dlfcn.h>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
using namespace nvinfer1;

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
            fields[f] = PluginField(x.name, values, x.type, x.length);
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
        PluginFieldCollection const* ser = rt->getFieldsToSerialize();
        bool values_kept = ser->nbFields == names->nbFields;
        for (int32_t f = 0; values_kept && f < ser->nbFields; ++f) {
            values_kept = std::memcmp(ser->fields[f].data, values, sizeof(float) * ser->fields[f].length) == 0;
        }
        IPluginV3* again = c->createPlugin("probe", ser, TensorRTPhase::kRUNTIME);
        std::printf("check serialize_roundtrip %s\n", (values_kept && again != nullptr) ? "ok" : "FAIL");
        IPluginV3* copy = p->clone();
        std::printf("check clone %s\n", copy ? "ok" : "FAIL");
        int32_t nin = inputs[c->getPluginName()];
        int32_t nout = build->getNbOutputs();
        DynamicPluginTensorDesc io[16] = {};
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
        delete again;
        delete copy;
        delete p;
    }
    return 0;
}
"""

# DataType codes (NvInferRuntimeBase.h): kFLOAT 0, kHALF 1, kBOOL 4, kBF16 7, kINT64 8; kFLOAT32 field type 1
_F32, _F16, _BOOL, _BF16, _I64 = 0, 1, 4, 7, 8
_EXPECTED_TYPES = {
    "TieredAttention": [[_F32]] * 3 + [[_I64], [_BOOL], [_I64], [_I64], [_I64]] + [[_F32]] * 3,
    "KVAppend": [[_F32, _F16, _BF16]] + [[_F32]] * 3 + [[_I64], [_I64]] + [[_F32]] * 2,
    "ImportanceScore": [[_F32]] * 3 + [[_I64], [_I64], [_F32], [_BOOL], [_F32], [_F32]],
}
_EXPECTED_FIELDS = {
    "TieredAttention": [("scale", 1, 1)],
    "KVAppend": [],
    "ImportanceScore": [("weights", 1, 3), ("scale", 1, 1)],
}


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
    current = None
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "creator":
            current = creators[rest[0]] = {"version": rest[1], "namespace": rest[2], "fields": [], "checks": {},
                                           "accepts": []}
        elif kind == "field":
            current["fields"].append((rest[0], int(rest[1]), int(rest[2])))
        elif kind == "check":
            current["checks"][rest[0]] = rest[1]
        elif kind == "accepts":
            current["accepts"].append([int(x) for x in rest[1:]])

    assert set(creators) == {TIERED_ATTENTION, KV_APPEND, IMPORTANCE_SCORE}
    for name, info in creators.items():
        assert (info["version"], info["namespace"]) == (PLUGIN_VERSION, PLUGIN_NAMESPACE), name
        assert info["fields"] == _EXPECTED_FIELDS[name], name
        assert info["checks"] and set(info["checks"].values()) == {"ok"}, (name, info["checks"])
        assert info["accepts"] == _EXPECTED_TYPES[name], name
