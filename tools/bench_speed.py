"""Prefill and decode throughput of the reference model on the paged KV cache.

    python tools/bench_speed.py [--model M | --preset NAME] [--prompt-lens 128 512 2048]
                                [--batch-sizes 1 4] [--new-tokens 32] [--repeats 3] [--out results/speed]

Prompts are real text (the Paul Graham essays) for a checkpoint, random ids for a
preset. Reports the median over repeats of prefill tok/s (one sequence) and decode
tok/s (tokens per second summed over the batch), and writes table.md + results.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from tieredkv.models.config import preset
from tieredkv.models.hub import resolve_model
from tieredkv.models.llama import Llama, init_random_weights
from tieredkv.models.loading import load_checkpoint
from tieredkv.runtime.generate import GenerationStats, generate
from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache
from tieredkv.runtime.sampling import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="results/speed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.preset:
        model = init_random_weights(Llama(preset(args.preset))).eval()
        ids = torch.randint(0, model.config.vocab_size, (max(args.prompt_lens) * max(args.batch_sizes),)).tolist()
        name = f"preset:{args.preset}"
    else:
        from tieredkv.runtime.eval.data import pg_essays_text

        loaded = load_checkpoint(resolve_model(args.model, log=lambda m: print(m, file=sys.stderr)))
        model, name = loaded.model, loaded.config.name
        ids = loaded.tokenizer.encode(pg_essays_text(), add_bos=False)

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for plen in args.prompt_lens:
        for bs in args.batch_sizes:
            prompts = [ids[i * plen : (i + 1) * plen] for i in range(bs)]
            pre, dec = [], []
            for _ in range(args.repeats):
                st = GenerationStats()
                generate(model, PagedKVCache(model.kv_spec(), PagedCacheConfig()), prompts, params, stats=st)
                pre.append(st.prefill_tok_s)
                dec.append(st.decode_tok_s)
            row = {"prompt_len": plen, "batch": bs, "prefill_tok_s": statistics.median(pre),
                   "decode_tok_s": statistics.median(dec), "decode_ms_per_step": 1000 * bs / statistics.median(dec),
                   "kv_bytes_per_seq": st.kv_bytes_peak // bs}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": name, "dtype": str(model.dtype), "threads": args.threads, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"model {name}, {meta['dtype']}, {args.threads} threads, {args.new_tokens} new tokens, median of "
             f"{args.repeats}; `{meta['command']}`", "",
             "| prompt tokens | batch | prefill tok/s | decode tok/s (batch total) | ms / decode step | KV MiB / seq |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['prompt_len']} | {r['batch']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
                     f"{r['decode_ms_per_step']:.1f} | {r['kv_bytes_per_seq'] / 2**20:.1f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
