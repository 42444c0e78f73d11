"""The ctypes side of libtieredkv_trt_harness.so (plugins/csrc/trt_harness): drive a tieredkv
TensorRT plugin through its creator as TensorRT does — the fields of the op's ONNX node, the
build phase (output types and shapes, supported types, workspace, aliases), then the runtime
phase (serialized fields -> runtime plugin -> attachToContext -> onShapeChange -> enqueue) on
torch tensors — without TensorRT.

The libraries: ``$TIEREDKV_TRT_PLUGINS`` and ``$TIEREDKV_TRT_HARNESS`` (tools/gpu_check.sh sets
them to its build), else a CMake build of plugins/csrc here (needs nvcc, cmake and
``$TRT_INCLUDE_DIR``; tests/csrc_build.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

#: nvinfer1::DataType of a torch dtype
TRT_TYPES = {torch.float32: 0, torch.float16: 1, torch.int8: 2, torch.int32: 3, torch.bool: 4, torch.uint8: 5,
             torch.bfloat16: 7, torch.int64: 8}
TORCH_TYPES = {v: k for k, v in TRT_TYPES.items()}
#: nvinfer1::PluginFieldType
FIELD_FLOAT32, FIELD_CHAR = 1, 6


class _Tensor(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("nb_dims", ctypes.c_int32), ("dims", ctypes.c_int64 * 8),
                ("data", ctypes.c_void_p)]


class _Field(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("type", ctypes.c_int32), ("length", ctypes.c_int32),
                ("data", ctypes.c_void_p)]


def _tensor(t: torch.Tensor | None = None, dtype: torch.dtype | None = None, shape=None) -> _Tensor:
    out = _Tensor()
    shape = list(t.shape) if t is not None else list(shape)
    out.type = TRT_TYPES[t.dtype if t is not None else dtype]
    out.nb_dims = len(shape)
    for i, d in enumerate(shape):
        out.dims[i] = d
    out.data = t.data_ptr() if t is not None else None
    return out


@dataclass(frozen=True)
class Built:
    """What the build phase says: each output's dtype and shape, getAliasedInput of each
    output, and the workspace the plugin asks for."""

    outputs: list[tuple[torch.dtype, tuple[int, ...]]]
    aliases: list[int]
    workspace: int


def node_fields(node) -> list[tuple[str, int, bytes, int]]:
    """The plugin fields TensorRT's ONNX parser passes for ``node`` (an ONNX NodeProto): every
    attribute but plugin_namespace / plugin_version, a float (or floats) as kFLOAT32, a string as
    kCHAR of its length, not NUL-terminated. (name, field type, data, length)."""
    import onnx

    fields = []
    for a in node.attribute:
        if a.name in ("plugin_namespace", "plugin_version"):
            continue
        if a.type == onnx.AttributeProto.FLOAT:
            fields.append((a.name, FIELD_FLOAT32, torch.tensor([a.f], dtype=torch.float32).numpy().tobytes(), 1))
        elif a.type == onnx.AttributeProto.FLOATS:
            fields.append((a.name, FIELD_FLOAT32, torch.tensor(list(a.floats), dtype=torch.float32).numpy().tobytes(),
                           len(a.floats)))
        elif a.type == onnx.AttributeProto.STRING:
            fields.append((a.name, FIELD_CHAR, a.s, len(a.s)))
        else:
            raise ValueError(f"{node.op_type}: attribute {a.name} of type {a.type}: no tieredkv plugin field is one")
    return fields


class Harness:
    """The harness library with the plugin library open (once per process)."""

    def __init__(self, harness_library: str | Path, plugin_library: str | Path) -> None:
        lib = self.lib = ctypes.CDLL(str(harness_library))
        lib.tkvh_open.argtypes, lib.tkvh_open.restype = [ctypes.c_char_p], ctypes.c_int
        lib.tkvh_creators.argtypes, lib.tkvh_creators.restype = [ctypes.c_char_p, ctypes.c_int64], ctypes.c_int64
        lib.tkvh_create.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Field), ctypes.c_int32]
        lib.tkvh_create.restype = ctypes.c_void_p
        lib.tkvh_build.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Tensor), ctypes.c_int32, ctypes.POINTER(_Tensor),
                                   ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32),
                                   ctypes.POINTER(ctypes.c_int64)]
        lib.tkvh_build.restype = ctypes.c_int
        lib.tkvh_enqueue.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Tensor), ctypes.c_int32, ctypes.POINTER(_Tensor),
                                     ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.tkvh_enqueue.restype = ctypes.c_int
        lib.tkvh_destroy.argtypes, lib.tkvh_destroy.restype = [ctypes.c_void_p], None
        lib.tkvh_log.argtypes, lib.tkvh_log.restype = [ctypes.c_char_p, ctypes.c_int64], ctypes.c_int64
        if lib.tkvh_open(str(plugin_library).encode()) < 0:
            raise RuntimeError(f"the harness cannot open {plugin_library}: {self.log()}")

    def log(self) -> str:
        """What the plugins logged and the harness noted since the last call."""
        n = self.lib.tkvh_log(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.lib.tkvh_log(buf, n + 1)
        return buf.value.decode(errors="replace")

    def creators(self) -> list[str]:
        n = self.lib.tkvh_creators(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.lib.tkvh_creators(buf, n + 1)
        return buf.value.decode().splitlines()

    def plugin(self, op: str, fields: list[tuple[str, int, bytes, int]]) -> "Plugin":
        """createPlugin(fields, kBUILD) of op's creator; RuntimeError (with the log) when refused."""
        keep = [(name.encode(), data) for name, _, data, _ in fields]  # alive for the call
        arr = (_Field * max(1, len(fields)))()
        for i, ((name, kind, _, length), (bname, data)) in enumerate(zip(fields, keep)):
            arr[i] = _Field(bname, kind, length, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p))
        handle = self.lib.tkvh_create(op.encode(), arr, len(fields))
        if not handle:
            raise RuntimeError(f"{op}: the creator refused the fields: {self.log()}")
        return Plugin(self, op, handle)


class Plugin:
    """One plugin made by its creator for the build phase."""

    def __init__(self, harness: Harness, op: str, handle: int) -> None:
        self.harness, self.op, self.handle = harness, op, handle

    def __del__(self) -> None:
        if self.handle:
            self.harness.lib.tkvh_destroy(self.handle)

    def build(self, inputs: list[tuple[torch.dtype, tuple[int, ...]]]) -> Built:
        """The build phase for inputs of these (dtype, shape); RuntimeError (with the log) when
        the plugin refuses them."""
        ins = (_Tensor * len(inputs))(*[_tensor(dtype=d, shape=s) for d, s in inputs])
        outs = (_Tensor * 8)()
        n, aliases, ws = ctypes.c_int32(0), (ctypes.c_int32 * 8)(), ctypes.c_int64(0)
        if self.harness.lib.tkvh_build(self.handle, ins, len(inputs), outs, 8, ctypes.byref(n), aliases,
                                       ctypes.byref(ws)) != 0:
            raise RuntimeError(f"{self.op}: build phase failed: {self.harness.log()}")
        return Built([(TORCH_TYPES[outs[i].type], tuple(outs[i].dims[: outs[i].nb_dims])) for i in range(n.value)],
                     list(aliases[: n.value]), ws.value)

    def enqueue(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], workspace: torch.Tensor | None,
                stream: int) -> None:
        """The runtime phase on these tensors (contiguous, on the GPU; an output that is its
        aliased input's tensor is written in place) on ``stream`` (a cudaStream_t as an int);
        RuntimeError (with the log) when a step fails. Synchronize before reading the outputs."""
        ins = (_Tensor * len(inputs))(*[_tensor(t) for t in inputs])
        outs = (_Tensor * len(outputs))(*[_tensor(t) for t in outputs])
        ws, ws_bytes = (workspace.data_ptr(), workspace.numel()) if workspace is not None else (None, 0)
        if self.harness.lib.tkvh_enqueue(self.handle, ins, len(inputs), outs, len(outputs), ws, ws_bytes, stream) != 0:
            raise RuntimeError(f"{self.op}: runtime phase failed: {self.harness.log()}")
