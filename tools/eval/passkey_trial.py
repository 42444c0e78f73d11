"""Re-run one passkey trial of the quality table under tiered-cache configurations, to
see which mechanism a miss comes from (selection, compression or replacement).

    python tools/eval/passkey_trial.py --trial 4 --budget 25% --warm-codec int4 --warm-fraction 1 \
        --kv-dtype float16 [--attention-budget 1000000000] [--threads 1]

The trial is rebuilt and scored exactly as ``tieredkv eval passkey`` and kvpress_compare
do (``tieredkv.runtime.eval.passkey.trial_prompts`` / ``run_trial``), so ``--trial 4`` of 10
is the depth-4/9 trial of the table. Prints one JSON line: depth, key, greedy answer, exact
match, teacher-forced key log-probability, seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import torch

from tieredkv.models.hub import resolve_model
from tieredkv.models.loading import load_checkpoint
from tieredkv.runtime.eval.data import pg_essays_text
from tieredkv.runtime.eval.harness import tiered_method
from tieredkv.runtime.eval.passkey import run_trial, trial_prompts
from tieredkv.runtime.tiered.config import TieredKVConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--trial", type=int, required=True, help="0-based index among --trials")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", default="25%", help="device budget")
    ap.add_argument("--attention-budget", default=None)
    ap.add_argument("--mode", default="exact", choices=["exact", "masked"])
    ap.add_argument("--policy", default="lfu-importance")
    ap.add_argument("--selection-aggregate", default="share", choices=["share", "head-rank"])
    ap.add_argument("--warm-codec", default=None)
    ap.add_argument("--warm-fraction", type=float, default=0.75)
    ap.add_argument("--kv-dtype", default=None)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if not 0 <= args.trial < args.trials:
        ap.error(f"--trial must be in [0, {args.trials}), got {args.trial}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TieredKVConfig(device_budget=args.budget, attention_budget=args.attention_budget, mode=args.mode,
                         policy=args.policy, warm_codec=args.warm_codec, warm_fraction=args.warm_fraction,
                         kv_dtype=args.kv_dtype, selection_aggregate=args.selection_aggregate)
    loaded = load_checkpoint(resolve_model(args.model))
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(pg_essays_text(), add_bos=False)
    prompt = next(itertools.islice(trial_prompts(tok, ids, context=args.context, trials=args.trials,
                                                 seed=args.seed), args.trial, None))
    t_start = time.perf_counter()
    # keep_decoded_warm as in the quality table's rows: identical numerics
    trial = run_trial(tiered_method(model, cfg, keep_decoded_warm=True), tok, prompt, context=args.context)
    print(json.dumps({"trial": args.trial, **dataclasses.asdict(trial),
                      "config": {k: v for k, v in vars(args).items() if k not in ("model", "threads")},
                      "seconds": round(time.perf_counter() - t_start, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
