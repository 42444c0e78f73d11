"""The evaluation suite: texts x tasks x context lengths, for any set of methods at KV budgets,
into one results store, one table (markdown + JSON) and one plot.

A *cell* is (method, budget, text, task, context length). Tasks are ``perplexity`` (the
budget protocol of :mod:`tieredkv.runtime.eval.perplexity`: each window of ``context``
tokens, its first 3/4 the compressed context, the last 1/4 scored) and the synthetic tasks
of :mod:`tieredkv.runtime.eval.tasks` (haystack = the text without digits). A context length
``c`` bounds everything the model sees: a perplexity window is ``c`` tokens; a task's prompt
is ``c - ANSWER_RESERVE`` tokens, so that prompt and answer fit in ``c`` (8192 is SmolLM2's
limit).

Methods (:class:`MethodSpec`, parsed from strings by :func:`parse_method`):

* ``full`` — the full cache (tieredkv's paged cache, budget 100 %), the reference that
  Δppl is measured against;
* ``tiered:SETTING=VALUE,...`` — tieredkv's tiered cache with those
  :class:`~tieredkv.runtime.tiered.config.TieredKVConfig` settings (flat names, e.g.
  ``tiered:mode=exact,warm_codec=int4,kv_dtype=float16``), at each budget as
  ``device_budget``; ``name=...`` names the row, ``device_budget=25%`` pins one budget,
  ``attention_budget=2x`` attends twice the device budget's pages (the others streamed);
* ``BACKEND:ARGS`` — any other backend the caller registers (``tools/eval_suite.py``
  registers ``kvpress:PRESS``).

The store (``results.json``) is saved after every cell and is also the resume point: a
finished cell with the same parameters is skipped on a rerun.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from tieredkv.errors import ConfigError, DataFileError
from tieredkv.models.llama import Llama
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.eval.harness import CacheMethod, EvalMethod, tiered_method
from tieredkv.runtime.eval.perplexity import perplexity
from tieredkv.runtime.eval.tasks import FRAMINGS, get_task, run_task, sanitize_haystack, task_frame, task_names
from tieredkv.runtime.eval.suite_report import (PERPLEXITY, PLOT_FILE, TABLE_FILE, TABLE_JSON, Row,  # noqa: F401 (re-exported)
                                                protocol_line, summarize, table_markdown, write_plot, write_report,
                                                write_tables)
from tieredkv.runtime.eval.texts import get_source, suite_text, suite_text_names

SCHEMA = 1
RESULTS_FILE = "results.json"
#: tokens of a task's context length left for its answer (the longest greedy answer is ~40)
ANSWER_RESERVE = 64


@dataclass(frozen=True)
class SuiteConfig:
    """What one run measures. ``tasks`` may hold ``perplexity`` and any task of
    :data:`tieredkv.runtime.eval.tasks.TASKS`; ``trials`` per task and text and context
    (needle depths evenly spread); ``ppl_windows`` perplexity windows per text and context."""

    texts: tuple[str, ...] = tuple(suite_text_names())
    tasks: tuple[str, ...] = (PERPLEXITY, *task_names())
    contexts: tuple[int, ...] = (2048, 4096, 8192)
    budgets: tuple[float, ...] = (0.5, 0.25, 0.125)
    trials: int = 6
    ppl_windows: int = 2
    ppl_context_fraction: float = 0.75
    seed: int = 0
    framing: str = "task"

    def __post_init__(self) -> None:
        for t in self.tasks:
            if t != PERPLEXITY:
                get_task(t)
        if not self.texts or not self.tasks or not self.contexts:
            raise ConfigError("the suite needs at least one text, one task and one context length")
        for c in self.contexts:
            if c < 4 * ANSWER_RESERVE:
                raise ConfigError(f"context length {c} is too short; expected at least {4 * ANSWER_RESERVE} tokens")
        for b in self.budgets:
            if not 0.0 < b <= 1.0:
                raise ConfigError(f"budget {b} must be in (0, 1]")
        if self.trials < 1 or self.ppl_windows < 1:
            raise ConfigError(f"trials and ppl_windows must be >= 1, got {self.trials} and {self.ppl_windows}")
        if self.framing not in FRAMINGS:
            raise ConfigError(f"framing must be one of {list(FRAMINGS)}, got {self.framing!r}")

    def params(self, task: str) -> dict[str, Any]:
        """What a cell's result depends on besides (method, budget, text, task, context)."""
        if task == PERPLEXITY:
            return {"windows": self.ppl_windows, "context_fraction": self.ppl_context_fraction}
        return {"trials": self.trials, "seed": self.seed, "reserve": ANSWER_RESERVE}


#: small settings for CI and smoke runs: 1k context, 2 trials, 1 perplexity window
QUICK = {"contexts": (1024,), "trials": 2, "ppl_windows": 1}


# ------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class MethodSpec:
    """One evaluated method. ``factory(model, budget)`` builds a *fresh* :class:`EvalMethod`
    per cell (its ``stats()`` belong to that cell). ``budgets``: the budgets it runs at
    (``None``: the run's). ``reference``: the full cache that Δppl is measured against."""

    name: str
    factory: Callable[[Llama, float], EvalMethod]
    budgets: tuple[float, ...] | None = None
    reference: bool = False
    backend: str = "tieredkv"
    spec: str = ""


def full_cache() -> MethodSpec:
    from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache

    def factory(model: Llama, budget: float) -> EvalMethod:
        spec, cfg = model.kv_spec(), PagedCacheConfig(page_size=16)
        return CacheMethod(model, lambda _total=None: PagedKVCache(spec, cfg), name="full",
                           info={"budget": 1.0, "cache": "PagedKVCache"})

    return MethodSpec("full", factory, budgets=(1.0,), reference=True, spec="full")


def _value(text: str) -> Any:
    """A setting's value from its text: int, float, true/false, none, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def tiered_spec(settings: str, *, spec: str = "") -> MethodSpec:
    """``"mode=exact,warm_codec=int4"`` -> the tiered cache with those settings at each budget."""
    from tieredkv.runtime.tiered.config import TieredKVConfig

    kv: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in settings.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"method {spec or settings!r}: {part!r} is not SETTING=VALUE")
        kv[key.strip()] = _value(value)
    name = str(kv.pop("name", "")) or ("tiered" + (f"[{settings}]" if settings else ""))
    budgets = None
    if "device_budget" in kv:
        b = str(kv.pop("device_budget"))
        if not b.endswith("%"):
            raise ConfigError(f"method {spec!r}: device_budget must be a percentage here (e.g. 25%), got {b!r}")
        budgets = (float(b[:-1]) / 100,)
    factor = None  # attention_budget=2x: twice the device budget (a share of the full cache, at most all of it)
    if isinstance(kv.get("attention_budget"), str) and kv["attention_budget"].lower().endswith("x"):
        try:
            factor = float(kv.pop("attention_budget")[:-1])
        except ValueError:
            factor = 0.0
        if not factor > 0:
            raise ConfigError(f"method {spec or settings!r}: attention_budget=<F>x takes a positive factor of the "
                              "device budget (e.g. 2x)")

    def resolved(budget: float) -> dict[str, Any]:
        extra = {} if factor is None else {"attention_budget": f"{min(100.0, 100 * budget * factor):g}%"}
        return {**kv, **extra}

    TieredKVConfig(device_budget="50%", **resolved(0.5))  # fail now on a bad setting, not after hours of other cells

    def factory(model: Llama, budget: float) -> EvalMethod:
        config = TieredKVConfig(device_budget=f"{100 * budget:g}%", **resolved(budget))
        # keep_decoded_warm: the CPU evaluation aid of the warm pool (each page decoded once; same numerics)
        return tiered_method(model, config, name=name, keep_decoded_warm=True)

    return MethodSpec(name, factory, budgets=budgets, backend="tieredkv", spec=spec or f"tiered:{settings}")


def parse_method(spec: str, backends: Mapping[str, Callable[[str], MethodSpec]] | None = None) -> MethodSpec:
    """``full``, ``tiered:SETTINGS`` or ``BACKEND:ARGS`` for a registered backend."""
    if spec.strip() == "full":
        return full_cache()
    backend, sep, rest = spec.partition(":")
    if backend == "tiered":
        return tiered_spec(rest, spec=spec)
    if sep and backends and backend in backends:
        return backends[backend](rest)
    known = ["full", "tiered:SETTING=VALUE,..."] + [f"{b}:..." for b in (backends or {})]
    raise ConfigError(f"unknown method {spec!r}; expected one of {known}")


# ------------------------------------------------------------------------------ texts
@dataclass(frozen=True)
class SuiteText:
    name: str
    text: str
    genre: str
    scorer: str  # "seen" (the scorer trained on it), "held-out", or "user" (a user's file)


def load_texts(items: Iterable[str], *, log: Callable[[str], None] | None = None) -> list[SuiteText]:
    """Registered text names (:data:`tieredkv.runtime.eval.texts.TEXTS`) or ``NAME=PATH`` of a
    user's UTF-8 text file."""
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if sep:
            p = Path(path)
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise DataFileError(f"{p}: not UTF-8 text ({exc})") from None
            except OSError as exc:
                raise DataFileError(f"{p}: cannot read the text file ({exc.strerror or exc})") from None
            out.append(SuiteText(name, text, "user file", "user"))
        else:
            source = get_source(name)
            out.append(SuiteText(name, suite_text(name, log=log), source.genre, source.scorer))
    if len({t.name for t in out}) != len(out):
        raise ConfigError(f"text names must be distinct, got {[t.name for t in out]}")
    return out


# ------------------------------------------------------------------------------ the store
def cell_key(method: str, budget: float, text: str, task: str, context: int) -> str:
    return f"{method}@{budget:g}/{text}/{task}@{context}"


def _is_store(store: Any) -> bool:
    return isinstance(store, dict) and store.get("schema") == SCHEMA and store.get("kind") == "eval-suite"


def load_store(path: Path) -> dict[str, Any]:
    if path.is_file():
        store = json.loads(path.read_text())
        if _is_store(store):
            return store
    return {"schema": SCHEMA, "kind": "eval-suite", "meta": {}, "results": {}}


def save_store(store: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(store, indent=1, default=str))
    os.replace(tmp, path)  # atomic: a killed run never leaves half a file


def parse_source(item: str) -> tuple[Path, dict[str, str] | None]:
    """``DIR`` (every method of that store) or ``DIR:METHOD,OLD=NEW,...`` (only those methods,
    ``OLD=NEW`` renamed; a selection names rows without ',' or '=' in their names, i.e. rows
    named with ``name=``) -> (the store file, {method: name in the merged store} or None)."""
    where, sep, pick = item.partition(":")
    path = Path(where)
    path = path / RESULTS_FILE if path.suffix != ".json" else path
    if not sep:
        return path, None
    names: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in pick.split(","))):
        old, _, new = part.partition("=")
        if not old or (_ and not new):
            raise ConfigError(f"merge source {item!r}: expected DIR:METHOD,OLD=NEW,... (got {part!r})")
        names[old] = new or old
    if not names:
        raise ConfigError(f"merge source {item!r}: no method named after ':'")
    return path, names


def _headline(entry: dict[str, Any]) -> tuple:
    res = entry["result"]
    return (res.get("perplexity"), res.get("accuracy"), res.get("recall"), res.get("mean_logprob"))


def merge_stores(sources: Sequence[tuple[Path, Mapping[str, str] | None]], *,
                 tasks: Sequence[str] | None = None) -> dict[str, Any]:
    """One store from several (each ``(results.json, {method: new name} or None)``): the table
    of runs made at different times, e.g. rows renamed after a default changed. Every source
    must be a suite store of the same model; a method named in a selection must be in its
    store; a cell present in two sources must agree on its parameters and figures (a full
    cache row copied between stores), else the merge is refused — name which source's row to
    keep with a selection. ``tasks``: only the cells of these tasks (e.g. to leave out a task a
    run covered on one text only). The merged meta lists the sources and the texts, framings,
    trials and perplexity windows of every cell."""
    if not sources:
        raise ConfigError("merge: no source stores given")
    merged: dict[str, Any] = {"schema": SCHEMA, "kind": "eval-suite", "meta": {}, "results": {}}
    meta = merged["meta"]
    origin: dict[str, str] = {}
    trials: set[int] = set()
    windows: set[int] = set()
    for path, names in sources:
        if not path.is_file():
            raise DataFileError(f"merge source {path}: no such results file")
        try:
            store = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DataFileError(f"merge source {path}: not JSON ({exc})") from None
        if not _is_store(store):
            raise DataFileError(f"merge source {path}: not an eval-suite results store (schema {SCHEMA})")
        smeta = store.get("meta", {})
        if meta.setdefault("model", smeta.get("model")) != smeta.get("model"):
            raise ConfigError(f"merge source {path}: model {smeta.get('model')!r}, the others {meta['model']!r}")
        present = {e["method"] for e in store["results"].values()}
        missing = sorted(set(names or ()) - present)
        if missing:
            raise ConfigError(f"merge source {path}: no method {missing} (it has {sorted(present)})")
        for entry in store["results"].values():
            if (names is not None and entry["method"] not in names) or (tasks and entry["task"] not in tasks):
                continue
            entry = dict(entry)
            new = (names or {}).get(entry["method"], entry["method"])
            if new != entry["method"]:
                entry["renamed_from"], entry["method"] = entry["method"], new
            key = cell_key(new, entry["budget"], entry["text"], entry["task"], entry["context"])
            old = merged["results"].get(key)
            if old is not None and (old["params"] != entry["params"] or _headline(old) != _headline(entry)):
                raise ConfigError(f"merge: cell {key} differs between {origin[key]} and {path}; keep one with "
                                  f"a selection (DIR:METHOD,...)")
            if old is None:
                merged["results"][key], origin[key] = entry, str(path)
            params = entry["params"]
            (windows if entry["task"] == PERPLEXITY else trials).add(params.get("windows", params.get("trials")))
        for name, info in smeta.get("texts", {}).items():
            if meta.setdefault("texts", {}).setdefault(name, info) != info:
                raise ConfigError(f"merge source {path}: text {name} is {info}, elsewhere {meta['texts'][name]}")
        for task, frame in (smeta.get("framing") or {}).items():
            if meta.setdefault("framing", {}).setdefault(task, frame) != frame:
                raise ConfigError(f"merge source {path}: task {task} framed {frame}, elsewhere {meta['framing'][task]}")
        for stamp in ("created", "updated"):
            if smeta.get(stamp):
                meta[stamp] = max(meta.get(stamp, ""), smeta[stamp])
        meta.setdefault("sources", []).append(str(path.parent) + ("" if names is None else ":" + ",".join(
            o if o == n else f"{o}={n}" for o, n in names.items())))
        cfg = smeta.get("config", {})
        meta["config"] = {**cfg, **meta.get("config", {})}
    if not merged["results"]:
        raise ConfigError(f"merge: no cell selected from {len(sources)} store(s)"
                          + (f" for tasks {list(tasks)}" if tasks else ""))
    used_texts = {e["text"] for e in merged["results"].values()}
    meta["texts"] = {n: v for n, v in meta.get("texts", {}).items() if n in used_texts}
    meta["config"].update(trials="/".join(map(str, sorted(t for t in trials if t is not None))) or None,
                          ppl_windows="/".join(map(str, sorted(w for w in windows if w is not None))) or None)
    return merged


@dataclass
class Cell:
    spec: MethodSpec
    budget: float
    text: SuiteText
    task: str
    context: int

    @property
    def key(self) -> str:
        return cell_key(self.spec.name, self.budget, self.text.name, self.task, self.context)


def plan(specs: Sequence[MethodSpec], texts: Sequence[SuiteText], config: SuiteConfig) -> list[Cell]:
    """Every cell, text by text (one tokenization each), then context, task, method, budget."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"method names must be distinct, got {names}; name tiered rows with name=...")
    return [Cell(s, b, t, task, c) for t in texts for c in config.contexts for task in config.tasks
            for s in specs for b in (s.budgets or config.budgets)]


def run_suite(specs: Sequence[MethodSpec], model: Llama, tokenizer: Tokenizer, texts: Sequence[SuiteText],
              config: SuiteConfig, out_dir: Path, *, model_name: str = "", log: Callable[[str], None] = print,
              progress: bool = True) -> dict[str, Any]:
    """Run every cell not already in ``out_dir``'s store; rewrite the store and the table after
    each cell, the plot at the end. Returns the store."""
    from tqdm.auto import tqdm

    limit = model.config.max_position_embeddings
    too_long = [c for c in config.contexts if c > limit]
    if too_long:
        raise ConfigError(f"context lengths {too_long} exceed the model's context of {limit} tokens")
    out_dir.mkdir(parents=True, exist_ok=True)
    store_path = out_dir / RESULTS_FILE
    store = load_store(store_path)
    meta = store["meta"]
    meta.setdefault("created", _dt.date.today().isoformat())
    frames = {t: task_frame(t, tokenizer, config.framing) for t in config.tasks if t != PERPLEXITY}
    meta.update(model=model_name or model.config.name, framing={t: f.name for t, f in frames.items()},
                config={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
                texts={t.name: {"genre": t.genre, "scorer": t.scorer} for t in texts})
    cells = plan(specs, texts, config)
    log(f"{len(cells)} cell(s): {len(specs)} method(s) x {len(texts)} text(s) x {len(config.tasks)} task(s) x "
        f"contexts {list(config.contexts)}; results in {store_path}")
    tokens: dict[str, tuple[list[int], list[int]]] = {}
    bar = tqdm(cells, desc="eval-suite", unit="cell", disable=not progress)
    for cell in bar:
        bar.set_postfix_str(cell.key)
        params = config.params(cell.task)
        if cell.task in frames:
            params["framing"] = frames[cell.task].name  # what the prompts were, whatever the option said
        done = store["results"].get(cell.key)
        if done is not None and done.get("params") == params:
            continue
        if cell.text.name not in tokens:
            tokens.clear()  # one text's tokens at a time
            tokens[cell.text.name] = (tokenizer.encode(cell.text.text, add_bos=False),
                                      tokenizer.encode(sanitize_haystack(cell.text.text), add_bos=False))
        ids, haystack = tokens[cell.text.name]
        t_start = time.perf_counter()
        method = cell.spec.factory(model, cell.budget)
        if cell.task == PERPLEXITY:
            res = perplexity(method, ids, window=cell.context, max_windows=config.ppl_windows,
                             context_fraction=config.ppl_context_fraction, progress=False)
            figure = f"ppl {res.perplexity:.4f}"
        else:
            res = run_task(method, tokenizer, haystack, cell.task, context=cell.context - ANSWER_RESERVE,
                           trials=config.trials, seed=config.seed, frame=frames[cell.task], progress=False)
            figure = f"acc {res.accuracy:.2f} recall {res.recall:.2f} logprob {res.mean_logprob:.3f}"
        store["results"][cell.key] = {
            "method": cell.spec.name, "spec": cell.spec.spec, "budget": cell.budget, "backend": cell.spec.backend,
            "reference": cell.spec.reference, "text": cell.text.name, "task": cell.task, "context": cell.context,
            "params": params, "seconds": time.perf_counter() - t_start,
            "finished": _dt.datetime.now().isoformat(timespec="seconds"), "result": res.to_dict(),
        }
        meta["updated"] = _dt.date.today().isoformat()
        save_store(store, store_path)
        write_tables(store, out_dir)
        log(f"done {cell.key}: {figure} ({time.perf_counter() - t_start:.1f}s)")
    save_store(store, store_path)
    write_report(store, out_dir)
    return store

