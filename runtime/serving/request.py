"""A request's state in the serving engine: its tokens, what the cache holds of them, its
sampling, its output and its timings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """Streamed once per generated token. ``text`` is the newly printable text (may be
    empty while a multi-byte character is incomplete). ``index`` is the request's index
    (its submission order). Return ``False`` from a callback to cancel the request."""

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
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # what went wrong, with finish_reason "error"
    request_id: str | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted by recompute: its pages are gone)
    RUNNING = "running"  # holds pages; prefilling or decoding
    PAUSED = "paused"  # preempted by demotion: holds pages off the device, resumes without recompute
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Per-request timings (seconds on the engine's clock) and counts."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix index (first admission)
    prefix_hit_pages: dict[str, int] = field(default_factory=dict)  # by the tier that held them
    preemptions: dict[str, int] = field(default_factory=dict)  # by kind: demote / recompute
    token_times: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def prefill_time(self) -> float | None:
        """The compute part of TTFT: from first scheduled to the first token (TTFT = queue time +
        this; it includes the steps shared with other requests)."""
        return None if self.first_token is None or self.first_scheduled is None else \
            self.first_token - self.first_scheduled

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token is None or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.first_token) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def itl_max(self) -> float | None:
        """The longest gap between two output tokens (what a preemption costs a stream)."""
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return max(gaps) if gaps else None

    def to_dict(self) -> dict:
        r = lambda x: None if x is None else round(x, 6)  # noqa: E731
        return {"queue_time": r(self.queue_time), "ttft": r(self.ttft), "prefill_time": r(self.prefill_time),
                "tpot": r(self.tpot), "e2e": r(self.e2e),
                "itl_max": r(self.itl_max), "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens,
                "prefix_hit_pages": dict(self.prefix_hit_pages), "preemptions": dict(self.preemptions)}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation); None for no values."""
    return float(np.percentile(values, q)) if values else None


OnToken = Callable[[TokenEvent], "bool | None"]


class Request:
    """One request. ``tokens`` = prompt + output so far; the cache holds ``tokens[:computed]``
    of sequence ``seq_id`` (None while waiting). A request with ``len(tokens) - computed``
    tokens to feed is prefilling (> 1) or decoding (== 1); after a step that fed the last of
    them the next token is sampled."""

    def __init__(self, index: int, request_id: str, prompt: list[int], params: SamplingParams, *,
                 tokenizer: Tokenizer | None, arrival: float, salt: str | None = None,
                 on_token: OnToken | None = None) -> None:
        self.index, self.request_id = index, request_id
        self.params, self.tokenizer, self.salt, self.on_token = params, tokenizer, salt, on_token
        self.out = Completion(index, list(prompt), request_id=request_id)
        self.tokens: list[int] = list(prompt)
        self.computed = 0
        self.seq_id: int | None = None
        self.status = RequestStatus.WAITING
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.metrics = RequestMetrics(arrival=arrival, prompt_tokens=len(prompt))
        self.chain = None  # the prefix keys of its pages (PrefixIndex.chain), when reuse is on
        self.hit_tokens = 0  # tokens its sequence started with (prefix hits): it has computed none past them
        self.admitted_at = -1  # the admission counter (victim order: the newest is preempted first)
        self.on_finish: Callable[[Request], None] | None = None
        self.no_publish = False  # cancelled with keep_prefix=False: its pages are not indexed at close

    @property
    def prompt(self) -> list[int]:
        return self.out.prompt_token_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def to_feed(self) -> int:
        return len(self.tokens) - self.computed

    def accept(self, token: int, eos_ids: frozenset[int], context_limit: int) -> TokenEvent:
        """Record a sampled token; decide whether the request is finished."""
        p, out = self.params, self.out
        if token in eos_ids and not p.ignore_eos:
            out.finish_reason = "eos"
            return TokenEvent(out.index, token, "", "eos")
        out.token_ids.append(token)
        self.tokens.append(token)
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
        if out.finish_reason is None and (len(out.token_ids) >= p.max_new_tokens or len(self.tokens) >= context_limit):
            out.finish_reason = "length"
        return TokenEvent(out.index, token, delta, out.finish_reason)
