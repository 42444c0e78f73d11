"""The replacement-policy interface.

A policy ranks the pages that may leave the device: ``priority(stats)`` returns, for
every (layer, page record), a number where *higher means keep*. The tier manager evicts
the lowest-priority candidates (T0 pages and pages the current step needs are never
candidates). Priorities are computed for all layers at once on [L, R] tensors: no
per-page Python in the hot path.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class PageStats:
    """Per (layer, page record) statistics, all [L, R] tensors.

    last_access: decode step of the last access (creation step before any access);
    frequency: decode steps that needed the page; importance: the latest importance score
    in [0, 1]; acc_mass: accumulated attention mass (prefill and decode, H2O's signal);
    position: the page's logical index in its sequence; next_use: the step of the next
    access from a recorded trace (+inf when never again; only the Belady oracle reads it).
    """

    last_access: torch.Tensor
    frequency: torch.Tensor
    importance: torch.Tensor
    acc_mass: torch.Tensor
    position: torch.Tensor
    next_use: torch.Tensor | None = None


class ReplacementPolicy(abc.ABC):
    name: str = "policy"
    #: the device budget does not apply (the `full` reference)
    unlimited: bool = False
    #: needs future knowledge (next_use) from a recorded trace
    needs_trace: bool = False

    @abc.abstractmethod
    def priority(self, stats: PageStats) -> torch.Tensor:
        """[L, R] float: higher = keep on the device."""

    def describe(self) -> str:
        return (self.__doc__ or self.name).strip().splitlines()[0]
