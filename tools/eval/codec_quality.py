"""Quality cost of each KV page codec on real SmolLM2, through the tiered cache's warm
sub-tier: every page outside T0's reservation (4 sinks + the 64-token recent
window + the page being written) is stored encoded and decoded on the attention path;
attention covers every page, so the only difference from the reference is the codec.

    python tools/eval/codec_quality.py [--codecs fp8 fp8-r2 ...] [--window 4096] [--windows 1]
        [--passkey-codecs fp8-r2] [--passkey-trials 10] [--out results/codec_quality]

Reference: the same cache storing every page in float16 (the deployment dtype) without
compression. Perplexity protocol of the quality table: the first ``--context-fraction``
of each window is prefilled, the rest is decoded one token per step with teacher forcing
(pages leave the recent window, and get compressed, as decoding goes). Reported per codec:
bits per value and ratio vs fp16 (scales, zero points, keyframes and 128-byte alignment
included), perplexity and its change vs the reference on the same tokens, the mean
KL(reference || codec) of the next-token distributions, the share of positions whose
greedy token changes, and (``--passkey-codecs``) passkey accuracy and key log-prob at
``--passkey-context``. Results are written incrementally (resumable) to OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tieredkv.models.hub import resolve_model
from tieredkv.models.llama import decode_one_token, prefill
from tieredkv.models.loading import load_checkpoint
from tieredkv.plugins.codec import CODECS, bits_per_value
from tieredkv.runtime.eval.data import pg_essays_text
from tieredkv.runtime.eval.harness import tiered_method
from tieredkv.runtime.eval.passkey import passkey
from tieredkv.runtime.eval.perplexity import context_length, split_windows
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig

REFERENCE = "float16"


def config_for(codec: str | None, total_tokens: int) -> TieredKVConfig:
    """Reference (codec None): float16 pages, nothing limited. Codec: a device budget of the
    whole sequence with warm_fraction 1, so everything outside T0's reservation is warm."""
    if codec is None:
        return TieredKVConfig(kv_dtype="float16")
    return TieredKVConfig(kv_dtype="float16", device_budget=total_tokens + 16 * 8, warm_codec=codec,
                          warm_fraction=1.0, attention_budget=10**9)


@torch.no_grad()
def window_logprobs(model, config: TieredKVConfig, ids: list[int], ctx: int, *, teacher_chunk: int) -> torch.Tensor:
    """Log-softmax rows [n, V] predicting ids[ctx:] (row i predicts ids[ctx + i])."""
    cache = TieredKVCache(model.kv_spec(), config, full_tokens=len(ids), keep_decoded_warm=True)
    sid = cache.add_sequence()
    last = prefill(model, cache, sid, torch.tensor(ids[:ctx]), chunk_size=512)
    rows = [last.view(1, -1)]
    cont = ids[ctx:-1]
    if teacher_chunk > 1:  # the reference (nothing changes between steps): chunked teacher forcing
        rows.append(prefill(model, cache, sid, torch.tensor(cont), start_pos=ctx, chunk_size=teacher_chunk,
                            all_logits=True))
    else:
        for i, tok in enumerate(tqdm(cont, desc="decode", leave=False, unit="tok")):
            rows.append(decode_one_token(model, cache, [sid], torch.tensor([tok]), torch.tensor([ctx + i])))
    stats = cache.metrics.to_dict()
    cache.free_sequence(sid)
    return torch.log_softmax(torch.cat(rows).double(), -1), stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--context-fraction", type=float, default=0.75)
    ap.add_argument("--passkey-codecs", nargs="*", default=[], choices=list(CODECS))
    ap.add_argument("--passkey-context", type=int, default=4096)
    ap.add_argument("--passkey-trials", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/codec_quality")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res_file = out / "results.json"
    results = json.loads(res_file.read_text()) if res_file.exists() else {}
    cmd = " ".join(["python"] + sys.argv)

    def save():
        tmp = res_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(res_file)

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    loaded = load_checkpoint(resolve_model(None, log=log))
    model, cfg, tok = loaded.model, loaded.config, loaded.tokenizer
    ids = tok.encode(pg_essays_text(log=log), add_bos=False)
    windows = split_windows(ids, args.window, args.windows) if args.windows > 0 else []  # 0: passkey only
    ctx = context_length(args.window, args.context_fraction)
    for w_i, w in enumerate(windows):
        w = list(w)
        if f"{REFERENCE}/w{w_i}" in results and all(f"{c}/w{w_i}" in results for c in args.codecs):
            continue  # everything of this window is measured
        t_start = time.perf_counter()
        ref, _ = window_logprobs(model, config_for(None, len(w)), w, ctx, teacher_chunk=256)
        targets = torch.tensor(w[ctx:])
        rows_idx = torch.arange(len(targets))
        ref_nll = -float(ref[rows_idx, targets].sum())
        results.setdefault(f"{REFERENCE}/w{w_i}", {"codec": REFERENCE, "window": w_i, "nll_sum": ref_nll,
                                                    "tokens": len(targets), "seconds": time.perf_counter() - t_start})
        ref_p = ref.exp()
        ref_top = ref.argmax(-1)
        for name in args.codecs:
            key = f"{name}/w{w_i}"
            if key in results:
                continue
            t_start = time.perf_counter()
            lp, stats = window_logprobs(model, config_for(name, len(w)), w, ctx, teacher_chunk=1)
            kl = (ref_p * (ref - lp)).sum(-1)
            results[key] = {"codec": name, "window": w_i, "nll_sum": -float(lp[rows_idx, targets].sum()),
                            "tokens": len(targets), "kl_sum": float(kl.sum()),
                            "top1_changed": int((lp.argmax(-1) != ref_top).sum()),
                            "warm_pages_end": stats["pages_per_tier"]["T2w"], "warm_reads": stats["warm_reads"],
                            "seconds": time.perf_counter() - t_start}
            log(f"window {w_i} {name}: ppl {math.exp(results[key]['nll_sum'] / len(targets)):.4f} "
                f"(ref {math.exp(ref_nll / len(targets)):.4f}), KL {float(kl.mean()):.5f}")
            save()
        save()
    for name in [None] + list(args.passkey_codecs):
        key = f"{name or REFERENCE}/passkey"
        if key in results:
            continue
        total = args.passkey_context + 32
        method = tiered_method(model, config_for(name, total), name=name or REFERENCE, keep_decoded_warm=True)
        r = passkey(method, tok, ids, context=args.passkey_context, trials=args.passkey_trials)
        results[key] = {"accuracy": r.accuracy, "mean_logprob": r.mean_logprob, "seconds": r.seconds}
        save()
    # table
    lines = [f"SmolLM2-135M, PG essays: {len(windows)} window(s) of {args.window} tokens, first "
             f"{args.context_fraction:g} prefilled, the rest decoded token by token with teacher forcing; every page "
             f"outside T0 (4 sinks + 64 recent tokens + the page being written) stored with the codec; reference = "
             f"float16 pages. `{cmd}`", "",
             "| codec | bits / value | ratio vs fp16 | perplexity | Δppl vs fp16 | mean KL (nats) | top-1 changed | "
             "passkey 4k | key log-prob |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def agg(name):
        rs = [v for k, v in results.items() if v.get("codec") == name and "/w" in k]
        n = sum(r["tokens"] for r in rs)
        return rs, n

    ref_rs, ref_n = agg(REFERENCE)
    ref_ppl = math.exp(sum(r["nll_sum"] for r in ref_rs) / ref_n) if ref_n else float("nan")
    pk = lambda name: results.get(f"{name}/passkey")  # noqa: E731
    fmt_pk = lambda p: (f"{p['accuracy']:.2f} | {p['mean_logprob']:.3f}" if p else "– | –")  # noqa: E731
    lines.append(f"| float16 (reference) | 16.00 | 1.00 | {ref_ppl:.4f} | – | – | – | {fmt_pk(pk(REFERENCE))} |")
    for name in dict.fromkeys(list(args.codecs) + list(args.passkey_codecs)):
        rs, n = agg(name)
        bpv = bits_per_value(CODECS[name], cfg.num_kv_heads, 16, cfg.head_dim)
        if rs:  # same windows as the reference
            ppl = math.exp(sum(r["nll_sum"] for r in rs) / n)
            quality = (f"{ppl:.4f} | {ppl - ref_ppl:+.4f} | {sum(r['kl_sum'] for r in rs) / n:.5f} | "
                       f"{sum(r['top1_changed'] for r in rs) / n:.2%}")
        elif pk(name):
            quality = "– | – | – | –"
        else:
            continue
        lines.append(f"| {name} | {bpv:.2f} | {16 / bpv:.2f} | {quality} | {fmt_pk(pk(name))} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
