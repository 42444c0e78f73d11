import torch

from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy


class BeladyPolicy(ReplacementPolicy):
    """Belady's MIN (offline oracle over a recorded trace): the page used furthest in the future leaves first."""

    name = "belady"
    needs_trace = True

    def priority(self, stats: PageStats) -> torch.Tensor:
        if stats.next_use is None:
            raise ValueError("the Belady oracle needs next_use from a recorded access trace")
        return -stats.next_use.float()
