"""The engine path against the torch backend: build time of a SmolLM2 engine, then prefill
and decode throughput of the ONNX Runtime backend and the PyTorch model under the same
tiered runtime, same prompts, same budgets.

    python tools/bench_engine.py [--engine-dir results/engine_smollm2] [--rebuild]
        [--prompt-lens 512 2048] [--budgets full 25%] [--new-tokens 32] [--repeats 2]
        [--warm-codec int4 --warm-fraction 0.75] [--precision fp32] [--threads 2] [--out results/engine_bench]

With ``--warm-codec`` the engine is built with that codec (its attention reads warm pages
from their bytes) and the budgeted rows run with float16 pages and the warm sub-tier
(``warm_fraction`` of the device bytes beyond T0 compressed).

The engine is built with ``builder/build_engine.py --tiered-kv --precision fp32`` (the
float32 graph, whose tokens the float32 torch backend gives exactly; ``--precision fp16``
builds the float16 one) (its own timing, including
the onnx checker and the ONNX Runtime verification, is read from config.json). Prompts are
the Paul Graham essays; one sequence; greedy with EOS ignored. Reported: median over
repeats of prefill tok/s and decode tok/s per backend, prompt length and device budget
(``full`` = unlimited; exact mode otherwise), and whether both backends produced the same
tokens. Writes table.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

from tieredkv.builder import build_engine
from tieredkv.models.hub import resolve_model
from tieredkv.models.loading import load_checkpoint
from tieredkv.runtime.engine import OnnxRuntimeBackend
from tieredkv.runtime.eval.data import pg_essays_text
from tieredkv.runtime.llm import LLM
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.tiered.config import TieredKVConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", type=Path, default=Path("results/engine_smollm2"))
    ap.add_argument("--rebuild", action="store_true", help="rebuild the engine even if the directory exists")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--budgets", nargs="+", default=["full", "25%"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warm-codec", default=None, help="build the engine with this warm codec; budgeted rows use it")
    ap.add_argument("--warm-fraction", type=float, default=0.75)
    ap.add_argument("--precision", choices=["fp32", "fp16"], default="fp32", help="the engine's precision")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=Path("results/engine_bench"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    source = resolve_model(None, log=log)
    built = None
    if (args.engine_dir / "config.json").is_file():
        cfg = json.loads((args.engine_dir / "config.json").read_text())["build"]
        built = (cfg.get("warm_codec"), cfg.get("precision"))
    if args.rebuild or built != (args.warm_codec, args.precision):
        argv = ["--tiered-kv", "--model", str(source), "--output", str(args.engine_dir), "--force",
                "--precision", args.precision]
        if args.warm_codec:
            argv += ["--warm-codec", args.warm_codec]
        t_start = time.perf_counter()
        if build_engine.main(argv) != 0:
            return 1
        log(f"build wall time {time.perf_counter() - t_start:.1f} s")
    cfg = json.loads((args.engine_dir / "config.json").read_text())
    size = sum(f.stat().st_size for f in args.engine_dir.rglob("*") if f.is_file())
    build = {"seconds": cfg["build"]["seconds"], "bytes": size,
             "verification_max_abs_error": cfg["build"]["verification_max_abs_error"]}

    loaded = load_checkpoint(source)
    backends = {"torch": loaded.model, "onnxruntime": OnnxRuntimeBackend(args.engine_dir, threads=args.threads)}
    ids = loaded.tokenizer.encode(pg_essays_text(), add_bos=False)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for plen in args.prompt_lens:
        prompt = [ids[5000 : 5000 + plen]]
        work = min(plen + args.new_tokens, loaded.config.max_position_embeddings)  # a percentage budget's base
        for budget in args.budgets:
            warm = (dict(kv_dtype="float16", warm_codec=args.warm_codec, warm_fraction=args.warm_fraction)
                    if args.warm_codec else {"warm_codec": "off"})
            kv = TieredKVConfig() if budget == "full" else TieredKVConfig(device_budget=budget, mode="exact", **warm)
            tokens = {}
            for name, model in backends.items():
                prefill, decode = [], []
                for _ in range(args.repeats):
                    llm = LLM.from_model(model, loaded.tokenizer, kv=kv, max_model_len=work)
                    out = llm.generate(prompt, params)
                    prefill.append(llm.last_stats.prefill_tok_s)
                    decode.append(llm.last_stats.decode_tok_s)
                tokens[name] = out[0].token_ids
                row = {"backend": name, "prompt_tokens": plen, "budget": budget,
                       "prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode)}
                rows.append(row)
                log(f"{name:12s} prompt {plen:5d} budget {budget:5s}: prefill {row['prefill_tok_s']:8.1f} tok/s, "
                    f"decode {row['decode_tok_s']:6.2f} tok/s")
            same = tokens["torch"] == tokens["onnxruntime"]
            for r in rows[-len(backends):]:
                r["same_tokens"] = same

    args.out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python"] + sys.argv)
    result = {"command": cmd, "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "torch": torch.__version__, "build": build, "rows": rows}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"`{cmd}` — {date.today()}, {args.threads} thread(s), torch {torch.__version__}", "",
             f"Engine build (SmolLM2, --tiered-kv{' --warm-codec ' + args.warm_codec if args.warm_codec else ''}, "
             f"float32): {build['seconds']:.1f} s including the onnx checker and "
             f"the ONNX Runtime verification; {size / 2**20:.0f} MiB; max |logits error| "
             f"{build['verification_max_abs_error']['logits']:.2g}.", "",
             "| prompt | budget | backend | prefill tok/s | decode tok/s | same tokens |", "|---:|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']} | {r['budget']} | {r['backend']} | {r['prefill_tok_s']:.1f} | "
                     f"{r['decode_tok_s']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
