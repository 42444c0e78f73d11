"""Recorded access traces and their replay through the tier manager.

In exact mode which pages a decode step needs depends on the scores alone, never on
residency, so one recorded trace serves every replacement policy: replaying it through
the same :class:`TierManager` (with one-value pages — decisions only) gives each policy's
device hit rate, and Belady's MIN oracle (which needs the future) its upper bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tieredkv.errors import ConfigError, DataFileError, short
from tieredkv.runtime.tiered.budgets import resolve_budgets
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.manager import TierManager
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.page_table import PageTable
from tieredkv.runtime.tiered.policies import make_policy
from tieredkv.runtime.tiered.step import StepAccess, StepRecord


@dataclass
class TraceStep:
    """One step of one sequence; [L, M] columns over the sequence's pages after the step began."""

    num_new: int
    decode: bool
    needed: torch.Tensor  # [L, M] bool: selected by the decode step, T0 excluded
    mass: torch.Tensor  # [L, M] float: attention mass received (0 where not attended)
    importance: torch.Tensor  # [L, M] float: the importance kept for the page
    scored: torch.Tensor  # [L, M] bool
    tier: torch.Tensor | None = None  # [L, M] int8: the tier at the step's start (step.TIER_CODES)
    spec: torch.Tensor | None = None  # [L, M] float32: relevance under the previous layer's query (NaN: none)
    t0: torch.Tensor | None = None  # [M] bool: in T0 (sinks + recent window + the page written)


#: the access log's file format (docs/prefetch.md)
LOG_FORMAT, LOG_VERSION = "tieredkv-access-log", 1


@dataclass
class AccessTrace:
    """The steps of one sequence (pages are identified by their index in the sequence), and
    free-form metadata (model, text, budgets, ...)."""

    num_layers: int
    page_size: int
    steps: list[TraceStep] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write the log (torch.save of plain tensors, ints and strings; docs/prefetch.md);
        written to a temporary file first, so a failed write leaves nothing behind."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            torch.save({"format": LOG_FORMAT, "version": LOG_VERSION, "num_layers": self.num_layers,
                        "page_size": self.page_size, "meta": self.meta,
                        "steps": [vars(s) for s in self.steps]}, str(tmp))
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> "AccessTrace":
        try:
            d = torch.load(str(path), weights_only=True)
            steps = [TraceStep(**s) for s in d["steps"]]
            return cls(d["num_layers"], d["page_size"], steps, d.get("meta", {}))
        except FileNotFoundError:
            raise DataFileError(f"{path}: access log not found") from None
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
            raise DataFileError(f"{path}: not a readable access log ({short(str(exc), 200)}); expected a file "
                                f"written by the tiered cache's access_log or TraceRecorder") from None

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

    def needed_within(self, i: int, horizon: int) -> torch.Tensor:
        """[L, M_max] bool: pages needed by the next ``horizon`` decode steps after step ``i``."""
        m_max = max(s.needed.shape[1] for s in self.steps)
        out = torch.zeros(self.num_layers, m_max, dtype=torch.bool)
        seen = 0
        for s in self.steps[i + 1:]:
            if seen >= horizon:
                break
            if s.decode:
                out[:, : s.needed.shape[1]] |= s.needed
                seen += 1
        return out


class TraceRecorder:
    """Attach to a TieredKVCache (``recorder=``) to record its single sequence's steps.
    ``speculate``: also record each decode step's relevance of every layer's pages under the
    previous layer's query (the cross-layer predictor's input; one extra scoring per layer)."""

    def __init__(self, *, speculate: bool = False, meta: dict | None = None) -> None:
        self.trace: AccessTrace | None = None
        self.seq: int | None = None
        self.speculate = speculate
        self.meta = dict(meta or {})

    def record(self, access: StepAccess, *, seq: int, num_new: int, decode: bool, page_size: int,
               t0: torch.Tensor | None = None) -> None:
        """One step's access record of sequence ``seq`` ([L, M] columns over its pages)."""
        if self.seq is not None and seq != self.seq:
            raise ValueError("trace recording supports one sequence at a time")
        if self.trace is None:
            self.trace, self.seq = AccessTrace(access.needed.shape[0], page_size, meta=self.meta), seq
        clone = lambda x: None if x is None else x.clone()  # noqa: E731
        spec = None if access.spec is None or not decode else access.spec.clone()
        self.trace.steps.append(TraceStep(num_new, decode, access.needed.clone(), access.mass.clone(),
                                          access.importance.clone(), access.scored.clone(), clone(access.tier),
                                          spec, clone(t0)))


class AccessLogger:
    """The runtime's access log (``access_log = DIR``): every sequence's steps, written to
    ``DIR/seq-<n>.pt`` (an :class:`AccessTrace`) when the sequence is freed or the cache closes."""

    def __init__(self, directory: str | Path, *, speculate: bool = True, meta: dict | None = None) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"access_log: cannot create the log directory {self.directory} "
                              f"({short(str(exc), 200)}); expected a writable path") from None
        self.speculate = speculate
        self.meta = dict(meta or {})
        self.open: dict[int, TraceRecorder] = {}
        self.written: list[Path] = []
        self._count = 0

    def record(self, access: StepAccess, *, seq: int, **kw) -> None:
        if seq not in self.open:
            self.open[seq] = TraceRecorder(speculate=self.speculate, meta=self.meta)
        self.open[seq].record(access, seq=seq, **kw)

    def finish(self, seq: int) -> Path | None:
        rec = self.open.pop(seq, None)
        if rec is None or rec.trace is None:
            return None
        path = self.directory / f"seq-{os.getpid()}-{self._count}.pt"
        self._count += 1
        rec.trace.save(path)
        self.written.append(path)
        return path


def replay(trace: AccessTrace, config: TieredKVConfig, *, token_bytes_per_layer: int, dtype: torch.dtype,
           full_tokens: int | None = None, predictor=None, prefetch_max_pages: int | None = None,
           prefetch_distance: int = 2) -> TierMetrics:
    """Run the trace through a TierManager with ``config`` (its policy, budgets and
    thresholds) and return the metrics: hits, misses, bytes moved, ... ``token_bytes_per_layer``
    and ``dtype``: the K/V bytes of one token of one layer and the dtype the recorded cache
    stored its pages in (percentage budgets count bytes in the reference dtype). A step selects the
    recorded pages (decode: the needed ones plus T0; prefill: every page) and attends them as
    the live cache would (exact / masked mode). ``predictor`` (a name of
    ``prefetch.PREDICTORS``, ``"oracle"`` included, or a Predictor): prefetch as the live
    cache would, ``prefetch_distance`` steps ahead, at most ``prefetch_max_pages`` per layer
    (default: the attention budget's pages beyond T0); a ``"layer"``-lead predictor reads the
    log's ``spec`` before each decode step's selection. The warm sub-tier is not simulated (a
    trace carries no K/V to encode): the replay runs ``config`` with ``warm_codec = "off"``."""
    from tieredkv.runtime.tiered.prefetch import Predictor, Prefetcher, make_predictor

    config = config.replace(warm_codec=None)
    if config.page_size != trace.page_size:
        raise ValueError(f"trace has page size {trace.page_size}, config {config.page_size}")
    budgets = resolve_budgets(config, num_layers=trace.num_layers, token_bytes_per_layer=token_bytes_per_layer,
                              full_tokens=full_tokens, dtype=dtype)
    policy = make_policy(config.migration.policy, lfu_importance_weights=config.migration.lfu_importance_weights)
    future = trace.next_use() if policy.needs_trace else None
    current = {"step": 0}

    def next_use(table: PageTable) -> torch.Tensor:
        nu = future[current["step"]]
        per_page = nu[:, table.index.clamp(max=nu.shape[1] - 1)]
        return torch.where(table.alive.unsqueeze(0), per_page, torch.full_like(per_page, float("inf")))

    def oracle_future(horizon: int) -> torch.Tensor:
        nw = trace.needed_within(current["step"], horizon)
        t = mgr.table
        per_page = nw[:, t.index.clamp(max=nw.shape[1] - 1)]
        return per_page & (t.alive & (t.index < nw.shape[1])).unsqueeze(0)

    prefetcher = None
    if predictor is not None:
        if not isinstance(predictor, Predictor):
            predictor = make_predictor(predictor, **({"future": oracle_future} if predictor == "oracle" else {}))
        prefetcher = Prefetcher(predictor, max_pages=prefetch_max_pages, distance=prefetch_distance)
    mgr = TierManager(num_layers=trace.num_layers, kv_heads=1, head_dim=1, dtype=torch.float32, config=config,
                      budgets=budgets, policy=policy, page_bytes=token_bytes_per_layer * config.page_size,
                      next_use=next_use if future is not None else None, prefetcher=prefetcher)
    mgr.add_sequence(0)
    everything = slice(None)
    for i, s in enumerate(trace.steps):
        current["step"] = i
        plan = mgr.begin_step((0,), s.num_new)
        recs = plan.row(0)
        m = len(recs)
        if prefetcher is not None and s.decode and predictor.lead == "layer":
            if s.spec is None:
                raise ValueError(f"predictor {predictor.name!r} needs a log recorded with speculation (spec)")
            spec = torch.full(mgr.table.device_slot.shape, float("nan"))
            spec[:, recs] = s.spec[:, :m].float()
            prefetcher.within_step(mgr, spec)
        needed = s.needed[:, :m]
        selected = (needed | plan.t0[0] if s.decode else torch.ones_like(needed)).unsqueeze(1)  # [L, 1, M]
        mgr.record_step(plan, StepRecord(selected=selected, attended=mgr.attended(everything, plan, selected),
                                         relevance=None, mass=s.mass[:, :m].unsqueeze(1),
                                         importance=s.importance[:, :m].unsqueeze(1)))
        mgr.end_step(decode=s.decode)
    mgr.close()
    return mgr.metrics
