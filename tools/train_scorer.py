"""Fit the importance scorer's learned parts on real SmolLM2 attention, and ablate its signals.

    python tools/train_scorer.py [--texts pg-essays alice paradise-lost] [--segments 4]
                                 [--eval-texts as-you-like-it licenses world-factbook loc-workshop]
                                 [--segment-len 2048] [--queries 48] [--horizon 16] [--steps 300]
                                 [--out runtime/tiered/weights/smollm2-135m.safetensors] [--report results/scorer]

Data: ``--segments`` segments of each training text (default: the registry's scorer texts —
essays, a novel, epic verse: three genres) run through SmolLM2; for sampled query positions t
(after the first quarter of a segment) and every page that competes for the attention budget
at t (after the sink page, before the 64-token recent window), the *target* is the page's
mean attention mass over the next ``horizon`` queries (mean over heads), normalized so the top
page is 1. Features at t: the Quest relevance estimate for q_t, the distance bucket, and the
page's keys (for the saliency MLP).

Training fits, per layer, the position table and the saliency MLP so that the design
note's mix (0.4 relevance + 0.3 position + 0.3 saliency) regresses the target (MSE).
Each training text's segments alternate train / test. The report ranks pages by each
signal, each pair, the mix and H2O's accumulated attention, and gives the share of the
future attention mass captured by the top 25% and 12.5% of pages, twice: on the test
segments of the training texts, and on one segment of each ``--eval-texts`` text (default
the suite's held-out texts, which the weights never see: the split of docs/eval-suite.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tieredkv.models.cache import ContiguousKVCache
from tieredkv.models.hub import resolve_model
from tieredkv.models.llama import prefill
from tieredkv.models.loading import load_checkpoint
from tieredkv.plugins.importance_score import distance_bucket, relevance
from tieredkv.runtime.eval.texts import get_source, scorer_texts, suite_text, text_names
from tieredkv.runtime.tiered.scorer import ImportanceScorer

PAGE = 16
RECENT_PAGES = 4  # the default recent window of 64 tokens


class CaptureCache(ContiguousKVCache):
    """A contiguous cache that also keeps every layer's rotated queries."""

    def __init__(self, spec):
        super().__init__(spec)
        self.q: dict[int, list[torch.Tensor]] = {}

    def attend(self, step, layer, q, k, v):
        self.q.setdefault(layer, []).append(q[0].detach().clone())
        return super().attend(step, layer, q, k, v)


def page_mass(probs: torch.Tensor, n_pages: int) -> torch.Tensor:
    """probs [..., S] -> [..., n_pages] (sum over each page's tokens)."""
    s = probs.shape[-1]
    pad = n_pages * PAGE - s
    return torch.nn.functional.pad(probs, (0, pad)).view(*probs.shape[:-1], n_pages, PAGE).sum(-1)


def segment_examples(model, ids: list[int], *, queries: int, horizon: int, gen: torch.Generator) -> list[dict]:
    """One group per layer: the layer's pages of keys, and the features and targets of
    ``queries`` sampled positions (each over the pages before its own page)."""
    cfg = model.config
    cache = CaptureCache(model.kv_spec())
    sid = cache.add_sequence()
    prefill(model, cache, sid, torch.tensor(ids), chunk_size=512)
    S = len(ids)
    lo = S // 4
    ts = torch.sort(torch.randint(lo, S - horizon - 1, (queries,), generator=gen)).values
    out = []
    for layer in range(cfg.num_layers):
        q = torch.cat(cache.q[layer], dim=1).float()  # [H, S, D]
        k = cache._k[sid][layer].float()  # [KVH, S, D]
        g = cfg.num_heads // cfg.num_kv_heads
        kr = k.repeat_interleave(g, dim=0)
        logits = (q @ kr.transpose(1, 2)) * cfg.head_dim ** -0.5  # [H, S, S]
        logits = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        probs = logits.softmax(-1).mean(0)  # [S, S]: mean over heads
        n_pages = -(-S // PAGE)
        pm = page_mass(probs, n_pages)  # [S, n_pages]
        acc = pm.cumsum(0)  # H2O: accumulated attention up to each query
        kp = torch.nn.functional.pad(k, (0, 0, 0, n_pages * PAGE - S))
        kpages = kp.view(cfg.num_kv_heads, n_pages, PAGE, cfg.head_dim)
        kmin, kmax = kpages.amin(2), kpages.amax(2)  # [KVH, n_pages, D] (padding zeros only in the last page)
        items = []
        for t in ts.tolist():
            # candidates as in the runtime: pages after the sink page and before the recent window
            # (T0: the first page, the last RECENT_PAGES pages and the query's own page are always attended)
            hi = t // PAGE - RECENT_PAGES
            if hi < 8:
                continue
            sl = slice(1, hi)
            m = hi - 1
            fut = pm[t + 1 : t + 1 + horizon, sl].mean(0)
            tokens = torch.full((1, m), PAGE)
            rel = relevance(q[:, t].unsqueeze(0), kmin[:, sl].permute(1, 0, 2).unsqueeze(0),
                            kmax[:, sl].permute(1, 0, 2).unsqueeze(0), tokens, torch.ones(1, m, dtype=torch.bool))[0]
            dist = t - (torch.arange(1, hi) * PAGE + PAGE - 1)
            items.append({"lo": 1, "m": hi, "rel": rel, "dist": dist, "h2o": acc[t - 1, sl], "now": pm[t, sl],
                          "target": fut / fut.max().clamp(min=1e-30), "future": fut})
        out.append({"layer": layer, "keys": kpages.permute(1, 2, 0, 3).contiguous(), "items": items})
    return out


def page_saliency(scorer: ImportanceScorer, layer: int, keys: torch.Tensor) -> torch.Tensor:
    """keys [m, P, KVH, D] -> [m]: mean token saliency of each page."""
    return scorer.token_saliency(layer, keys).mean(-1)


def recall_at(score: torch.Tensor, future: torch.Tensor, frac: float) -> float:
    k = max(1, int(round(frac * len(score))))
    top = torch.topk(score + 1e-9 * torch.arange(len(score)), k).indices  # ties broken toward recent pages
    return float(future[top].sum() / future.sum().clamp(min=1e-30))


def train(scorer: ImportanceScorer, examples: list[dict], steps: int, lr: float) -> list[float]:
    scorer.requires_grad_(True)
    opt = torch.optim.Adam(scorer.parameters(), lr=lr)
    w_rel, w_pos, w_sal = scorer.weights
    nb = scorer.num_buckets
    losses = []
    n_items = sum(len(g["items"]) for g in examples)
    for _ in tqdm(range(steps), desc="training", leave=False):
        opt.zero_grad()
        loss = 0.0
        for g in examples:
            sal_all = page_saliency(scorer, g["layer"], g["keys"])
            for ex in g["items"]:
                pos = scorer.position[g["layer"]][distance_bucket(ex["dist"], nb)]
                pred = w_rel * ex["rel"] + w_pos * pos + w_sal * sal_all[ex["lo"] : ex["m"]]
                loss = loss + ((pred - ex["target"]) ** 2).mean()
        loss = loss / n_items
        loss.backward()
        opt.step()
        with torch.no_grad():
            scorer.position.clamp_(0.0, 1.0)
        losses.append(float(loss.detach()))
    scorer.requires_grad_(False)
    return losses


def ablation(scorer: ImportanceScorer, untrained: ImportanceScorer, examples: list[dict]) -> list[dict]:
    """Share of the next-``horizon`` attention mass captured by the top pages of each ranking."""
    rows = []
    with torch.no_grad():
        feats = []
        for g in examples:
            sal_all = page_saliency(scorer, g["layer"], g["keys"])
            for ex in g["items"]:
                b = distance_bucket(ex["dist"], scorer.num_buckets)
                feats.append({"relevance": ex["rel"], "position": scorer.position[g["layer"]][b],
                              "saliency": sal_all[ex["lo"] : ex["m"]], "position (cosine init)": untrained.position[g["layer"]][b],
                              "h2o": ex["h2o"], "future": ex["future"], "now": ex["now"]})
        w = dict(zip(("relevance", "position", "saliency"), scorer.weights))
        combos = [(n,) for n in w] + list(itertools.combinations(w, 2)) + [tuple(w)]
        rankings = {}
        for combo in combos:
            total = sum(w[n] for n in combo)
            name = " + ".join(combo) if len(combo) < 3 else "mix 0.4/0.3/0.3 (trained)"
            rankings[name] = lambda f, combo=combo, total=total: sum(w[n] / total * f[n] for n in combo)
        rankings["mix 0.4/0.3/0.3 (untrained: cosine position, neutral saliency)"] = (
            lambda f: w["relevance"] * f["relevance"] + w["position"] * f["position (cosine init)"] + w["saliency"] * 0.5)
        rankings["h2o (accumulated attention)"] = lambda f: f["h2o"]
        for name, fn in rankings.items():
            row = {"ranking": name}
            for target in ("now", "future"):
                for frac in (0.25, 0.125):
                    row[f"{target}@{frac:g}"] = sum(recall_at(fn(f), f[target], frac) for f in feats) / len(feats)
            rows.append(row)
    return rows


def _ablation_lines(title: str, rows: list[dict]) -> list[str]:
    lines = [title, "", "| ranking | now, top 25% | now, top 12.5% | future, top 25% | future, top 12.5% |",
             "|---|---:|---:|---:|---:|"]
    return lines + [f"| {r['ranking']} | {r['now@0.25']:.3f} | {r['now@0.125']:.3f} | {r['future@0.25']:.3f} | "
                    f"{r['future@0.125']:.3f} |" for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", nargs="+", default=scorer_texts(), choices=text_names(), metavar="TEXT",
                    help="training texts (default: %(default)s)")
    ap.add_argument("--eval-texts", nargs="+", default=None, choices=text_names(), metavar="TEXT",
                    help="texts the weights are judged on and never trained on (default: the held-out texts)")
    ap.add_argument("--segments", type=int, default=4, help="segments per training text (alternately train/test)")
    ap.add_argument("--segment-len", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=48)
    ap.add_argument("--horizon", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "runtime/tiered/weights/smollm2-135m.safetensors"))
    ap.add_argument("--report", default="results/scorer")
    args = ap.parse_args()
    eval_texts = args.eval_texts or [n for n in text_names() if get_source(n).scorer == "held-out"]
    if set(eval_texts) & set(args.texts):
        ap.error(f"--eval-texts {sorted(set(eval_texts) & set(args.texts))} are also training texts: the weights "
                 "must be judged on texts they never saw")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    loaded = load_checkpoint(resolve_model(None, log=lambda m: print(m, file=sys.stderr)))
    model = loaded.model

    def segments(name: str, n: int) -> list[list[int]]:
        ids = loaded.tokenizer.encode(suite_text(name, log=lambda m: print(m, file=sys.stderr)), add_bos=False)
        stride = max(1, (len(ids) - args.segment_len) // max(1, n - 1)) if n > 1 else 0
        start = 0 if n > 1 else (len(ids) - args.segment_len) // 2  # one segment: the middle of the text
        return [ids[start + i * stride : start + i * stride + args.segment_len] for i in range(n)]

    train_ex, test_ex, eval_ex = [], [], []
    t_start = time.perf_counter()
    with torch.no_grad():
        work = [(name, i, seg, (train_ex if i % 2 == 0 else test_ex))
                for name in args.texts for i, seg in enumerate(segments(name, args.segments))]
        work += [(name, 0, seg, eval_ex) for name in eval_texts for seg in segments(name, 1)]
        for name, i, seg, into in tqdm(work, desc="tracing segments"):
            into.extend(segment_examples(model, seg, queries=args.queries, horizon=args.horizon, gen=gen))
    trace_s = time.perf_counter() - t_start
    cfg = model.config
    scorer = ImportanceScorer(cfg.num_layers, cfg.head_dim)
    untrained = ImportanceScorer(cfg.num_layers, cfg.head_dim)
    t1 = time.perf_counter()
    losses = train(scorer, train_ex, args.steps, args.lr)
    train_s = time.perf_counter() - t1
    rows = ablation(scorer, untrained, test_ex)
    eval_rows = ablation(scorer, untrained, eval_ex)
    meta = {"model": cfg.name, "texts": list(args.texts), "eval_texts": eval_texts, "segments": args.segments,
            "segment_len": args.segment_len, "queries": args.queries, "horizon": args.horizon, "steps": args.steps,
            "lr": args.lr, "train_examples": sum(len(g["items"]) for g in train_ex),
            "test_examples": sum(len(g["items"]) for g in test_ex),
            "eval_examples": sum(len(g["items"]) for g in eval_ex), "final_loss": losses[-1],
            "date": time.strftime("%Y-%m-%d"),
            # what reproduces the weights (not where they were written: no machine path in the file)
            "command": (f"python tools/train_scorer.py --texts {' '.join(args.texts)} --eval-texts {' '.join(eval_texts)} "
                        f"--segments {args.segments} --segment-len {args.segment_len} --queries {args.queries} "
                        f"--horizon {args.horizon} --steps {args.steps} --lr {args.lr:g} --seed {args.seed}")}
    scorer.save(args.out, meta)
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    (report / "ablation.json").write_text(json.dumps({"meta": meta, "rows": rows, "held_out_rows": eval_rows,
                                                      "losses": losses[::10], "trace_seconds": trace_s,
                                                      "train_seconds": train_s}, indent=2))
    what = (f"(layer, query) examples; pages before the query's own page. Share of the attention mass captured by "
            f"the top-ranked 25% / 12.5% of pages: *now* = the query's own attention (what selection needs), "
            f"*future* = the next {args.horizon} queries' (what replacement needs). `{meta['command']}`")
    lines = _ablation_lines(f"Test segments of the training texts ({', '.join(args.texts)}): {meta['test_examples']} "
                            + what, rows)
    lines += [""] + _ablation_lines(f"Held-out texts ({', '.join(eval_texts)}; never trained on): "
                                    f"{meta['eval_examples']} " + what, eval_rows)
    (report / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"weights -> {args.out} (loss {losses[0]:.4f} -> {losses[-1]:.4f}; tracing {trace_s:.0f}s, "
          f"training {train_s:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
