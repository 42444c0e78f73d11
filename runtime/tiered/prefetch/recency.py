"""Recency + sinks (StreamingLLM's prior): the most recent pages beyond T0 come next. The
sink pages and the recent window are T0 (always resident), so this ranks the other pages of
each sequence by position, newest first, up to what a step selects."""

from __future__ import annotations

import torch

from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput


class RecencySinks(Predictor):
    name = "recency"

    def scores(self, x: PredictorInput) -> torch.Tensor:
        position = (x.index.float() + 1).unsqueeze(0).expand(x.hist.shape[0], -1)
        chosen = x.top_per_sequence(position)
        return torch.where(chosen, position, torch.zeros_like(position))
