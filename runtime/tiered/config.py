"""TieredKVConfig: the one configuration object of the tiered cache.

Budgets are strings or numbers:

* ``"25%"`` — a share of the full KV cache's bytes in the reference dtype (``budget_reference``,
  float16 by default: what a GPU deployment stores), whatever the pages are stored in, for
  the work at hand (for a generation: prompt + max new tokens of every sequence; for an
  evaluation: the whole window or prompt). Resolved when that size is known;
* ``"64MiB"``, ``"1.5GB"``, ``"123456B"`` — bytes of K/V pages across all layers (the
  page summaries kept for scoring are reported separately, not counted);
* ``2048`` or ``"2048"`` / ``"2048tok"`` — tokens per sequence-layer, i.e. pages * page size.

Two budgets are never confused (docs/tiers.md): ``device_budget`` is what may be resident on
the device (T0 + T1 + T2 + the staging area); ``attention_budget`` is how many pages one
decode step attends to (T0 included). A needed page that is not resident is a miss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import torch

from tieredkv.errors import ConfigError, DataFileError, short
from tieredkv.runtime.tiered.budgets import REFERENCE_DTYPES, Budget

MODES = ("exact", "masked")
#: the largest page (tokens) a cache takes
MAX_PAGE_SIZE = 1024
#: how a step's page ranking for selection combines a layer's query heads
SELECTION_AGGREGATES = ("share", "head-rank", "kv-head")
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------ the per-field table
# Every setting is declared once, as a field of its section with ``setting(default, check,
# flat=...)``: ``check`` validates (and normalizes) the value, ``flat`` is the setting's name
# outside its section (keyword arguments, CLI flags, top-level keys of a file), unique across
# all sections.


def setting(default: Any, check: Callable[[Any], Any], *, flat: str | None = None) -> Any:
    return field(default=default, metadata={"check": check, "flat": flat})


def _integer(low: int, high: int = 1 << 40) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise ValueError(f"must be an integer in [{low}, {high}], got {short(v)}")
        return v
    return check


def _number(low: float, high: float, *, open_low: bool = False) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"must be a number, got {short(v)}")
        if not (low < v if open_low else low <= v) or v > high:
            raise ValueError(f"must be in {'(' if open_low else '['}{low:g}, {high:g}], got {short(v)}")
        return v
    return check


def _weights(n: int, *, unit_sum: bool) -> Callable[[Any], tuple[float, ...]]:
    what = (f"{n} non-negative numbers summing to 1 (relevance, position, saliency)" if unit_sum
            else f"{n} finite non-negative numbers")

    def check(v: Any) -> tuple[float, ...]:
        if isinstance(v, (str, bytes, Mapping)):
            raise ValueError(f"must be a list of {what}, got {short(v)}")
        try:
            w = tuple(float(x) for x in v)
        except (TypeError, ValueError):
            raise ValueError(f"must be a list of {what}, got {short(v)}") from None
        if len(w) != n or any(isinstance(x, bool) for x in v) or not all(0 <= x < math.inf for x in w) or \
                (unit_sum and not math.isclose(sum(w), 1.0, abs_tol=1e-6)):
            raise ValueError(f"must be a list of {what}, got {short(v)}")
        return w
    return check


def _choice(options: Callable[[], Any], *, optional: bool = False,
            aliases: Callable[[], Mapping[str, str]] = dict) -> Callable[[Any], str | None]:
    """One of ``options()`` (read when checked: the policy and codec registries import late)."""
    def check(v: Any) -> str | None:
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise ValueError(f"must be a string, got {short(v)}")
        v = aliases().get(v, v)
        if v is None and optional:  # an alias of "none" (e.g. warm_codec = "off")
            return None
        if v not in options():
            raise ValueError(f"unknown value {short(v)}; expected one of {sorted(options())}")
        return v
    return check


def _optional_path(v: Any) -> str | None:
    if v is not None and (not isinstance(v, (str, Path)) or not str(v).strip()):
        raise ValueError(f"must be a non-empty path or unset, got {short(v)}")
    return None if v is None else str(v)


def _budget(v: Any) -> Any:
    try:
        Budget.parse(v, "budget")
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("budget: ")) from None
    return v


def _policies() -> Mapping[str, Any]:
    from tieredkv.runtime.tiered.policies import POLICIES

    return POLICIES


def _codecs() -> Mapping[str, Any]:
    from tieredkv.plugins.codec import CODECS

    return CODECS


#: the aliases of "none" an optional choice takes (e.g. warm_codec = "off": no warm tier)
_OFF: Mapping[str, None] = {"off": None, "none": None}


def _codec_aliases() -> Mapping[str, str | None]:
    from tieredkv.plugins.codec import DEFAULT_CODEC

    return {"default": DEFAULT_CODEC, **_OFF}


class _Settings:
    """A frozen section of settings validated from its fields' ``setting`` metadata."""

    #: the section's table in a config file (``[tiered_kv.<table>]``)
    table: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            check = f.metadata.get("check")
            if check is None:
                continue
            try:
                object.__setattr__(self, f.name, check(getattr(self, f.name)))
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"{_label(self, f)}: {exc}") from None
        self._check()

    def _check(self) -> None:
        """Checks across the section's fields."""


def _label(section: _Settings, f) -> str:
    """How errors name a field: its flat name, and where it sits in a file."""
    where = f"{section.table}.{f.name}" if section.table else f.name
    flat = f.metadata.get("flat") or f.name
    return flat if flat == where else f"{flat} ({where})"


@dataclass(frozen=True)
class WindowConfig(_Settings):
    """T0, never evicted and always attended: the first ``sink_tokens`` and the last
    ``recent_tokens`` of each sequence, plus the page being written."""

    table: ClassVar[str] = "window"
    sink_tokens: int = setting(4, _integer(0))
    recent_tokens: int = setting(64, _integer(0))


@dataclass(frozen=True)
class BudgetConfig(_Settings):
    """Budgets (the module docstring): ``device`` (resident on the device: T0 + T1 + T2 + the
    staging area), ``host`` (T3; past it pages spill to ``disk_path``, T4), ``attention`` (pages
    one decode step attends to, T0 included). ``staging_pages`` of the device budget are the
    transit area through which non-resident pages are streamed (exact-mode misses, chunked
    prefill); ``hot_key_fraction`` of the resident pages may be labelled T1. ``reference_dtype``
    (flat ``budget_reference``): the dtype whose bytes a percentage budget counts — ``25%`` is
    a quarter of the full cache's bytes in it (float16 by default, what a GPU deployment
    stores), whatever dtype the pages are stored in; bytes and token budgets do not use it."""

    table: ClassVar[str] = "budgets"
    device: str | int | None = setting(None, _budget, flat="device_budget")
    host: str | int | None = setting(None, _budget, flat="host_budget")
    attention: str | int | None = setting(None, _budget, flat="attention_budget")
    staging_pages: int = setting(4, _integer(1, 1 << 20))
    hot_key_fraction: float = setting(0.25, _number(0.0, 1.0))
    disk_path: str | None = setting(None, _optional_path)
    reference_dtype: str = setting("float16", _choice(lambda: REFERENCE_DTYPES), flat="budget_reference")


@dataclass(frozen=True)
class MigrationConfig(_Settings):
    """Replacement and migration: the replacement ``policy`` (``lfu-importance``: victim =
    argmin(w_freq * frequency + w_imp * importance), ``lfu_importance_weights``); the
    *importance* it and the thresholds read mixes (relevance, position, saliency) with
    ``score_weights`` (the design note's 0.4 / 0.3 / 0.3); every ``window_steps`` decode steps
    pages accessed >= ``promote_accesses`` times scoring > ``promote_score`` are promoted, pages
    idle ``demote_idle_windows`` windows or scoring < ``demote_score`` demoted."""

    table: ClassVar[str] = "migration"
    policy: str = setting("lfu-importance", _choice(_policies))
    lfu_importance_weights: tuple[float, float] = setting((0.6, 0.4), _weights(2, unit_sum=False))
    score_weights: tuple[float, float, float] = setting((0.4, 0.3, 0.3), _weights(3, unit_sum=True))
    window_steps: int = setting(16, _integer(1))
    promote_accesses: int = setting(2, _integer(1))
    promote_score: float = setting(0.7, _number(0.0, 1.0))
    demote_idle_windows: int = setting(3, _integer(1))
    demote_score: float = setting(0.3, _number(0.0, 1.0))

    def _check(self) -> None:
        if self.demote_score > self.promote_score:
            raise ConfigError(f"demote_score ({self.demote_score}) must not exceed promote_score ({self.promote_score})")


@dataclass(frozen=True)
class SelectionConfig(_Settings):
    """What a decode step attends to: T0 plus the top pages by a ranking that mixes the same
    signals with ``weights`` (default: relevance alone — the measured best for selection,
    docs/benchmarks.md: the position and saliency terms predict *future* attention, and cost
    perplexity when they steer the current step). ``aggregate`` combines a layer's query heads
    in that ranking: ``share`` (each page's largest estimated attention share over the heads)
    or ``head-rank`` (its best per-head rank, so every head gets its top pages in; PyTorch
    backend only) or ``kv-head`` (each kv head selects its own pages within the attention
    budget, ranked by the share over its query group; a page any head selects is fetched;
    PyTorch backend only). ``dense_layers``: the first that many layers attend every page
    (Quest leaves its first two layers dense: their attention is diffuse and the bound ranks
    it poorly); their pages are resident or streamed like any other. A selected page that is
    not resident: ``mode = "exact"`` streams it in before use, ``"masked"`` skips it and
    counts the miss."""

    table: ClassVar[str] = "selection"
    mode: str = setting("exact", _choice(lambda: MODES))
    weights: tuple[float, float, float] = setting((1.0, 0.0, 0.0), _weights(3, unit_sum=True),
                                                  flat="selection_weights")
    aggregate: str = setting("share", _choice(lambda: SELECTION_AGGREGATES), flat="selection_aggregate")
    dense_layers: int = setting(0, _integer(0, 1 << 10))


def _warm_fraction(v: Any) -> float | str:
    if v == "auto":
        return v
    try:
        return _number(0.0, 1.0, open_low=True)(v)
    except ValueError:
        raise ValueError(f"must be 'auto' or a number in (0, 1], got {short(v)}") from None


#: ``warm.exact_reads = "auto"`` in exact mode: chosen by the evaluation suite (docs/benchmarks.md
#: §7: at 25 % of a 2k context the worst held-out text's perplexity gap falls from +1.7 % to
#: +0.5 %, and every text's within it, for 4 pages x layers of host reads per token)
AUTO_EXACT_READS = 4


def _exact_reads(v: Any) -> int | str:
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 10:
        raise ValueError(f"must be 'auto' or an integer in [0, 1024] (warm pages per layer and decode step), "
                         f"got {short(v)}")
    return v


def _ladder(v: Any) -> str | None:
    """``warm.ladder``: the rungs below ``warm.codec``, highest precision first, as
    ``"codec:share,..."`` (or ``+`` between rungs; share: of the warm tier's bytes, the top rung
    keeping the rest), or off. Normalized to the comma form (shares as given)."""
    if v is None or (isinstance(v, str) and v in _OFF):
        return None
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"must be 'off' or a string like 'int2:0.5' or 'int4:0.4,int2:0.3', got {short(v)}")
    codecs, rungs, total = _codecs(), [], 0.0
    for item in v.replace("+", ",").split(","):
        name, sep, share = item.strip().partition(":")
        if name not in codecs or not sep:
            raise ValueError(f"rung {short(item.strip())}: expected codec:share with a codec of {sorted(codecs)} "
                             "and a share of the warm bytes in (0, 1), e.g. 'int2:0.5'")
        try:
            value = float(share)
        except ValueError:
            value = math.nan
        if not 0.0 < value < 1.0:
            raise ValueError(f"rung {short(item.strip())}: the share must be a number in (0, 1), got {short(share)}")
        rungs.append(f"{name}:{share.strip()}")
        total += value
    if total >= 1.0:
        raise ValueError(f"the rungs' shares sum to {total:g}; expected less than 1 (the top rung, warm.codec, "
                         "keeps the rest of the warm bytes)")
    return ",".join(rungs)


@dataclass(frozen=True)
class WarmConfig(_Settings):
    """The warm sub-tier of T2: with a ``codec`` (a name of ``tieredkv.plugins.codec.CODECS``;
    ``"default"`` is ``codec.DEFAULT_CODEC``, int4, the default; ``"off"`` or None: no warm
    tier) and a device budget, ``fraction`` of the resident bytes beyond T0's reservation hold
    pages encoded with the codec; cold pages (the replacement policy's victims, pages demoted
    at window boundaries) are compressed into it instead of leaving the device. ``"auto"``
    (the default) gives the warm tier the smallest share with which the exact and the
    compressed pages together hold the whole work (``full_tokens`` x ``num_sequences``), and
    all of it when the work is larger than that or its size unknown: nothing is compressed that
    fits exact, and nothing leaves the device that fits compressed (chosen by the evaluation
    suite, docs/benchmarks.md §7). On by default since the suite chose it (at 25 % and 12.5 %
    it beats the warm-less cache on every held-out text in the same device bytes, with no more
    host traffic); without a device budget nothing is compressed.

    ``exact_reads``: in a decode step, at most that many warm pages of each layer — the ones most
    relevant at the last step that listed them (the attention share they drew where attended, the
    scorer's estimate elsewhere; ``TierManager.exact_read_choice``) — are read, where the step
    attends them, from their exact copy off the device (every warm page keeps one on the host or
    disk) instead of decoded: the codec's error removed where the attention is, for up to that
    many pages x layers of host-to-device bytes per token (counted in ``bytes_h2d``). Chosen
    before the step runs, so an engine's runtime stages the same pages for its graph as the
    PyTorch backend reads. ``"auto"`` (the default): :data:`AUTO_EXACT_READS` in exact mode, 0
    in masked mode (which fetches nothing during a step).

    ``ladder``: rungs of lower precision below ``codec`` (``"int2:0.5"``: int2 takes half the warm
    bytes, ``codec`` the rest; ``"int4:0.4,int2:0.3"`` below an fp8 codec), each warm page's rung
    chosen by its priority whenever pages enter the warm tier (``WarmTier._grade``; docs/tiers.md).
    Off by default: the suite did not choose it (docs/benchmarks.md §13, "the warm ladder": it
    holds more pages in the same bytes, which recovers the 4k needles the single codec loses on
    one held-out text and lowers the 12.5 % perplexity on average, but raises it at 25 %). The
    PyTorch backend only (an engine's graph decodes one codec)."""

    table: ClassVar[str] = "warm"
    codec: str | None = setting("int4", _choice(_codecs, optional=True, aliases=_codec_aliases), flat="warm_codec")
    fraction: float | str = setting("auto", _warm_fraction, flat="warm_fraction")
    exact_reads: int | str = setting("auto", _exact_reads, flat="warm_exact_reads")
    ladder: str | None = setting(None, _ladder, flat="warm_ladder")

    def _check(self) -> None:
        if self.ladder is not None and self.codec is None:
            raise ConfigError(f"warm.ladder {self.ladder!r} needs a warm codec (its top rung); got warm.codec = off")

    def rungs(self) -> tuple[tuple[str, float], ...]:
        """(codec, share of the warm bytes) of every rung, highest precision first: ``codec`` with
        the share the ladder leaves, then the ladder's rungs; () without a warm tier."""
        if self.codec is None:
            return ()
        lower = [] if self.ladder is None else [(n, float(s)) for n, _, s in
                                                 (r.partition(":") for r in self.ladder.split(","))]
        return ((self.codec, 1.0 - sum(s for _, s in lower)), *lower)

    def reads_exact(self, mode: str) -> int:
        """Warm pages per layer a decode step reads exact (``exact_reads`` resolved for the
        selection ``mode``: ``"auto"`` is :data:`AUTO_EXACT_READS` in exact mode, none in masked
        mode, which fetches nothing during a step)."""
        if self.exact_reads != "auto":
            return self.exact_reads
        return AUTO_EXACT_READS if mode == "exact" else 0


def _predictors() -> Mapping[str, Any]:
    from tieredkv.runtime.tiered.prefetch import PREDICTORS

    return {n: p for n, p in PREDICTORS.items() if not p.offline}


def _predictor_aliases() -> Mapping[str, str | None]:
    # the measured winner (docs/benchmarks.md §9: the GRU did not beat it after paying its cost)
    return {"default": "last", **_OFF}


def _distance(v: Any) -> str | int:
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 16:
        raise ValueError(f"must be 'auto' or an integer in [1, 16] (decode steps ahead), got {short(v)}")
    return v


def _optional_count(v: Any) -> int | None:
    return None if v is None else _integer(0)(v)


@dataclass(frozen=True)
class PrefetchConfig(_Settings):
    """Predictive prefetch (docs/prefetch.md): after every decode step the ``predictor`` (a
    name of ``tieredkv.runtime.tiered.prefetch.PREDICTORS``, or ``"default"``: ``last``, the
    measured winner (docs/benchmarks.md §9); unset: no prefetch) predicts
    the pages of the next ``distance`` steps (``"auto"``: 2-5, from the step time and the
    transfer bandwidth of the ``gpu`` model) and at most ``max_pages`` per layer (default:
    the attention budget's pages beyond T0) are brought onto the device. ``weights``: a
    trained predictor file (default: the packaged one). ``access_log``: a directory where
    every sequence's access log is written (one file per sequence)."""

    table: ClassVar[str] = "prefetch"
    predictor: str | None = setting(None, _choice(_predictors, optional=True, aliases=_predictor_aliases),
                                    flat="prefetch_predictor")
    distance: str | int = setting("auto", _distance, flat="prefetch_distance")
    max_pages: int | None = setting(None, _optional_count, flat="prefetch_max_pages")
    weights: str | None = setting(None, _optional_path, flat="prefetch_weights")
    gpu: str = setting("h200", _choice(lambda: _gpus()), flat="prefetch_gpu")
    access_log: str | None = setting(None, _optional_path, flat="access_log")


def _gpus() -> Mapping[str, Any]:
    from tieredkv.runtime.tiered.step_time import GPUS

    return GPUS


_SECTIONS: dict[str, type[_Settings]] = {"window": WindowConfig, "budgets": BudgetConfig,
                                         "migration": MigrationConfig, "selection": SelectionConfig,
                                         "warm": WarmConfig, "prefetch": PrefetchConfig}
#: flat setting name -> (section, field)
FLAT_SETTINGS: dict[str, tuple[str, str]] = {(f.metadata.get("flat") or f.name): (name, f.name)
                                              for name, cls in _SECTIONS.items() for f in fields(cls)}


@dataclass(frozen=True, init=False)
class TieredKVConfig(_Settings):
    """Everything the tiered cache needs, in sections that match the tables of a config file
    (``[tiered_kv]``, ``[tiered_kv.window]``, ``[tiered_kv.budgets]``, ``[tiered_kv.migration]``,
    ``[tiered_kv.selection]``, ``[tiered_kv.warm]``, ``[tiered_kv.prefetch]``); see the module
    docstring for budgets.

    Construct it with sections, with flat setting names, or both (flat names override the
    sections they belong to)::

        TieredKVConfig(device_budget="25%", policy="lfu-importance", warm_codec="int4")
        TieredKVConfig(budgets=BudgetConfig(device="25%"), warm=WarmConfig(codec="int4"))

    ``page_size`` tokens per page; ``kv_dtype`` stores pages in another dtype than the model
    computes in (``float16`` is the deployment dtype; budgets count the stored bytes);
    ``scorer_weights`` a trained scorer file (default: the packaged one for the model's shape).
    """

    page_size: int = setting(16, _integer(1, MAX_PAGE_SIZE))
    kv_dtype: str | None = setting(None, _choice(lambda: KV_DTYPES, optional=True))
    scorer_weights: str | None = setting(None, _optional_path)
    window: WindowConfig = field(default_factory=WindowConfig)
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)

    def __init__(self, **settings: Any) -> None:
        top = {f.name for f in fields(self) if f.name not in _SECTIONS}
        unknown = sorted(set(settings) - top - set(_SECTIONS) - set(FLAT_SETTINGS))
        if unknown:
            raise ConfigError(f"unknown settings {short(unknown)}; expected any of {sorted(top | set(FLAT_SETTINGS))} "
                              f"or the sections {sorted(_SECTIONS)}")
        overrides: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in settings.items():
            if key in FLAT_SETTINGS:
                section, name = FLAT_SETTINGS[key]
                overrides[section][name] = value
        for f in fields(self):
            if f.name in _SECTIONS:
                value = _section(f.name, settings.get(f.name, None))
                if overrides[f.name]:
                    try:
                        value = dataclasses.replace(value, **overrides[f.name])
                    except TypeError as exc:  # a bad value reached a constructor
                        raise ConfigError(f"{f.name}: {exc}") from None
            else:
                value = settings.get(f.name, f.default)
            object.__setattr__(self, f.name, value)
        self.__post_init__()

    # ------------------------------------------------------------------ derived
    @property
    def t0_pages(self) -> int:
        """Upper bound of T0 pages per sequence-layer: sink pages + recent-window pages + the hot page."""
        return -(-self.window.sink_tokens // self.page_size) + -(-self.window.recent_tokens // self.page_size) + 1

    def replace(self, **settings: Any) -> "TieredKVConfig":
        """A copy with some settings changed (flat names, top-level names or whole sections)."""
        current = {f.name: getattr(self, f.name) for f in fields(self)}
        return TieredKVConfig(**{**current, **settings})

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _SECTIONS}
        for key, (section, name) in FLAT_SETTINGS.items():
            out[key] = getattr(getattr(self, section), name)
        return out

    # ------------------------------------------------------------------ files
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config") -> "TieredKVConfig":
        """From a mapping of settings: sections as tables (``{"budgets": {"device": "25%"}}``)
        and flat names at the top level (``{"device_budget": "25%"}``); lists become tuples."""
        data = _settings_table(data, source)
        for name in _SECTIONS:
            if name in data and not isinstance(data[name], Mapping):
                raise ConfigError(f"{source}: {name} must be a table of settings, got {short(data[name])}")
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
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataFileError(f"{p}: cannot read the KV config ({short(str(exc), 200)}); expected a readable UTF-8 "
                                "TOML or YAML file") from None
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
            raise ConfigError(f"{p}: cannot parse ({short(str(exc), 300)})") from None
        except RecursionError:
            raise ConfigError(f"{p}: cannot parse (nested too deeply); expected a few tables of settings") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping of settings at the top level")
        return _settings_table(data, str(p))


def _section(name: str, value: Any) -> _Settings:
    """A section from an instance, a mapping of its fields, or None (the defaults)."""
    cls = _SECTIONS[name]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"{name}: unknown keys {short(unknown)}; expected a subset of {sorted(known)}")
        return cls(**value)
    raise ConfigError(f"{name}: expected a {cls.__name__} or a table of settings, got {short(value)}")


def _settings_table(data: Mapping[str, Any], source: str) -> dict:
    """The settings of a mapping: its ``tiered_kv`` table / key when it has one, else itself;
    every key (of the tables of sections too) a string."""
    inner = data.get("tiered_kv", data)
    if not isinstance(inner, Mapping):
        raise ConfigError(f"{source}: tiered_kv must be a table of settings, got {short(inner)}")
    for table in (inner, *(v for v in inner.values() if isinstance(v, Mapping))):
        if not all(isinstance(k, str) for k in table):
            raise ConfigError(f"{source}: setting names must be strings, got {short([k for k in table])}")
    return dict(inner)


def yaml_error() -> type[Exception]:
    import yaml

    return yaml.YAMLError
