"""Engine arguments: everything a server needs to build its serving engine, in one place.

The front doors (``tieredkv serve``, the Triton model repository's ``model.py``) and the
CLI share :class:`EngineArgs`: the model (or engine directory), the KV cache (the plain
paged cache, or the tiered cache with its settings), the scheduler, prefix reuse and the
remote KV tier. It is written as the JSON file beside a Triton ``model.py``
(``engine_args.json``, like Triton's vLLM backend's ``model.json``) and read back by it;
the CLI fills it from its flags (:func:`add_engine_arguments`, :meth:`EngineArgs.from_namespace`).

Percentage budgets (``--kv-budget 25%``) are shares of the full cache a server that
reserves the served length for each of ``max_num_seqs`` sequences would hold.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from tieredkv.errors import ConfigError, DataFileError, short

#: the tiered-KV flags of the CLI, by their TieredKVConfig setting name
KV_FLAGS = {"kv_budget": "device_budget", "attention_budget": "attention_budget", "policy": "policy",
            "mode": "mode", "warm_codec": "warm_codec", "warm_fraction": "warm_fraction",
            "warm_exact_reads": "warm_exact_reads", "warm_ladder": "warm_ladder", "kv_dtype": "kv_dtype",
            "selection_aggregate": "selection_aggregate", "dense_layers": "dense_layers",
            "prefetch": "prefetch_predictor",
            "prefetch_distance": "prefetch_distance", "access_log": "access_log"}
PREFIX_CHOICES = ("off", "device", "host", "disk")
ENGINE_ARGS_FILE = "engine_args.json"
METRICS_WINDOW = 10_000  # a server's latency percentiles cover its last this many requests and steps


def resolve_kv_config(*, settings_file: str | None = None, settings: dict | None = None,
                      page_size: int | None = None, engine_page_size: int | None = None, force: bool = False):
    """The TieredKVConfig a settings file, explicit settings and a page size ask for, or None
    for the plain paged cache (nothing tiered asked and not ``force``d). An engine
    directory runs at the page size it was built for unless one is given."""
    from tieredkv.runtime.tiered.config import TieredKVConfig

    settings = {k: v for k, v in (settings or {}).items() if v is not None}
    if not force and settings_file is None and not settings:
        return None
    from_file = TieredKVConfig.read_settings(settings_file) if settings_file else {}
    base = TieredKVConfig.from_mapping(from_file, source=settings_file) if settings_file else TieredKVConfig()
    if page_size is not None:
        settings["page_size"] = page_size
    elif engine_page_size is not None and "page_size" not in from_file and "page_size" not in settings:
        settings["page_size"] = engine_page_size
    try:
        return base.replace(**settings)
    except TypeError as exc:
        raise ConfigError(f"unknown tiered KV setting ({exc}); see docs/tiers.md for the settings") from None


@dataclass
class EngineArgs:
    """``model``: a .gguf file, an HF directory or a known model name (None: the default
    SmolLM2); ``engine``: an engine directory instead (run by ``backend``); ``kv``: tiered
    KV settings (flat TieredKVConfig names, e.g. ``{"device_budget": "25%"}``) — None with
    no ``kv_config`` file: the plain paged cache; ``cache_tokens``: the plain paged cache's
    capacity (None: unbounded); ``scheduler``: SchedulerConfig fields; ``prefix``: prefix
    reuse down to this tier (tiered cache only; ``off``); ``remote``: the remote KV tier's
    settings (``{"url": "redis://127.0.0.1:6379/0", ...}``, see ``remote.py``) or None."""

    model: str | None = None
    dtype: str = "float32"
    engine: str | None = None
    backend: str = "auto"
    served_model_name: str | None = None
    page_size: int | None = None
    kv: dict[str, Any] | None = None
    kv_config: str | None = None
    cache_tokens: int | None = None
    scheduler: dict[str, Any] = field(default_factory=dict)
    prefix: str = "disk"
    max_cached_pages: int | None = None
    remote: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {short(self.dtype)}")
        if self.backend not in ("auto", "onnxruntime", "tensorrt"):
            raise ConfigError(f"backend must be auto, onnxruntime or tensorrt, got {short(self.backend)}")
        if self.engine is not None and (self.model is not None or self.dtype != "float32"):
            raise ConfigError("an engine directory runs its own float32 weights; give either engine or model/dtype")
        if self.prefix not in PREFIX_CHOICES:
            raise ConfigError(f"prefix must be one of {list(PREFIX_CHOICES)}, got {short(self.prefix)}")
        for name in ("page_size", "cache_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ConfigError(f"{name} must be a positive integer or null, got {short(v)}")
        if not isinstance(self.scheduler, dict):
            raise ConfigError(f"scheduler must be a mapping of SchedulerConfig fields, got {short(self.scheduler)}")
        if self.kv is not None and not isinstance(self.kv, dict):
            raise ConfigError(f"kv must be a mapping of tiered KV settings or null, got {short(self.kv)}")
        if self.remote is not None and not isinstance(self.remote, dict):
            raise ConfigError(f"remote must be a mapping (url, ...) or null, got {short(self.remote)}")
        self.scheduler_config()  # typed errors now, not at load

    @property
    def tiered(self) -> bool:
        return self.engine is not None or self.kv is not None or self.kv_config is not None

    def scheduler_config(self):
        from tieredkv.runtime.serving.scheduler import SchedulerConfig

        known = {f.name for f in fields(SchedulerConfig)}
        unknown = sorted(set(self.scheduler) - known)
        if unknown:
            raise ConfigError(f"unknown scheduler setting(s) {unknown}; expected some of {sorted(known)}")
        return SchedulerConfig(**self.scheduler)

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "engine args") -> "EngineArgs":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of engine arguments, got {short(data)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown engine argument(s) {unknown}; expected some of {sorted(known)}")
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "EngineArgs":
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataFileError(f"{p}: engine arguments file not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataFileError(f"{p}: cannot read the engine arguments ({short(str(exc), 200)}); expected a JSON "
                                "object") from None
        return cls.from_dict(data, source=str(p))

    def save(self, path: str | Path) -> None:
        """Write atomically (a temporary file renamed into place)."""
        p = Path(path)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=2)
                f.write("\n")
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # ------------------------------------------------------------------ the CLI
    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "EngineArgs":
        """From the flags :func:`add_engine_arguments` (with the CLI's model and KV flags) added."""
        kv = {setting: getattr(args, flag) for flag, setting in KV_FLAGS.items() if getattr(args, flag, None) is not None}
        sched = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                 "prefill_chunk": args.prefill_chunk, "max_model_len": args.max_model_len,
                 "oversubscribe": True if getattr(args, "oversubscribe", False) else None}
        remote = None
        if getattr(args, "remote_kv_secret", None) is not None and not getattr(args, "remote_kv", None):
            raise ConfigError("--remote-kv-secret signs the remote KV tier's entries; give --remote-kv URL with it")
        if getattr(args, "remote_kv", None):
            remote = {"url": args.remote_kv}
            if getattr(args, "remote_kv_secret", None) is not None:
                remote["secret"] = args.remote_kv_secret
        return cls(model=args.model, dtype=args.dtype, engine=args.engine, backend=args.backend,
                   served_model_name=args.served_model_name, page_size=args.page_size,
                   kv=kv or (None if args.kv_config is None else {}), kv_config=args.kv_config,
                   cache_tokens=args.cache_tokens, scheduler={k: v for k, v in sched.items() if v is not None},
                   prefix=args.prefix, remote=remote)

    # ------------------------------------------------------------------ building
    def build(self, *, log: Callable[[str], None] | None = None) -> "Served":
        """Load the model and build the engine (typed errors for bad settings)."""
        from tieredkv.models.hub import resolve_model
        from tieredkv.models.loading import load_checkpoint
        from tieredkv.runtime.llm import parse_dtype

        if self.engine is not None:
            from tieredkv.runtime.engine import load_engine

            loaded = load_engine(self.engine, self.backend)
        else:
            loaded = load_checkpoint(resolve_model(self.model, log=log), dtype=parse_dtype(self.dtype))
        if loaded.tokenizer is None:
            from tieredkv.errors import UnsupportedModelError

            raise UnsupportedModelError(f"{loaded.source}: no tokenizer found (GGUF vocabulary or tokenizer.json); "
                                        "a server needs one")
        return Served(self, loaded, self.build_engine(loaded.model, loaded.tokenizer,
                                                      model_id=self.model_name(loaded)))

    def model_name(self, loaded=None) -> str:
        """The name clients use: ``served_model_name``, else the known model's name (the
        default SmolLM2's is ``smollm2-135m-instruct``), the engine directory's or the
        checkpoint's file name without its suffix."""
        from tieredkv.models.hub import DEFAULT_MODEL, MODELS

        if self.served_model_name:
            return self.served_model_name
        if self.engine is not None:
            return Path(self.engine).name
        if self.model is None:
            return DEFAULT_MODEL
        if self.model in MODELS:
            return self.model
        return Path(self.model).stem if Path(self.model).suffix == ".gguf" else Path(self.model).name

    def build_engine(self, model, tokenizer, *, model_id: str | None = None):
        """The serving engine on an already loaded model."""
        from tieredkv.runtime.paged import PagedCacheConfig, PagedKVCache
        from tieredkv.runtime.serving.engine import Engine
        from tieredkv.runtime.serving.prefix import PrefixConfig

        sched = self.scheduler_config()
        engine_model = getattr(model, "engine", None)
        kv = resolve_kv_config(settings_file=self.kv_config, settings=self.kv, page_size=self.page_size,
                               engine_page_size=getattr(engine_model, "page_size", None),
                               force=engine_model is not None)
        prefix = remote = None
        if kv is None:
            if self.remote is not None:
                raise ConfigError("the remote KV tier holds prefix pages of the tiered cache; give tiered KV "
                                  "settings (e.g. --kv-budget) with it")
            page = self.page_size or 16
            cap = None if self.cache_tokens is None else max(1, self.cache_tokens // page)
            cache = PagedKVCache(model.kv_spec(), PagedCacheConfig(page_size=page, max_pages=cap))
        else:
            from tieredkv.runtime.tiered.cache import TieredKVCache

            full = sched.max_model_len or model.config.max_position_embeddings
            cache = TieredKVCache(model.kv_spec(), kv, full_tokens=full, num_sequences=sched.max_num_seqs)
            if self.prefix != "off":
                prefix = PrefixConfig(tiers=self.prefix, max_cached_pages=self.max_cached_pages)
            if self.remote is not None:
                from tieredkv.runtime.serving.remote import RemoteConfig

                remote = RemoteConfig.from_dict(self.remote)
                if prefix is None:
                    raise ConfigError("the remote KV tier shares prefix pages; it needs prefix reuse (prefix != off)")
        return Engine(model, cache, tokenizer=tokenizer, scheduler=sched, prefix=prefix, remote=remote,
                      model_id=model_id or model.config.name, on_error="fail", keep_finished=False,
                      metrics_window=METRICS_WINDOW)


@dataclass
class Served:
    """A built serving stack: the arguments, the loaded model and its engine."""

    args: EngineArgs
    loaded: Any
    engine: Any

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def model_name(self) -> str:
        return self.args.model_name(self.loaded)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The serving flags beyond the CLI's model and tiered-KV flags."""
    g = p.add_argument_group("serving engine")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    g.add_argument("--page-size", type=int, default=None, help="KV page size in tokens (default 16)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="requests holding KV at once (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens fed per engine step, prefill and decode together (default 2048)")
    g.add_argument("--prefill-chunk", type=int, default=None, help="most prompt tokens per forward call (default 512)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence served, prompt + output (default: the model's context)")
    g.add_argument("--oversubscribe", action="store_true",
                   help="tiered cache: admit requests on their hot windows alone, past what the device holds of "
                        "the pages they attend (more at once, each step reading the rest from the host; default: "
                        "such a request waits)")
    g.add_argument("--cache-tokens", type=int, default=None,
                   help="capacity of the plain paged cache, in tokens (default: unbounded; the tiered cache is "
                        "bounded by --kv-budget instead)")
    g.add_argument("--prefix", default="disk", choices=PREFIX_CHOICES,
                   help="prefix reuse (tiered cache): unlisted cached pages stay indexed down to this tier "
                        "(default disk); off disables it")
    g.add_argument("--remote-kv", default=None, metavar="URL",
                   help="a shared remote KV tier for prefix pages, e.g. redis://127.0.0.1:6379/0 (docs/serving.md)")
    g.add_argument("--remote-kv-secret", default=None, metavar="KEY",
                   help="a key shared by the replicas: remote entries are signed with HMAC-SHA256 and only entries "
                        "signed with it are read (default: the TIEREDKV_REMOTE_KV_SECRET environment variable, which "
                        "other users of the machine cannot read from the process list; none: a plain SHA-256)")
