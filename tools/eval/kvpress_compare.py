"""Side-by-side quality of KV-cache compression: NVIDIA kvpress presses vs tieredkv, on the
same weights, scored by the same code (``tieredkv.runtime.eval``).

    python tools/eval/kvpress_compare.py --budgets 0.5 0.25 0.125 --ppl-window 4096 \\
        --ppl-max-windows 4 --passkey-context 4096 --passkey-trials 10 --out results/kvpress

For every row (a method) at every KV budget (fraction of the context's KV kept) it
computes

* perplexity with the budget protocol: each window's first ``--ppl-context-fraction``
  (3/4) is the context, compressed by the method before the rest is seen; the last 1/4
  is scored with teacher forcing against that cache;
* passkey retrieval: accuracy and the mean teacher-forced log-prob of the key, the
  haystack compressed before the question is seen.

Both are question-agnostic: compression never sees the continuation or the question.

Rows. tieredkv's rows come from :data:`TIEREDKV_ROWS` (its full cache, budget 100 %, is
the first and the reference that Δppl is measured against); kvpress presses from
``--presses``; more rows from ``--rows-from MODULE:ATTR`` (a list of :class:`Row`, or a
callable returning one) — a tieredkv policy becomes a row by appending a :class:`Row`
whose ``factory(model, budget)`` returns its :class:`EvalMethod`, with no change here.

Output in ``--out``: ``results.json`` (every raw result, per window and per trial; also
the resume store: a finished (row, budget, metric) with the same parameters is skipped
on a rerun), ``table.md`` and ``quality_vs_budget.png``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tieredkv.models.llama import Llama  # noqa: E402
from tieredkv.runtime.eval.harness import CacheMethod, EvalMethod  # noqa: E402

METRICS = ("perplexity", "passkey")
RESULTS_FILE, TABLE_FILE, PLOT_FILE = "results.json", "table.md", "quality_vs_budget.png"
SCHEMA = 1


# ------------------------------------------------------------------------------ rows
@dataclass(frozen=True)
class Row:
    """One method of the comparison.

    ``factory(model, budget)`` builds a *fresh* :class:`EvalMethod` (one per budget and
    metric, so its ``stats()`` belong to that result only). ``budgets``: the budgets this
    row runs at; ``None`` means the run's ``--budgets``. ``reference``: the full-cache
    baseline (Δppl is measured against the first reference row).
    """

    name: str
    factory: Callable[[Llama, float], EvalMethod]
    budgets: tuple[float, ...] | None = None
    reference: bool = False
    backend: str = "tieredkv"


def _tieredkv_full_cache(model: Llama, budget: float) -> EvalMethod:
    from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache

    if budget != 1.0:
        raise ValueError(f"the full cache keeps everything; budget must be 1.0, got {budget}")
    spec, cfg = model.kv_spec(), PagedCacheConfig(page_size=16)
    return CacheMethod(model, lambda _total_tokens=None: PagedKVCache(spec, cfg), name="full",
                       info={"budget": 1.0, "backend": "tieredkv", "cache": "PagedKVCache", "page_size": 16})


#: tieredkv's rows; append a :class:`Row` here (or pass ``--rows-from``) to add a policy.
TIEREDKV_ROWS: list[Row] = [
    Row("full", _tieredkv_full_cache, budgets=(1.0,), reference=True, backend="tieredkv"),
]


def kvpress_row(press_name: str, *, teacher_forcing_chunk: int = 256) -> Row:
    """The registered kvpress press ``press_name`` as a row (see kvpress_methods.PRESS_CLASSES)."""
    from kvpress_methods import KVPressMethod

    def factory(model: Llama, budget: float) -> EvalMethod:
        return KVPressMethod.from_registry(model, press_name, budget, teacher_forcing_chunk=teacher_forcing_chunk)

    return Row(press_name, factory, backend="kvpress")


def load_rows_from(spec: str) -> list[Row]:
    """``MODULE:ATTR`` -> rows; ATTR is a list of :class:`Row` or a callable returning one."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"error: --rows-from {spec!r}: expected MODULE:ATTR")
    obj = getattr(importlib.import_module(module_name), attr)
    rows = obj() if callable(obj) else obj
    if not all(isinstance(r, Row) for r in rows):
        raise SystemExit(f"error: --rows-from {spec!r} must give a list of kvpress_compare.Row")
    return list(rows)


# ------------------------------------------------------------------------------ results store
def result_key(row: str, budget: float, metric: str) -> str:
    return f"{row}@{budget:g}/{metric}"


def load_store(path: Path) -> dict[str, Any]:
    if path.is_file():
        store = json.loads(path.read_text())
        if store.get("schema") == SCHEMA:
            return store
    return {"schema": SCHEMA, "meta": {}, "results": {}}


def save_store(store: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(store, indent=1, default=str))
    os.replace(tmp, path)  # atomic: a killed run never leaves half a file


def summarize(store: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per (row, budget), in the order results were first recorded, with
    ppl / Δppl / passkey figures (None where not measured)."""
    rows: dict[tuple[str, float], dict[str, Any]] = {}
    for entry in store["results"].values():
        r = rows.setdefault((entry["row"], entry["budget"]), {
            "row": entry["row"], "budget": entry["budget"], "backend": entry.get("backend", ""),
            "reference": entry.get("reference", False), "perplexity": None, "passkey_accuracy": None,
            "passkey_logprob": None, "kept_fraction": None, "seconds": 0.0,
        })
        res = entry["result"]
        r["seconds"] += res.get("seconds", 0.0)
        kept = res.get("stats", {}).get("kept_fraction")
        if kept is not None and (r["kept_fraction"] is None or entry["metric"] == "perplexity"):
            r["kept_fraction"] = kept  # the perplexity contexts' figure wins over the passkey one
        if entry["metric"] == "perplexity":
            r["perplexity"] = res["perplexity"]
        elif entry["metric"] == "passkey":
            r["passkey_accuracy"] = res["accuracy"]
            r["passkey_logprob"] = res["mean_logprob"]
    out = list(rows.values())
    ref = next((r for r in out if r["reference"] and r["perplexity"] is not None), None)
    for r in out:
        r["delta_ppl"] = (r["perplexity"] - ref["perplexity"]) if ref and r["perplexity"] is not None else None
    return out


# ------------------------------------------------------------------------------ table & plot
def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def protocol_line(meta: dict[str, Any]) -> str:
    p, k = meta.get("perplexity"), meta.get("passkey")
    parts = ["Protocol: question-agnostic — each context is compressed before the continuation/question is seen"]
    if p:
        windows = p.get("windows_used", p.get("max_windows"))
        parts.append(f"perplexity over {windows} window(s) of {p['window']} tokens of {p.get('text', 'text')}, "
                     f"first {p['context_fraction']:g} of each window is the (compressed) context, the rest scored")
    if k:
        parts.append(f"passkey: {k['trials']} trial(s) at {k['context']}-token context, needle depths evenly spread, "
                     f"seed {k['seed']}")
    parts.append(f"model {meta.get('model', '?')}")
    parts.append(f"date {meta.get('updated', meta.get('created', '?'))}")
    return "; ".join(parts) + "."


def write_table(store: dict[str, Any], out_dir: Path) -> Path:
    rows = summarize(store)
    lines = [protocol_line(store.get("meta", {})), "",
             "| method | backend | budget % | KV kept % (measured) | perplexity | Δppl vs full | passkey accuracy | "
             "mean key log-prob (nats) | seconds |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kept = None if r["kept_fraction"] is None else 100 * r["kept_fraction"]
        if kept is None and r["reference"]:
            kept = 100.0
        delta = "–" if r["delta_ppl"] is None else f"{r['delta_ppl']:+.3f}"
        lines.append(
            f"| {r['row']} | {r['backend']} | {100 * r['budget']:g} | {_fmt(kept, '.1f')} | "
            f"{_fmt(r['perplexity'], '.3f')} | {delta} | {_fmt(r['passkey_accuracy'], '.2f')} | "
            f"{_fmt(r['passkey_logprob'], '.3f')} | {r['seconds']:.0f} |"
        )
    path = out_dir / TABLE_FILE
    path.write_text("\n".join(lines) + "\n")
    return path


def write_plot(store: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(store)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    panels = (("perplexity", "perplexity (last 1/4 of each window)"),
              ("passkey_logprob", "passkey: mean log-prob of the key (nats)"))
    budgets = sorted({r["budget"] for r in rows})
    colors = plt.get_cmap("tab20")
    for ax, (field, label) in zip(axes, panels):
        by_name: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            if r[field] is not None:
                by_name.setdefault(r["row"], []).append(r)
        for name, pts in by_name.items():
            pts.sort(key=lambda r: r["budget"])
            if any(p["reference"] for p in pts) and len(pts) == 1:
                ax.axhline(pts[0][field], color="black", linestyle="--", linewidth=1, label=f"{name} (100 %)")
                continue
            ours = pts[0]["backend"] == "tieredkv"  # our rows: solid squares; presses: dashed circles
            ax.plot([100 * p["budget"] for p in pts], [p[field] for p in pts], marker="s" if ours else "o",
                    linestyle="-" if ours else "--", color=colors(len(ax.lines) % 20), label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks([100 * b for b in budgets])
        ax.set_xticklabels([f"{100 * b:g}" for b in budgets])
        ax.set_xlabel("KV budget (% of context kept)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for h, lab in zip(*axes[1].get_legend_handles_labels()):
        if lab not in labels:
            handles.append(h)
            labels.append(lab)
    fig.legend(handles, labels, loc="center right", fontsize=8)
    meta = store.get("meta", {})
    fig.suptitle(f"KV compression quality vs budget — {meta.get('model', '')} (question-agnostic)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.85, 0.95))
    path = out_dir / PLOT_FILE
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ run
@dataclass(frozen=True)
class Job:
    row: Row
    budget: float
    metric: str


def plan(rows: Sequence[Row], budgets: Sequence[float], metrics: Sequence[str]) -> list[Job]:
    return [Job(row, b, m) for row in rows for b in (row.budgets or tuple(budgets)) for m in metrics]


def run_jobs(jobs: Iterable[Job], model: Llama, store: dict[str, Any], store_path: Path,
             params: dict[str, dict[str, Any]], compute: dict[str, Callable[[EvalMethod], Any]],
             *, log: Callable[[str], None], report: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Run every job not already in ``store`` with the same ``params[metric]``; save the store
    (and call ``report(store)``, e.g. to rewrite the table) after each."""
    from tqdm.auto import tqdm

    jobs = list(jobs)
    bar = tqdm(jobs, desc="kvpress-compare", unit="job")
    for job in bar:
        key = result_key(job.row.name, job.budget, job.metric)
        bar.set_postfix_str(key)
        done = store["results"].get(key)
        if done is not None and done.get("params") == params[job.metric]:
            log(f"skip {key} (done {done.get('finished')})")
            continue
        t_start = time.perf_counter()
        method = job.row.factory(model, job.budget)
        res = compute[job.metric](method)
        elapsed = time.perf_counter() - t_start
        store["results"][key] = {
            "row": job.row.name, "budget": job.budget, "metric": job.metric, "backend": job.row.backend,
            "reference": job.row.reference, "params": params[job.metric], "seconds_total": elapsed,
            "finished": _dt.datetime.now().isoformat(timespec="seconds"), "result": res.to_dict(),
        }
        store["meta"]["updated"] = _dt.date.today().isoformat()
        save_store(store, store_path)
        if report is not None:
            report(store)
        figure = (f"ppl {res.perplexity:.4f}" if job.metric == "perplexity"
                  else f"acc {res.accuracy:.2f} logprob {res.mean_logprob:.3f}")
        kept = res.stats.get("kept_fraction")
        log(f"done {key}: {figure}" + (f", kept {100 * kept:.1f}%" if kept is not None else "")
            + f" ({elapsed:.1f}s)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from kvpress_methods import press_names

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint path or known name (default: the default model)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125],
                   help="KV budgets, fractions of the context kept (default 0.5 0.25 0.125)")
    p.add_argument("--presses", nargs="*", default=press_names(), choices=press_names(), metavar="PRESS",
                   help=f"kvpress presses to run (default: all of {', '.join(press_names())}; none: `--presses`)")
    p.add_argument("--no-tieredkv-rows", action="store_true", help="leave out TIEREDKV_ROWS (incl. the full cache)")
    p.add_argument("--rows-from", action="append", default=[], metavar="MODULE:ATTR",
                   help="extra rows: a list of Row (or a callable returning one); repeatable")
    p.add_argument("--skip-perplexity", action="store_true", help="do not run perplexity")
    p.add_argument("--skip-passkey", action="store_true", help="do not run passkey retrieval")
    p.add_argument("--ppl-window", type=int, default=4096, help="perplexity window in tokens (default 4096)")
    p.add_argument("--ppl-max-windows", type=int, default=4, help="windows scored per method (default 4)")
    p.add_argument("--ppl-context-fraction", type=float, default=0.75,
                   help="leading fraction of each window that is the compressed context (default 0.75)")
    p.add_argument("--passkey-context", type=int, default=4096, help="passkey prompt length in tokens")
    p.add_argument("--passkey-trials", type=int, default=10, help="passkey trials (needle depths evenly spread)")
    p.add_argument("--seed", type=int, default=0, help="passkey seed (keys, haystack offsets)")
    p.add_argument("--teacher-forcing-chunk", type=int, default=256,
                   help="continuation tokens per forward call for kvpress rows (any value gives the same result)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=Path("results/kvpress"),
                   help="output directory: results.json (also the resume store), table.md, quality_vs_budget.png")
    p.add_argument("--report-only", action="store_true", help="rewrite table.md and the plot from results.json")
    args = p.parse_args(argv)
    for b in args.budgets:
        if not 0.0 < b <= 1.0:
            p.error(f"--budgets: each budget must be in (0, 1], got {b}")
    return args


def _log(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"[{_dt.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr)
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None, *, extra_rows: Sequence[Row] = ()) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    store_path = args.out / RESULTS_FILE
    store = load_store(store_path)
    if args.report_only:
        _log(f"wrote {write_table(store, args.out)} and {write_plot(store, args.out)}")
        return 0

    import torch
    from tqdm.auto import tqdm

    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.runtime.eval.data import pg_essays_text
    from tieredkv.runtime.eval.passkey import passkey
    from tieredkv.runtime.eval.perplexity import perplexity

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model, log=_log)
    loaded = load_checkpoint(path, progress=lambda it: tqdm(it, desc="loading weights", unit="tensor", leave=False))
    if loaded.tokenizer is None:
        raise SystemExit(f"error: {path}: no tokenizer")
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(pg_essays_text(log=_log), add_bos=False)
    _log(f"model {loaded.config.name} ({path.name}); {len(ids)} tokens of Paul Graham essays; "
         f"{torch.get_num_threads()} threads")

    rows = [] if args.no_tieredkv_rows else list(TIEREDKV_ROWS)
    rows += [kvpress_row(name, teacher_forcing_chunk=args.teacher_forcing_chunk) for name in args.presses]
    rows += list(extra_rows)
    for spec in args.rows_from:
        rows += load_rows_from(spec)
    metrics = [m for m in METRICS if not getattr(args, f"skip_{m}")]

    n_windows = min(len(ids) // args.ppl_window, args.ppl_max_windows)
    params = {
        "perplexity": {"window": args.ppl_window, "max_windows": args.ppl_max_windows,
                       "context_fraction": args.ppl_context_fraction, "text": "pg-essays"},
        "passkey": {"context": args.passkey_context, "trials": args.passkey_trials, "seed": args.seed,
                    "haystack": "pg-essays"},
    }
    compute = {
        "perplexity": lambda m: perplexity(m, ids, window=args.ppl_window, max_windows=args.ppl_max_windows,
                                           context_fraction=args.ppl_context_fraction),
        "passkey": lambda m: passkey(m, tok, ids, context=args.passkey_context, trials=args.passkey_trials,
                                     seed=args.seed),
    }
    meta = store["meta"]
    meta.setdefault("created", _dt.date.today().isoformat())
    meta.update(model=f"{loaded.config.name} ({path.name})", threads=torch.get_num_threads(),
                perplexity={**params["perplexity"], "windows_used": n_windows} if "perplexity" in metrics
                else meta.get("perplexity"),
                passkey=params["passkey"] if "passkey" in metrics else meta.get("passkey"))
    jobs = plan(rows, args.budgets, metrics)
    _log(f"{len(jobs)} job(s): {len(rows)} row(s) x budgets {args.budgets} x {metrics}; results in {store_path}")
    try:
        run_jobs(jobs, model, store, store_path, params, compute, log=_log,
                 report=lambda s: (write_table(s, args.out), write_plot(s, args.out)))
    finally:
        save_store(store, store_path)
        _log(f"wrote {write_table(store, args.out)} and {write_plot(store, args.out)}")
    return 0


if __name__ == "__main__":
    # `--rows-from` modules import this file as `kvpress_compare`: let them get this module, so their
    # Row is this Row
    sys.modules.setdefault("kvpress_compare", sys.modules[__name__])
    sys.exit(main())
