"""The serving benchmark (``tieredkv serve-bench``, ``tools/bench_serving.py``): the design
note's deployment table, measured at one fixed KV byte budget.

Arms (every one holds at most ``budget_tokens`` tokens' worth of K/V bytes on the device):
  * ``contiguous`` — the note's baseline: every request reserves the served length
    (``max_model_len``), as a contiguous max-length preallocation does (paged cache,
    ``admission="contiguous"``);
  * ``paged-recompute`` — the paged cache, optimistic admission, preemption by recompute
    (vLLM's default);
  * ``paged-reserve`` — the paged cache, reserve-to-completion admission (no preemption;
    TensorRT-LLM's guaranteed-no-evict);
  * ``tiered-exact`` — the tiered cache in exact mode (every page attended; pages off the
    device are fetched), optimistic admission (a request waits while the device could not
    hold the running requests' pages: the scheduler's working sets), preemption by demotion,
    prefix reuse;
  * ``tiered-exact-oversubscribe`` — the same admitting on hot windows alone (more requests at
    once, each step reading the pages the device does not hold from the host);
  * ``tiered-masked`` — the same in masked mode (attention limited to what the device
    holds: quality is measured, not assumed).
The host tier of the tiered arms is not bounded (host memory is the cheap tier).

Workloads, all built from the Paul Graham essays with the model's tokenizer:
  * ``chat`` — customer-service-like conversations: one shared system prompt, then turns
    whose prompt is the whole history (system + earlier user turns + the model's answers)
    plus a new user message;
  * ``docs`` — long documents (``doc_tokens``) each asked several short questions (a
    document's second question arrives after the other documents' first);
  * ``unique`` — the no-sharing control: chat-sized single prompts that share nothing.
A closed loop keeps ``clients`` sessions in flight (a client starts its next session when
one ends; a session's turns run one after another); an open loop starts sessions at
Poisson arrival times. Everything runs on the engine's thread: time is wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable

import numpy as np

from tieredkv.errors import ConfigError, TieredKVError
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving.engine import Engine
from tieredkv.runtime.serving.prefix import PrefixConfig
from tieredkv.runtime.serving.scheduler import SchedulerConfig

ARMS = ("contiguous", "paged-recompute", "paged-reserve", "tiered-exact", "tiered-exact-oversubscribe",
        "tiered-masked")
WORKLOADS = ("chat", "docs", "unique")


@dataclass(frozen=True)
class BenchConfig:
    """``budget_tokens``: the device KV budget, in tokens' worth of the model's K/V bytes;
    ``max_model_len``: the served length (the contiguous arm reserves it per request);
    ``prefix``: the tiered arms' prefix-reuse tiers (``off``, ``device``, ``host``, ``disk``)."""

    budget_tokens: int = 16384
    max_model_len: int = 4096
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prefill_chunk: int = 512
    prefix: str = "disk"
    recent_tokens: int = 64
    sink_tokens: int = 4


def make_engine(arm: str, model, tokenizer, cfg: BenchConfig, *, disk_dir: str | None = None) -> Engine:
    """The engine of one arm at the configured budget."""
    if arm not in ARMS:
        raise ConfigError(f"unknown arm {arm!r}; expected one of {list(ARMS)}")
    spec = model.kv_spec()
    token_bytes = spec.token_bytes_per_layer * spec.num_layers
    sched = dict(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                 prefill_chunk=cfg.prefill_chunk, max_model_len=cfg.max_model_len)
    prefix = None
    if arm.startswith("paged") or arm == "contiguous":
        cache = PagedKVCache(spec, PagedCacheConfig(page_size=cfg.page_size,
                                                    max_pages=cfg.budget_tokens // cfg.page_size))
        admission = {"contiguous": "contiguous", "paged-recompute": "optimistic", "paged-reserve": "reserve"}[arm]
        scheduler = SchedulerConfig(admission=admission, preemption="recompute", **sched)
    else:
        from tieredkv.runtime.tiered.cache import TieredKVCache
        from tieredkv.runtime.tiered.config import TieredKVConfig

        mode = arm.split("-")[1]
        kv = TieredKVConfig(page_size=cfg.page_size, device_budget=f"{cfg.budget_tokens * token_bytes}B",
                            attention_budget=10 ** 7 if mode == "exact" else None, mode=mode, warm_codec="off",
                            sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens,
                            disk_path=None if disk_dir is None else str(Path(disk_dir) / f"{arm}-t4.bin"))
        cache = TieredKVCache(spec, kv)
        scheduler = SchedulerConfig(admission="optimistic", preemption="demote",
                                    oversubscribe=arm.endswith("-oversubscribe"), **sched)
        if cfg.prefix != "off":
            prefix = PrefixConfig(tiers=cfg.prefix)
    return Engine(model, cache, tokenizer=tokenizer, scheduler=scheduler, prefix=prefix, on_error="fail")


# ------------------------------------------------------------------------------ workloads
@dataclass
class Session:
    """One client session: ``turns`` user messages (token ids); a turn's prompt is ``prefix``,
    then — for a conversation — every earlier turn and its answer, then the turn's message."""

    key: str
    prefix: list[int]
    turns: list[list[int]]
    max_new_tokens: int
    conversation: bool = True


def _slices(ids: list[int], n: int, length: int, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def make_sessions(workload: str, ids: list[int], *, sessions: int, seed: int = 0, system_tokens: int = 512,
                  turns: int = 3, user_tokens: tuple[int, int] = (32, 96), max_new_tokens: int = 32,
                  doc_tokens: tuple[int, int] = (4096, 6144), questions: int = 2) -> list[Session]:
    """Sessions of a workload (see the module docstring) from the token ids of a text."""
    rng = random.Random(seed)
    if workload == "chat":
        system = _slices(ids, 1, system_tokens, rng)[0]
        return [Session(f"c{i}", system, [_slices(ids, 1, rng.randint(*user_tokens), rng)[0] for _ in range(turns)],
                        max_new_tokens) for i in range(sessions)]
    if workload == "unique":
        return [Session(f"u{i}", [], [_slices(ids, 1, system_tokens + rng.randint(*user_tokens), rng)[0]],
                        max_new_tokens, conversation=False) for i in range(sessions)]
    if workload == "docs":  # question-major: a document's later questions come after other documents'
        ndocs = max(1, math.ceil(sessions / questions))
        docs = [_slices(ids, 1, rng.randint(*doc_tokens), rng)[0] for _ in range(ndocs)]
        out = [Session(f"d{d}q{q}", docs[d], [_slices(ids, 1, rng.randint(12, 24), rng)[0]], max_new_tokens,
                       conversation=False) for q in range(questions) for d in range(ndocs)]
        return out[:sessions]
    raise ConfigError(f"unknown workload {workload!r}; expected one of {list(WORKLOADS)}")


def long_tailed_sessions(ids: list[int], n: int, *, seed: int, median: int, sigma: float, max_len: int,
                         max_new_tokens: int) -> list[Session]:
    """Single-prompt sessions with log-normal prompt lengths (median ``median``), capped so
    prompt + output fit ``max_len``: the crash-rate run's traffic."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = int(min(max_len - max_new_tokens - 1, max(8, rng.lognormvariate(math.log(median), sigma))))
        out.append(Session(f"r{i}", [], _slices(ids, 1, length, rng), max_new_tokens, conversation=False))
    return out


# ------------------------------------------------------------------------------ driving
@dataclass
class RunResult:
    arm: str
    workload: str
    clients: int | None
    rate: float | None
    summary: dict
    outputs: dict[str, list[int]] = field(default_factory=dict)  # "session/turn" -> token ids
    rejected: int = 0
    errors: int = 0
    timeouts: int = 0
    crashed: str | None = None  # an exception that stopped the whole run
    sessions_done: int = 0
    wall_seconds: float = 0.0
    quality: dict | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("outputs")
        return d


def drive(engine: Engine, sessions: list[Session], *, arm: str, workload: str, clients: int | None = None,
          rate: float | None = None, seed: int = 0, timeout_s: float | None = None,
          log: Callable[[str], None] | None = None) -> RunResult:
    """Run sessions through the engine, closed loop (``clients``) or open loop (``rate``
    sessions per second, Poisson)."""
    if (clients is None) == (rate is None):
        raise ConfigError("give either clients (closed loop) or rate (open loop)")
    res = RunResult(arm, workload, clients, rate, {})
    pending = deque(sessions)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    arrivals: deque[float] = deque()
    if rate is not None:
        t = 0.0
        for _ in sessions:
            t += rng.expovariate(rate)
            arrivals.append(t)
    finished: list = []
    state: dict[str, tuple[Session, int, list[int]]] = {}  # request id -> (session, turn, prompt)

    def submit(session: Session, turn: int, history: list[int]) -> None:
        prompt = history + session.turns[turn] if session.conversation else session.prefix + session.turns[turn]
        rid = f"{session.key}/{turn}"
        try:
            engine.add_request(prompt, SamplingParams(max_new_tokens=session.max_new_tokens, ignore_eos=True),
                               request_id=rid, on_finish=finished.append)
        except TieredKVError:
            res.rejected += 1
            start_next()
            return
        state[rid] = (session, turn, prompt)

    def start(session: Session) -> None:
        submit(session, 0, list(session.prefix))

    def start_next() -> None:
        if clients is not None and pending:
            start(pending.popleft())

    if clients is not None:
        for _ in range(min(clients, len(pending))):
            start(pending.popleft())
    last_log = t0
    while True:
        now = time.perf_counter() - t0
        while rate is not None and arrivals and arrivals[0] <= now:
            arrivals.popleft()
            start(pending.popleft())
        if engine.has_unfinished():
            try:
                engine.step()
            except Exception as exc:  # noqa: BLE001 - a crash of the whole engine is a result here
                res.crashed = f"{type(exc).__name__}: {exc}"
                break
        elif rate is not None and arrivals:
            time.sleep(max(0.0, arrivals[0] - (time.perf_counter() - t0)))
            continue
        else:
            break
        if timeout_s is not None:
            late = [r for r in engine.requests.values()
                    if not r.finished and time.perf_counter() - r.metrics.arrival > timeout_s]
            for r in late:
                engine.abort(r.request_id)
                res.timeouts += 1
        while finished:
            req = finished.pop(0)
            session, turn, prompt = state.pop(req.request_id)
            res.outputs[req.request_id] = list(req.out.token_ids)
            if req.out.finish_reason == "error":
                res.errors += 1
            if req.out.finish_reason in ("error", "cancelled") or turn + 1 == len(session.turns):
                res.sessions_done += 1
                start_next()
            else:
                submit(session, turn + 1, prompt + req.out.token_ids)
        if log is not None and time.perf_counter() - last_log > 30:
            last_log = time.perf_counter()
            s = engine.scheduler
            log(f"  {arm}/{workload}: {time.perf_counter() - t0:.0f}s, {res.sessions_done}/{len(sessions)} sessions, "
                f"running {len(s.running)}, waiting {len(s.waiting)}, paused {len(s.paused)}")
    res.wall_seconds = time.perf_counter() - t0
    res.summary = engine.summary()
    return res


def agreement(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> dict:
    """How far an arm's outputs agree with a reference arm's, request by request."""
    keys = sorted(set(outputs) & set(reference))
    if not keys:
        return {"compared": 0, "identical": None, "token_agreement": None}
    same = sum(outputs[k] == reference[k] for k in keys)
    agree = []
    for k in keys:
        a, b = outputs[k], reference[k]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree.append(n / max(1, len(b)))
    return {"compared": len(keys), "identical": round(same / len(keys), 4),
            "token_agreement": round(float(np.mean(agree)), 4)}


# ------------------------------------------------------------------------------ reporting
def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def row(res: RunResult, slo_tpot: float | None = None) -> dict:
    s = res.summary
    ok = res.crashed is None and res.errors == 0 and res.timeouts == 0
    tpot99 = s["tpot"]["p99"]
    return {
        "arm": res.arm, "workload": res.workload, "clients": res.clients, "rate": res.rate,
        "requests": s["requests"], "rejected": res.rejected, "errors": res.errors, "timeouts": res.timeouts,
        "crashed": res.crashed, "running_max": s["kv"]["running_max"], "running_mean": s["kv"]["running_mean"],
        "queue_p50": s["queue_time"]["p50"], "queue_p99": s["queue_time"]["p99"],
        "ttft_p50": s["ttft"]["p50"], "ttft_p99": s["ttft"]["p99"], "ttft_compute_p50": s["prefill_time"]["p50"],
        "ttft_compute_p99": s["prefill_time"]["p99"], "tpot_p50": s["tpot"]["p50"],
        "tpot_p99": tpot99, "e2e_p99": s["e2e"]["p99"], "itl_max_p99": s["itl_max"]["p99"],
        "kv_cv": s["kv"]["allocated_cv"], "kv_util": s["kv"]["utilization"],
        "kv_peak_mib": round(s["kv"]["allocated_peak"] / 2 ** 20, 1), "preemptions": s["preemptions"],
        "prefix_hit_rate": (s.get("prefix") or {}).get("hit_rate"),
        "prefix_hits_by_tier": (s.get("prefix") or {}).get("hit_pages"),
        "output_tok_s": s["output_tok_s"], "wall_s": round(res.wall_seconds, 1),
        "within_slo": ok and (slo_tpot is None or (tpot99 is not None and tpot99 <= slo_tpot)),
        "quality": res.quality,
    }


def markdown(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "|" + "|".join("---:" if i else "---" for i in range(len(columns))) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key)
            if key.startswith(("queue", "ttft", "tpot", "e2e", "itl")) and not isinstance(v, str):
                cells.append(_ms(v))
            elif isinstance(v, float):
                cells.append(f"{v:.3g}")
            elif isinstance(v, dict):
                cells.append(", ".join(f"{k} {n}" for k, n in v.items() if n) or "0")
            else:
                cells.append("-" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ suites
SUITES = ("concurrency", "prefix", "docs", "control", "poisson", "crash")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tieredkv serve-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", nargs="+", choices=SUITES, default=["concurrency"])
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--model", default=None, help="checkpoint or model name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--budget-tokens", type=int, default=16384, help="device KV budget, tokens' worth of bytes")
    ap.add_argument("--max-model-len", type=int, default=4096, help="served length (the contiguous reservation)")
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 24], help="closed-loop concurrency sweep")
    ap.add_argument("--sessions", type=int, default=None, help="sessions per run (default: per client, below)")
    ap.add_argument("--sessions-per-client", type=int, default=1)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=[4096, 6144])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2], help="open-loop sessions per second")
    ap.add_argument("--crash-requests", type=int, default=1000)
    ap.add_argument("--crash-median", type=int, default=128, help="median prompt tokens of the crash run")
    ap.add_argument("--crash-sigma", type=float, default=1.2, help="log-normal sigma of the crash run's prompts")
    ap.add_argument("--crash-new-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600.0, help="a request slower than this is a timeout (s)")
    ap.add_argument("--slo-tpot", type=float, default=1.0, help="P99 TPOT SLO in seconds (this CPU)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/serving"))
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object with every row")
    args = ap.parse_args(argv)

    import torch

    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.runtime.eval.data import pg_essays_text

    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    loaded = load_checkpoint(resolve_model(args.model, log=log))
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(pg_essays_text(log=log), add_bos=False)
    context = model.config.max_position_embeddings
    base = BenchConfig(budget_tokens=args.budget_tokens, max_model_len=min(args.max_model_len, context))
    args.out.mkdir(parents=True, exist_ok=True)
    disk_dir = str(args.out)
    report: dict = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "model": loaded.config.name, "config": dataclasses.asdict(base),
                    "argv": argv if argv is not None else sys.argv[1:], "suites": {}}
    md = [f"# Serving benchmark — {report['date']}, {loaded.config.name}, {report['threads']} threads",
          f"budget {base.budget_tokens} tokens of KV on the device; served length {base.max_model_len}; "
          f"page size {base.page_size}; token budget per step {base.max_num_batched_tokens}"]
    cols = [("arm", "arm"), ("clients", "clients"), ("requests", "done"), ("running_max", "max running"),
            ("running_mean", "mean running"), ("queue_p99", "queue p99 ms"), ("ttft_p50", "TTFT p50"),
            ("ttft_p99", "TTFT p99"), ("tpot_p50", "TPOT p50"), ("tpot_p99", "TPOT p99"), ("kv_cv", "KV CV"),
            ("kv_util", "KV util"), ("preemptions", "preemptions"), ("prefix_hit_rate", "prefix hits"),
            ("output_tok_s", "tok/s"), ("within_slo", "in SLO")]

    def run(arm, workload, sessions, cfg=base, **kw) -> RunResult:
        engine = make_engine(arm, model, tok, cfg, disk_dir=disk_dir)
        log(f"{arm} / {workload}: {len(sessions)} sessions {kw}")
        try:
            return drive(engine, sessions, arm=arm, workload=workload, timeout_s=args.timeout, log=log, **kw)
        finally:
            engine.cache.close()

    def add_quality(results: list[RunResult]) -> None:
        ref = next((r for name in ("contiguous", "paged-recompute", "paged-reserve") for r in results
                    if r.arm == name), None)
        for r in results:
            if ref is not None and r is not ref:
                r.quality = agreement(r.outputs, ref.outputs)

    def section(name: str, title: str, results: list[RunResult], columns=cols, note: str = "") -> None:
        rows = [row(r, args.slo_tpot) for r in results]
        report["suites"][name] = rows
        md.extend(["", f"## {title}", note, "", markdown(rows, columns)])
        (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / "table.md").write_text("\n".join(md) + "\n")

    qcols = cols + [("quality", "vs reference")]
    if "concurrency" in args.suite:
        results = []
        for n in args.clients:
            sessions = make_sessions("chat", ids, sessions=args.sessions or args.sessions_per_client * n, seed=args.seed,
                                     system_tokens=args.system_tokens, turns=args.turns,
                                     max_new_tokens=args.max_new_tokens)
            group = [run(arm, "chat", sessions, clients=n) for arm in args.arms]
            add_quality(group)
            results += group
        section("concurrency", "Chat, closed loop: concurrency at a fixed KV budget", results, qcols,
                f"max concurrency = the most requests running at once in a run that completed every request "
                f"with no error and P99 TPOT <= {args.slo_tpot:g} s")
    if "prefix" in args.suite:
        n = args.clients[0]
        sessions = make_sessions("chat", ids, sessions=args.sessions or args.sessions_per_client * n, seed=args.seed,
                                 system_tokens=args.system_tokens, turns=args.turns, max_new_tokens=args.max_new_tokens)
        results = []
        for tiers in ("off", "device", "host", "disk"):
            cfg = dataclasses.replace(base, prefix=tiers, budget_tokens=args.budget_tokens // 4)
            r = run("tiered-exact", f"chat/reuse {tiers}", sessions, cfg=cfg, clients=n)
            results.append(r)
        add_quality(results)
        pcols = [("workload", "reuse"), ("requests", "done"), ("prefix_hit_rate", "hit rate"),
                 ("prefix_hits_by_tier", "hit pages by tier"), ("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"),
                 ("tpot_p50", "TPOT p50"), ("output_tok_s", "tok/s"), ("wall_s", "wall s")]
        section("prefix", f"Prefix reuse by tier (tiered exact, chat, {n} clients, device budget "
                          f"{args.budget_tokens // 4} tokens)", results, pcols)
    if "docs" in args.suite:
        n = 2
        sessions = make_sessions("docs", ids, sessions=args.sessions or 8, seed=args.seed,
                                 doc_tokens=tuple(args.doc_tokens), max_new_tokens=16)
        cfg = dataclasses.replace(base, max_model_len=context)
        group = [run(arm, "docs", sessions, cfg=cfg, clients=n) for arm in args.arms]
        add_quality(group)
        section("docs", f"Long documents ({args.doc_tokens[0]}-{args.doc_tokens[1]} tokens, 2 questions each, "
                        f"{n} clients, served length {context})", group, qcols)
    if "control" in args.suite:
        n = args.clients[-1]
        sessions = make_sessions("unique", ids, sessions=args.sessions or args.sessions_per_client * n, seed=args.seed,
                                 system_tokens=args.system_tokens, max_new_tokens=args.max_new_tokens)
        results = [run("tiered-exact", "unique/reuse " + tiers, sessions,
                       cfg=dataclasses.replace(base, prefix=tiers), clients=n) for tiers in ("off", "disk")]
        add_quality(results)
        section("control", f"No-sharing control (unique prompts, {n} clients): what reuse costs when nothing is "
                           "shared", results, [("workload", "run")] + cols[2:])
    if "poisson" in args.suite:
        results = []
        for rate in args.rates:
            sessions = make_sessions("chat", ids, sessions=args.sessions or 24, seed=args.seed,
                                     system_tokens=args.system_tokens, turns=args.turns,
                                     max_new_tokens=args.max_new_tokens)
            for arm in args.arms:
                results.append(run(arm, "chat", sessions, rate=rate))
        section("poisson", "Chat, open loop (Poisson session arrivals)", results,
                [("arm", "arm"), ("rate", "sessions/s")] + cols[2:])
    if "crash" in args.suite:
        sessions = long_tailed_sessions(ids, args.crash_requests, seed=args.seed, median=args.crash_median,
                                        sigma=args.crash_sigma, max_len=context,
                                        max_new_tokens=args.crash_new_tokens)
        lens = np.array([len(s.turns[0]) for s in sessions])
        cfg = dataclasses.replace(base, max_model_len=context)
        results = [run(arm, "long-tailed", sessions, cfg=cfg, clients=args.clients[-1]) for arm in args.arms]
        ccols = [("arm", "arm"), ("requests", "done"), ("errors", "errors"), ("timeouts", "timeouts"),
                 ("crashed", "engine crash"), ("rejected", "rejected at submission"), ("queue_p99", "queue p99"),
                 ("e2e_p99", "e2e p99"), ("preemptions", "preemptions"), ("wall_s", "wall s")]
        section("crash", f"Crash rate: {len(sessions)} requests, prompt tokens log-normal (median "
                         f"{int(np.median(lens))}, mean {int(lens.mean())}, p99 {int(np.percentile(lens, 99))}, max "
                         f"{lens.max()}), {args.crash_new_tokens} new tokens, {args.clients[-1]} clients, served "
                         f"length {context}", results, ccols)
    log(f"wrote {args.out / 'table.md'} and {args.out / 'results.json'}")
    print("\n".join(md))
    if args.json:
        print(json.dumps(report["suites"], default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
