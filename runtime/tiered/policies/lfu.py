import torch

from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy


class LFUPolicy(ReplacementPolicy):
    """Least frequently used page leaves first (ties: least recently used)."""

    name = "lfu"

    def priority(self, stats: PageStats) -> torch.Tensor:
        recency = stats.last_access.float()
        tie = recency / (recency.amax() + 1)  # in [0, 1): only breaks ties between equal counts
        return stats.frequency.float() + tie
