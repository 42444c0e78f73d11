"""The importance scorer's learned parts and their weights file.

Per layer: a position table over log-spaced distance buckets (initialized with a cosine
anneal) and a small MLP over keys (D -> hidden -> 1, sigmoid) giving each token a
saliency; a page's saliency is the running mean of its tokens'. Untrained, the MLP's
output layer is zero, so saliency is a neutral 0.5 everywhere. ``tools/train_scorer.py``
fits both to predict future attention mass from real SmolLM2 traces; the result ships in
``runtime/tiered/weights/`` and is picked up by shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tieredkv.errors import ConfigError, CorruptCheckpointError, short
from tieredkv.plugins.importance_score import cosine_position_init, position_value

WEIGHTS_DIR = Path(__file__).parent / "weights"


class ImportanceScorer(nn.Module):
    def __init__(self, num_layers: int, head_dim: int, *, num_buckets: int = 16, hidden: int = 32,
                 weights: tuple[float, float, float] = (0.4, 0.3, 0.3)) -> None:
        super().__init__()
        self.num_layers, self.head_dim, self.num_buckets, self.hidden = num_layers, head_dim, num_buckets, hidden
        self.weights = tuple(weights)
        self.position = nn.Parameter(cosine_position_init(num_buckets).repeat(num_layers, 1))
        gen = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(num_layers, head_dim, hidden, generator=gen) / head_dim ** 0.5)
        self.b1 = nn.Parameter(torch.zeros(num_layers, hidden))
        self.w2 = nn.Parameter(torch.zeros(num_layers, hidden))
        self.b2 = nn.Parameter(torch.zeros(num_layers))
        self.source = "untrained (cosine position init, neutral saliency)"

    # ------------------------------------------------------------------ signals
    def token_saliency(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k [..., KVH, D] -> saliency [...] in [0, 1] (mean over kv heads)."""
        h = torch.relu(k.float() @ self.w1[layer] + self.b1[layer])
        return torch.sigmoid(h @ self.w2[layer] + self.b2[layer]).mean(-1)

    def token_saliency_all(self, k: torch.Tensor, layers: torch.Tensor | None = None) -> torch.Tensor:
        """Several layers' at once: k [L', N, KVH, D] of ``layers`` [L'] (default: every layer) ->
        saliency [L', N] (one batched matmul per MLP layer instead of one per model layer; equal
        to :meth:`token_saliency` per layer to float32 rounding)."""
        pick = (lambda x: x) if layers is None else (lambda x: x.index_select(0, layers))  # noqa: E731
        n, d = k.shape[0], k.shape[-1]
        h = torch.relu(torch.baddbmm(pick(self.b1).unsqueeze(1), k.float().reshape(n, -1, d), pick(self.w1)))
        out = torch.baddbmm(pick(self.b2).view(n, 1, 1), h, pick(self.w2).unsqueeze(-1))  # [L', N*KVH, 1]
        return torch.sigmoid(out).view(*k.shape[:-1]).mean(-1)

    def positions(self, distance: torch.Tensor) -> torch.Tensor:
        """The position signal of every layer [L, ...] for token distances [...]."""
        return position_value(distance, self.position.T).movedim(-1, 0)

    # ------------------------------------------------------------------ file
    def save(self, path: str | Path, meta: dict | None = None) -> Path:
        from safetensors.torch import save_file

        info = {"num_layers": self.num_layers, "head_dim": self.head_dim, "num_buckets": self.num_buckets,
                "hidden": self.hidden, **(meta or {})}
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path),
                  metadata={"tieredkv_scorer": json.dumps(info)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, *, weights: tuple[float, float, float] = (0.4, 0.3, 0.3)) -> "ImportanceScorer":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: scorer weights file not found")
        try:
            with safe_open(str(path), framework="pt") as f:
                info = json.loads((f.metadata() or {})["tieredkv_scorer"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            shape = {k: info[k] for k in ("num_layers", "head_dim", "num_buckets", "hidden")}
            if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16 for v in shape.values()):
                raise ValueError(f"shape fields {short(shape)}")
            scorer = cls(shape["num_layers"], shape["head_dim"], num_buckets=shape["num_buckets"],
                         hidden=shape["hidden"], weights=weights)
            scorer.load_state_dict(tensors)
        except Exception as exc:  # safetensors raises its own SafetensorError; torch a RuntimeError on shapes
            raise CorruptCheckpointError(f"{path}: not a tieredkv scorer weights file ({type(exc).__name__}: "
                                         f"{short(str(exc), 200)})") from None
        scorer.source = str(path)
        scorer.meta = info
        return scorer.requires_grad_(False)

    @classmethod
    def for_model(cls, num_layers: int, head_dim: int, *, path: str | Path | None = None,
                  weights: tuple[float, float, float] = (0.4, 0.3, 0.3)) -> "ImportanceScorer":
        """The scorer for a model shape: ``path`` if given, else a packaged weights file
        whose shape matches, else an untrained scorer."""
        if path is not None:
            scorer = cls.load(path, weights=weights)
            if (scorer.num_layers, scorer.head_dim) != (num_layers, head_dim):
                raise ConfigError(f"{path}: scorer for {scorer.num_layers} layers x head dim {scorer.head_dim}; the "
                                  f"model has {num_layers} x {head_dim}")
            return scorer
        for f in sorted(WEIGHTS_DIR.glob("*.safetensors")):
            scorer = cls.load(f, weights=weights)
            if (scorer.num_layers, scorer.head_dim) == (num_layers, head_dim):
                return scorer
        return cls(num_layers, head_dim, weights=weights).requires_grad_(False)
