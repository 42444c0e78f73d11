"""Which ranking should pick the pages a decode step attends to? Perplexity of SmolLM2
with the tiered cache (exact mode: nothing is lost, only the selection differs) under
several selection rankings, against the full cache and an oracle.

    python tools/eval/selection_ablation.py [--budget 25%] [--window 4096] [--context-fraction 0.875]
                                            [--windows 1] [--out results/selection]

The oracle ranks pages by the attention mass the current query really pays them (max
over heads) — computed from every page, resident or not, so it is not implementable; it
bounds what any page-level selection can reach at this attention budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tieredkv.models.hub import resolve_model
from tieredkv.models.loading import load_checkpoint
from tieredkv.plugins.tiered_attention import tiered_attention
from tieredkv.runtime.eval.data import pg_essays_text
from tieredkv.runtime.eval.harness import CacheMethod
from tieredkv.runtime.eval.perplexity import perplexity
from tieredkv.runtime.paged import PagedKVCache
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig


class OracleSelectionCache(TieredKVCache):
    """Decode steps rank pages by the true attention share of each page for the current query
    (max over heads), read from every page wherever it lives, uncounted: the oracle is not a
    real transfer."""

    def _score(self, layer, seq, q, *, decode):
        rel, score, saliency = super()._score(layer, seq, q, decode=decode)
        if not decode:
            return rel, score, saliency
        n = len(seq.recs)
        k, v = self.mgr.read_pages(layer, seq.recs, q.dtype)
        _, _, probs = tiered_attention(q.unsqueeze(2), k, v, torch.arange(n).unsqueeze(0),
                                       torch.ones(1, n, dtype=torch.bool), seq.index.unsqueeze(0),
                                       torch.tensor([seq.seq_len]), torch.tensor([seq.seq_len - 1]), with_lse=False)
        candidates = ~seq.t0 if not seq.t0.all() else seq.t0
        oracle = probs.amax(1)[0, 0] * candidates
        oracle = oracle / oracle.max().clamp(min=1e-30)
        return oracle, oracle, saliency


VARIANTS = {
    "relevance (default)": {"selection_weights": (1.0, 0.0, 0.0)},
    "relevance + position": {"selection_weights": (0.5, 0.5, 0.0)},
    "mix 0.4/0.3/0.3": {"selection_weights": (0.4, 0.3, 0.3)},
    "position only": {"selection_weights": (0.0, 1.0, 0.0)},
    "mix, recent window 256": {"selection_weights": (0.4, 0.3, 0.3), "recent_tokens": 256},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--context-fraction", type=float, default=0.875)
    ap.add_argument("--out", default="results/selection")
    args = ap.parse_args()
    loaded = load_checkpoint(resolve_model(None, log=lambda m: print(m, file=sys.stderr)))
    model = loaded.model
    ids = loaded.tokenizer.encode(pg_essays_text(), add_bos=False)
    spec = model.kv_spec()
    kw = dict(window=args.window, max_windows=args.windows, context_fraction=args.context_fraction)
    rows = []
    t_start = time.perf_counter()
    full = perplexity(CacheMethod(model, lambda total: PagedKVCache(spec)), ids, **kw)
    rows.append({"selection": "full cache", "perplexity": full.perplexity, "seconds": time.perf_counter() - t_start})
    methods = {name: (TieredKVCache, TieredKVConfig(device_budget=args.budget, warm_codec="off", **cfg))
               for name, cfg in VARIANTS.items()}
    methods["oracle (true attention, max over heads)"] = (OracleSelectionCache,
                                                          TieredKVConfig(device_budget=args.budget, warm_codec="off"))
    for name, (cls, cfg) in methods.items():
        t_start = time.perf_counter()
        m = CacheMethod(model, lambda total, cls=cls, cfg=cfg: cls(spec, cfg, full_tokens=total), name=name,
                        teacher_forcing_chunk=1)
        r = perplexity(m, ids, **kw)
        rows.append({"selection": name, "perplexity": r.perplexity, "seconds": time.perf_counter() - t_start,
                     "bytes_h2d": r.stats.get("bytes_h2d")})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    cmd = " ".join(["python"] + sys.argv)
    ref = rows[0]["perplexity"]
    lines = [f"SmolLM2-135M, {args.windows} window(s) of {args.window} tokens, the first {args.context_fraction:g} "
             f"as context, the rest teacher-forced one token per step; device budget {args.budget}, attention budget "
             f"= what fits, exact mode; `{cmd}`", "",
             "| selection ranking | perplexity | vs full |", "|---|---:|---:|"]
    lines += [f"| {r['selection']} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / ref - 1):+.1f}% |" for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selection.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    (out / "selection.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
