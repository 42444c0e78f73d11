"""A vote over the last few decode steps' selections: a page needed by at least
``min_votes`` of the last ``steps`` steps is predicted; more votes and a recent vote rank first."""

from __future__ import annotations

import torch

from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput


class Vote(Predictor):
    name = "vote"

    def __init__(self, steps: int = 4, min_votes: int = 2) -> None:
        self.steps, self.min_votes = steps, min_votes

    def scores(self, x: PredictorInput) -> torch.Tensor:
        bits = x.bits(self.steps)  # oldest first
        votes = bits.sum(0)
        score = votes + 0.5 * bits[-1]
        return torch.where((votes >= self.min_votes) & x.alive.unsqueeze(0), score, torch.zeros_like(score))
