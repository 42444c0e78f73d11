"""A step-time model: the bytes a decode step moves, turned into time on a named GPU.

On the CPU every tier is host memory, so the runtime's byte counters are real and its
wall-clock times are not what a GPU would see. This model turns one decode step's bytes into
GPU time, with the bandwidths as parameters (defaults: vendor figures; the H200's host link
at the ~55 GB/s pinned host->device copies reach on PCIe 5.0 x16):

* the step's compute reads the weights and the K/V pages it attends from HBM — a decode step
  at small batch is bandwidth-bound: ``compute = (weight_bytes + kv_read_bytes) / hbm``;
* a page the step needs that is not resident (a *stall*, exact mode's demand fetch) is copied
  over the host link on the critical path before the step can use it: ``+ stall_bytes / link``;
* prefetch copies run on their own copy stream while the step computes; they are free while
  the link keeps up, and bound the step when it does not: the link carries ``prefetch +
  stall`` bytes per step;
* the predictor runs on the host (the page table lives there) while the GPU computes: when
  prefetching at least one step ahead its work overlaps the step, and bounds the step only
  when it takes longer (the host path). The rest of the runtime's host work is left out of
  every row alike (its Python overhead is measured in docs/benchmarks.md, not modelled).

    step = max(compute + stall / link, (prefetch + stall) / link, predictor_s)

Not modelled: kernel launch gaps, compute-bound prefill, contention of the two copy
directions, L2 effects. The model is to be checked against a real GPU run
(tools/gpu_check.sh) when one is lent; until then its figures are estimates and say so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # pinned host -> device copies

    def describe(self) -> str:
        return f"{self.name} (HBM {self.hbm_bytes_per_s / 1e12:g} TB/s, host link {self.link_bytes_per_s / 1e9:g} GB/s)"


#: vendor HBM bandwidths; host links at what pinned copies reach (PCIe 5.0 x16 ~55 GB/s, 4.0 ~25 GB/s)
GPUS = {
    "h200": GPU("NVIDIA H200 SXM", 4.8e12, 55e9),
    "h100": GPU("NVIDIA H100 SXM", 3.35e12, 55e9),
    "a100": GPU("NVIDIA A100 80GB SXM", 2.04e12, 25e9),
    "l40s": GPU("NVIDIA L40S", 0.864e12, 25e9),
}


def get_gpu(name: str | GPU) -> GPU:
    if isinstance(name, GPU):
        return name
    from tieredkv.errors import ConfigError

    try:
        return GPUS[name]
    except KeyError:
        raise ConfigError(f"unknown GPU model {name!r}; expected one of {sorted(GPUS)}") from None


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    stall_s: float
    link_s: float  # the host link's busy time: prefetch + stall copies
    predictor_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s + self.stall_s, self.link_s, self.predictor_s)


def step_time(gpu: str | GPU, *, weight_bytes: float, kv_read_bytes: float, stall_bytes: float = 0.0,
              prefetch_bytes: float = 0.0, predictor_s: float = 0.0) -> StepTime:
    """The modelled time of one decode step (module docstring); all byte counts per step."""
    g = get_gpu(gpu)
    compute = (weight_bytes + kv_read_bytes) / g.hbm_bytes_per_s
    stall = stall_bytes / g.link_bytes_per_s
    link = (prefetch_bytes + stall_bytes) / g.link_bytes_per_s
    return StepTime(compute, stall, link, predictor_s)


def weight_bytes(cfg, dtype_bytes: int = 2) -> int:
    """Bytes of a Llama model's weights (a ``models.config.LlamaConfig``), read once per decode step."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return dtype_bytes * (cfg.num_layers * layer + embed + h)


def prefetch_distance(copy_s: float, step_s: float, *, low: int = 2, high: int = 5) -> int:
    """Decode steps ahead to prefetch: enough steps of compute to hide one round of copies
    (``copy_s``, the predicted pages over the host link) at the current step time ``step_s``,
    within [low, high] (the design note's 2-5 tokens): faster generation, further ahead."""
    if step_s <= 0:
        return high
    need = -(-copy_s // step_s)  # ceil
    return int(min(high, max(low, need)))
