"""ONNX graphs written as code: :class:`OnnxGraph` collects nodes (and, for a model's main
graph, initializers) under fresh value names, so that a function body or a whole step graph
reads as a sequence of ``g.op(...)`` calls.

It is what the ONNX forms of the tieredkv ops (``onnx_ops``, ``onnx_codec``: local-function
bodies) and the builder's step graph (``tieredkv.builder.export``) are written with. A name
given with ``out=`` is used as it is (a function's declared output, a graph output); every
other value gets ``<hint>_<n>``, unique within the graph.

    g = OnnxGraph()
    y = g.op("Mul", "x", g.const(2.0))
    g.op("Identity", y, out="y")
    fn = onnx.helper.make_function(domain, "Twice", ["x"], ["y"], g.nodes, opsets)
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

__all__ = ["OnnxGraph"]


class OnnxGraph:
    """Nodes, initializers and fresh value names of one ONNX graph or function body under
    construction."""

    def __init__(self) -> None:
        self.nodes: list = []
        self.initializers: list[TensorProto] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        """A new value name, ``<hint>_<n>``."""
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value: float | int | list, dtype: int = TensorProto.FLOAT) -> str:
        """A Constant node holding ``value`` (a scalar, or a list: a 1-D tensor) of ``dtype``."""
        out = self.fresh("c")
        dims = [len(value)] if isinstance(value, list) else []
        vals = value if isinstance(value, list) else [value]
        self.nodes.append(helper.make_node("Constant", [], [out], value=helper.make_tensor(out, dtype, dims, vals)))
        return out

    def array(self, values: np.ndarray, hint: str = "table") -> str:
        """A Constant node holding the numpy array ``values`` as it is (its dtype and shape)."""
        out = self.fresh(hint)
        self.nodes.append(helper.make_node("Constant", [], [out],
                                           value=numpy_helper.from_array(np.ascontiguousarray(values), out)))
        return out

    def op(self, op_type: str, *inputs: str, out: str | None = None, domain: str | None = None, **attrs) -> str:
        """One node of ``op_type`` (standard domain unless ``domain``) with one output; returns
        the output's name (``out``, or a fresh one)."""
        out = out or self.fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], domain=domain, **attrs))
        return out

    def initializer(self, name: str, array: np.ndarray) -> str:
        """A named initializer (a weight of the main graph) holding ``array``; returns ``name``."""
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def dim(self, x: str, i: int) -> str:
        """Dimension ``i`` of ``x`` as a 1-D int64 tensor of one element (ready for Concat)."""
        return self.op("Shape", x, start=i, end=i + 1)

    def unsqueeze(self, x: str, *axes: int) -> str:
        return self.op("Unsqueeze", x, self.const(list(axes), TensorProto.INT64))
