"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tieredkv.errors import ConfigError, short

#: the smallest sampling temperature (other than 0, greedy) and the largest
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy; otherwise it lies in [MIN_TEMPERATURE, MAX_TEMPERATURE]
    (below, dividing the logits overflows float32; above, sampling is uniform noise).
    ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed`` (an integer in
    [0, 2^63)) makes sampling reproducible per sequence: a prompt sampled alone or in a batch
    gives the same tokens. ``stop`` strings end generation and are not part of the returned
    text.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not integer(self.max_new_tokens) or not 1 <= self.max_new_tokens <= 1 << 24:
            raise ConfigError(f"max_new_tokens must be an integer in [1, {1 << 24}], got {short(self.max_new_tokens)}")
        if not number(self.temperature) or not (self.temperature == 0
                                                or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise ConfigError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got "
                              f"{short(self.temperature)}")
        if not integer(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0, got {short(self.top_k)}")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {short(self.top_p)}")
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 1 << 63):
            raise ConfigError(f"seed must be an integer in [0, 2^63), got {short(self.seed)}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside top-k / the top-p nucleus to -inf. logits [..., V]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass of the tokens strictly before it already reaches top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [V] (float32). Seeded sampling draws on the generator's device
    (the logits go there): the same seed gives the same tokens whatever device the model runs on."""
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is not None and logits.device != generator.device:
        logits = logits.to(generator.device)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
