"""The evaluation suite's report: the stored results summarized per (method, budget, context,
text) row, the markdown tables and the plot (``tools/eval_suite.py``; the suite itself,
docs/eval-suite.md, is :mod:`tieredkv.runtime.eval.suite`, which re-exports these names)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tieredkv.runtime.eval.tasks import task_names

#: the perplexity task's name in the stored results; the report's files under the output folder
PERPLEXITY = "perplexity"
TABLE_FILE, TABLE_JSON, PLOT_FILE = "table.md", "table.json", "suite.png"


# ------------------------------------------------------------------------------ summary
@dataclass
class Row:
    """One (method, budget, context, text) row of the table; ``text`` is ``"mean"`` for the
    mean over texts. ``tasks``: task -> (accuracy, recall, mean log-prob)."""

    method: str
    budget: float
    backend: str
    reference: bool
    context: int | None  # None: every context length
    text: str
    perplexity: float | None = None
    delta_ppl_pct: float | None = None
    tasks: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def task_accuracy(self) -> float | None:
        return _mean([a for a, _, _ in self.tasks.values()])

    @property
    def task_logprob(self) -> float | None:
        return _mean([lp for _, _, lp in self.tasks.values()])


def _mean(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _tasks_of(store: dict[str, Any]) -> list[str]:
    seen = {e["task"] for e in store["results"].values() if e["task"] != PERPLEXITY}
    order = task_names()
    return [t for t in order if t in seen] + sorted(seen - set(order))


def summarize(store: dict[str, Any]) -> list[Row]:
    """Per (method, budget, context): one row per text, then the mean over texts; then per
    (method, budget) the mean over every context (``context=None``)."""
    entries = list(store["results"].values())
    ref_ppl = {(e["text"], e["context"]): e["result"]["perplexity"] for e in entries
               if e["reference"] and e["task"] == PERPLEXITY}
    rows: dict[tuple, Row] = {}
    for e in entries:
        key = (e["method"], e["budget"], e["context"], e["text"])
        r = rows.setdefault(key, Row(e["method"], e["budget"], e["backend"], e["reference"], e["context"], e["text"]))
        res = e["result"]
        if e["task"] == PERPLEXITY:
            r.perplexity = res["perplexity"]
            ref = ref_ppl.get((e["text"], e["context"]))
            r.delta_ppl_pct = 100 * (res["perplexity"] / ref - 1) if ref else None
        else:
            r.tasks[e["task"]] = (res["accuracy"], res["recall"], res["mean_logprob"])
    out: list[Row] = []
    groups: dict[tuple, list[Row]] = {}
    for r in rows.values():
        groups.setdefault((r.method, r.budget, r.context), []).append(r)
    # the reference first, then budget by budget (largest first), methods in order of appearance
    order = {m: i for i, m in enumerate(dict.fromkeys(k[0] for k in groups))}
    groups = dict(sorted(groups.items(), key=lambda kv: (not kv[1][0].reference, -kv[0][1], kv[0][2],
                                                         order[kv[0][0]])))
    overall: dict[tuple, list[Row]] = {}
    for (method, budget, context), members in groups.items():
        members.sort(key=lambda r: r.text)
        mean = _mean_row(members, context=context)
        out += members + [mean]
        overall.setdefault((method, budget), []).append(mean)
    for members in overall.values():
        out.append(_mean_row(members, context=None))
    return out


def _mean_row(members: Sequence[Row], *, context: int | None) -> Row:
    first = members[0]
    tasks = sorted({t for r in members for t in r.tasks})
    ppl = [r.perplexity for r in members if r.perplexity is not None]
    return Row(first.method, first.budget, first.backend, first.reference, context, "mean",
               perplexity=math.exp(sum(math.log(p) for p in ppl) / len(ppl)) if ppl else None,
               delta_ppl_pct=_mean([r.delta_ppl_pct for r in members]),
               tasks={t: tuple(_mean([r.tasks[t][i] for r in members if t in r.tasks]) for i in range(3))
                      for t in tasks})


# ------------------------------------------------------------------------------ table & plot
def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _cell(v: tuple[float, float, float] | None) -> str:
    return "–" if v is None else f"{v[0]:.2f} ({v[2]:.2f})"


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def protocol_line(store: dict[str, Any]) -> str:
    meta = store.get("meta", {})
    cfg = meta.get("config", {})
    texts = ", ".join(f"{n} ({v['genre']}; {'seen by the scorer' if v['scorer'] == 'seen' else v['scorer']})"
                      for n, v in meta.get("texts", {}).items())
    return (f"Model {meta.get('model', '?')}; question-agnostic (every context compressed before the question or "
            f"the scored continuation is seen); texts: {texts}; perplexity: {cfg.get('ppl_windows')} window(s) of "
            f"the context length per text, the first {cfg.get('ppl_context_fraction')} of each the compressed "
            f"context; tasks: {cfg.get('trials')} trial(s) per text at evenly spread depths, seed {cfg.get('seed')}, "
            f"framing {_framing(meta.get('framing'))}, haystacks without digits; budgets: shares of the full cache's "
            f"float16 bytes (or a tiered row's budget_reference; a press keeps that share of the tokens; a quantized "
            f"peer's peak is in its stats); date {meta.get('updated', meta.get('created', '?'))}.")


def _framing(frames: Any) -> str:
    if not isinstance(frames, dict) or not frames:
        return "?"
    by: dict[str, list[str]] = {}
    for task, frame in frames.items():
        by.setdefault(frame, []).append(task)
    return " / ".join(f"{f} ({', '.join(ts)})" for f, ts in by.items())


def table_markdown(store: dict[str, Any]) -> str:
    rows = summarize(store)
    tasks = _tasks_of(store)
    head = (["method", "budget %", "Δppl % vs full"] + [f"{t} acc (log-prob)" for t in tasks]
            + ["task mean acc", "task mean log-prob"])
    lines = ["# Evaluation suite", "", protocol_line(store), "",
             "Task cells: exact-match accuracy, and in brackets the mean teacher-forced log-probability of the "
             "answer (nats; higher is better). Δppl: perplexity relative to the full cache on the same text and "
             "context length, mean over texts.", "",
             "## Summary: mean over texts and context lengths", "",
             _line(head), "|---|" + "---:|" * (len(head) - 1)]
    summary = [r for r in rows if r.context is None]
    covered = {tuple(sorted(r.tasks)) for r in summary}
    if len(covered) > 1:
        lines[-2:-2] = ["Rows ran different task sets (a '–' is a task a row did not run): compare the task means "
                        "only between rows with the same tasks.", ""]
    for r in summary:
        lines.append(_line([r.method, f"{100 * r.budget:g}", _fmt(r.delta_ppl_pct, '+.2f'),
                            *(_cell(r.tasks.get(t)) for t in tasks), _fmt(r.task_accuracy, '.2f'),
                            _fmt(r.task_logprob, '.2f')]))
    contexts = sorted({r.context for r in rows if r.context is not None})
    head = (["method", "budget %", "text", "ppl", "Δppl %"] + list(tasks) + ["task mean acc", "task mean log-prob"])
    for c in contexts:
        lines += ["", f"## Context length {c}", "", _line(head),
                  "|---|---:|---|" + "---:|" * (len(head) - 3)]
        for r in (r for r in rows if r.context == c):
            text = "**mean**" if r.text == "mean" else r.text
            lines.append(_line([r.method, f"{100 * r.budget:g}", text, _fmt(r.perplexity, '.3f'),
                                _fmt(r.delta_ppl_pct, '+.2f'), *(_cell(r.tasks.get(t)) for t in tasks),
                                _fmt(r.task_accuracy, '.2f'), _fmt(r.task_logprob, '.2f')]))
    return "\n".join(lines) + "\n"


def write_tables(store: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """``table.md`` and ``table.json`` (the same rows as data)."""
    md = out_dir / TABLE_FILE
    md.write_text(table_markdown(store))
    js = out_dir / TABLE_JSON
    rows = [{**asdict(r), "task_mean_accuracy": r.task_accuracy, "task_mean_logprob": r.task_logprob,
             "tasks": {t: {"accuracy": a, "recall": rc, "mean_logprob": lp} for t, (a, rc, lp) in r.tasks.items()}}
            for r in summarize(store)]
    js.write_text(json.dumps({"meta": store.get("meta", {}), "rows": rows}, indent=1, default=str))
    return md, js


def write_report(store: dict[str, Any], out_dir: Path) -> tuple[Path, Path, Path]:
    """``table.md``, ``table.json`` and ``suite.png``."""
    return (*write_tables(store, out_dir), write_plot(store, out_dir))


def write_plot(store: dict[str, Any], out_dir: Path) -> Path:
    """One panel per figure of the summary (Δppl %, each task's accuracy, the mean log-prob)
    against the budget, one line per method; the full cache as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summarize(store) if r.context is None]
    tasks = _tasks_of(store)
    panels: list[tuple[str, Callable[[Row], float | None]]] = [("Δppl % vs full (mean over texts)",
                                                                 lambda r: r.delta_ppl_pct)]
    panels += [(f"{t}: accuracy", (lambda t: lambda r: r.tasks[t][0] if t in r.tasks else None)(t)) for t in tasks]
    panels += [("tasks: mean answer log-prob (nats)", lambda r: r.task_logprob)]
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.4 * nrows), squeeze=False)
    budgets = sorted({r.budget for r in rows})
    colors = plt.get_cmap("tab10")
    names = list(dict.fromkeys(r.method for r in rows))
    for ax, (label, value) in zip(axes.flat, panels):
        for i, name in enumerate(names):
            pts = sorted((r for r in rows if r.method == name and value(r) is not None), key=lambda r: r.budget)
            if not pts:
                continue
            if pts[0].reference:
                ax.axhline(value(pts[0]), color="black", linestyle="--", linewidth=1, label=f"{name} (100 %)")
                continue
            ours = pts[0].backend == "tieredkv"
            ax.plot([100 * p.budget for p in pts], [value(p) for p in pts], marker="s" if ours else "o",
                    linestyle="-" if ours else "--", color=colors(i % 10), label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks([100 * b for b in budgets])
        ax.set_xticklabels([f"{100 * b:g}" for b in budgets])
        ax.set_xlabel("KV budget %")
        if label.endswith("accuracy"):
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=min(4, max(1, len(labels))),
               fontsize=8)
    meta = store.get("meta", {})
    fig.suptitle(f"Evaluation suite — {meta.get('model', '')}: mean over texts and context lengths "
                 "(question-agnostic)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    path = out_dir / PLOT_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
