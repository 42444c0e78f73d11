"""A stand-in for TensorRT's Python module, where TensorRT cannot be installed (its wheels need
a GPU machine): the builder's TensorRT path (``builder/tensorrt_build.py``) runs against it.

Its enums are those of the TensorRT headers (``HEADER_ENUMS``: names, values and the
``TRT_DEPRECATED_ENUM`` marks of ``NvInfer*.h`` 10.16 and 11.1, the Python names being the C++
names without their ``k``); ``tests/builder/test_tensorrt_build.py`` checks them against the
headers of ``$TRT_INCLUDE_DIR`` when it is set (:func:`parse_header_enums`). A member that is
not in a version's headers does not exist in its stand-in (``BuilderFlag.FP16`` on 11.1), and
every member used is recorded, so a test can say that no deprecated member was touched.

What it models of TensorRT: the plugin registry (``load_library`` registers the creators the
test says the library holds), the ONNX parser (a node carrying ``plugin_namespace`` becomes a
V3 plugin layer named after the node when ``ENABLE_PLUGIN_OVERRIDE`` is set and its creator is
registered; otherwise its function body is inlined as standard layers, as older parsers do),
the network's creation flags, the builder config (flags, preview features, profiles) and a
build that fails as TensorRT's does on a strongly typed network given a precision flag, or on
a dynamic input without a shape in every profile.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

#: per TensorRT version, per enum: "NAME=value" members, "!" marking TRT_DEPRECATED_ENUM. Complete
#: for every enum but LayerType (the layer types the stand-in builds)
HEADER_ENUMS = {
    "10.16": {
        "NetworkDefinitionCreationFlag": "EXPLICIT_BATCH=0! STRONGLY_TYPED=1 PREFER_JIT_PYTHON_PLUGINS=2 "
                                         "PREFER_AOT_PYTHON_PLUGINS=3",
        "BuilderFlag": "FP16=0! INT8=1! DEBUG=2 GPU_FALLBACK=3 REFIT=4 DISABLE_TIMING_CACHE=5 TF32=6 SPARSE_WEIGHTS=7 "
                       "SAFETY_SCOPE=8! OBEY_PRECISION_CONSTRAINTS=9! PREFER_PRECISION_CONSTRAINTS=10! DIRECT_IO=11! "
                       "REJECT_EMPTY_ALGORITHMS=12! VERSION_COMPATIBLE=13 EXCLUDE_LEAN_RUNTIME=14 FP8=15! "
                       "ERROR_ON_TIMING_CACHE_MISS=16 BF16=17! DISABLE_COMPILATION_CACHE=18 STRIP_PLAN=19 "
                       "WEIGHTLESS=19! REFIT_IDENTICAL=20 WEIGHT_STREAMING=21 INT4=22! REFIT_INDIVIDUAL=23 "
                       "STRICT_NANS=24 MONITOR_MEMORY=25 FP4=26! EDITABLE_TIMING_CACHE=27 DISTRIBUTIVE_INDEPENDENCE=28",
        "PreviewFeature": "PROFILE_SHARING_0806=0! ALIASED_PLUGIN_IO_10_03=1 RUNTIME_ACTIVATION_RESIZE_10_10=2 "
                          "MULTIDEVICE_RUNTIME_10_16=3",
        "OnnxParserFlag": "NATIVE_INSTANCENORM=0 ENABLE_UINT8_AND_ASYMMETRIC_QUANTIZATION_DLA=1 "
                          "REPORT_CAPABILITY_DLA=2 ENABLE_PLUGIN_OVERRIDE=3 ADJUST_FOR_DLA=4",
        "PluginCapabilityType": "CORE=0 BUILD=1 RUNTIME=2",
        "DataType": "FLOAT=0 HALF=1 INT8=2 INT32=3 BOOL=4 UINT8=5 FP8=6 BF16=7 INT64=8 INT4=9 FP4=10 E8M0=11",
        "TensorIOMode": "NONE=0 INPUT=1 OUTPUT=2",
        "Severity": "INTERNAL_ERROR=0 ERROR=1 WARNING=2 INFO=3 VERBOSE=4",
        "LayerType": "MATRIX_MULTIPLY=17 ELEMENTWISE=9 SHUFFLE=13 PLUGIN=10 PLUGIN_V2=21 PLUGIN_V3=46",
    },
    "11.1": {
        "NetworkDefinitionCreationFlag": "STRONGLY_TYPED=0! PREFER_JIT_PYTHON_PLUGINS=1 PREFER_AOT_PYTHON_PLUGINS=2",
        "BuilderFlag": "DEBUG=2 GPU_FALLBACK=3 REFIT=4 DISABLE_TIMING_CACHE=5 TF32=6 SPARSE_WEIGHTS=7 SAFETY_SCOPE=8! "
                       "DIRECT_IO=11! VERSION_COMPATIBLE=12 EXCLUDE_LEAN_RUNTIME=13 ERROR_ON_TIMING_CACHE_MISS=15 "
                       "DISABLE_COMPILATION_CACHE=17 STRIP_PLAN=18 REFIT_IDENTICAL=19 WEIGHT_STREAMING=20 "
                       "REFIT_INDIVIDUAL=22 STRICT_NANS=23 MONITOR_MEMORY=24 EDITABLE_TIMING_CACHE=26 "
                       "DISTRIBUTIVE_INDEPENDENCE=27",
        "PreviewFeature": "ALIASED_PLUGIN_IO_10_03=0 RUNTIME_ACTIVATION_RESIZE_10_10=1",
        "OnnxParserFlag": "NATIVE_INSTANCENORM=0 ENABLE_UINT8_AND_ASYMMETRIC_QUANTIZATION_DLA=1 "
                          "REPORT_CAPABILITY_DLA=2 ENABLE_PLUGIN_OVERRIDE=3 ADJUST_FOR_DLA=4",
        "PluginCapabilityType": "CORE=0 BUILD=1 RUNTIME=2",
        "DataType": "FLOAT=0 HALF=1 INT8=2 INT32=3 BOOL=4 UINT8=5 FP8=6 BF16=7 INT64=8 INT4=9 FP4=10 E8M0=11",
        "TensorIOMode": "NONE=0 INPUT=1 OUTPUT=2",
        "Severity": "INTERNAL_ERROR=0 ERROR=1 WARNING=2 INFO=3 VERBOSE=4",
        "LayerType": "MATRIX_MULTIPLY=17 ELEMENTWISE=9 SHUFFLE=13 PLUGIN=10 PLUGIN_V2=21 PLUGIN_V3=46",
    },
}
#: enums listed with only some members (every other one is complete)
PARTIAL = {"LayerType"}
#: where the Python API puts a nested C++ enum (ILogger::Severity is trt.Logger.Severity and trt.Logger.*)
PYTHON_HOME = {"Severity": "Logger"}
#: TensorRT's Python aliases of DataType members
DTYPE_ALIASES = {"float32": "FLOAT", "float16": "HALF", "int8": "INT8", "int32": "INT32", "bool": "BOOL",
                 "uint8": "UINT8", "bfloat16": "BF16", "int64": "INT64"}


def members(version: str, enum: str) -> dict[str, tuple[int, bool]]:
    """{name: (value, deprecated)} of ``enum`` in the headers of ``version``."""
    out = {}
    for item in HEADER_ENUMS[version][enum].split():
        name, value = item.rstrip("!").split("=")
        out[name] = (int(value), item.endswith("!"))
    return out


def parse_header_enums(include_dir: Path) -> dict[str, dict[str, tuple[int | None, bool]]]:
    """Every ``enum class`` of the TensorRT headers in ``include_dir`` (NvInfer*.h, NvOnnx*.h):
    {enum: {member without its k: (value, deprecated)}}; a value given by an expression other
    than a number or another member is None."""
    text = "\n".join(f.read_text(errors="replace") for f in sorted(Path(include_dir).glob("Nv*.h")))
    text = re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)
    enums: dict[str, dict[str, tuple[int | None, bool]]] = {}
    for m in re.finditer(r"enum\s+class\s+(\w+)\s*:\s*\w+\s*\{(.*?)\}", text, flags=re.S):
        found: dict[str, tuple[int | None, bool]] = {}
        following: int | None = 0
        for item in m.group(2).split(","):
            mm = re.match(r"\s*k(\w+)(\s+TRT_DEPRECATED_ENUM)?\s*(?:=\s*(.+?))?\s*$", item, flags=re.S)
            if not mm:
                continue
            raw = mm.group(3)
            if raw is None:
                value = following
            elif re.fullmatch(r"\d+|0x[0-9a-fA-F]+", raw):
                value = int(raw, 0)
            else:
                value = found[raw[1:]][0] if raw.startswith("k") and raw[1:] in found else None
            found[mm.group(1)] = (value, bool(mm.group(2)))
            following = None if value is None else value + 1
        enums.setdefault(m.group(1), {}).update(found)
    return enums


def header_version(include_dir: Path) -> str:
    """"major.minor" of the TensorRT headers in ``include_dir`` (NvInferVersion.h)."""
    text = (Path(include_dir) / "NvInferVersion.h").read_text()
    major, minor = (re.search(rf"#define TRT_{part}_ENTERPRISE (\d+)", text).group(1) for part in ("MAJOR", "MINOR"))
    return f"{major}.{minor}"


class _Member(int):
    """An enum member: an int (its header value) with a name."""

    def __new__(cls, name: str, value: int):
        obj = super().__new__(cls, value)
        obj.name = name
        return obj

    def __repr__(self) -> str:
        return self.name


class _Enum:
    """An enum of the stand-in: the members of one version's headers; records each one used."""

    def __init__(self, name: str, version: str, used: list) -> None:
        self._name, self._members, self._used = name, members(version, name), used

    def __getattr__(self, attr: str):
        if attr.startswith("_") or attr not in self._members:
            raise AttributeError(f"tensorrt.{self._name} has no member {attr!r}")
        value, deprecated = self._members[attr]
        self._used.append((self._name, attr, deprecated))
        return _Member(f"{self._name}.{attr}", value)


def make_tensorrt(version: str, *, library_creators: tuple[str, ...] = ()) -> types.ModuleType:
    """The stand-in module for TensorRT ``version`` ("10.16" or "11.1"). ``load_library`` of any
    existing file registers ``library_creators`` (plugin names; version "1", namespace
    "tieredkv"). ``trt.used`` lists (enum, member, deprecated) of every member read."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = f"{version}.0"
    trt.used = []
    for enum in HEADER_ENUMS[version]:
        setattr(trt, PYTHON_HOME.get(enum, enum), _Enum(enum, version, trt.used))
    for alias, member in DTYPE_ALIASES.items():
        setattr(trt, alias, getattr(trt.DataType, member))
    trt.used.clear()
    severity = trt.Logger

    class Logger:
        def __init__(self, min_severity) -> None:
            self.min_severity = min_severity
            self.messages: list[str] = []

        def log(self, severity, message: str) -> None:
            self.messages.append(f"{severity!r}: {message}")

    for name in members(version, "Severity"):
        setattr(Logger, name, getattr(severity, name))
    trt.Logger = Logger
    trt.used.clear()

    class PluginRegistry:
        def __init__(self) -> None:
            self.creators: set[tuple[str, str, str]] = set()
            self.libraries: list[str] = []

        def load_library(self, path: str):
            if not Path(path).is_file():
                return None
            self.libraries.append(path)
            self.creators |= {(name, "1", "tieredkv") for name in library_creators}
            return object()

        def get_creator(self, name: str, version: str, namespace: str = ""):
            return (name, version, namespace) if (name, version, namespace) in self.creators else None

    registry = PluginRegistry()
    trt.get_plugin_registry = lambda: registry

    class Layer:
        def __init__(self, name: str, kind) -> None:
            self.name, self.type = name, kind

    class IPluginV3Layer(Layer):
        def __init__(self, name: str, plugin_name: str) -> None:
            super().__init__(name, trt.LayerType.PLUGIN_V3)
            self._plugin_name = plugin_name

        def get_plugin(self):
            core = types.SimpleNamespace(plugin_name=self._plugin_name, plugin_namespace="tieredkv", plugin_version="1")
            return types.SimpleNamespace(get_capability_interface=lambda kind: core if int(kind) == 0 else None)

    trt.IPluginV3Layer = IPluginV3Layer

    class Network:
        def __init__(self, flags: int) -> None:
            self.flags, self.layers, self.inputs = flags, [], {}

        @property
        def num_layers(self) -> int:
            return len(self.layers)

        def get_layer(self, i: int):
            return self.layers[i]

        @property
        def strongly_typed(self) -> bool:  # TensorRT 11: always
            if version.startswith("10."):
                return bool(self.flags & (1 << members(version, "NetworkDefinitionCreationFlag")["STRONGLY_TYPED"][0]))
            return True

    class OnnxParser:
        def __init__(self, network: Network, logger) -> None:
            self.network, self.flags, self.num_errors = network, set(), 0

        def set_flag(self, flag) -> None:
            self.flags.add(int(flag))

        def get_error(self, i: int) -> str:
            raise IndexError(i)

        def parse_from_file(self, path: str) -> bool:
            import onnx

            model = onnx.load(path, load_external_data=False)
            bodies = {f.name: f for f in model.functions}
            override = members(version, "OnnxParserFlag")["ENABLE_PLUGIN_OVERRIDE"][0] in self.flags
            self.network.inputs = {i.name: [d.dim_value if d.HasField("dim_value") else -1
                                            for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
            for node in model.graph.node:
                attrs = {a.name: a.s.decode() for a in node.attribute if a.name.startswith("plugin_")}
                if attrs and override and registry.get_creator(node.op_type, attrs["plugin_version"],
                                                               attrs["plugin_namespace"]):
                    self.network.layers.append(IPluginV3Layer(node.name, node.op_type))
                elif node.op_type in bodies:  # the function body, inlined
                    for inner in bodies[node.op_type].node:
                        self.network.layers.append(Layer(f"{node.name}/{inner.op_type}", trt.LayerType.ELEMENTWISE))
                else:
                    kind = trt.LayerType.MATRIX_MULTIPLY if node.op_type in ("Gemm", "MatMul") else \
                        trt.LayerType.ELEMENTWISE
                    self.network.layers.append(Layer(node.name, kind))
            return True

    trt.OnnxParser = OnnxParser

    class Profile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple] = {}

        def set_shape(self, name: str, lo, opt, hi) -> None:
            assert len(lo) == len(opt) == len(hi) and all(a <= b <= c for a, b, c in zip(lo, opt, hi)), name
            self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))

    class BuilderConfig:
        def __init__(self) -> None:
            self.flags, self.preview, self.profiles = set(), {}, []

        def set_flag(self, flag) -> None:
            self.flags.add(int(flag))

        def set_preview_feature(self, feature, enable: bool) -> None:
            self.preview[int(feature)] = enable

        def add_optimization_profile(self, profile: Profile) -> int:
            self.profiles.append(profile)
            return len(self.profiles) - 1

    class Builder:
        def __init__(self, logger) -> None:
            self.logger = logger

        def create_network(self, flags: int = 0) -> Network:
            return Network(flags)

        def create_builder_config(self) -> BuilderConfig:
            return BuilderConfig()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: BuilderConfig):
            precision = {value for name, (value, _) in members(version, "BuilderFlag").items()
                         if name in ("FP16", "BF16", "INT8", "FP8")}
            if network.strongly_typed and config.flags & precision:
                self.logger.log(trt.Logger.ERROR, "precision flags cannot be set on a strongly typed network")
                return None
            for profile in config.profiles:
                for name, dims in network.inputs.items():
                    if -1 in dims and name not in profile.shapes:
                        self.logger.log(trt.Logger.ERROR, f"{name}: dynamic input without a profile shape")
                        return None
                    if name in profile.shapes and len(profile.shapes[name][0]) != len(dims):
                        self.logger.log(trt.Logger.ERROR, f"{name}: profile rank differs from the input's")
                        return None
            return b"stand-in plan"

    trt.Builder = Builder
    return trt
