"""Serving: many requests through one model and one KV cache (scheduler, admission,
preemption, prefix reuse, metrics) — ``Engine`` for batch jobs, ``AsyncEngine`` for servers."""

from tieredkv.runtime.serving.engine import AsyncEngine, Engine
from tieredkv.runtime.serving.prefix import PrefixConfig, PrefixIndex
from tieredkv.runtime.serving.request import Completion, Request, RequestMetrics, RequestStatus, TokenEvent
from tieredkv.runtime.serving.scheduler import Scheduler, SchedulerConfig

__all__ = ["AsyncEngine", "Completion", "Engine", "PrefixConfig", "PrefixIndex", "Request", "RequestMetrics",
           "RequestStatus", "Scheduler", "SchedulerConfig", "TokenEvent"]
