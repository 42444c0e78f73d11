"""KV page codecs on real SmolLM2 keys and values: bits per value, compression ratio,
reconstruction error, attention-output error, encode/decode throughput on this CPU.

    python tools/bench_codec.py [--tokens 2048] [--threads N] [--out results/codec]

K/V come from one prefill of the Paul Graham essays; every full page (16 tokens) of
every layer is encoded and decoded with each codec. Errors: relative L2 of K and of V
over all pages; and the relative L2 error of the attention output of the last 64 queries
of each layer when their keys and values are replaced by the decoded ones (what the model
actually sees). Ratios are against fp16 storage (16 bits per value) and include scales,
zero points, keyframes and 128-byte alignment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tieredkv.models.cache import ContiguousKVCache
from tieredkv.models.hub import resolve_model
from tieredkv.models.llama import prefill
from tieredkv.models.loading import load_checkpoint
from tieredkv.plugins.codec import CODECS, bits_per_value, decode, encode
from tieredkv.runtime.eval.data import pg_essays_text

PAGE = 16


class _QCache(ContiguousKVCache):
    """Keeps every layer's rotated queries too (for the attention-output error)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.q: dict[int, list[torch.Tensor]] = {}

    def attend(self, step, layer, q, k, v):
        self.q.setdefault(layer, []).append(q[0].clone())
        return super().attend(step, layer, q, k, v)


def attention(q, k, v):
    """q [H, T, D] (the last T positions), k/v [KVH, S, D]; causal."""
    h, t, d = q.shape
    g = h // k.shape[0]
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = k.shape[1]
    logits = q @ kk.transpose(1, 2) / d ** 0.5
    mask = torch.arange(s).view(1, -1) <= (s - t + torch.arange(t)).view(-1, 1)
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ vv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="results/codec")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_checkpoint(resolve_model(None, log=lambda m: print(m, file=sys.stderr)))
    model, cfg = loaded.model, loaded.config
    ids = loaded.tokenizer.encode(pg_essays_text(), add_bos=False)[: args.tokens]
    cache = _QCache(model.kv_spec())
    sid = cache.add_sequence()
    prefill(model, cache, sid, torch.tensor(ids))
    n = (len(ids) // PAGE) * PAGE
    rows = []
    for name, spec in CODECS.items():
        err_k = err_v = norm_k = norm_v = 0.0
        err_o = norm_o = 0.0
        enc_s = dec_s = 0.0
        for layer in range(cfg.num_layers):
            k = cache._k[sid][layer][:, :n].float()  # [KVH, n, D]
            v = cache._v[sid][layer][:, :n].float()
            pages = lambda t: t.view(t.shape[0], n // PAGE, PAGE, -1).permute(1, 0, 2, 3)  # noqa: E731
            kh, vh = torch.empty_like(k), torch.empty_like(v)
            for i, (kp, vp) in enumerate(zip(pages(k), pages(v))):
                t_start = time.perf_counter()
                ek, ev = encode(kp, spec, role="k"), encode(vp, spec, role="v")
                t1 = time.perf_counter()
                kh[:, i * PAGE : (i + 1) * PAGE] = decode(ek, spec, kp.shape, role="k")
                vh[:, i * PAGE : (i + 1) * PAGE] = decode(ev, spec, vp.shape, role="v")
                enc_s += t1 - t_start
                dec_s += time.perf_counter() - t1
            err_k += float((kh - k).pow(2).sum())
            norm_k += float(k.pow(2).sum())
            err_v += float((vh - v).pow(2).sum())
            norm_v += float(v.pow(2).sum())
            q = torch.cat(cache.q[layer], dim=1)[:, n - args.queries : n].float()
            ref = attention(q, k, v)
            err_o += float((attention(q, kh, vh) - ref).pow(2).sum())
            norm_o += float(ref.pow(2).sum())
        bpv = bits_per_value(spec, cfg.num_kv_heads, PAGE, cfg.head_dim)
        values = 2 * cfg.num_layers * cfg.num_kv_heads * n * cfg.head_dim
        rows.append({"codec": name, "bits_per_value": round(bpv, 3), "ratio_vs_fp16": round(16 / bpv, 3),
                     "rel_err_k": (err_k / norm_k) ** 0.5, "rel_err_v": (err_v / norm_v) ** 0.5,
                     "rel_err_attention_out": (err_o / norm_o) ** 0.5,
                     "encode_mvalues_s": values / enc_s / 1e6, "decode_mvalues_s": values / dec_s / 1e6})
        print(json.dumps(rows[-1]), file=sys.stderr)
    cmd = " ".join(["python"] + sys.argv)
    lines = [f"SmolLM2-135M K/V of {n} tokens of the Paul Graham essays (30 layers, pages of {PAGE} tokens), "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; `{cmd}`", "",
             "| codec | bits / value | ratio vs fp16 | rel. error K | rel. error V | rel. error of attention output | "
             "encode Mvalues/s | decode Mvalues/s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['bits_per_value']:.2f} | {r['ratio_vs_fp16']:.2f} | {r['rel_err_k']:.4f} | "
                     f"{r['rel_err_v']:.4f} | {r['rel_err_attention_out']:.4f} | {r['encode_mvalues_s']:.1f} | "
                     f"{r['decode_mvalues_s']:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    (out / "codec.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
