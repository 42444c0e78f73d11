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
from tieredkv.runtime.tiered.manager import TierManager
from tieredkv.runtime.tiered.step import StepAccess
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.page_table import PageTable
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
        self.seq: int | None = None

    def record(self, access: StepAccess, *, seq: int, num_new: int, decode: bool, page_size: int) -> None:
        """One step's access record of sequence ``seq`` ([L, M] columns over its pages)."""
        if self.seq is not None and seq != self.seq:
            raise ValueError("trace recording supports one sequence at a time")
        if self.trace is None:
            self.trace, self.seq = AccessTrace(access.needed.shape[0], page_size), seq
        self.trace.steps.append(TraceStep(num_new, decode, access.needed.clone(), access.mass.clone(),
                                          access.importance.clone(), access.scored.clone()))


def replay(trace: AccessTrace, config: TieredKVConfig, *, token_bytes_per_layer: int,
           full_tokens: int | None = None) -> TierMetrics:
    """Run the trace through a TierManager with ``config`` (its policy, budgets and
    thresholds) and return the metrics: hits, misses, bytes moved, ... A step selects the
    recorded pages (decode: the needed ones plus T0; prefill: every page) and attends them as
    the live cache would (exact / masked mode)."""
    if config.page_size != trace.page_size:
        raise ValueError(f"trace has page size {trace.page_size}, config {config.page_size}")
    budgets = resolve_budgets(config, num_layers=trace.num_layers, token_bytes_per_layer=token_bytes_per_layer,
                              full_tokens=full_tokens)
    policy = make_policy(config.migration.policy, lfu_importance_weights=config.migration.lfu_importance_weights)
    future = trace.next_use() if policy.needs_trace else None
    current = {"step": 0}

    def next_use(table: PageTable) -> torch.Tensor:
        nu = future[current["step"]]
        per_page = nu[:, table.index.clamp(max=nu.shape[1] - 1)]
        return torch.where(table.alive.unsqueeze(0), per_page, torch.full_like(per_page, float("inf")))

    mgr = TierManager(num_layers=trace.num_layers, kv_heads=1, head_dim=1, dtype=torch.float32, config=config,
                      budgets=budgets, policy=policy, page_bytes=token_bytes_per_layer * config.page_size,
                      next_use=next_use if future is not None else None)  # one-value pages: decisions only
    mgr.add_sequence(0)
    everything = slice(None)
    for i, s in enumerate(trace.steps):
        current["step"] = i
        (seq,) = mgr.begin_step((0,), s.num_new).seqs
        m = len(seq.recs)
        needed = s.needed[:, :m]
        selected = needed | seq.t0 if s.decode else torch.ones_like(needed)
        attended = mgr.attended(everything, seq, selected, decode=s.decode)
        mgr.record_access(everything, seq, decode=s.decode, selected=selected, attended=attended,
                          importance=s.importance[:, :m], mass=s.mass[:, :m])
        mgr.end_step(decode=s.decode)
    return mgr.metrics
