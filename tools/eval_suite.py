"""Run the evaluation suite — texts x tasks (perplexity, passkey, RULER-style tasks) x context
lengths — for any set of methods at KV budgets; write one table (markdown + JSON) and one plot.

    python tools/eval_suite.py --methods full tiered:mode=exact \\
        tiered:name=tiered-warm-int4,mode=exact,kv_dtype=float16,warm_codec=int4 \\
        kvpress:snapkv kvpress:streaming_llm --budgets 0.5 0.25 0.125 --out results/suite

    python tools/eval_suite.py --quick --out results/suite-quick      # CI-sized: 1k, 2 trials, 1 window

    python tools/eval_suite.py --merge results/suite results/old:full,default=exact --out results/table

Methods: ``full`` (the reference), ``tiered:SETTING=VALUE,...`` (TieredKVConfig flat settings;
``name=`` names the row; each budget becomes ``device_budget``, a share of the full cache's
float16 bytes), ``kvpress:PRESS`` (a press of tools/eval/kvpress_methods.py: streaming_llm,
snapkv, tova, observed_attention, knorm, expected_attention), ``quantized:int8|int4|int2``
(transformers' QuantizedCache with HQQ: one row at its share of the fp16 bytes) and
``quantized:int4,press=PRESS`` (a press on it, sized to each budget's fp16 bytes;
tools/eval/quantized_cache.py). Texts: registered names (runtime/eval/texts.py; default: all) or
``NAME=PATH`` for a UTF-8 file of your own. Output in ``--out``: results.json (every raw
result; the resume store: finished cells with the same parameters are skipped), table.md,
table.json, suite.png. docs/eval-suite.md explains the table. ``--merge DIR[:METHOD,OLD=NEW,...] ...``
runs nothing: it writes one store, table and plot from several stores (only the methods named
after ':', ``OLD=NEW`` renamed — e.g. a row measured under an earlier default; ``--tasks``
keeps only those tasks); a cell two stores hold must agree in both, else the merge is refused.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent / "eval"))

from tieredkv.errors import TieredKVError  # noqa: E402
from tieredkv.runtime.eval import suite as S  # noqa: E402
from tieredkv.runtime.eval.tasks import FRAMINGS, task_names  # noqa: E402
from tieredkv.runtime.eval.texts import suite_text_names, text_names  # noqa: E402


#: the transformers view of a model, built once per attention implementation and shared by every cell
_HF_MODELS: dict[tuple[int, str], Any] = {}


def _hf_model(model, impl: str):
    from tieredkv.models.hf_compat import to_transformers

    key = (id(model), impl)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = to_transformers(model, attn_implementation=impl)
    return _HF_MODELS[key]


def kvpress_backend(*, teacher_forcing_chunk: int = 256):
    """``kvpress:PRESS`` -> a MethodSpec."""
    from kvpress_methods import KVPressMethod, attn_implementation_for, make_press, press_names

    def parse(press_name: str) -> S.MethodSpec:
        if press_name not in press_names():
            raise TieredKVError(f"unknown press {press_name!r}; expected one of {press_names()}")

        def factory(model, budget: float):
            press = make_press(press_name, 1.0 - budget)
            impl = attn_implementation_for(press)
            return KVPressMethod(model, press, name=press_name, budget=budget, attn_implementation=impl,
                                 teacher_forcing_chunk=teacher_forcing_chunk, hf_model=_hf_model(model, impl))

        return S.MethodSpec(press_name, factory, backend="kvpress", spec=f"kvpress:{press_name}")

    return parse


def quantized_backend():
    """``quantized:int4[,press=NAME][,budget=P%][,group=G][,residual=R][,axis=A][,name=NAME]`` -> a MethodSpec:
    transformers' QuantizedCache (HQQ) at int8 / int4 / int2, alone (one row at its nominal share
    of the fp16 bytes) or with a kvpress press sized to each budget (tools/eval/quantized_cache.py)."""
    from kvpress_methods import attn_implementation_for, make_press
    from quantized_cache import QuantizedCacheMethod, nominal_fraction, parse_settings

    def parse(args: str) -> S.MethodSpec:
        st = parse_settings(args)

        def factory(model, budget: float):
            impl = attn_implementation_for(make_press(st["press"], 0.5) if st["press"] else None)
            return QuantizedCacheMethod(model, bits=st["bits"], budget=budget, press_name=st["press"],
                                        group=st["group"], residual=st["residual"], axis=st["axis"], name=st["name"],
                                        hf_model=_hf_model(model, impl))

        budgets = (st["budget"],) if st["budget"] else None if st["press"] else (
            round(nominal_fraction(st["bits"], st["group"]), 6),)
        return S.MethodSpec(st["name"], factory, budgets=budgets, backend="quantized", spec=f"quantized:{args}")

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="checkpoint path or known name (default: the default model)")
    p.add_argument("--methods", nargs="+", default=["full"], metavar="METHOD",
                   help="full | tiered:SETTING=VALUE,... | kvpress:PRESS | quantized:int8|int4|int2[,press=PRESS] "
                        "(default: full)")
    p.add_argument("--budgets", type=float, nargs="+", default=None,
                   help="KV budgets, shares of the full cache's float16 bytes (default 0.5 0.25 0.125)")
    p.add_argument("--texts", nargs="+", default=None, metavar="TEXT",
                   help=f"registered texts ({', '.join(text_names())}; default {', '.join(suite_text_names())}) or NAME=PATH")
    p.add_argument("--tasks", nargs="+", default=None, choices=[S.PERPLEXITY, *task_names()], metavar="TASK",
                   help=f"default all: {S.PERPLEXITY} {' '.join(task_names())}")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths (default 2048 4096 8192)")
    p.add_argument("--trials", type=int, default=None, help="trials per task, text and context (default 6)")
    p.add_argument("--ppl-windows", type=int, default=None, help="perplexity windows per text and context (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--framing", choices=FRAMINGS, default="task",
                   help="task prompts framed as each task's own (task, default: passkey plain, the others a chat "
                        "turn where the model has a chat template), or all plain / chat / auto")
    p.add_argument("--quick", action="store_true",
                   help="small settings for CI: contexts 1024, 2 trials, 1 perplexity window (explicit flags win)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--teacher-forcing-chunk", type=int, default=256, help="for kvpress rows (same results any value)")
    p.add_argument("--out", type=Path, default=Path("results/suite"))
    p.add_argument("--report-only", action="store_true", help="rewrite the table and plot from results.json")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR[:METHOD,OLD=NEW,...]",
                   help="write one store, table and plot into --out from these stores (only the methods named "
                        "after ':', OLD=NEW renamed); nothing is run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> S.SuiteConfig:
    given: dict[str, Any] = dict(S.QUICK) if args.quick else {}
    for field, value in (("texts", args.texts), ("tasks", args.tasks), ("contexts", args.contexts),
                         ("budgets", args.budgets), ("trials", args.trials), ("ppl_windows", args.ppl_windows)):
        if value is not None:
            given[field] = tuple(value) if isinstance(value, list) else value
    if "texts" in given:
        given["texts"] = tuple(t.partition("=")[0] for t in given["texts"])
    return S.SuiteConfig(seed=args.seed, framing=args.framing, **given)


def _log(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"[{_dt.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr)
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.merge or args.report_only:  # nothing to run: a store to report
            if args.merge:
                store = S.merge_stores([S.parse_source(item) for item in args.merge], tasks=args.tasks)
                args.out.mkdir(parents=True, exist_ok=True)
                S.save_store(store, args.out / S.RESULTS_FILE)
            else:
                store = S.load_store(args.out / S.RESULTS_FILE)
                if not store["results"]:
                    raise TieredKVError(f"{args.out / S.RESULTS_FILE}: no results to report")
            for path in S.write_report(store, args.out):
                _log(f"wrote {path}")
            return 0
        config = config_from(args)
        backends = {"kvpress": kvpress_backend(teacher_forcing_chunk=args.teacher_forcing_chunk),
                    "quantized": quantized_backend()}
        specs = [S.parse_method(m, backends) for m in args.methods]
        import torch
        from tqdm.auto import tqdm

        from tieredkv.models.hub import resolve_model
        from tieredkv.models.loading import load_checkpoint

        if args.threads:
            torch.set_num_threads(args.threads)
        path = resolve_model(args.model, log=_log)
        loaded = load_checkpoint(path, progress=lambda it: tqdm(it, desc="loading weights", unit="tensor",
                                                                 leave=False, disable=args.no_progress))
        if loaded.tokenizer is None:
            raise TieredKVError(f"{path}: the checkpoint has no tokenizer; the suite needs one")
        texts = S.load_texts(args.texts or config.texts, log=_log)
        store = S.run_suite(specs, loaded.model, loaded.tokenizer, texts, config, args.out,
                            model_name=f"{loaded.config.name} ({path.name})", log=_log, progress=not args.no_progress)
    except TieredKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _log(f"{len(store['results'])} result(s); wrote {args.out / S.TABLE_FILE}, {args.out / S.TABLE_JSON} and "
         f"{args.out / S.PLOT_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
