"""What an evaluated KV method must offer, and tieredkv's own implementation of it.

Every method — tieredkv's caches and policies, and the kvpress presses run through
transformers in ``tools/eval`` — is scored by the *same* perplexity and passkey code
through this interface. The protocol is question-agnostic: ``open(context)`` builds the
(possibly compressed) cache from the context alone; what comes after (the scored
continuation, the question) is seen only afterwards.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Sequence

import torch

from tieredkv.errors import ContextLengthError
from tieredkv.models.cache import KVCache
from tieredkv.models.llama import Llama, decode_one_token, prefill


class EvalSession(abc.ABC):
    """A context held in a cache. Calls leave the session as they found it."""

    context_len: int

    @abc.abstractmethod
    def logprobs(self, continuation: Sequence[int]) -> torch.Tensor:
        """Teacher-forced log p(continuation[i] | context, continuation[:i]) -> float64 [n]."""

    @abc.abstractmethod
    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Feed ``prompt`` after the context, then decode greedily."""

    def close(self) -> None:
        """Release the cache."""


class EvalMethod(abc.ABC):
    name: str = "method"
    #: the model's context in tokens (None: unknown); longer evaluations are refused
    max_context: int | None = None

    def check_length(self, tokens: int, what: str) -> None:
        """ContextLengthError when ``tokens`` do not fit the model's context."""
        if self.max_context is not None and tokens > self.max_context:
            raise ContextLengthError(f"{what} of {tokens} tokens does not fit the model context of {self.max_context} "
                                     "tokens; expected at most that")

    @abc.abstractmethod
    def open(self, context: Sequence[int], *, total_tokens: int | None = None) -> EvalSession:
        """Prefill ``context`` (and compress it, for methods that do). ``total_tokens``: how
        long the sequence will get (context + what is scored or generated after it);
        methods with percentage budgets size themselves from it."""

    def describe(self) -> dict[str, Any]:
        """Name, budget and anything else a results row should carry."""
        return {"method": self.name}

    def stats(self) -> dict[str, Any]:
        """Counters accumulated over all sessions (cache metrics), for ``--json``."""
        return {}


def token_logprobs(prev_logits: torch.Tensor, logits: torch.Tensor, targets: Sequence[int]) -> torch.Tensor:
    """Log-probs of ``targets`` [n] given the logits before the first target [V] and the
    logits at each target [n, V] (the last row is unused)."""
    rows = torch.cat([prev_logits.view(1, -1), logits[:-1]], dim=0).double()
    return torch.log_softmax(rows, dim=-1)[torch.arange(len(targets)), torch.as_tensor(targets)]


def greedy_loop(logits: torch.Tensor, step: Callable[[int], torch.Tensor], *, max_new_tokens: int,
                eos: set[int]) -> list[int]:
    """Greedy tokens starting from ``logits`` [V]; ``step(token)`` feeds a token and returns
    the next logits. Stops at EOS (not returned) or after ``max_new_tokens``."""
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(torch.argmax(logits))
        if tok in eos:
            break
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        logits = step(tok)
    return out


class _CacheSession(EvalSession):
    def __init__(self, method: "CacheMethod", context: Sequence[int], total_tokens: int | None) -> None:
        self.m = method
        self.cache = method.cache_factory(total_tokens or len(context))
        self.sid = self.cache.add_sequence()
        self.context_len = len(context)
        self.last_logits = prefill(method.model, self.cache, self.sid, torch.as_tensor(list(context)),
                                   chunk_size=method.prefill_chunk)
        self.saved = self.cache.checkpoint(self.sid)

    def _feed(self, ids: Sequence[int], *, chunk: int) -> torch.Tensor:
        return prefill(self.m.model, self.cache, self.sid, torch.as_tensor(list(ids)), start_pos=self.context_len,
                       chunk_size=chunk, all_logits=True)

    def logprobs(self, continuation: Sequence[int]) -> torch.Tensor:
        logits = self._feed(continuation, chunk=self.m.teacher_forcing_chunk)
        self.cache.rollback(self.sid, self.saved)
        return token_logprobs(self.last_logits, logits, continuation)

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        logits = self._feed(prompt, chunk=self.m.teacher_forcing_chunk)[-1] if prompt else self.last_logits
        pos = [self.context_len + len(prompt)]

        def step(tok: int) -> torch.Tensor:
            pos[0] += 1
            return decode_one_token(self.m.model, self.cache, [self.sid], torch.tensor([tok]),
                                    torch.tensor([pos[0] - 1]))[0]

        out = greedy_loop(logits, step, max_new_tokens=max_new_tokens, eos=set(self.m.model.config.eos_token_ids))
        self.cache.rollback(self.sid, self.saved)
        return out

    def close(self) -> None:
        self.cache.free_sequence(self.sid)
        metrics = getattr(self.cache, "metrics", None)
        if metrics is not None:
            self.m.collect(metrics)
        self.cache.close()


class CacheMethod(EvalMethod):
    """tieredkv's reference model over any :class:`KVCache` built by
    ``cache_factory(total_tokens)``.

    ``teacher_forcing_chunk``: continuation tokens fed per forward call while scoring.
    Causal attention makes a chunk of n teacher-forced tokens identical to n decode
    steps *when the cache does not change its mind between steps* (a full cache, or
    one compressed only at prefill); caches that evict or select per decode step must
    use 1.
    """

    def __init__(self, model: Llama, cache_factory: Callable[[int], KVCache], *, name: str = "full",
                 prefill_chunk: int = 512, teacher_forcing_chunk: int = 256, info: dict | None = None) -> None:
        self.model, self.cache_factory, self.name = model, cache_factory, name
        self.max_context = model.config.max_position_embeddings
        self.prefill_chunk, self.teacher_forcing_chunk = prefill_chunk, teacher_forcing_chunk
        self.info = info or {}
        self.totals = None  # merged cache metrics of all sessions (caches that keep metrics)
        self.sessions = 0

    def collect(self, metrics) -> None:
        self.sessions += 1
        if self.totals is None:
            self.totals = type(metrics)()
        self.totals.merge(metrics)

    def stats(self) -> dict[str, Any]:
        if self.totals is None:
            return {}
        return {"sessions": self.sessions, **self.totals.to_dict()}

    def open(self, context: Sequence[int], *, total_tokens: int | None = None) -> EvalSession:
        session = _CacheSession(self, context, total_tokens)
        self.last_cache = session.cache
        return session

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, **self.info}


def tiered_method(model: Llama, config, *, name: str | None = None, prefill_chunk: int = 512,
                  keep_decoded_warm: bool = False) -> CacheMethod:
    """tieredkv's tiered cache as an evaluated method. Percentage budgets resolve against
    each session's total tokens; continuations are fed one token per step (the tiered
    cache selects and evicts per decode step). ``keep_decoded_warm``: the CPU evaluation aid
    of the warm pool (each warm page decoded once; identical numerics)."""
    from tieredkv.runtime.tiered.cache import TieredKVCache

    from tieredkv.runtime.tiered.config import KV_DTYPES

    spec = model.kv_spec()
    label = name or f"tieredkv-{config.migration.policy}-{config.selection.mode}"
    stored = dataclasses.replace(spec, dtype=KV_DTYPES[config.kv_dtype]) if config.kv_dtype else spec
    info = {"budget": str(config.budgets.device or "100%"), "budget_reference": config.budgets.reference_dtype,
            "policy": config.migration.policy,
            "mode": config.selection.mode, "attention_budget": str(config.budgets.attention or "device"),
            "kv_bytes_per_token": stored.token_bytes_per_layer * stored.num_layers}
    if config.warm.codec:
        info.update(warm_codec=config.warm.codec, warm_fraction=config.warm.fraction,
                    warm_exact_reads=config.warm.reads_exact(config.selection.mode))
        if config.warm.ladder:
            info["warm_ladder"] = config.warm.ladder
    if config.kv_dtype:
        info["kv_dtype"] = config.kv_dtype
    if config.selection.aggregate != "share":
        info["selection_aggregate"] = config.selection.aggregate
    if config.selection.dense_layers:
        info["dense_layers"] = config.selection.dense_layers
    return CacheMethod(model, lambda total: TieredKVCache(spec, config, full_tokens=total,
                                                          keep_decoded_warm=keep_decoded_warm), name=label,
                       prefill_chunk=prefill_chunk, teacher_forcing_chunk=1, info=info)
