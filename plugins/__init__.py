"""tieredkv.plugins: every op's PyTorch reference, under the op's own name (the semantics
each ONNX function and CUDA kernel must match; docs/plugins.md lists where each op's
implementations live):

====================  ==============================  ==========================================
op                    reference                       ONNX form (``onnx_ops`` / ``onnx_codec``)
====================  ==============================  ==========================================
TieredAttention       ``tiered_attention``            ``onnx_ops.tiered_attention_function``
ImportanceScore       ``importance_score``            ``onnx_ops.importance_score_function``
SelectPages           ``select_pages``                ``onnx_ops.select_pages_function``
KVAppend              ``kv_append``                   ``onnx_ops.kv_append_function``
KVEncodePages         ``codec.encode_pages``          ``onnx_codec.encode_function`` (groups)
KVDecodePages         ``codec.decode_pages``          ``onnx_codec.decode_pages_function``
====================  ==============================  ==========================================

The ONNX forms need the ``onnx`` extra: import them explicitly; they are written with
``onnx_graph.OnnxGraph``, the graph builder the engine's step graph uses too. The CUDA kernels
are in ``plugins/csrc`` and, as PyTorch ops, in ``cuda_ops``.
"""

#: the custom ONNX domain of the ops, the TensorRT plugin namespace and the version of every op
DOMAIN = "tieredkv"
PLUGIN_NAMESPACE = "tieredkv"
PLUGIN_VERSION = "1"

from tieredkv.plugins.codec import decode_pages, encode_pages  # noqa: E402
from tieredkv.plugins.importance_score import (  # noqa: E402
    cosine_position_init,
    distance_bucket,
    importance_score,
    position_value,
    quest_upper_bound,
    relevance,
)
from tieredkv.plugins.kv_append import kv_append  # noqa: E402
from tieredkv.plugins.select_pages import select_pages  # noqa: E402
from tieredkv.plugins.tiered_attention import attention_over_pages, merge_attention, tiered_attention  # noqa: E402

__all__ = ["DOMAIN", "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "attention_over_pages", "cosine_position_init", "decode_pages", "distance_bucket", "encode_pages",
           "importance_score", "kv_append", "merge_attention", "position_value", "quest_upper_bound", "relevance",
           "select_pages", "tiered_attention"]
