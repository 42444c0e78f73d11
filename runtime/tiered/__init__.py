"""The tiered KV cache: tiers T0-T4, importance scoring, replacement policies, migration."""

from tieredkv.runtime.tiered.budgets import Budget
from tieredkv.runtime.tiered.cache import TieredKVCache
from tieredkv.runtime.tiered.config import TieredKVConfig
from tieredkv.runtime.tiered.metrics import TierMetrics
from tieredkv.runtime.tiered.policies import POLICIES

__all__ = ["Budget", "POLICIES", "TierMetrics", "TieredKVCache", "TieredKVConfig"]
