import torch

from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy


class FullPolicy(ReplacementPolicy):
    """No limit: every page stays on the device (the full-cache reference)."""

    name = "full"
    unlimited = True

    def priority(self, stats: PageStats) -> torch.Tensor:
        return torch.zeros_like(stats.importance)
