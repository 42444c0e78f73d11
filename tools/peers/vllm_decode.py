"""Decode throughput of vLLM's offline ``LLM`` on given prompts: run with the peer venv's Python
(``tools/peers/setup_vllm.sh``), never tieredkv's (it imports vLLM, which tieredkv does not
depend on). ``tools/bench_decode.py`` calls it as one of its rows.

    $PEERS/vllm-venv/bin/python tools/peers/vllm_decode.py --model CKPT --prompts prompts.json
        --new-tokens 64 --out result.json [--threads 2] [--kv-gib 4]

``prompts.json``: a list of token-id lists. The prompts go in as token ids (``TokensPrompt``),
greedy, ``ignore_eos``, prefix caching off (each prompt is prefilled in every call). Decode time
is the time of a call generating ``new_tokens`` minus that of a call generating one token (the
prefill and the first token), over ``new_tokens - 1`` steps per prompt; the better of
``repeats`` pairs of calls after a warm-up call. ``result.json``: ``decode_tok_s``, the two
times, and every prompt's generated ids.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(max(0, (os.cpu_count() or 1) - args.threads))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(open(args.prompts))]
    longest = max(len(p["prompt_token_ids"]) for p in prompts) + args.new_tokens
    llm = LLM(model=args.model, dtype="float32", enable_prefix_caching=False, max_model_len=max(longest, 1024),
              max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=max(2048, longest),
              kv_cache_memory_bytes=args.kv_gib << 30, enforce_eager=False)

    def run(n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    run(args.new_tokens)  # warm-up (compilation, allocation)
    best = None
    for _ in range(args.repeats):
        t1, _ = run(1)
        tn, ids = run(args.new_tokens)
        if best is None or tn - t1 < best[1] - best[0]:
            best = (t1, tn, ids)
    t1, tn, ids = best
    steps = args.new_tokens - 1
    result = {"first_token_seconds": round(t1, 4), "total_seconds": round(tn, 4),
              "decode_seconds": round(tn - t1, 4), "decode_tokens": steps * len(prompts),
              "decode_tok_s": round(steps * len(prompts) / (tn - t1), 2) if tn > t1 else None, "outputs": ids}
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
