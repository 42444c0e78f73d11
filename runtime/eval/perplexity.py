"""Perplexity over non-overlapping windows of a token stream, one protocol for every method.

Each window of ``window`` tokens is split: the first ``context_fraction`` of it is the
context (given to ``method.open``, which may compress it to a budget); every following
token is scored with teacher forcing against that cache. ``context_fraction = 0`` gives
plain perplexity (context = the window's first token, every other token scored).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

from tieredkv.errors import ConfigError
from tieredkv.runtime.eval.harness import EvalMethod


@dataclass
class PerplexityResult:
    method: dict
    window: int
    context_fraction: float
    windows: int
    tokens_scored: int
    nll: float
    perplexity: float
    seconds: float
    window_ppl: list[float] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def split_windows(ids: Sequence[int], window: int, max_windows: int | None) -> list[Sequence[int]]:
    if window < 2:
        raise ConfigError(f"--window must be at least 2 tokens, got {window}")
    n = len(ids) // window
    if n == 0:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    if max_windows is not None:
        if max_windows < 1:
            raise ConfigError(f"--max-windows must be >= 1, got {max_windows}")
        n = min(n, max_windows)
    return [ids[i * window : (i + 1) * window] for i in range(n)]


def context_length(window: int, context_fraction: float) -> int:
    if not 0.0 <= context_fraction < 1.0:
        raise ConfigError(f"context fraction must be in [0, 1), got {context_fraction}")
    return max(1, int(round(window * context_fraction)))


def perplexity(method: EvalMethod, ids: Sequence[int], *, window: int, max_windows: int | None = None,
               context_fraction: float = 0.0, progress: bool = True) -> PerplexityResult:
    method.check_length(window, "--window")
    windows = split_windows(ids, window, max_windows)
    ctx = context_length(window, context_fraction)
    total_nll, total_tokens, per_window = 0.0, 0, []
    t_start = time.perf_counter()
    bar = tqdm(windows, desc=f"perplexity[{method.name}]", unit="window", disable=not progress, leave=False)
    for w in bar:
        session = method.open(w[:ctx], total_tokens=len(w))
        try:
            lp = session.logprobs(w[ctx:])
        finally:
            session.close()
        nll = -float(lp.sum())
        total_nll += nll
        total_tokens += len(lp)
        per_window.append(math.exp(nll / len(lp)))
        bar.set_postfix(ppl=f"{math.exp(total_nll / total_tokens):.3f}")
    mean = total_nll / total_tokens
    return PerplexityResult(
        method=method.describe(), window=window, context_fraction=context_fraction, windows=len(windows),
        tokens_scored=total_tokens, nll=mean, perplexity=math.exp(mean), seconds=time.perf_counter() - t_start,
        window_ppl=per_window, stats=method.stats(),
    )
