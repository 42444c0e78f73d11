"""tieredkv.plugins: the op specs as PyTorch references (the semantics every ONNX function
and CUDA kernel must match); the ONNX forms live in ``onnx_codec`` and ``onnx_ops``
(import them explicitly: they need the ``onnx`` extra). Specs: docs/plugins.md."""

from tieredkv.plugins.attention import attention_over_pages, merge_attention, tiered_attention
from tieredkv.plugins.importance import (
    cosine_position_init,
    distance_bucket,
    head_rank_relevance,
    importance_score,
    position_value,
    quest_upper_bound,
    relevance,
)

__all__ = ["attention_over_pages", "merge_attention", "tiered_attention", "cosine_position_init", "distance_bucket",
           "head_rank_relevance", "importance_score", "position_value", "quest_upper_bound", "relevance"]
