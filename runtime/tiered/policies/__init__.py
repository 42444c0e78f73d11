"""Replacement policies, one per file, all listed in ``POLICIES`` (which parametrizes the tests)."""

from tieredkv.runtime.tiered.policies.base import PageStats, ReplacementPolicy
from tieredkv.runtime.tiered.policies.belady import BeladyPolicy
from tieredkv.runtime.tiered.policies.full import FullPolicy
from tieredkv.runtime.tiered.policies.h2o import H2OPolicy
from tieredkv.runtime.tiered.policies.lfu import LFUPolicy
from tieredkv.runtime.tiered.policies.lfu_importance import LFUImportancePolicy
from tieredkv.runtime.tiered.policies.lru import LRUPolicy
from tieredkv.runtime.tiered.policies.streaming import StreamingPolicy

POLICIES: dict[str, type[ReplacementPolicy]] = {
    cls.name: cls
    for cls in (FullPolicy, LRUPolicy, LFUPolicy, LFUImportancePolicy, H2OPolicy, StreamingPolicy, BeladyPolicy)
}


def make_policy(name: str, *, lfu_importance_weights: tuple[float, float] = (0.6, 0.4)) -> ReplacementPolicy:
    from tieredkv.errors import ConfigError

    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}")
    if name == "lfu-importance":
        return LFUImportancePolicy(weights=lfu_importance_weights)
    return POLICIES[name]()


__all__ = ["POLICIES", "PageStats", "ReplacementPolicy", "make_policy"]
