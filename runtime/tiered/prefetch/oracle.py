"""The oracle: the true selection of the next steps, read from the recorded access log —
the ceiling every predictor is measured against. Replay only (it needs the future)."""

from __future__ import annotations

from typing import Callable

import torch

from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput


class Oracle(Predictor):
    name = "oracle"
    offline = True

    def __init__(self, future: Callable[[int], torch.Tensor] | None = None) -> None:
        #: future(horizon) -> [L, R] bool: the records the next ``horizon`` decode steps need
        self.future = future

    def scores(self, x: PredictorInput) -> torch.Tensor:
        if self.future is None:
            raise ValueError("the oracle predictor needs a recorded access log (replay)")
        # the next step's pages first (they are the ones the staging area can take)
        score = self.future(1).float() + self.future(x.horizon).float()
        return score * x.alive.unsqueeze(0)
