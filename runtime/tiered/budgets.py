"""Budgets of the tiered cache: how a budget string is read, and how the budgets of a
:class:`~tieredkv.runtime.tiered.config.TieredKVConfig` resolve into pages per layer.

* ``"25%"`` — a share of the full KV cache's *bytes in the reference dtype*
  (``budgets.reference_dtype``, flat ``budget_reference``: float16 by default, what a GPU
  deployment stores) for the work at hand (for a generation: prompt + max new tokens of every
  sequence; for an evaluation: the whole window or prompt), whatever dtype the pages are
  stored in: ``25%`` of a float32 cache at the float16 reference is 12.5 % of its tokens, the
  same bytes as 25 % of a float16 one. Resolved when that size is known; ``"100%"`` (like
  ``"unlimited"``) is no budget: every page;
* ``"64MiB"``, ``"1.5GB"``, ``"123456B"`` — bytes of K/V pages across all layers (the
  page summaries kept for scoring are reported separately, not counted);
* ``2048`` or ``"2048"`` / ``"2048tok"`` — tokens per sequence-layer, i.e. pages * page size.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tieredkv.errors import ConfigError, short

if TYPE_CHECKING:
    from tieredkv.runtime.tiered.config import TieredKVConfig

_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_BUDGET_RE = re.compile(r"^\s*(?P<num>\d+(\.\d+)?)\s*(?P<unit>%|[kmgt]?i?b|tok|tokens|t)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """A parsed budget: ``kind`` is 'percent' (value in (0, 1]), 'bytes' or 'tokens'."""

    kind: str
    value: float

    @classmethod
    def parse(cls, text: str | int | float | None, field: str = "budget") -> "Budget | None":
        if text is None or (isinstance(text, str) and text.strip().lower() in ("", "none", "unlimited", "100%")):
            return None
        if isinstance(text, bool):
            raise ConfigError(f"{field}: expected a budget such as '25%', '64MiB' or 2048 (tokens), got {short(text)}")
        if isinstance(text, (int, float)):
            if not math.isfinite(text):
                raise ConfigError(f"{field}: a budget must be a finite number, got {short(text)}")
            if text <= 0:
                raise ConfigError(f"{field}: a token budget must be positive, got {text}")
            return cls("tokens", float(text))
        m = _BUDGET_RE.match(str(text))
        if not m:
            raise ConfigError(f"{field}: cannot parse {short(text)}; expected '25%', '64MiB', '1.5GB' or a token count "
                              "such as 2048")
        num, unit = float(m.group("num")), (m.group("unit") or "tok").lower()
        if not num < 1e18:
            raise ConfigError(f"{field}: {short(text)} is beyond any memory or context; expected a budget that fits")
        if num <= 0:
            raise ConfigError(f"{field}: must be positive, got {short(text)}")
        if unit == "%":
            if num > 100:
                raise ConfigError(f"{field}: a percentage must be in (0, 100], got {short(text)}")
            return cls("percent", num / 100)
        if unit in ("tok", "tokens", "t"):
            return cls("tokens", num)
        return cls("bytes", num * _UNITS[unit])

    def tokens(self, *, full_tokens: int | None, token_bytes_all_layers: int, field: str,
               reference_ratio: float = 1.0) -> int:
        """The budget in tokens per sequence-layer. ``reference_ratio``: bytes of an element in
        the reference dtype over bytes of a stored element (a percentage is a share of the full
        cache's bytes in the reference dtype: 0.5 for float32 pages at the float16 reference)."""
        if self.kind == "tokens":
            return int(self.value)
        if self.kind == "bytes":
            return int(self.value // token_bytes_all_layers)
        if full_tokens is None:
            raise ConfigError(f"{field}: a percentage needs the size of the full cache, which is not known here; "
                              "give bytes or tokens instead")
        # the ratio is a power of two (4/2, 2/4, 1): exact in floating point, so an equal
        # reference and storage dtype gives exactly the share of the tokens
        return int(math.floor(self.value * full_tokens * reference_ratio))

    def __str__(self) -> str:
        if self.kind == "percent":
            return f"{self.value * 100:g}%"
        if self.kind == "bytes":
            return f"{int(self.value)}B"
        return f"{int(self.value)}tok"


#: bytes of one element in each reference dtype a percentage budget may be counted in
REFERENCE_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class BudgetBytes:
    """One budget as resolved: what was asked (``given``), its bytes (a percentage: that share
    of the full cache's bytes in the reference dtype; bytes: themselves; tokens: the tokens'
    bytes in the stored dtype), and the pages per layer they became."""

    name: str  # "device", "host", "attention"
    given: str
    kind: str  # "percent", "bytes", "tokens"
    bytes: int  # across all layers (and sequences, for device and host)
    pages: int | None  # per layer (attention: per sequence-layer); None: every page

    def to_dict(self) -> dict:
        return {"given": self.given, "kind": self.kind, "bytes": self.bytes, "pages_per_layer": self.pages}


@dataclass(frozen=True)
class ResolvedBudgets:
    """Budgets in pages per layer (shared by all sequences of a cache)."""

    device_pages: int | None  # None: unlimited (grows on demand)
    host_pages: int | None
    attention_pages: int | None  # per sequence-layer; None: every page of the sequence
    hot_key_pages: int
    staging_pages: int
    warm_pages: int = 0  # compressed pages per layer (warm sub-tier of T2)
    warm_given: int = 0  # full-precision pages whose bytes the warm sub-tier holds instead
    warm_rungs: tuple[int, ...] = ()  # of warm_pages, the pages of each rung of the warm ladder
    reference: str = "float16"  # the dtype percentage budgets count bytes in
    stored: str = ""  # the dtype the pages are stored in ("": not given)
    page_bytes: int = 0  # bytes of one full-precision page across all layers, stored dtype
    given: tuple[BudgetBytes, ...] = ()  # the budgets that were set, as resolved

    @property
    def resident_pages(self) -> int | None:
        """Full-precision pages that may be owned on the device (T0 + T1 + T2), i.e. without
        the staging area and the bytes given to the warm sub-tier."""
        return None if self.device_pages is None else self.device_pages - self.staging_pages - self.warm_given

    def describe(self) -> str:
        """One line per budget set: what was asked, its bytes, the reference and the pages."""
        if not self.given:
            return "budgets: none (every page resident)"
        lines = []
        for b in self.given:
            share = (f"of the full cache's {self.reference} bytes" if b.kind == "percent" else
                     "of K/V pages" if b.kind == "bytes" else f"tokens of {self.stored or 'stored'} K/V")
            pages = "every page" if b.pages is None else f"{b.pages} page(s) per layer" + (
                " per sequence" if b.name == "attention" else "")
            lines.append(f"{b.name} budget {b.given} {share} = {_mib(b.bytes)} -> {pages} of "
                         f"{self.stored or 'stored'} pages ({_mib(self.page_bytes)} each, all layers)")
        if self.warm_pages:
            rungs = (f" (rungs of the ladder: {' + '.join(map(str, self.warm_rungs))})"
                     if len(self.warm_rungs) > 1 else "")
            lines.append(f"warm sub-tier: {self.warm_pages} encoded page(s) per layer{rungs} in the bytes of "
                         f"{self.warm_given} full-precision page(s)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The budgets for ``--json``: the reference dtype, the stored one, and per budget set
        what was asked, its bytes and the pages per layer."""
        return {"reference_dtype": self.reference, "stored_dtype": self.stored, "page_bytes": self.page_bytes,
                **{b.name: b.to_dict() for b in self.given},
                "device_pages": self.device_pages, "host_pages": self.host_pages,
                "attention_pages": self.attention_pages, "warm_pages": self.warm_pages,
                "warm_given": self.warm_given, "warm_rungs": list(self.warm_rungs)}


def _mib(n: int) -> str:
    return f"{n} B" if n < 2**20 else f"{n / 2**20:.2f} MiB ({n} B)"


def resolve_budgets(config: TieredKVConfig, *, num_layers: int, token_bytes_per_layer: int,
                    full_tokens: int | None, dtype: torch.dtype, num_sequences: int = 1,
                    warm_page_bytes: int | tuple[int, ...] | None = None) -> ResolvedBudgets:
    """Turn the budget strings into pages per layer; ConfigError when the device budget
    cannot hold the hot window (T0 of every sequence) plus the staging area.
    ``token_bytes_per_layer``: K + V bytes of one token of one layer in ``dtype``, the dtype
    the pages are stored in; a percentage budget is a share of the full cache's bytes in
    ``config.budgets.reference_dtype`` (module docstring).
    ``warm_page_bytes``: bytes of one encoded page of one layer (with ``warm_codec``); with a
    warm ladder, one figure per rung (``config.warm.rungs()``), each rung holding the pages its
    share of the warm bytes pays for."""
    P = config.page_size
    tok_all = token_bytes_per_layer * num_layers
    elem = torch.tensor([], dtype=dtype).element_size()
    reference = config.budgets.reference_dtype
    ratio = REFERENCE_DTYPES[reference] / elem
    dev = Budget.parse(config.budgets.device, "device_budget")
    host = Budget.parse(config.budgets.host, "host_budget")
    att = Budget.parse(config.budgets.attention, "attention_budget")
    device_pages = host_pages = attention_pages = None
    staging = config.budgets.staging_pages
    if dev is not None:
        per_seq = dev.tokens(full_tokens=full_tokens, token_bytes_all_layers=tok_all, field="device_budget",
                             reference_ratio=ratio)
        # percent and per-sequence token budgets are per sequence; bytes are for the whole cache
        device_pages = per_seq // P * (1 if dev.kind == "bytes" else num_sequences)
        need = config.t0_pages * num_sequences + staging + 1
        if device_pages < need:
            raise ConfigError(
                f"device_budget {dev}{_of_reference(dev, reference, dtype)} gives {device_pages} pages per layer "
                f"({P} tokens each), too small to hold the "
                f"hot window: T0 = {config.t0_pages} page(s) per sequence (sinks {config.window.sink_tokens} + recent "
                f"{config.window.recent_tokens} tokens + the page being written) x {num_sequences} sequence(s) + "
                f"{staging} staging page(s) + 1; expected at least {need} pages = {need * P} tokens per layer"
                + (f" (or pages stored in {reference}: kv_dtype = {reference!r} holds "
                   f"{elem // REFERENCE_DTYPES[reference]}x the tokens in these bytes)"
                   if dev.kind == "percent" and elem > REFERENCE_DTYPES[reference] else "")
            )
    if host is not None:
        host_pages = host.tokens(full_tokens=full_tokens, token_bytes_all_layers=tok_all, field="host_budget",
                                 reference_ratio=ratio) // P
        if host.kind != "bytes":
            host_pages *= num_sequences
        if host_pages < 1:
            raise ConfigError(f"host_budget {host} is smaller than one page ({P} tokens per layer)")
        if config.budgets.disk_path is None and device_pages is not None and full_tokens is not None:
            total = -(-full_tokens // P) * num_sequences
            if device_pages + host_pages < total:
                raise ConfigError(
                    f"device_budget + host_budget hold {device_pages + host_pages} pages per layer but the work needs "
                    f"{total}; demoted pages would be lost. Raise host_budget or set disk_path (T4)."
                )
    if att is not None:
        attention_pages = -(-att.tokens(full_tokens=full_tokens, token_bytes_all_layers=tok_all,
                                        field="attention_budget", reference_ratio=ratio) // P)
        if attention_pages < config.t0_pages:
            raise ConfigError(f"attention_budget {att} = {attention_pages} page(s) cannot cover T0 "
                              f"({config.t0_pages} pages: sinks, recent window, hot page)")
    elif device_pages is not None and config.budgets.attention is None:
        # default: attend to as many pages as can be resident for one sequence ('100%' or
        # 'unlimited' given explicitly: every page, the non-resident ones fetched or masked)
        attention_pages = (device_pages - staging) // num_sequences
    warm_pages = warm_given = 0
    warm_rungs: tuple[int, ...] = ()
    if device_pages is not None and config.warm.codec is not None:
        if not warm_page_bytes:
            raise ValueError("internal: warm_codec set but warm_page_bytes not given")
        shares = [share for _, share in config.warm.rungs()]
        rung_bytes = ((warm_page_bytes,) * len(shares) if isinstance(warm_page_bytes, int)
                      else tuple(warm_page_bytes))
        # the bytes of one encoded page, on average over the rungs' shares
        mean_bytes = rung_bytes[0] if len(shares) == 1 else math.ceil(
            1 / sum(s / b for s, b in zip(shares, rung_bytes)))
        # T0 (+ the page being allocated) stays full precision; warm_fraction of the rest is compressed
        spare = device_pages - staging - (config.t0_pages * num_sequences + 1)
        per_given = token_bytes_per_layer * P  # warm bytes one full-precision page gives
        if config.warm.fraction == "auto":
            warm_given = _auto_warm_given(spare, device_pages - staging, per_given, mean_bytes,
                                          None if full_tokens is None else -(-full_tokens // P) * num_sequences)
        else:
            warm_given = round(config.warm.fraction * spare)
        given_bytes = warm_given * per_given
        warm_rungs = ((given_bytes // rung_bytes[0],) if len(shares) == 1 else
                      tuple(int(s * given_bytes) // b for s, b in zip(shares, rung_bytes)))
        warm_pages = sum(warm_rungs)
        if att is None:
            attention_pages = (device_pages - staging - warm_given + warm_pages) // num_sequences
    page_bytes_all_layers = tok_all * P
    for name, budget, pages in (("device_budget", dev, device_pages), ("host_budget", host, host_pages)):
        if pages is not None and pages * page_bytes_all_layers > physical_memory():
            raise ConfigError(f"{name} {budget} is "
                              f"{pages * page_bytes_all_layers / 2**30:.1f} GiB of pages; this machine has "
                              f"{physical_memory() / 2**30:.1f} GiB of memory: expected a budget that fits")
    hot = 0 if device_pages is None else int(config.budgets.hot_key_fraction * (device_pages - staging - warm_given))
    given = tuple(BudgetBytes(name, str(b), b.kind, _budget_bytes(b, full_tokens, tok_all, ratio, num_sequences, name),
                              pages)
                  for name, b, pages in (("device", dev, device_pages), ("host", host, host_pages),
                                         ("attention", att, attention_pages)) if b is not None)
    return ResolvedBudgets(device_pages, host_pages, attention_pages, hot, staging, warm_pages, warm_given, warm_rungs,
                           reference=reference, stored=str(dtype).removeprefix("torch."),
                           page_bytes=page_bytes_all_layers, given=given)


def _of_reference(b: Budget, reference: str, dtype: torch.dtype) -> str:
    """How an error names what a percentage counts."""
    return (f" (of the full cache's {reference} bytes, {str(dtype).removeprefix('torch.')} pages)"
            if b.kind == "percent" else "")


def _budget_bytes(b: Budget, full_tokens: int | None, tok_all: int, ratio: float, num_sequences: int,
                  name: str) -> int:
    """The bytes a budget stands for: a percentage that share of the full cache's bytes in the
    reference dtype; bytes themselves; tokens their bytes in the stored dtype (device and host
    budgets of every sequence, the attention budget of one)."""
    if b.kind == "bytes":
        return int(b.value)
    seqs = 1 if name == "attention" else num_sequences
    if b.kind == "tokens":
        return int(b.value) * tok_all * seqs
    return int(b.value * (full_tokens or 0) * tok_all * ratio) * seqs


def _auto_warm_given(spare: int, owned: int, per_given: int, warm_page_bytes: int, need: int | None) -> int:
    """``warm_fraction = "auto"``: the fewest full-precision pages (of ``spare``) whose bytes,
    holding compressed pages, make the ``owned`` device pages hold ``need`` pages in all;
    ``spare`` when even all of them do not (or ``need`` is unknown)."""
    if per_given <= warm_page_bytes:  # the codec saves nothing on these pages
        return 0
    if need is None:
        return max(spare, 0)
    def held(g: int) -> int:  # pages the device holds with g slots' bytes given to the warm tier (grows with g)
        return owned - g + g * per_given // warm_page_bytes

    # held(g) >= need implies g >= the closed form below (the floor only lowers held): start there
    g = max(0, -(-(need - owned) * warm_page_bytes // (per_given - warm_page_bytes)))
    while g < spare and held(g) < need:
        g += 1
    return min(g, spare)


def physical_memory() -> int:
    """Bytes of memory of this machine (where the pools live)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: no limit
