"""Llama models: configuration, checkpoint loaders, tokenizer, the reference model."""

from tieredkv.models.cache import ContiguousKVCache, KVCache, KVSpec, Step
from tieredkv.models.config import PRESETS, LlamaConfig, RopeScaling, preset
from tieredkv.models.hub import DEFAULT_MODEL, cache_dir, pull, resolve_model
from tieredkv.models.llama import Llama, decode_one_token, init_random_weights, prefill
from tieredkv.models.loading import LoadedModel, load_checkpoint, load_gguf, load_hf
from tieredkv.models.tokenizer import Tokenizer

__all__ = [
    "ContiguousKVCache", "KVCache", "KVSpec", "Step", "PRESETS", "LlamaConfig", "RopeScaling", "preset",
    "DEFAULT_MODEL", "cache_dir", "pull", "resolve_model", "Llama", "decode_one_token", "init_random_weights",
    "prefill", "LoadedModel", "load_checkpoint", "load_gguf", "load_hf", "Tokenizer",
]
