"""Reuse of the last decode step's selection: the pages it needed will be needed next."""

from __future__ import annotations

import torch

from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput


class LastStep(Predictor):
    name = "last"

    def scores(self, x: PredictorInput) -> torch.Tensor:
        return (x.hist & 1).float() * x.alive.unsqueeze(0)
