import torch

from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy


class LRUPolicy(ReplacementPolicy):
    """Least recently used page leaves first."""

    name = "lru"

    def priority(self, stats: PageStats) -> torch.Tensor:
        return stats.last_access.float()
