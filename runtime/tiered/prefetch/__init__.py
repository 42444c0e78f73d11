"""Predictive prefetch: access predictors behind one interface (``base.Predictor``), each
in its own file, in one registry, and the prefetcher that turns predictions into copies."""

from __future__ import annotations

from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput
from tieredkv.runtime.tiered.prefetch.gru import GRUPredictor
from tieredkv.runtime.tiered.prefetch.last import LastStep
from tieredkv.runtime.tiered.prefetch.oracle import Oracle
from tieredkv.runtime.tiered.prefetch.quest_next_layer import QuestNextLayer
from tieredkv.runtime.tiered.prefetch.recency import RecencySinks
from tieredkv.runtime.tiered.prefetch.vote import Vote
from tieredkv.runtime.tiered.prefetch.prefetcher import Prefetcher, make_prefetcher

PREDICTORS: dict[str, type[Predictor]] = {p.name: p for p in (Oracle, LastStep, Vote, RecencySinks, QuestNextLayer,
                                                             GRUPredictor)}


def make_predictor(name: str, **kwargs) -> Predictor:
    from tieredkv.errors import ConfigError

    if name not in PREDICTORS:
        raise ConfigError(f"unknown predictor {name!r}; expected one of {sorted(PREDICTORS)}")
    return PREDICTORS[name](**kwargs)


__all__ = ["PREDICTORS", "Predictor", "PredictorInput", "Prefetcher", "make_predictor", "make_prefetcher"]
