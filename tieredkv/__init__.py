"""tieredkv: an importance-aware, multi-tier KV cache for Llama inference.

Public API (imported lazily, so `tieredkv --help` does not load torch)::

    from tieredkv import LLM, SamplingParams
    llm = LLM()                      # default model: SmolLM2-135M-Instruct, pulled on first use
    out = llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=16))

    # a server's engine: EngineArgs(...).build().engine, stepped on a thread by AsyncEngine
    from tieredkv import AsyncEngine, EngineArgs
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "tieredkv.runtime.llm",
    "AsyncEngine": "tieredkv.runtime.serving.engine",
    "EngineArgs": "tieredkv.runtime.serving.deploy",
    "SamplingParams": "tieredkv.runtime.sampling",
    "Completion": "tieredkv.runtime.generate",
    "TokenEvent": "tieredkv.runtime.generate",
    "GenerationStats": "tieredkv.runtime.generate",
    "PagedCacheConfig": "tieredkv.runtime.paged",
    "PagedKVCache": "tieredkv.runtime.paged",
    "TieredKVConfig": "tieredkv.runtime.tiered.config",
    "TieredKVCache": "tieredkv.runtime.tiered.cache",
    "LlamaConfig": "tieredkv.models.config",
    "load_checkpoint": "tieredkv.models.loading",
    "errors": "tieredkv.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tieredkv' has no attribute {name!r}")
    mod = importlib.import_module(module)
    return mod if name == "errors" else getattr(mod, name)
