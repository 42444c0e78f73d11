"""Recorded access traces and their replay through the tier manager.

In exact mode which pages a decode step needs depends on the scores alone, never on
residency, so one recorded trace serves every replacement policy: replaying it through
the same :class:`TierManager` (with one-value pages — decisions only) gives each policy's
device hit rate, and Belady's MIN oracle (which needs the future) its upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tieredkv.runtime.tiered.config import TieredKVConfig, resolve_budgets
from tieredkv.runtime.tiered.manager import StepAccess, TierManager
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.policies import make_policy


@dataclass
class TraceStep:
    num_new: int
    decode: bool
    needed: torch.Tensor  # [L, M] bool, over the sequence's pages after the step began
    mass: torch.Tensor  # [L, M] float
    importance: torch.Tensor  # [L, M] float
    scored: torch.Tensor  # [L, M] bool


@dataclass
class AccessTrace:
    """The steps of one sequence (pages are identified by their index in the sequence)."""

    num_layers: int
    page_size: int
    steps: list[TraceStep] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        torch.save({"num_layers": self.num_layers, "page_size": self.page_size,
                    "steps": [vars(s) for s in self.steps]}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> "AccessTrace":
        d = torch.load(str(path))
        return cls(d["num_layers"], d["page_size"], [TraceStep(**s) for s in d["steps"]])

    @property
    def decode_steps(self) -> int:
        return sum(s.decode for s in self.steps)

    def next_use(self) -> list[torch.Tensor]:
        """For each step i, [L, M_max]: the decode-step number (1-based, the manager's clock
        after that step) of the next step after i that needs each page; +inf if none."""
        L = self.num_layers
        m_max = max(s.needed.shape[1] for s in self.steps)
        out: list[torch.Tensor] = [None] * len(self.steps)  # type: ignore[list-item]
        nxt = torch.full((L, m_max), float("inf"))
        clock = self.decode_steps
        for i in range(len(self.steps) - 1, -1, -1):
            out[i] = nxt.clone()
            s = self.steps[i]
            if s.decode:
                m = s.needed.shape[1]
                nxt[:, :m] = torch.where(s.needed, torch.tensor(float(clock)), nxt[:, :m])
                clock -= 1
        return out


class TraceRecorder:
    """Attach to a TieredKVCache (``recorder=``) to record its single sequence's steps."""

    def __init__(self) -> None:
        self.trace: AccessTrace | None = None

    def record(self, cache, step, access: StepAccess, *, decode: bool) -> None:
        if len(step.seq_ids) != 1:
            raise ValueError("trace recording supports one sequence at a time")
        mgr = cache.mgr
        if self.trace is None:
            self.trace = AccessTrace(mgr.L, mgr.P)
        recs = mgr.records_of(step.seq_ids[0])
        self.trace.steps.append(TraceStep(step.num_new, decode, access.needed[:, recs].clone(),
                                          access.mass[:, recs].clone(), access.importance[:, recs].clone(),
                                          access.scored[:, recs].clone()))


def replay(trace: AccessTrace, config: TieredKVConfig, *, token_bytes_per_layer: int,
           full_tokens: int | None = None) -> TierMetrics:
    """Run the trace through a TierManager with ``config`` (its policy, budgets and
    thresholds) and return the metrics: hits, misses, bytes moved, ..."""
    if config.page_size != trace.page_size:
        raise ValueError(f"trace has page size {trace.page_size}, config {config.page_size}")
    budgets = resolve_budgets(config, num_layers=trace.num_layers, token_bytes_per_layer=token_bytes_per_layer,
                              full_tokens=full_tokens)
    policy = make_policy(config.policy, lfu_importance_weights=config.lfu_importance_weights)
    mgr = TierManager(num_layers=trace.num_layers, kv_heads=1, head_dim=1, dtype=torch.float32, config=config,
                      budgets=budgets, policy=policy)
    mgr.page_bytes = token_bytes_per_layer * config.page_size  # account as the real pages would
    mgr.add_sequence(0)
    future = trace.next_use() if policy.needs_trace else None
    current = {"i": 0}

    def next_use_fn() -> torch.Tensor:
        nu = future[current["i"]]
        idx = mgr.rec_index.clamp(max=nu.shape[1] - 1)
        table = nu[:, idx]
        return torch.where(mgr.alive.unsqueeze(0), table, torch.full_like(table, float("inf")))

    if future is not None:
        mgr.next_use_fn = next_use_fn
    L = trace.num_layers
    for i, s in enumerate(trace.steps):
        current["i"] = i
        mgr.begin_step((0,), s.num_new)
        recs = mgr.records_of(0)
        m = len(recs)
        flags = lambda: torch.zeros(L, mgr.R, dtype=torch.bool)  # noqa: E731
        access = StepAccess(needed=flags(), missing=flags(), streamed=flags(), mass=torch.zeros(L, mgr.R),
                            importance=torch.zeros(L, mgr.R), scored=flags())
        resident = mgr.dev_slot[:, recs] >= 0
        access.needed[:, recs] = s.needed[:, :m]
        access.missing[:, recs] = s.needed[:, :m] & ~resident
        attended = s.needed[:, :m] | (torch.ones_like(resident) if not s.decode else mgr.rec_t0[recs].expand(L, -1))
        access.streamed[:, recs] = attended & ~resident if config.mode == "exact" or not s.decode else False
        access.mass[:, recs] = s.mass[:, :m]
        access.importance[:, recs] = s.importance[:, :m]
        access.scored[:, recs] = s.scored[:, :m]
        if s.decode and config.mode == "masked":
            mgr.metrics.masked += int(access.missing.sum())
        per_layer = access.streamed.sum(1)
        mgr.metrics.streamed_pages += int(per_layer.sum())
        mgr.metrics.staging_rounds += int((-(-per_layer // max(1, mgr.staging_pages))).sum())
        mgr.metrics.bytes_h2d += int(access.streamed.sum()) * mgr.page_bytes
        mgr.end_step(access, decode=s.decode)
    return mgr.metrics
