"""TieredKVConfig: the one configuration object of the tiered cache.

Budgets are strings or numbers:

* ``"25%"`` — a fraction of the full KV cache of the work at hand (for a generation:
  prompt + max new tokens of every sequence; for an evaluation: the whole window or
  prompt). Resolved when that size is known;
* ``"64MiB"``, ``"1.5GB"``, ``"123456B"`` — bytes of K/V pages across all layers (the
  page summaries kept for scoring are reported separately, not counted);
* ``2048`` or ``"2048"`` / ``"2048tok"`` — tokens per sequence-layer, i.e. pages * page size.

Two budgets are never confused (DESIGN.md): ``device_budget`` is what may be resident on
the device (T0 + T1 + T2 + the staging area); ``attention_budget`` is how many pages one
decode step attends to (T0 included). A needed page that is not resident is a miss.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from tieredkv.errors import ConfigError, DataFileError

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
            raise ConfigError(f"{field}: expected a budget such as '25%', '64MiB' or 2048 (tokens), got {text!r}")
        if isinstance(text, (int, float)):
            if text <= 0:
                raise ConfigError(f"{field}: a token budget must be positive, got {text}")
            return cls("tokens", float(text))
        m = _BUDGET_RE.match(str(text))
        if not m:
            raise ConfigError(f"{field}: cannot parse {text!r}; expected '25%', '64MiB', '1.5GB' or a token count "
                              "such as 2048")
        num, unit = float(m.group("num")), (m.group("unit") or "tok").lower()
        if num <= 0:
            raise ConfigError(f"{field}: must be positive, got {text!r}")
        if unit == "%":
            if num > 100:
                raise ConfigError(f"{field}: a percentage must be in (0, 100], got {text!r}")
            return cls("percent", num / 100)
        if unit in ("tok", "tokens", "t"):
            return cls("tokens", num)
        return cls("bytes", num * _UNITS[unit])

    def tokens(self, *, full_tokens: int | None, token_bytes_all_layers: int, field: str) -> int:
        """The budget in tokens per sequence-layer."""
        if self.kind == "tokens":
            return int(self.value)
        if self.kind == "bytes":
            return int(self.value // token_bytes_all_layers)
        if full_tokens is None:
            raise ConfigError(f"{field}: a percentage needs the size of the full cache, which is not known here; "
                              "give bytes or tokens instead")
        return int(math.floor(self.value * full_tokens))

    def __str__(self) -> str:
        if self.kind == "percent":
            return f"{self.value * 100:g}%"
        if self.kind == "bytes":
            return f"{int(self.value)}B"
        return f"{int(self.value)}tok"


MODES = ("exact", "masked")
#: how a step's page ranking for selection combines a layer's query heads
SELECTION_AGGREGATES = ("share", "head-rank")
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TieredKVConfig:
    """Everything the tiered cache needs; see the module docstring for budgets.

    T0 (never evicted, always attended) = the first ``sink_tokens`` and the last
    ``recent_tokens`` of each sequence plus the page being written.

    ``score_weights`` mix (relevance, position, saliency) into the *importance* that
    replacement and migration use (the design note's 0.4 / 0.3 / 0.3);
    ``selection_weights`` mix the same signals into the ranking that picks the pages a
    decode step attends to. Default: relevance alone — the measured best for selection
    (docs/benchmarks.md: the position and saliency terms predict *future* attention, and
    cost perplexity when they steer the current step). ``selection_aggregate`` combines a
    layer's query heads in that ranking: ``"share"`` (default) takes each page's largest
    estimated attention share over the heads; ``"head-rank"`` its best per-head rank, so
    every head gets its top pages in (Quest's per-head selection on pages the heads share;
    PyTorch backend only, docs/benchmarks.md §2). ``staging_pages``
    of the device budget are a transit area through which non-resident pages are
    streamed (exact-mode misses, chunked prefill); they are never owned by a page.

    Warm sub-tier of T2 (issue #4): with ``warm_codec`` set (a name of
    ``tieredkv.plugins.codec.CODECS``, or ``"default"`` for ``codec.DEFAULT_CODEC``, int4)
    and a device budget, ``warm_fraction`` of the resident bytes beyond T0's reservation
    hold pages encoded with the codec; cold pages (the replacement policy's victims, and
    pages demoted at window boundaries) are
    compressed into it instead of leaving the device (default share 0.75: the measured
    end-to-end setting, docs/benchmarks.md §3). ``kv_dtype`` stores pages in another
    dtype than the model computes in (``float16`` is the deployment dtype; budgets count
    the stored bytes).
    """

    page_size: int = 16
    sink_tokens: int = 4
    recent_tokens: int = 64
    device_budget: str | int | None = None
    host_budget: str | int | None = None
    disk_path: str | None = None
    attention_budget: str | int | None = None
    hot_key_fraction: float = 0.25
    staging_pages: int = 4
    policy: str = "lfu-importance"
    mode: str = "exact"
    score_weights: tuple[float, float, float] = (0.4, 0.3, 0.3)
    selection_weights: tuple[float, float, float] = (1.0, 0.0, 0.0)
    selection_aggregate: str = "share"
    lfu_importance_weights: tuple[float, float] = (0.6, 0.4)
    promote_accesses: int = 2
    promote_score: float = 0.7
    demote_idle_windows: int = 3
    demote_score: float = 0.3
    window_steps: int = 16
    scorer_weights: str | None = None
    warm_codec: str | None = None
    warm_fraction: float = 0.75
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("policy", "mode", "selection_aggregate"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("disk_path", "scorer_weights", "warm_codec", "kv_dtype"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (str, Path)):
                raise ConfigError(f"{name} must be a string or unset, got {getattr(self, name)!r}")
        for name, n in (("score_weights", 3), ("selection_weights", 3), ("lfu_importance_weights", 2)):
            v = getattr(self, name)
            try:
                w = tuple(float(x) for x in v)
            except (TypeError, ValueError):
                raise ConfigError(f"{name} must be a list of {n} numbers, got {v!r}") from None
            if len(w) != n or any(isinstance(x, bool) for x in v):
                raise ConfigError(f"{name} must be a list of {n} numbers, got {v!r}")
            object.__setattr__(self, name, w)
        for name in ("promote_score", "demote_score", "hot_key_fraction", "warm_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{name} must be a number, got {v!r}")
        for name in ("page_size", "staging_pages", "window_steps", "promote_accesses", "demote_idle_windows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("sink_tokens", "recent_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.selection_aggregate not in SELECTION_AGGREGATES:
            raise ConfigError(f"selection_aggregate must be one of {SELECTION_AGGREGATES}, got "
                              f"{self.selection_aggregate!r}")
        from tieredkv.runtime.tiered.policies import POLICIES

        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; expected one of {sorted(POLICIES)}")
        for name in ("score_weights", "selection_weights"):
            w = getattr(self, name)
            if any(x < 0 for x in w) or not math.isclose(sum(w), 1.0, abs_tol=1e-6):
                raise ConfigError(f"{name} must be 3 non-negative numbers summing to 1 (relevance, position, "
                                  f"saliency), got {w}")
        if any(w < 0 for w in self.lfu_importance_weights):
            raise ConfigError(f"lfu_importance_weights must be 2 non-negative numbers, got {self.lfu_importance_weights}")
        for name in ("promote_score", "demote_score", "hot_key_fraction"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {v!r}")
        if self.demote_score > self.promote_score:
            raise ConfigError(f"demote_score ({self.demote_score}) must not exceed promote_score ({self.promote_score})")
        for name in ("device_budget", "host_budget", "attention_budget"):
            Budget.parse(getattr(self, name), name)  # validates
        if self.warm_codec is not None:
            from tieredkv.plugins.codec import CODECS, DEFAULT_CODEC

            if self.warm_codec == "default":
                object.__setattr__(self, "warm_codec", DEFAULT_CODEC)
            if self.warm_codec not in CODECS:
                raise ConfigError(f"unknown warm_codec {self.warm_codec!r}; expected one of {sorted(CODECS)} "
                                  "or 'default'")
        if not isinstance(self.warm_fraction, (int, float)) or not 0.0 < self.warm_fraction <= 1.0:
            raise ConfigError(f"warm_fraction must be in (0, 1], got {self.warm_fraction!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")

    # ------------------------------------------------------------------ derived
    @property
    def t0_pages(self) -> int:
        """Upper bound of T0 pages per sequence-layer: sink pages + recent-window pages + the hot page."""
        return -(-self.sink_tokens // self.page_size) + -(-self.recent_tokens // self.page_size) + 1

    def replace(self, **changes: Any) -> "TieredKVConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ files
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config") -> "TieredKVConfig":
        data = _settings_table(data, source)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown keys {unknown}; expected a subset of {sorted(known)}")
        for key in ("score_weights", "selection_weights", "lfu_importance_weights"):
            if key in data and isinstance(data[key], list):
                data[key] = tuple(data[key])
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "TieredKVConfig":
        """Load from TOML (``.toml``) or YAML (``.yaml``/``.yml``)."""
        return cls.from_mapping(cls.read_settings(path), source=str(path))

    @staticmethod
    def read_settings(path: str | Path) -> dict:
        """The settings a TOML / YAML file holds (the ``[tiered_kv]`` table when there is one),
        unchecked; typed errors for a missing, unparsable or non-mapping file."""
        p = Path(path)
        if not p.is_file():
            raise DataFileError(f"{p}: KV config file not found")
        text = p.read_text(encoding="utf-8")
        try:
            if p.suffix == ".toml":
                import tomllib

                data = tomllib.loads(text)
            elif p.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text) or {}
            else:
                raise ConfigError(f"{p}: unknown config format {p.suffix!r}; expected .toml, .yaml or .yml")
        except (ValueError, yaml_error()) as exc:
            raise ConfigError(f"{p}: cannot parse ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping of settings at the top level")
        return _settings_table(data, str(p))


def _settings_table(data: Mapping[str, Any], source: str) -> dict:
    """The settings of a mapping: its ``tiered_kv`` table / key when it has one, else itself."""
    inner = data.get("tiered_kv", data)
    if not isinstance(inner, Mapping):
        raise ConfigError(f"{source}: tiered_kv must be a table of settings, got {inner!r}")
    return dict(inner)


def yaml_error() -> type[Exception]:
    import yaml

    return yaml.YAMLError


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

    @property
    def resident_pages(self) -> int | None:
        """Full-precision pages that may be owned on the device (T0 + T1 + T2), i.e. without
        the staging area and the bytes given to the warm sub-tier."""
        return None if self.device_pages is None else self.device_pages - self.staging_pages - self.warm_given


def resolve_budgets(config: TieredKVConfig, *, num_layers: int, token_bytes_per_layer: int,
                    full_tokens: int | None, num_sequences: int = 1,
                    warm_page_bytes: int | None = None) -> ResolvedBudgets:
    """Turn the budget strings into pages per layer; ConfigError when the device budget
    cannot hold the hot window (T0 of every sequence) plus the staging area.
    ``warm_page_bytes``: bytes of one encoded page of one layer (with ``warm_codec``)."""
    P = config.page_size
    tok_all = token_bytes_per_layer * num_layers
    dev = Budget.parse(config.device_budget, "device_budget")
    host = Budget.parse(config.host_budget, "host_budget")
    att = Budget.parse(config.attention_budget, "attention_budget")
    device_pages = host_pages = attention_pages = None
    staging = config.staging_pages
    if dev is not None:
        per_seq = dev.tokens(full_tokens=full_tokens, token_bytes_all_layers=tok_all, field="device_budget")
        # percent and per-sequence token budgets are per sequence; bytes are for the whole cache
        device_pages = per_seq // P * (1 if dev.kind == "bytes" else num_sequences)
        need = config.t0_pages * num_sequences + staging + 1
        if device_pages < need:
            raise ConfigError(
                f"device_budget {dev} gives {device_pages} pages per layer ({P} tokens each), too small to hold the "
                f"hot window: T0 = {config.t0_pages} page(s) per sequence (sinks {config.sink_tokens} + recent "
                f"{config.recent_tokens} tokens + the page being written) x {num_sequences} sequence(s) + "
                f"{staging} staging page(s) + 1; expected at least {need} pages = {need * P} tokens per layer"
            )
    if host is not None:
        host_pages = host.tokens(full_tokens=full_tokens, token_bytes_all_layers=tok_all, field="host_budget") // P
        if host.kind != "bytes":
            host_pages *= num_sequences
        if host_pages < 1:
            raise ConfigError(f"host_budget {host} is smaller than one page ({P} tokens per layer)")
        if config.disk_path is None and device_pages is not None and full_tokens is not None:
            total = -(-full_tokens // P) * num_sequences
            if device_pages + host_pages < total:
                raise ConfigError(
                    f"device_budget + host_budget hold {device_pages + host_pages} pages per layer but the work needs "
                    f"{total}; demoted pages would be lost. Raise host_budget or set disk_path (T4)."
                )
    if att is not None:
        attention_pages = -(-att.tokens(full_tokens=full_tokens, token_bytes_all_layers=tok_all,
                                        field="attention_budget") // P)
        if attention_pages < config.t0_pages:
            raise ConfigError(f"attention_budget {att} = {attention_pages} page(s) cannot cover T0 "
                              f"({config.t0_pages} pages: sinks, recent window, hot page)")
    elif device_pages is not None:
        # default: attend to as many pages as can be resident for one sequence
        attention_pages = (device_pages - staging) // num_sequences
    warm_pages = warm_given = 0
    if device_pages is not None and config.warm_codec is not None:
        if not warm_page_bytes:
            raise ValueError("internal: warm_codec set but warm_page_bytes not given")
        # T0 (+ the page being allocated) stays full precision; warm_fraction of the rest is compressed
        spare = device_pages - staging - (config.t0_pages * num_sequences + 1)
        warm_given = round(config.warm_fraction * spare)
        warm_pages = warm_given * token_bytes_per_layer * P // warm_page_bytes
        if att is None:
            attention_pages = (device_pages - staging - warm_given + warm_pages) // num_sequences
    hot = 0 if device_pages is None else int(config.hot_key_fraction * (device_pages - staging - warm_given))
    return ResolvedBudgets(device_pages, host_pages, attention_pages, hot, staging, warm_pages, warm_given)
