import torch

from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy


class StreamingPolicy(ReplacementPolicy):
    """StreamingLLM: attention sinks (T0) + the most recent pages; the oldest page leaves first."""

    name = "streaming"

    def priority(self, stats: PageStats) -> torch.Tensor:
        return stats.position.float()
