"""The serving engine's figures as metric families, for every front door: the OpenAI
server's ``/metrics`` (Prometheus text) and the Triton model's custom metrics read the same
list, so the two report the same names.

Counters are totals since the engine started; gauges are the state after the last step;
latency quantiles cover the engine's metrics window (its last requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: every metric name starts with this
PREFIX = "tieredkv_"
LATENCIES = {"queue_time": "seconds from arrival to first scheduled",
             "ttft": "time to first token, seconds", "tpot": "time per output token after the first, seconds",
             "e2e": "request latency, arrival to last token, seconds"}


@dataclass
class Family:
    """One metric: ``kind`` is ``counter`` or ``gauge``; samples are (labels, value)."""

    name: str
    kind: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def metric_families(engine) -> list[Family]:
    """The engine's metrics (call on the engine thread, or accept a step's worth of skew)."""
    m, s = engine.metrics, engine.scheduler
    fams: list[Family] = []

    def add(name: str, kind: str, help: str, value=None, samples=None) -> None:
        fams.append(Family(PREFIX + name, kind, help, samples if samples is not None else [({}, float(value))]))

    add("requests_finished_total", "counter", "finished requests, by finish reason",
        samples=[({"finish_reason": r}, float(n)) for r, n in sorted(m.finish_reasons.items())])
    add("requests_running", "gauge", "requests holding KV on the device", len(s.running))
    add("requests_waiting", "gauge", "requests queued for admission", len(s.waiting))
    add("requests_paused", "gauge", "requests preempted by demotion (KV off the device)", len(s.paused))
    add("prompt_tokens_total", "counter", "prompt tokens of finished requests", m.prompt_tokens_total)
    add("generation_tokens_total", "counter", "generated tokens of finished requests", m.output_tokens_total)
    add("prefix_cached_tokens_total", "counter", "prompt tokens served from the prefix index",
        m.cached_tokens_total)
    add("engine_steps_total", "counter", "engine steps", m.steps_total)
    add("preemptions_total", "counter", "preemptions, by kind (demote: KV kept off the device; recompute)",
        samples=[({"kind": k}, float(m.preemptions.get(k, 0))) for k in ("demote", "recompute")])
    lat = m.latencies(tuple(LATENCIES))  # not summary(): this runs on the engine thread between steps
    for key, help in LATENCIES.items():
        q = lat[key]
        add(f"{key}_seconds", "gauge", f"{help}, quantiles over the last {len(m.requests)} requests",
            samples=[({"quantile": label}, float(q[p])) for p, label in (("p50", "0.5"), ("p90", "0.9"),
                                                                           ("p99", "0.99")) if q.get(p) is not None])
    cache = engine.cache
    usage, counts = cache.usage(), cache.counters()
    add("kv_bytes_allocated", "gauge", "device KV bytes held", usage.device_bytes)
    if counts:
        add("kv_tier_bytes", "gauge", "KV bytes per tier (T0 hot window .. T4 disk)",
            samples=[({"tier": k}, float(v)) for k, v in usage.tier_bytes.items()])
        add("kv_page_hits_total", "counter", "attended pages found resident on the device", counts["hits"])
        add("kv_page_misses_total", "counter", "attended pages fetched from a lower tier", counts["misses"])
        add("kv_page_masked_total", "counter", "needed pages skipped (masked mode)", counts["masked"])
        add("kv_bytes_moved_total", "counter", "bytes moved between tiers, by direction",
            samples=[({"direction": d}, float(counts[f"bytes_{d}"])) for d in
                     ("h2d", "d2h", "disk_read", "disk_write")])
        add("kv_page_moves_total", "counter", "pages moved between tiers, by kind",
            samples=[({"kind": k}, float(counts[k])) for k in
                     ("promotions", "demotions", "fetched_pages", "evicted_pages", "spilled_pages",
                      "compressed_pages")])
    if engine.prefix is not None:
        p = engine.prefix.stats
        add("prefix_queried_pages_total", "counter", "full prompt pages looked up in the prefix index",
            p.queried_pages)
        add("prefix_hit_pages_total", "counter", "prompt pages found in the prefix index, by the tier holding them",
            samples=[({"tier": k}, float(v)) for k, v in p.hit_pages.items()])
        add("prefix_indexed_pages", "gauge", "pages the prefix index holds", len(engine.prefix))
    remote = getattr(engine, "remote", None)
    if remote is not None:
        for name, kind, help, samples in remote.metric_samples():
            add(name, kind, help, samples=samples)
    return fams


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def prometheus_text(families: list[Family], *, labels: dict[str, str] | None = None) -> str:
    """Prometheus text exposition format (version 0.0.4); ``labels`` are added to every sample."""
    out = []
    for f in families:
        out.append(f"# HELP {f.name} {f.help}")
        out.append(f"# TYPE {f.name} {'gauge' if f.kind == 'gauge' else 'counter'}")
        for lab, value in f.samples:
            out.append(f"{f.name}{_labels({**(labels or {}), **lab})} {value:g}" if value == int(value)
                       else f"{f.name}{_labels({**(labels or {}), **lab})} {value!r}")
    return "\n".join(out) + "\n"
