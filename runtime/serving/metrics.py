"""What a server reports: per-request timings and counts (``RequestMetrics``), and per step
the KV bytes held — allocated and used, and per tier — aggregated into one summary."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tieredkv.runtime.serving.request import RequestMetrics, percentile


#: the per-request latencies (RequestMetrics properties) a summary reports
LATENCIES = ("queue_time", "ttft", "prefill_time", "tpot", "e2e", "itl_max")


@dataclass
class StepSample:
    """The state after one engine step."""

    time: float
    running: int
    waiting: int
    paused: int
    tokens: int  # fed this step
    kv_allocated: int  # device KV bytes held for requests (reserved or resident)
    kv_used: int  # ... of which hold tokens
    tier_bytes: dict[str, int] = field(default_factory=dict)  # tiered cache: bytes per tier


@dataclass
class ServingMetrics:
    """Everything the engine measured (see the module docstring). ``window``: keep only the
    last ``window`` finished requests and steps for the percentiles and series (a server's
    setting, so memory stays bounded); the totals count everything."""

    window: int | None = None
    requests: deque[RequestMetrics] = field(default_factory=deque)  # finished requests (the last `window`)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    steps: deque[StepSample] = field(default_factory=deque)
    requests_total: int = 0
    prompt_tokens_total: int = 0
    output_tokens_total: int = 0
    cached_tokens_total: int = 0
    steps_total: int = 0
    preemptions: dict[str, int] = field(default_factory=dict)
    prefix: dict | None = None  # PrefixStats.to_dict()
    start: float | None = None
    end: float | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0  # batched decode forward calls
    decode_tokens: int = 0  # tokens they fed (sum of batch sizes)
    kv_bytes_peak: int = 0  # the cache's kv_bytes() after a prefill or decode, at most

    def __post_init__(self) -> None:
        self.requests = deque(self.requests, maxlen=self.window)
        self.steps = deque(self.steps, maxlen=self.window)

    def finished(self, m: RequestMetrics, reason: str) -> None:
        """Count a finished request."""
        self.requests.append(m)
        self.requests_total += 1
        self.prompt_tokens_total += m.prompt_tokens
        self.output_tokens_total += m.output_tokens
        self.cached_tokens_total += m.cached_tokens
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        for kind, n in m.preemptions.items():
            self.preemptions[kind] = self.preemptions.get(kind, 0) + n

    def step(self, sample: StepSample) -> None:
        self.steps.append(sample)
        self.steps_total += 1
        self.end = sample.time

    def steady(self) -> list[StepSample]:
        """The steady state: the steps between the first and last 10 % of the run."""
        steps = list(self.steps)
        n = len(steps)
        return steps[n // 10: n - n // 10] or steps

    def latencies(self, names: tuple[str, ...] = LATENCIES) -> dict[str, dict]:
        """p50/p90/p99 and mean (seconds) of each per-request latency over the kept requests."""
        out = {}
        for name in names:
            values = [v for v in (getattr(r, name) for r in self.requests) if v is not None]
            out[name] = {f"p{q}": _r(percentile(values, q)) for q in (50, 90, 99)}
            out[name]["mean"] = _r(float(np.mean(values))) if values else None
        return out

    def summary(self) -> dict:
        """Counts, throughput, latency percentiles (seconds), KV memory and prefix reuse."""
        wall = (self.end or 0.0) - (self.start or 0.0)
        out_tokens = self.output_tokens_total
        res: dict = {"requests": self.requests_total, "finish_reasons": dict(self.finish_reasons),
                     "wall_seconds": round(wall, 3), "steps": self.steps_total,
                     "prompt_tokens": self.prompt_tokens_total, "output_tokens": out_tokens,
                     "cached_prompt_tokens": self.cached_tokens_total,
                     "output_tok_s": round(out_tokens / wall, 3) if wall > 0 else 0.0,
                     "prefill_seconds": round(self.prefill_seconds, 3), "decode_seconds": round(self.decode_seconds, 3),
                     "preemptions": dict(self.preemptions)}
        res.update(self.latencies())
        steady = self.steady()
        alloc = np.array([s.kv_allocated for s in steady], dtype=float)
        used = np.array([s.kv_used for s in steady], dtype=float)
        res["kv"] = {
            "allocated_peak": int(max((s.kv_allocated for s in self.steps), default=0)),
            "allocated_mean": int(alloc.mean()) if len(alloc) else 0,
            "allocated_cv": _r(float(alloc.std() / alloc.mean())) if len(alloc) and alloc.mean() > 0 else None,
            "utilization": _r(float(used.sum() / alloc.sum())) if alloc.sum() > 0 else None,
            "running_mean": _r(float(np.mean([s.running for s in steady]))) if steady else 0.0,
            "running_max": max((s.running for s in self.steps), default=0),
        }
        if self.steps and self.steps[-1].tier_bytes:
            res["kv"]["tier_bytes_peak"] = {t: max(s.tier_bytes.get(t, 0) for s in self.steps)
                                            for t in self.steps[-1].tier_bytes}
        if self.prefix is not None:
            res["prefix"] = self.prefix
        res["kv_series"] = self.series()
        return res

    def series(self, points: int = 200) -> list[dict]:
        """KV bytes over time (at most ``points`` evenly spaced steps): seconds since the start,
        requests running, device bytes allocated and used, bytes per tier."""
        if not self.steps:
            return []
        steps = list(self.steps)
        stride = max(1, -(-len(steps) // points))
        t0 = self.start if self.start is not None else steps[0].time
        return [{"t": round(s.time - t0, 3), "running": s.running, "allocated": s.kv_allocated, "used": s.kv_used,
                 **({"tiers": dict(s.tier_bytes)} if s.tier_bytes else {})} for s in steps[::stride]]

    def format(self) -> str:
        """A plain-text summary."""
        s = self.summary()
        mib = 2 ** 20
        ms = lambda d: "/".join("-" if d[k] is None else f"{1000 * d[k]:.0f}" for k in ("p50", "p90", "p99"))  # noqa: E731
        lines = [
            f"{s['requests']} requests in {s['wall_seconds']:.1f} s ({s['steps']} steps): "
            f"{s['prompt_tokens']} prompt tokens ({s['cached_prompt_tokens']} from the prefix cache), "
            f"{s['output_tokens']} output tokens, {s['output_tok_s']:.1f} tok/s; finished {s['finish_reasons']}",
            f"latency ms p50/p90/p99: queue {ms(s['queue_time'])}, TTFT {ms(s['ttft'])} (of which compute "
            f"{ms(s['prefill_time'])}), TPOT {ms(s['tpot'])}, "
            f"end-to-end {ms(s['e2e'])}",
            f"KV on the device: peak {s['kv']['allocated_peak'] / mib:.1f} MiB, steady mean "
            f"{s['kv']['allocated_mean'] / mib:.1f} MiB (CV {s['kv']['allocated_cv']}), utilization "
            f"{s['kv']['utilization']}; concurrent requests mean {s['kv']['running_mean']}, max "
            f"{s['kv']['running_max']}; preemptions {s['preemptions'] or 0}",
        ]
        if "prefix" in s:
            p = s["prefix"]
            lines.append(f"prefix cache: hit rate {p['hit_rate']:.3f} of {p['queried_pages']} pages looked up "
                         f"(by tier: {p['hit_rate_by_tier']})")
        return "\n".join(lines)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
