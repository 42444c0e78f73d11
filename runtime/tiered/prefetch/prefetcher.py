"""The prefetcher: turns a predictor's output into copies onto the device.

Between decode steps (``lead = "step"`` predictors) it asks for the pages of the next
``distance`` steps and admits at most ``max_pages`` non-resident predicted pages per layer
(``TierManager.prefetch``); inside a step (``lead = "layer"``) it does the same for one layer
ahead. ``distance = "auto"`` adapts between 2 and 5 steps: a round of copies (the bytes of the
last prefetch over the GPU model's host link) must fit in ``distance`` steps at the measured
step time (``step_time.prefetch_distance``). Exact mode stays exact whatever is predicted: a
page the predictor missed is still fetched before use.
"""

from __future__ import annotations

import time

import torch

from tieredkv.runtime.tiered.prefetch.base import Predictor, PredictorInput
from tieredkv.runtime.tiered.step_time import get_gpu, prefetch_distance


class Prefetcher:
    def __init__(self, predictor: Predictor, *, max_pages: int | None = None, distance: str | int = "auto",
                 gpu: str = "h200", clock=time.perf_counter) -> None:
        self.predictor, self.max_pages, self.gpu = predictor, max_pages, get_gpu(gpu)
        self.auto = distance == "auto"
        self.distance = 2 if self.auto else int(distance)
        self.clock = clock
        self._last_call: float | None = None
        self._step_s: float | None = None  # EMA of the wall time between decode steps
        self.distances: list[int] = []  # the distance used at each decode step

    def budget(self, mgr) -> int:
        """Pages per layer one prefetch may admit: ``max_pages``, else what a decode step
        selects beyond T0 (the attention budget), else the resident capacity beyond T0."""
        if self.max_pages is not None:
            return self.max_pages
        t0 = mgr.config.t0_pages * max(1, mgr.num_sequences)
        if mgr.budgets.attention_pages is not None:
            return max(0, mgr.budgets.attention_pages - mgr.config.t0_pages)
        return 0 if mgr.resident_cap is None else max(0, mgr.resident_cap - t0)

    def between_steps(self, mgr) -> None:
        """After a decode step (TierManager.end_step): predict and prefetch."""
        now = self.clock()
        if self._last_call is not None:
            dt = now - self._last_call
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        self._last_call = now
        self.distances.append(self.distance)
        if self.predictor.lead != "step":
            return
        t = time.perf_counter()
        scores = self.predictor.scores(PredictorInput.from_manager(mgr, self.distance))
        mgr.metrics.predictor_seconds += time.perf_counter() - t
        admitted = mgr.prefetch(scores, self.budget(mgr))
        if self.auto and self._step_s is not None:
            copy_s = admitted * mgr.page_bytes / self.gpu.link_bytes_per_s
            self.distance = prefetch_distance(copy_s, self._step_s)

    def within_step(self, mgr, spec: torch.Tensor, layers=slice(None)) -> None:
        """Inside a decode step, before ``layers``' selection: ``spec`` [L, R] holds their pages'
        relevance under the previous layer's query (NaN elsewhere)."""
        if self.predictor.lead != "layer":
            return
        t = time.perf_counter()
        scores = self.predictor.scores(PredictorInput.from_manager(mgr, 1, spec=spec))
        only = torch.zeros_like(scores)
        only[layers] = scores[layers]
        mgr.metrics.predictor_seconds += time.perf_counter() - t
        mgr.prefetch(only, self.budget(mgr), layer_ahead=True)


def make_prefetcher(config, *, oracle_future=None) -> Prefetcher | None:
    """The prefetcher a TieredKVConfig asks for (None without a predictor)."""
    from tieredkv.runtime.tiered.prefetch import make_predictor

    p = config.prefetch
    if p.predictor is None:
        return None
    kwargs = {}
    if p.predictor == "gru" and p.weights is not None:
        kwargs["path"] = p.weights
    if p.predictor == "oracle":
        kwargs["future"] = oracle_future
    return Prefetcher(make_predictor(p.predictor, **kwargs), max_pages=p.max_pages, distance=p.distance, gpu=p.gpu)
