"""The batch API: ``tieredkv.LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from tieredkv.errors import ConfigError, PromptError, short
from tieredkv.models import cpu_attention
from tieredkv.models.cache import KVCache
from tieredkv.models.hub import resolve_model
from tieredkv.models.llama import Llama
from tieredkv.models.loading import load_checkpoint
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.generate import (BATCH_MAX_SEQS, ERRORS, Completion, GenerationStats, TokenEvent, batch_scheduler,
                                       run_batch)
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache
from tieredkv.runtime.serving.engine import Engine
from tieredkv.runtime.serving.prefix import PrefixConfig
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving.prompts import check_text, check_token_ids
from tieredkv.runtime.tiered.budgets import Budget
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
    ``max_model_len``: the longest sequence, prompt + output (default: the model's context);
    a percentage budget of ``kv`` (``device_budget="25%"``) is that share of the full cache's
    KV for ``max_model_len`` tokens per sequence decoded at once (the prompts of a call, at
    most 256), whatever the prompts' lengths — as a server's is of its served length.

    ``prefix_caching`` (default on, as in vLLM's ``LLM``): the cache and its prefix index
    outlive a call, so prompts that share a prefix — within a call and across calls — prefill
    it once; ``last_stats`` reports the prompt tokens found (``cached_tokens``) and the pages
    by the tier that held them (``prefix_hit_pages``). Pages no sequence lists stay indexed up
    to ``prefix_cache_tokens`` tokens (default ``max_model_len``; least recently used go
    first). A call whose percentage budgets resolve differently (another number of prompts)
    starts a new cache. Off: every call runs on a fresh cache and computes every prompt.
    :meth:`close` (or ``with LLM(...) as llm``) releases the cache.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "float32", cache: PagedCacheConfig | None = None,
                 kv: TieredKVConfig | None = None, prefill_chunk: int = 512,
                 log: Callable[[str], None] | None = None, device: str | None = None,
                 max_model_len: int | None = None, prefix_caching: bool = True,
                 prefix_cache_tokens: int | None = None) -> None:
        target = resolve_device(device)
        path = resolve_model(model, log=log)
        loaded = load_checkpoint(path, dtype=parse_dtype(dtype))
        self._init(loaded.model.to(target), loaded.tokenizer, cache, kv, prefill_chunk, max_model_len,
                   prefix_caching, prefix_cache_tokens)
        self.source = path
        cpu_attention.prepare(target, loaded.model.dtype, log=log)  # its build is no decode step's time

    @classmethod
    def from_model(cls, model: Llama, tokenizer: Tokenizer | None = None, *, cache: PagedCacheConfig | None = None,
                   kv: TieredKVConfig | None = None, prefill_chunk: int = 512,
                   max_model_len: int | None = None, prefix_caching: bool = True,
                   prefix_cache_tokens: int | None = None) -> "LLM":
        self = cls.__new__(cls)
        self._init(model, tokenizer, cache, kv, prefill_chunk, max_model_len, prefix_caching, prefix_cache_tokens)
        self.source = None
        return self

    @classmethod
    def from_engine(cls, engine_dir: str, *, backend: str = "auto", kv: TieredKVConfig | None = None,
                    prefill_chunk: int = 512, max_model_len: int | None = None, prefix_caching: bool = True,
                    **backend_kwargs) -> "LLM":
        """An engine directory (builder/build_engine.py) run by an engine backend
        (tieredkv.runtime.engine) under the tiered cache: ``kv`` (default: unlimited budgets
        at the engine's page size, equal to the plain cache)."""
        from tieredkv.runtime.engine import load_engine

        loaded = load_engine(engine_dir, backend, **backend_kwargs)
        kv = kv or TieredKVConfig(page_size=loaded.model.engine.page_size)
        self = cls.from_model(loaded.model, loaded.tokenizer, kv=kv, prefill_chunk=prefill_chunk,
                              max_model_len=max_model_len, prefix_caching=prefix_caching)
        self.source = loaded.source
        return self

    def _init(self, model: Llama, tokenizer: Tokenizer | None, cache: PagedCacheConfig | None,
              kv: TieredKVConfig | None, prefill_chunk: int, max_model_len: int | None,
              prefix_caching: bool = True, prefix_cache_tokens: int | None = None) -> None:
        if prefill_chunk <= 0:
            raise ConfigError(f"prefill_chunk must be a positive integer, got {prefill_chunk}")
        if cache is not None and kv is not None:
            raise ConfigError("give either cache (a plain paged cache) or kv (the tiered cache), not both")
        context = model.config.max_position_embeddings
        if max_model_len is not None and (not isinstance(max_model_len, int) or isinstance(max_model_len, bool)
                                          or not 2 <= max_model_len <= context):
            raise ConfigError(f"max_model_len must be an integer in [2, {context}] (the model's context), got "
                              f"{short(max_model_len)}")
        self.max_model_len = max_model_len or context
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        self.cache_config = cache or PagedCacheConfig()
        self.kv_config = kv
        self.prefill_chunk = prefill_chunk
        if not isinstance(prefix_caching, bool):
            raise ConfigError(f"prefix_caching must be True or False, got {short(prefix_caching)}")
        if prefix_cache_tokens is not None and (not isinstance(prefix_cache_tokens, int)
                                                or isinstance(prefix_cache_tokens, bool) or prefix_cache_tokens < 0):
            raise ConfigError(f"prefix_cache_tokens must be a non-negative integer or None, got "
                              f"{short(prefix_cache_tokens)}")
        self.prefix_caching = prefix_caching
        self.prefix_cache_tokens = self.max_model_len if prefix_cache_tokens is None else prefix_cache_tokens
        self.last_stats = GenerationStats()
        self.last_cache: KVCache | None = None
        self._engine: Engine | None = None
        self._engine_key = None  # what the engine's cache was resolved for (its percent budgets' sequences)

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
        check_text(prompt, "the prompt")
        if chat:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def prompt_ids(self, prompt, *, index: int = 0, chat: bool = False) -> list[int]:
        """One prompt of :meth:`generate` as token ids: text (a str) is encoded, token ids are
        checked against the vocabulary; anything else (bytes, None, a number) is a PromptError."""
        what = f"prompt {index}"
        if isinstance(prompt, str):
            try:
                return self.encode(prompt, chat=chat)
            except PromptError as exc:
                raise PromptError(str(exc).replace("the prompt", what, 1)) from None
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise PromptError(f"{what} is {type(prompt).__name__}, not text: expected a str (decode the bytes first, "
                              "e.g. .decode('utf-8')) or a list of token ids")
        if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:  # a tensor or an array of ids
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple, range)):
            raise PromptError(f"{what} is {short(prompt)} ({type(prompt).__name__}); expected text (a str) or a list "
                              "of token ids")
        return check_token_ids(prompt, what, self.config.vocab_size)

    def _engine_for(self, num_prompts: int) -> Engine:
        """The engine of a call: the kept one when its cache suits the call, else a new one
        (percentages are of max_model_len tokens for each sequence decoded at once)."""
        num_sequences = min(max(1, num_prompts), BATCH_MAX_SEQS)
        key = num_sequences if self._budgets_per_sequence() else None
        if self._engine is not None and self._engine_key == key:
            return self._engine
        self._drop_engine()
        cache = self.new_cache(full_tokens=self.max_model_len, num_sequences=num_sequences)
        prefix = None
        if self.prefix_caching:
            prefix = PrefixConfig(max_cached_pages=-(-self.prefix_cache_tokens // cache.page_size))
        self._engine = Engine(self.model, cache, tokenizer=self.tokenizer, prefix=prefix, keep_finished=False,
                              scheduler=batch_scheduler(BATCH_MAX_SEQS, self.prefill_chunk, self.max_model_len))
        self._engine_key = key
        self.last_cache = cache
        return self._engine

    def _budgets_per_sequence(self) -> bool:
        """Whether the tiered cache's budgets scale with the sequences decoded at once
        (percentages and token counts are per sequence; bytes are for the whole cache)."""
        if self.kv_config is None:
            return False
        b = self.kv_config.budgets
        parsed = (Budget.parse(v) for v in (b.device, b.host, b.attention))
        return any(p is not None and p.kind != "bytes" for p in parsed)

    def _drop_engine(self) -> None:
        if self._engine is not None:
            if self._engine.prefix is not None:
                self._engine.prefix.clear()  # the pages only the index held are freed
            self._engine.cache.close()  # its statistics stay readable (last_cache)
        self._engine = self._engine_key = None

    def close(self) -> None:
        """Release the kept cache and its prefix index (a later call starts a new one)."""
        self._drop_engine()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | None = None, *, chat: bool = False,
                 on_token: Callable[[TokenEvent], bool | None] | None = None, errors: str = "raise",
                 progress: bool | None = None) -> list[Completion]:
        """Generate a completion for each prompt (text, or token ids), in input order, through the
        serving engine (all prompts admitted as the KV budget allows, decoded together).
        ``errors``: ``"raise"`` checks every prompt first and raises the first error;
        ``"report"`` gives a prompt that cannot run a completion with finish reason ``error``
        and goes on with the others — a prompt that is not text or token ids, or not valid
        Unicode, included. ``progress``: a progress bar per finished request (None: when
        stderr is a terminal). Statistics of the call are left in ``self.last_stats``."""
        if errors not in ERRORS:
            raise ConfigError(f"errors must be one of {list(ERRORS)}, got {errors!r}")
        prompts = [prompts] if isinstance(prompts, (str, bytes)) else list(prompts)
        ids, refused = [], {}
        for i, p in enumerate(prompts):
            try:
                ids.append(self.prompt_ids(p, index=i, chat=chat))
            except PromptError as exc:
                if errors == "raise":
                    raise
                refused[i] = f"{type(exc).__name__}: {exc}"
        params = params or SamplingParams()
        self.last_stats = GenerationStats()
        engine = self._engine_for(len(ids))
        bar = tqdm(total=len(prompts), unit="req", desc="generate",
                   disable=None if progress is None else not progress, leave=False)
        bar.update(len(refused))
        try:
            outs = iter(run_batch(engine, ids, params, on_token=on_token, stats=self.last_stats, errors=errors,
                                  progress=bar))
        except BaseException:
            self._drop_engine()  # requests may be left mid-step: the next call starts clean
            raise
        finally:
            bar.close()
            if not self.prefix_caching:
                self._drop_engine()  # its statistics stay readable in last_cache
        results = []
        for i in range(len(prompts)):
            if i in refused:
                results.append(Completion(i, [], finish_reason="error", error=refused[i]))
            else:
                results.append(next(outs))
                results[-1].index = i
        return results
