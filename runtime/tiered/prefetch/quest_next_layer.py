"""Cross-layer speculation (InfiniGen-style): inside a decode step, layer l-1's query scores
layer l's pages with the Quest bound of their key summaries (the relevance ImportanceScore
computes); the top pages a step selects are fetched while layer l-1 computes. Layer 0 has no
previous layer: it reuses the last step's selection."""

from __future__ import annotations

import torch

from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput


class QuestNextLayer(Predictor):
    name = "quest-next-layer"
    lead = "layer"
    needs_spec = True

    def scores(self, x: PredictorInput) -> torch.Tensor:
        if x.spec is None:
            raise ValueError("quest-next-layer needs the relevance under the previous layer's query (spec)")
        spec = x.spec.float()
        known = ~torch.isnan(spec)
        last = (x.hist & 1).float()
        score = torch.where(known, spec, last)  # layer 0 (no previous layer): the last step's selection
        chosen = x.top_per_sequence(score)
        chosen &= known | (last > 0)
        return torch.where(chosen, score.clamp(min=1e-6), torch.zeros_like(score))
