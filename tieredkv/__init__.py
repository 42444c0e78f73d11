"""tieredkv: an importance-aware, multi-tier KV cache for Llama inference."""

__version__ = "0.1.0"
