import torch

from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy


class LFUImportancePolicy(ReplacementPolicy):
    """Design note's hybrid: victim = argmin(0.6 * normalized frequency + 0.4 * importance)."""

    name = "lfu-importance"

    def __init__(self, weights: tuple[float, float] = (0.6, 0.4)) -> None:
        self.w_freq, self.w_imp = weights

    def priority(self, stats: PageStats) -> torch.Tensor:
        freq = stats.frequency.float()
        norm = freq / freq.amax(dim=1, keepdim=True).clamp(min=1.0)  # per layer, in [0, 1]
        return self.w_freq * norm + self.w_imp * stats.importance.float()
