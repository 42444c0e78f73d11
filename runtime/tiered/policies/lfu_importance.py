import torch

from tieredkv.models.cpu_attention import tier_step_ops
from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy


class LFUImportancePolicy(ReplacementPolicy):
    """Design note's hybrid: victim = argmin(0.6 * normalized frequency + 0.4 * importance)."""

    name = "lfu-importance"

    def __init__(self, weights: tuple[float, float] = (0.6, 0.4)) -> None:
        self.w_freq, self.w_imp = weights

    def priority(self, stats: PageStats) -> torch.Tensor:
        """On the CPU one pass of the extension's ``lfu_priority`` (the tier manager's ops), bit for
        bit the torch code below, its reference."""
        freq, imp = stats.frequency, stats.importance
        ops = tier_step_ops() if freq.device.type == "cpu" and imp.device.type == "cpu" else None
        if (ops is not None and freq.dtype == torch.long and imp.dtype == torch.float32 and freq.dim() == 2
                and freq.is_contiguous() and imp.is_contiguous()):
            return ops.lfu_priority(freq, imp, self.w_freq, self.w_imp)
        return self.reference(stats)

    def reference(self, stats: PageStats) -> torch.Tensor:
        freq = stats.frequency.float()
        norm = freq / freq.amax(dim=1, keepdim=True).clamp(min=1.0)  # per layer, in [0, 1]
        return self.w_freq * norm + self.w_imp * stats.importance.float()
