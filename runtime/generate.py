"""Batched generation over a KV cache: chunked prefill per prompt, then batched decode
steps (gpt-fast style: ``prefill`` / ``decode_one_token`` / ``sample_token``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tieredkv.errors import ContextLengthError
from tieredkv.models.cache import KVCache
from tieredkv.models.llama import Llama, decode_one_token, prefill
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.sampling import SamplingParams, sample_token


@dataclass(frozen=True)
class TokenEvent:
    """Streamed once per generated token. ``text`` is the newly printable text (may be
    empty while a multi-byte character is incomplete). Return ``False`` from the
    callback to cancel that sequence."""

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None


@dataclass
class Completion:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "cancelled"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens fed through decode steps (sum of batch sizes)
    kv_bytes_peak: int = 0

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
        }


class _Sequence:
    def __init__(self, index: int, prompt: list[int], params: SamplingParams, tokenizer: Tokenizer | None) -> None:
        self.out = Completion(index, list(prompt))
        self.params = params
        self.tokenizer = tokenizer
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.seq_id = -1
        self.position = len(prompt)

    def accept(self, token: int, eos_ids: frozenset[int], context_limit: int) -> TokenEvent:
        """Record a sampled token; decide whether the sequence is finished."""
        p, out = self.params, self.out
        if token in eos_ids and not p.ignore_eos:
            out.finish_reason = "eos"
            return TokenEvent(out.index, token, "", "eos")
        out.token_ids.append(token)
        delta = ""
        if self.tokenizer is not None:
            full = self.tokenizer.decode(out.token_ids)
            if p.stop:
                lo = max(0, len(out.text) - max(len(s) for s in p.stop))
                hits = [i for i in (full.find(s, lo) for s in p.stop) if i >= 0]
                if hits:
                    full = full[: min(hits)]
                    out.finish_reason = "stop"
            if not full.endswith("\ufffd") or out.finish_reason:
                delta, out.text = full[len(out.text):], full
        if out.finish_reason is None and (len(out.token_ids) >= p.max_new_tokens or self.position + 1 >= context_limit):
            out.finish_reason = "length"
        return TokenEvent(out.index, token, delta, out.finish_reason)


def validate_prompts(prompts: Sequence[Sequence[int]], context: int) -> None:
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ContextLengthError(f"prompt {i} is empty; expected at least one token")
        if len(ids) >= context:
            raise ContextLengthError(
                f"prompt {i} has {len(ids)} tokens; the model context is {context} tokens, so a prompt may have "
                f"at most {context - 1} (one position must remain to generate)"
            )


@torch.no_grad()
def generate(model: Llama, cache: KVCache, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
             tokenizer: Tokenizer | None = None, on_token: Callable[[TokenEvent], bool | None] | None = None,
             prefill_chunk: int = 512, stats: GenerationStats | None = None) -> list[Completion]:
    """Generate for every prompt (token ids). Sequences are freed from ``cache`` as they finish."""
    context = model.config.max_position_embeddings
    validate_prompts(prompts, context)
    stats = stats if stats is not None else GenerationStats()
    eos_ids = frozenset(model.config.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer else ())
    seqs = [_Sequence(i, list(p), params, tokenizer) for i, p in enumerate(prompts)]
    active: list[_Sequence] = []

    def emit(seq: _Sequence, token: int) -> None:
        event = seq.accept(token, eos_ids, context)
        if on_token is not None and on_token(event) is False and seq.out.finish_reason is None:
            seq.out.finish_reason = "cancelled"
        if seq.out.finish_reason is not None:
            cache.free_sequence(seq.seq_id)
        else:
            active.append(seq)

    for seq in seqs:
        t_start = time.perf_counter()
        seq.seq_id = cache.add_sequence()
        logits = prefill(model, cache, seq.seq_id, torch.tensor(seq.out.prompt_token_ids), chunk_size=prefill_chunk)
        stats.prefill_seconds += time.perf_counter() - t_start
        stats.prompt_tokens += len(seq.out.prompt_token_ids)
        stats.kv_bytes_peak = max(stats.kv_bytes_peak, cache.kv_bytes())
        emit(seq, sample_token(logits, params, seq.generator))

    while active:
        batch, active = active, []
        t_start = time.perf_counter()
        tokens = torch.tensor([s.out.token_ids[-1] for s in batch])
        positions = torch.tensor([s.position for s in batch])
        logits = decode_one_token(model, cache, [s.seq_id for s in batch], tokens, positions)
        stats.kv_bytes_peak = max(stats.kv_bytes_peak, cache.kv_bytes())
        for row, seq in enumerate(batch):
            seq.position += 1
            emit(seq, sample_token(logits[row], params, seq.generator))
        stats.decode_seconds += time.perf_counter() - t_start
        stats.decode_steps += 1
        stats.decode_tokens += len(batch)
    stats.generated_tokens += sum(len(s.out.token_ids) for s in seqs)
    return [s.out for s in seqs]
