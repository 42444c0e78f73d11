import torch

from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy


class H2OPolicy(ReplacementPolicy):
    """Heavy-hitter oracle (H2O): the page with the least accumulated attention leaves first."""

    name = "h2o"

    def priority(self, stats: PageStats) -> torch.Tensor:
        return stats.acc_mass.float()
