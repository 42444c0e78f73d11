"""Train the GRU access predictor (runtime/tiered/prefetch/gru.py) from access logs.

    python tools/bench_prefetch.py record --texts pg-essays --contexts 1024 2048 4096 --out results/prefetch/train
    python tools/bench_prefetch.py record --kind digits --texts pg-essays --contexts 2048 --out results/prefetch/train
    python tools/bench_prefetch.py record --kind generate --texts pg-essays --contexts 2048 --out results/prefetch/train
    python tools/train_prefetcher.py --logs results/prefetch/train --out runtime/tiered/prefetch/access-gru.safetensors

The design note's recipe: a curriculum over context lengths (the ``window`` logs, shortest
first; each stage trains on every length up to its own), the ``digits`` logs (contexts dense
in numbers, which the note's predictor mispredicted) mixed into every stage, then a fine-tune
at a tenth of the learning rate on the ``generate`` logs (free generation: the model's own
tokens, as in serving). Training rows are the predictor's own inputs: each log is replayed
through the TierManager and the features are taken from the same ``PredictorInput`` the
runtime builds; the label of a page is whether each of the next 3 decode steps selected it.
The last quarter of every log's decode steps is held out; the decision threshold is the
one with the best F1 there. Train on texts the predictor is not evaluated on (the default
logs: pg-essays; tools/bench_prefetch.py eval uses the held-out texts).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput
from tieredkv.runtime.tiered.prefetch.gru import AccessGRU, features, save
from tieredkv.runtime.tiered.trace import AccessTrace, replay


class _Capture(Predictor):
    """Replays a log and keeps the features of every ``every``-th decode step (predicts nothing)."""

    name = "capture"

    def __init__(self, history: int, every: int) -> None:
        self.history, self.every = history, every
        self.rows: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def scores(self, x: PredictorInput) -> torch.Tensor:
        if x.step % self.every == 0:
            seq, layers, recs = features(x, self.history)
            self.rows.append((x.step, seq, layers, x.index[recs]))
        return torch.zeros(x.hist.shape)


def dataset(path: Path, *, history: int, horizons: int, every: int, holdout: float = 0.25):
    """(train, validation) tensors (x [N, history, F], y [N, horizons]) of one log."""
    trace = AccessTrace.load(path)
    cap = _Capture(history, every)
    replay(trace, TieredKVConfig(page_size=trace.page_size), token_bytes_per_layer=1, dtype=torch.float16,
           predictor=cap)  # no budget: the bytes do not matter
    dec = [s.needed for s in trace.steps if s.decode]
    split = int(len(dec) * (1 - holdout))
    parts: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
    for step, seq, layers, index in cap.rows:
        if step - 1 + horizons >= len(dec) or len(seq) == 0:
            continue
        y = torch.stack([dec[step - 1 + h][layers, index.clamp(max=dec[step - 1 + h].shape[1] - 1)]
                         for h in range(1, horizons + 1)], dim=1).float()
        train = step - 1 + horizons < split
        parts[train][0].append(seq)
        parts[train][1].append(y)
    cat = lambda xs, ys: (torch.cat(xs), torch.cat(ys)) if xs else None  # noqa: E731
    return cat(*parts[True]), cat(*parts[False])


def fit(model: AccessGRU, data: list[tuple[torch.Tensor, torch.Tensor]], *, epochs: int, lr: float, batch: int,
        log) -> None:
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(x))
        total = 0.0
        for i in range(0, len(x), batch):
            idx = order[i : i + batch]
            loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        log(f"  epoch {epoch + 1}/{epochs}: {len(x)} rows, loss {total / len(x):.4f}")
    model.eval()


@torch.no_grad()
def evaluate(model: AccessGRU, data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Next-step precision / recall / F1 at the best-F1 threshold."""
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])[:, 0] > 0
    p = torch.cat([torch.sigmoid(model(x[i : i + 8192]))[:, 0] for i in range(0, len(x), 8192)])
    best = {"f1": -1.0}
    for thr in [i / 20 for i in range(1, 20)]:
        pred = p > thr
        tp = int((pred & y).sum())
        prec = tp / max(1, int(pred.sum()))
        rec = tp / max(1, int(y.sum()))
        f1 = 2 * prec * rec / max(1e-9, prec + rec)
        if f1 > best["f1"]:
            best = {"threshold": thr, "precision": prec, "recall": rec, "f1": f1}
    return {**best, "rows": len(x), "positives": int(y.sum())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs", default="results/prefetch/train")
    ap.add_argument("--out", default="runtime/tiered/prefetch/access-gru.safetensors")
    ap.add_argument("--history", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--every", type=int, default=4, help="keep every k-th decode step of a log as training rows")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per curriculum stage")
    ap.add_argument("--finetune-epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    log = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    logs = sorted(Path(args.logs).glob("*.pt"))
    if not logs:
        log(f"no access logs under {args.logs}")
        return 1
    model = AccessGRU(history=args.history, hidden=args.hidden)
    data: dict[Path, tuple] = {}
    meta: dict[Path, dict] = {}
    for p in logs:
        meta[p] = AccessTrace.load(p).meta
        data[p] = dataset(p, history=args.history, horizons=model.horizons, every=args.every)
        log(f"{p.name}: {0 if data[p][0] is None else len(data[p][0][0])} training rows")
    kind = lambda p: meta[p].get("kind", "window")  # noqa: E731
    windows = [p for p in logs if kind(p) == "window"]
    digits = [p for p in logs if kind(p) == "digits"]
    generated = [p for p in logs if kind(p) == "generate"]
    stages = sorted({meta[p]["context"] for p in windows}) or [0]
    history = []
    for ctx in stages:
        part = [data[p][0] for p in windows if meta[p]["context"] <= ctx] + [data[p][0] for p in digits]
        part = [d for d in part if d is not None]
        log(f"curriculum stage: contexts <= {ctx} ({len(part)} logs, digit logs included)")
        fit(model, part, epochs=args.epochs, lr=args.lr, batch=args.batch, log=log)
        history.append({"stage": f"contexts <= {ctx}", "logs": len(part)})
    if generated:
        part = [data[p][0] for p in generated if data[p][0] is not None]
        log(f"fine-tune on {len(part)} generation logs")
        fit(model, part, epochs=args.finetune_epochs, lr=args.lr / 10, batch=args.batch, log=log)
        history.append({"stage": "fine-tune (generation logs)", "logs": len(part)})
    val = [data[p][1] for p in logs if data[p][1] is not None]
    result = evaluate(model, val)
    log(f"validation (held-out last quarter of each log), next step: {json.dumps(result)}")
    save(model, args.out, {"threshold": result["threshold"], "validation": result, "stages": history,
                           "logs": [p.name for p in logs], "command": " ".join(["python"] + sys.argv)})
    log(f"wrote {args.out} ({sum(p.numel() for p in model.parameters())} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
