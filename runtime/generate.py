"""Batched generation over a KV cache: a batch job on the serving engine
(``runtime/serving``), every prompt admitted at once, prefilled in chunks, then decoded
together; the figures a batch job reports (:class:`GenerationStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tieredkv.errors import ConfigError, ContextLengthError, TieredKVError
from tieredkv.models.cache import KVCache
from tieredkv.models.llama import Llama
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving.engine import Engine
from tieredkv.runtime.serving.request import Completion, TokenEvent
from tieredkv.runtime.serving.scheduler import SchedulerConfig

__all__ = ["ERRORS", "Completion", "GenerationStats", "TokenEvent", "batch_scheduler", "generate", "run_batch",
           "validate_prompts"]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens fed through decode steps (sum of batch sizes)
    kv_bytes_peak: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)
    prefix_hit_pages: dict = field(default_factory=dict)  # those pages by the tier that held them

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "decode_steps": self.decode_steps,
            "decode_tokens": self.decode_tokens,
            "prefill_tok_s": round(self.prefill_tok_s, 2),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "kv_bytes_peak": self.kv_bytes_peak,
            "cached_tokens": self.cached_tokens,
            "prefix_hit_pages": dict(self.prefix_hit_pages),
        }


def validate_prompts(prompts: Sequence[Sequence[int]], context: int) -> None:
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ContextLengthError(f"prompt {i} is empty; expected at least one token")
        if len(ids) >= context:
            raise ContextLengthError(
                f"prompt {i} has {len(ids)} tokens; the model context is {context} tokens, so a prompt may have "
                f"at most {context - 1} (one position must remain to generate)"
            )


#: the most prompts of a batch job decoded together (more wait for a slot, as in vLLM)
BATCH_MAX_SEQS = 256


def batch_scheduler(num_prompts: int, prefill_chunk: int, max_model_len: int | None = None) -> SchedulerConfig:
    """A batch job's schedule: the prompts admitted at once (as the KV budget and
    ``BATCH_MAX_SEQS`` allow), each prefilled whole in the step it is admitted, then decoded
    together; the rest join as others finish. ``max_model_len``: the longest sequence (prompt
    + output; None: the model's context)."""
    return SchedulerConfig(max_num_seqs=min(max(1, num_prompts), BATCH_MAX_SEQS), max_num_batched_tokens=None,
                           prefill_chunk=prefill_chunk, admission="optimistic", max_model_len=max_model_len)


ERRORS = ("raise", "report")


@torch.no_grad()
def generate(model: Llama, cache: KVCache, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
             tokenizer: Tokenizer | None = None, on_token: Callable[[TokenEvent], bool | None] | None = None,
             prefill_chunk: int = 512, stats: GenerationStats | None = None, errors: str = "raise",
             progress=None, max_model_len: int | None = None) -> list[Completion]:
    """Generate for every prompt (token ids) through the serving engine with a batch job's
    schedule (:func:`batch_scheduler`); results in input order, sequences freed from ``cache``
    as they finish. ``errors="raise"``: every prompt is checked before any work and the first
    error is raised; ``"report"``: a prompt that cannot run, or whose step fails, gets a
    completion with finish reason ``error`` (and the message in ``error``) and the others go
    on. ``progress``: a tqdm-like bar advanced per finished request; ``max_model_len``: the
    longest sequence, prompt + output (None: the model's context)."""
    engine = Engine(model, cache, tokenizer=tokenizer,
                    scheduler=batch_scheduler(len(prompts), prefill_chunk, max_model_len))
    return run_batch(engine, prompts, params, on_token=on_token, stats=stats, errors=errors, progress=progress)


def run_batch(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
              on_token: Callable[[TokenEvent], bool | None] | None = None, stats: GenerationStats | None = None,
              errors: str = "raise", progress=None) -> list[Completion]:
    """:func:`generate` on an engine that may outlive the call (``LLM`` keeps one, so that its
    prefix cache serves later calls): the prompts added, the engine run until they finish,
    ``stats`` given this call's share of the engine's metrics."""
    if errors not in ERRORS:
        raise ConfigError(f"errors must be one of {list(ERRORS)}, got {errors!r}")
    context = min(engine.context, engine.config.max_model_len or engine.context)
    if errors == "raise":
        validate_prompts(prompts, context)
    engine.on_error = "raise" if errors == "raise" else "fail"
    m = engine.metrics
    before = (m.prefill_seconds, m.decode_seconds, m.decode_steps, m.decode_tokens)
    outs: list[Completion] = []
    reqs = []
    for i, p in enumerate(prompts):
        try:
            req = engine.add_request(p, params, on_token=on_token, index=i)
        except TieredKVError as exc:
            if errors == "raise":
                raise
            outs.append(Completion(i, list(p), finish_reason="error", error=f"{type(exc).__name__}: {exc}"))
            if progress is not None:
                progress.update(1)
        else:
            reqs.append(req)
            outs.append(req.out)
    engine.run(progress=progress)
    if stats is not None:
        stats.prompt_tokens += sum(len(p) for p in prompts)
        stats.generated_tokens += sum(len(r.out.token_ids) for r in reqs)
        stats.prefill_seconds += m.prefill_seconds - before[0]
        stats.decode_seconds += m.decode_seconds - before[1]
        stats.decode_steps += m.decode_steps - before[2]
        stats.decode_tokens += m.decode_tokens - before[3]
        stats.kv_bytes_peak = max(stats.kv_bytes_peak, m.kv_bytes_peak)
        for r in reqs:
            stats.cached_tokens += r.metrics.cached_tokens
            for tier, n in r.metrics.prefix_hit_pages.items():
                stats.prefix_hit_pages[tier] = stats.prefix_hit_pages.get(tier, 0) + n
    return outs
