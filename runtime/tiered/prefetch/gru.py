"""The design note's learned access predictor: a bidirectional GRU reads each page's recent
access history (one step per decode step: was it needed) together with what the page table
knows of it (position, importance, attention mass, layer) and predicts whether each of the
next 3 decode steps will select it.

Trained by ``tools/train_prefetcher.py`` from access logs (a curriculum from short to long
contexts, digit-heavy logs added, then fine-tuned on logs of free generation); the weights
ship in ``runtime/tiered/weights/`` (a few thousand parameters) with the command that made them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from tieredkv.errors import ConfigError, DataFileError, short
from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput

WEIGHTS = Path(__file__).resolve().parent / "access-gru.safetensors"
#: per-page static features (module docstring), appended to every history step
STATIC_FEATURES = ("relative position", "log distance to the end", "importance", "mean attention mass per step",
                   "layer")


class AccessGRU(nn.Module):
    def __init__(self, *, history: int = 16, hidden: int = 16, horizons: int = 3) -> None:
        super().__init__()
        self.history, self.hidden, self.horizons = history, hidden, horizons
        self.gru = nn.GRU(1 + len(STATIC_FEATURES), hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, horizons)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        """seq [N, history, 1 + static] -> logits [N, horizons] (step t+1, t+2, ...)."""
        _, h = self.gru(seq)
        return self.head(torch.cat([h[0], h[1]], dim=-1))


def features(x: PredictorInput, history: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's input for every candidate page (alive, not T0) of every layer:
    (seq [N, history, 1 + static], layers [N], records [N])."""
    L = x.hist.shape[0]
    cand = (x.alive & ~x.t0).nonzero().flatten()
    layers = torch.arange(L).repeat_interleave(len(cand))
    recs = cand.repeat(L)
    if len(recs) == 0:
        return torch.zeros(0, history, 1 + len(STATIC_FEATURES)), layers, recs
    bits = x.bits(history)[:, layers, recs].T  # [N, history]
    pages = x.seq_pages[recs].clamp(min=1).float()
    idx = x.index[recs].float()
    static = torch.stack([idx / (pages - 1).clamp(min=1),
                          torch.log1p(pages - 1 - idx) / math.log(1024.0),
                          x.importance[layers, recs].clamp(0, 1),
                          (x.acc_mass[layers, recs] / max(1, x.step)).clamp(0, 1) * 8,
                          layers.float() / max(1, L - 1)], dim=1)
    seq = torch.cat([bits.unsqueeze(-1), static.unsqueeze(1).expand(-1, history, -1)], dim=-1)
    return seq, layers, recs


class GRUPredictor(Predictor):
    """Predicts a page when its probability of being selected within the horizon (the first
    min(horizon, 3) steps) exceeds ``threshold`` (stored with the weights)."""

    name = "gru"

    def __init__(self, path: str | Path | None = None, *, model: AccessGRU | None = None,
                 threshold: float | None = None) -> None:
        if model is None:
            model, meta = load(path or WEIGHTS)
            threshold = float(meta.get("threshold", 0.5)) if threshold is None else threshold
        self.model = model.eval()
        self.threshold = 0.5 if threshold is None else threshold

    @torch.inference_mode()
    def probabilities(self, x: PredictorInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seq, layers, recs = features(x, self.model.history)
        if len(recs) == 0:
            return torch.zeros(0, self.model.horizons), layers, recs
        return torch.sigmoid(self.model(seq)), layers, recs

    def scores(self, x: PredictorInput) -> torch.Tensor:
        out = torch.zeros(x.hist.shape, dtype=torch.float32)
        p, layers, recs = self.probabilities(x)
        if len(recs) == 0:
            return out
        p = p[:, : max(1, min(x.horizon, self.model.horizons))].amax(1)
        keep = p > self.threshold
        out[layers[keep], recs[keep]] = p[keep]
        return out


def save(model: AccessGRU, path: str | Path, meta: dict) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    info = {"history": model.history, "hidden": model.hidden, "horizons": model.horizons, **meta}
    try:
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp),
                  metadata={"tieredkv": json.dumps(info)})
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: str | Path) -> tuple[AccessGRU, dict]:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prefetch_weights: {path}: access predictor weights not found; expected a file written "
                          "by tools/train_prefetcher.py")
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {})["tieredkv"])
            state = {k: f.get_tensor(k) for k in f.keys()}
        model = AccessGRU(history=int(meta["history"]), hidden=int(meta["hidden"]), horizons=int(meta["horizons"]))
        model.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - any damage is the same user error
        raise DataFileError(f"{path}: not a readable access predictor ({short(str(exc), 200)}); expected a file "
                            "written by tools/train_prefetcher.py") from None
    return model, meta
