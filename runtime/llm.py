"""The batch API: ``tieredkv.LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from tieredkv.errors import ConfigError
from tieredkv.models.cache import KVCache
from tieredkv.models.hub import resolve_model
from tieredkv.models.llama import Llama
from tieredkv.models.loading import load_checkpoint
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.generate import Completion, GenerationStats, TokenEvent, generate
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not supported; expected one of {sorted(DTYPES)}") from None


def resolve_device(name: str | None) -> torch.device:
    """``cpu`` (default), ``cuda`` or ``cuda:N`` as a torch device, checked against what torch
    sees here (ConfigError naming the problem otherwise)."""
    if name is None:
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {name!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"device {name!r}: torch {torch.__version__} ({build}) sees no CUDA GPU here; use "
                              "--device cpu, or a machine with a GPU and a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: torch sees {torch.cuda.device_count()} GPU(s) (cuda:0 .. "
                              f"cuda:{torch.cuda.device_count() - 1})")
    return device


class LLM:
    """A Llama model with a tokenizer and a paged KV cache configuration.

    ``model``: None (the default SmolLM2), a known model name, a .gguf file or an HF
    directory. Each ``generate`` call uses a fresh cache, so calls are independent.
    ``device``: where the model runs (``cpu``, ``cuda``, ``cuda:N``); the plain cache's pools and
    the tiered cache's device tier live there, its host and disk tiers in host memory.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "float32", cache: PagedCacheConfig | None = None,
                 kv: TieredKVConfig | None = None, prefill_chunk: int = 512,
                 log: Callable[[str], None] | None = None, device: str | None = None) -> None:
        target = resolve_device(device)
        path = resolve_model(model, log=log)
        loaded = load_checkpoint(path, dtype=parse_dtype(dtype))
        self._init(loaded.model.to(target), loaded.tokenizer, cache, kv, prefill_chunk)
        self.source = path

    @classmethod
    def from_model(cls, model: Llama, tokenizer: Tokenizer | None = None, *, cache: PagedCacheConfig | None = None,
                   kv: TieredKVConfig | None = None, prefill_chunk: int = 512) -> "LLM":
        self = cls.__new__(cls)
        self._init(model, tokenizer, cache, kv, prefill_chunk)
        self.source = None
        return self

    @classmethod
    def from_engine(cls, engine_dir: str, *, backend: str = "auto", kv: TieredKVConfig | None = None,
                    prefill_chunk: int = 512, **backend_kwargs) -> "LLM":
        """An engine directory (builder/build_engine.py) run by an engine backend
        (tieredkv.runtime.engine) under the tiered cache: ``kv`` (default: unlimited budgets
        at the engine's page size, equal to the plain cache)."""
        from tieredkv.runtime.engine import load_engine

        loaded = load_engine(engine_dir, backend, **backend_kwargs)
        kv = kv or TieredKVConfig(page_size=loaded.model.engine.page_size)
        self = cls.from_model(loaded.model, loaded.tokenizer, kv=kv, prefill_chunk=prefill_chunk)
        self.source = loaded.source
        return self

    def _init(self, model: Llama, tokenizer: Tokenizer | None, cache: PagedCacheConfig | None,
              kv: TieredKVConfig | None, prefill_chunk: int) -> None:
        if prefill_chunk <= 0:
            raise ConfigError(f"prefill_chunk must be a positive integer, got {prefill_chunk}")
        if cache is not None and kv is not None:
            raise ConfigError("give either cache (a plain paged cache) or kv (the tiered cache), not both")
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        self.cache_config = cache or PagedCacheConfig()
        self.kv_config = kv
        self.prefill_chunk = prefill_chunk
        self.last_stats = GenerationStats()
        self.last_cache: KVCache | None = None

    def new_cache(self, *, full_tokens: int | None = None, num_sequences: int = 1) -> KVCache:
        """A plain paged cache, or the tiered cache when ``kv`` was given (percent budgets
        resolve against ``full_tokens`` per sequence)."""
        if self.kv_config is None:
            return PagedKVCache(self.model.kv_spec(), self.cache_config)
        return TieredKVCache(self.model.kv_spec(), self.kv_config, full_tokens=full_tokens,
                             num_sequences=num_sequences)

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer; pass prompts as lists of token ids")
        if chat:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | None = None, *, chat: bool = False,
                 on_token: Callable[[TokenEvent], bool | None] | None = None, errors: str = "raise",
                 progress: bool | None = None) -> list[Completion]:
        """Generate a completion for each prompt (text, or token ids), in input order, through the
        serving engine (all prompts admitted as the KV budget allows, decoded together).
        ``errors``: ``"raise"`` checks every prompt first and raises the first error;
        ``"report"`` gives a prompt that cannot run a completion with finish reason ``error``
        and goes on with the others. ``progress``: a progress bar per finished request (None:
        when stderr is a terminal). Statistics of the call are left in ``self.last_stats``."""
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self.encode(p, chat=chat) if isinstance(p, str) else list(p) for p in prompts]
        params = params or SamplingParams()
        self.last_stats = GenerationStats()
        # the work's full cache: prompt + new tokens, which generation stops at the model's context
        full = min(max(len(p) for p in ids) + params.max_new_tokens, self.config.max_position_embeddings) \
            if ids else None
        self.last_cache = self.new_cache(full_tokens=full, num_sequences=len(ids))
        bar = tqdm(total=len(ids), unit="req", desc="generate", disable=None if progress is None else not progress,
                   leave=False)
        try:
            return generate(self.model, self.last_cache, ids, params, tokenizer=self.tokenizer,
                            on_token=on_token, prefill_chunk=self.prefill_chunk, stats=self.last_stats,
                            errors=errors, progress=bar)
        finally:
            bar.close()
            self.last_cache.close()  # its statistics stay readable
