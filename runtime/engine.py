"""Engine backends: run an engine directory (``builder/build_engine.py``) step by step under
the tiered KV runtime, in place of the PyTorch model.

A backend looks like the reference model to everything above it — ``config``,
``kv_spec()`` and ``backend(tokens, positions, cache, seq_ids, last_only=...)`` — so
generation, the batch API and the eval commands take either. Per step the tiered cache
(:class:`~tieredkv.runtime.tiered.cache.TieredKVCache`) opens the step, ``engine_io`` turns it
into the graph's inputs (``step_feeds``: page tables, residency masks, device pools, key
summaries, scorer parameters), the engine computes logits, the new K/V, page selection,
relevance and attention mass, and ``engine_io.finish_step`` hands them back to the cache
(writes the K/V, records the access, lets the TierManager migrate and admit) — the same
decisions the torch backend takes inside its forward pass.

* :class:`OnnxRuntimeBackend` — ONNX Runtime with IOBinding; CPU here, the CUDA execution
  provider where onnxruntime-gpu and a GPU are present.
* :class:`TensorRTBackend` — the same interface over a serialized TensorRT engine built on
  a GPU machine; importable anywhere, it fails with a clear error without TensorRT.
"""

from __future__ import annotations

import abc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tieredkv.errors import ConfigError, TieredKVError, short
from tieredkv.models.cache import KVCache, KVSpec
from tieredkv.models.config import LlamaConfig
from tieredkv.plugins import PLUGIN_VERSION
from tieredkv.plugins.codec import CODECS

__all__ = ["ENGINE_FORMAT", "ENGINE_FORMAT_VERSION", "CONFIG_FILE", "STEP_GRAPH", "TRT_ENGINE", "EngineInfo",
           "EngineError", "BackendUnavailableError", "read_engine_dir", "OnnxRuntimeBackend", "TensorRTBackend",
           "load_backend", "load_engine", "BACKENDS", "ENGINE_DTYPES", "layers_not_appended_in_place"]

ENGINE_FORMAT = "tieredkv-engine"
ENGINE_FORMAT_VERSION = 3  # 3: build.precision (float16 pools and activations)
CONFIG_FILE = "config.json"
STEP_GRAPH = "step.onnx"
TRT_ENGINE = "step.plan"
#: the TensorRT plugin library to load when none is passed (``TensorRTBackend(plugin_library=)``)
PLUGINS_ENV = "TIEREDKV_TRT_PLUGINS"
#: an engine's ``build.precision`` -> the dtype of its weights, K/V pools and activations
ENGINE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class EngineError(TieredKVError):
    """An engine directory is missing, incomplete, of another format version, or does not
    fit the cache it is asked to run with."""


class BackendUnavailableError(TieredKVError):
    """The runtime a backend needs (onnxruntime, TensorRT) is not installed or has no device."""


@dataclass(frozen=True)
class EngineInfo:
    """What ``config.json`` of an engine directory says."""

    path: Path
    model: LlamaConfig
    tiered_kv: bool
    page_size: int
    selection_weights: tuple[float, float, float]
    warm_codec: str | None
    graph: Path
    tensorrt_engine: Path | None
    raw: dict[str, Any]
    #: the dtype of the graph's K/V pools and new K/V (``build.precision``)
    kv_dtype: torch.dtype = torch.float32
    #: the largest attention budget (pages per sequence and layer) the engine's TensorRT TopK
    #: was built for (``build.max_attention_pages``; None: no bound recorded)
    max_attention_pages: int | None = None


def _inside(root: Path, name: object, what: str) -> Path:
    """``root / name`` for a relative path that stays inside ``root`` (EngineError otherwise): an
    engine directory's config.json names files of that directory only."""
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise EngineError(f"{root / CONFIG_FILE}: {what} must be a relative path inside the engine directory, got "
                          f"{short(name)}")
    target = (root / name).resolve()
    if target != root.resolve() and root.resolve() not in target.parents:
        raise EngineError(f"{root / CONFIG_FILE}: {what} {name!r} leaves the engine directory; expected a path inside "
                          "it")
    return root / name


def read_engine_dir(path: str | Path) -> EngineInfo:
    """Read and check an engine directory; raises :class:`EngineError` naming what is wrong.
    Every file it names must lie inside it."""
    path = Path(path).expanduser()
    cfg_file = path / CONFIG_FILE
    if not path.is_dir():
        raise EngineError(f"{path}: engine directory not found (build one with builder/build_engine.py --tiered-kv)")
    if not cfg_file.is_file():
        raise EngineError(f"{path}: not an engine directory ({CONFIG_FILE} is missing)")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        fmt, version = raw["format"], raw["format_version"]
    except (ValueError, KeyError, TypeError, OSError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise EngineError(f"{cfg_file}: not a tieredkv engine config ({short(str(exc), 200)})") from None
    if fmt != ENGINE_FORMAT or version != ENGINE_FORMAT_VERSION:
        raise EngineError(f"{cfg_file}: format {fmt!r} version {version!r}; this tieredkv reads {ENGINE_FORMAT!r} "
                          f"version {ENGINE_FORMAT_VERSION} — rebuild the engine with this version's builder")
    try:
        model = LlamaConfig.from_dict(raw["model"])
        build = raw["build"]
        graph = _inside(path, raw["graphs"]["step"]["file"], "the step graph")
        trt = build.get("tensorrt_engine")
        trt = trt and _inside(path, trt, "the TensorRT engine").relative_to(path).as_posix()
        if raw.get("tokenizer") is not None:
            _inside(path, raw["tokenizer"], "the tokenizer directory")
        warm_codec = build.get("warm_codec")
        if warm_codec is not None and (warm_codec not in CODECS or CODECS[warm_codec].keyframe):
            raise EngineError(f"{cfg_file}: build.warm_codec {short(warm_codec)} is not a codec an engine reads; "
                              f"expected one of {sorted(n for n, c in CODECS.items() if not c.keyframe)} or null")
        versions = raw["ops"]["versions"]
        if not isinstance(versions, dict) or any(v != PLUGIN_VERSION for v in versions.values()):
            raise EngineError(f"{cfg_file}: op versions {short(versions)}; this tieredkv runs version {PLUGIN_VERSION} "
                              "of every op: rebuild the engine")
        tiered, page_size, weights = raw["tiered_kv"], build["page_size"], build["selection_weights"]
        precision, max_pages = build["precision"], build.get("max_attention_pages")
        if precision not in ENGINE_DTYPES:
            raise EngineError(f"{cfg_file}: build.precision {short(precision)}; expected one of {sorted(ENGINE_DTYPES)}")
        if not isinstance(tiered, bool) or isinstance(page_size, bool) or not isinstance(page_size, int) \
                or not isinstance(weights, list) or len(weights) != 3 \
                or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
            raise TypeError(f"tiered_kv {short(tiered)} (expected true or false), build.page_size {short(page_size)} "
                            f"(expected an integer), build.selection_weights {short(weights)} (expected 3 numbers)")
        info = EngineInfo(path=path, model=model, tiered_kv=tiered, page_size=page_size,
                          selection_weights=tuple(float(x) for x in build["selection_weights"]),
                          warm_codec=warm_codec, graph=graph,
                          tensorrt_engine=path / trt if trt else None, raw=raw, kv_dtype=ENGINE_DTYPES[precision],
                          max_attention_pages=int(max_pages) if max_pages is not None else None)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(f"{cfg_file}: incomplete engine config (missing or bad {short(str(exc), 200)})") from None
    if not graph.is_file():
        raise EngineError(f"{path}: the step graph {graph.name} is missing")
    return info


class _Backend(abc.ABC):
    """What the backends share: the model-like face and the step protocol with the cache."""

    name = "engine"

    def __init__(self, engine_dir: str | Path) -> None:
        self.engine = read_engine_dir(engine_dir)
        self.config = self.engine.model
        self.dtype = torch.float32
        self.run_seconds = 0.0
        self.steps = 0

    #: where the tiered cache keeps its device tier for this backend: on the GPU when the backend
    #: runs there, so the pools are bound in place rather than copied to the device every step
    kv_device = "cpu"

    def kv_spec(self) -> KVSpec:
        """The K/V geometry of the engine: its pools are of the engine's precision, so the tiered
        cache keeps them in that dtype and binds them as they are."""
        c = self.config
        return KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, self.engine.kv_dtype, device=self.kv_device)

    def check_graph(self, inputs: dict[str, list], outputs: dict[str, list], pool_type: str | None = None) -> None:
        """The graph is the one config.json describes: the inputs and outputs of an engine with
        its layers, tiered and warm options (``StepFeeds`` / ``StepOutputs``), the dimensions
        its model, page size and codec fix, and (``pool_type``: ONNX Runtime's type string of
        k_pool_0) pools of its precision. EngineError otherwise."""
        from tieredkv.plugins.codec import page_bytes
        from tieredkv.runtime.tiered.engine_io import StepFeeds, StepOutputs

        eng, c = self.engine, self.config
        warm = eng.warm_codec is not None
        for kind, got, want in (("inputs", list(inputs), StepFeeds.names(c.num_layers, tiered_kv=eng.tiered_kv,
                                                                          warm=warm)),
                                ("outputs", list(outputs), StepOutputs.names(c.num_layers, tiered_kv=eng.tiered_kv))):
            if got != want:
                raise EngineError(f"{eng.graph}: its {kind} {short(got)} are not those of the engine {CONFIG_FILE} "
                                  f"describes ({c.num_layers} layers, tiered {eng.tiered_kv}, warm codec "
                                  f"{eng.warm_codec}): expected {short(want)}; rebuild the engine")
        fixed = {"k_pool_0": (1, [c.num_kv_heads, eng.page_size, c.head_dim]), "logits": (2, [c.vocab_size])}
        if eng.tiered_kv:
            fixed["key_min"] = (3, [c.num_kv_heads, c.head_dim])
        if warm:
            fixed["warm_pool_0"] = (1, [page_bytes(CODECS[eng.warm_codec], c.num_kv_heads, eng.page_size,
                                                   c.head_dim) // 4])  # int32 words
        want_type = {torch.float32: "tensor(float)", torch.float16: "tensor(float16)"}[eng.kv_dtype]
        if pool_type is not None and pool_type != want_type:
            raise EngineError(f"{eng.graph}: its pools are {pool_type}; the engine's {CONFIG_FILE} says build.precision "
                              f"{eng.raw['build']['precision']} ({want_type}); rebuild the engine")
        shapes = {**inputs, **outputs}
        for name, (start, want) in fixed.items():
            got = list(shapes[name][start:])
            if got != want:
                raise EngineError(f"{eng.graph}: {name} has dimensions {short(got)} from axis {start}; the engine's "
                                  f"{CONFIG_FILE} (model, page size, codec) says {want}; rebuild the engine")

    def check_cache(self, cache: KVCache) -> None:
        """The cache must be the tiered cache with the engine's page size and selection mix; a
        plain engine (no --tiered-kv) needs a cache without budgets (it cannot select)."""
        from tieredkv.runtime.tiered.cache import TieredKVCache

        if not isinstance(cache, TieredKVCache):
            raise ConfigError(f"the {self.name} backend runs under the tiered KV cache; got {type(cache).__name__} "
                              "(use LLM(..., kv=TieredKVConfig()) — unlimited budgets equal the plain paged cache)")
        cfg, eng = cache.config, self.engine
        if cfg.page_size != eng.page_size:
            raise ConfigError(f"page_size {cfg.page_size} of the KV config does not match the engine's "
                              f"{eng.page_size} ({eng.path}); set page_size = {eng.page_size} or rebuild the engine")
        if cfg.selection.aggregate != "share":
            raise ConfigError(f"selection_aggregate {cfg.selection.aggregate!r} runs in the PyTorch backend only: the "
                              f"engine's ImportanceScore nodes ({eng.path}) rank pages by their largest share over "
                              "the heads; use selection_aggregate = 'share' with an engine")
        if cfg.selection.dense_layers:
            raise ConfigError(f"dense_layers = {cfg.selection.dense_layers} runs in the PyTorch backend only: the "
                              f"engine ({eng.path}) applies one attention budget to every layer; use dense_layers = 0 "
                              "with an engine")
        if eng.tiered_kv and cfg.selection.weights != eng.selection_weights:
            raise ConfigError(f"selection_weights {cfg.selection.weights} do not match the engine's "
                              f"{eng.selection_weights} (baked into its ImportanceScore nodes); rebuild with "
                              "--selection-weights or change the KV config")
        if eng.warm_codec is not None and cfg.warm.codec not in (None, eng.warm_codec):
            raise ConfigError(f"warm_codec {cfg.warm.codec!r} of the KV config does not match the engine's "
                              f"{eng.warm_codec!r} ({eng.path}: its attention reads that codec's bytes); set "
                              f"warm_codec = {eng.warm_codec!r} or rebuild with --warm-codec {cfg.warm.codec}")
        if cfg.warm.ladder is not None:
            raise ConfigError(f"warm_ladder {cfg.warm.ladder!r} runs in the PyTorch backend only: the engine "
                              f"({eng.path}) decodes one warm codec in its graph; use warm_ladder = 'off' with "
                              "an engine")
        if not eng.tiered_kv and (cache.budgets.device_pages is not None or cache.budgets.attention_pages is not None):
            raise ConfigError(f"{eng.path} was built without --tiered-kv (plain paged attention): it cannot select "
                              "pages, so it runs only without device or attention budgets")

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 seq_ids: list[int] | tuple[int, ...], *, last_only: bool = False) -> torch.Tensor:
        """tokens, positions: [B, T] int64 (one row per sequence in ``seq_ids``). Returns logits
        [B, T, vocab] (float32), or [B, 1, vocab] with ``last_only`` — as ``Llama.forward``."""
        from tieredkv.runtime.tiered.engine_io import StepOutputs, finish_step, step_feeds

        self.check_cache(cache)
        step = cache.begin_step(seq_ids, tokens.shape[1])
        feeds = step_feeds(cache, tiered_graph=self.engine.tiered_kv, warm_codec=self.engine.warm_codec,
                           kv_dtype=self.engine.kv_dtype)
        feeds.input_ids, feeds.positions = tokens.long(), positions.long()
        t_start = time.perf_counter()
        outputs = StepOutputs.from_dict(self.run(feeds.as_dict()))
        self.run_seconds += time.perf_counter() - t_start
        self.steps += 1
        finish_step(cache, step, feeds, outputs)
        return outputs.logits[:, -1:] if last_only else outputs.logits

    forward = __call__

    @abc.abstractmethod
    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the step graph on ``feeds`` (every graph input); returns every output (CPU tensors)."""


class OnnxRuntimeBackend(_Backend):
    """The engine's step graph in ONNX Runtime, inputs and outputs bound with IOBinding.

    ``providers``: ONNX Runtime execution providers (default: CUDA when onnxruntime offers it,
    else CPU). ``threads``: intra-op threads (default: torch's)."""

    name = "onnxruntime"

    def __init__(self, engine_dir: str | Path, *, providers: list[str] | None = None,
                 threads: int | None = None) -> None:
        super().__init__(engine_dir)
        try:
            import onnxruntime as ort
        except ImportError:
            raise BackendUnavailableError("the onnxruntime backend needs onnxruntime: pip install 'tieredkv[onnx]'") \
                from None
        available = ort.get_available_providers()
        if providers is None:
            providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        missing = [p for p in providers if p not in available]
        if missing:
            raise BackendUnavailableError(f"ONNX Runtime {ort.__version__} here offers {available}, not {missing}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(self.engine.graph), opts, providers=providers)
        except Exception as exc:  # onnxruntime raises its own Fail / InvalidProtobuf / NoSuchFile types
            raise EngineError(f"{self.engine.graph}: ONNX Runtime cannot load the step graph ({type(exc).__name__}: "
                              f"{short(str(exc), 300)}); rebuild the engine") from None
        self.device = self.kv_device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.check_graph({i.name: i.shape for i in self.session.get_inputs()},
                         {o.name: o.shape for o in self.session.get_outputs()},
                         next(i.type for i in self.session.get_inputs() if i.name == "k_pool_0"))

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = set(self.input_names) - set(feeds)
        if missing:
            raise EngineError(f"{self.engine.graph}: the cache supplied no {sorted(missing)}")
        binding = self.session.io_binding()
        for name in self.input_names:
            t = feeds[name].contiguous()
            if t.dtype == torch.bool or t.device.type == "cpu":
                binding.bind_cpu_input(name, t.cpu().numpy())
            else:  # device tensors are bound in place
                binding.bind_input(name, t.device.type, t.device.index or 0, _NP_DTYPES[t.dtype], list(t.shape),
                                   t.data_ptr())
        for name in self.output_names:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        return {n: torch.from_numpy(v) for n, v in zip(self.output_names, binding.copy_outputs_to_cpu())}


_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
              torch.bool: np.bool_}


class TensorRTBackend(_Backend):
    """The engine's serialized TensorRT engine (``step.plan``, built on a GPU machine by
    ``build_engine.py`` where TensorRT is installed, with the tieredkv plugin library, which it
    loads from ``plugin_library`` or ``$TIEREDKV_TRT_PLUGINS``: never from a path in
    config.json). Importable without TensorRT; constructing it there raises
    BackendUnavailableError."""

    name = "tensorrt"

    def __init__(self, engine_dir: str | Path, *, plugin_library: str | Path | None = None) -> None:
        super().__init__(engine_dir)
        try:
            import tensorrt as trt
        except ImportError:
            raise BackendUnavailableError(
                "the tensorrt backend needs TensorRT (>= 10.7) and a CUDA GPU; TensorRT is not installed here. "
                f"Run {self.engine.path} with --backend onnxruntime, or build its TensorRT engine on a GPU machine "
                "(docs/engine.md, 'Building the TensorRT engine on a GPU machine')") from None
        if not torch.cuda.is_available():
            raise BackendUnavailableError("the tensorrt backend needs a CUDA GPU; torch sees none")
        if self.engine.tensorrt_engine is None or not self.engine.tensorrt_engine.is_file():
            raise EngineError(f"{self.engine.path} holds no TensorRT engine ({TRT_ENGINE}); rebuild it on a machine "
                              "with TensorRT: python builder/build_engine.py --tiered-kv ... --force")
        # only a library the caller names is loaded: a path in config.json is where it was at build time,
        # and loading a library is running its code
        lib = plugin_library or os.environ.get(PLUGINS_ENV)
        if lib:
            trt.get_plugin_registry().load_library(str(lib))
        self._trt = trt
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        self.trt_engine = runtime.deserialize_cuda_engine(self.engine.tensorrt_engine.read_bytes())
        if self.trt_engine is None:
            raise EngineError(f"{self.engine.tensorrt_engine}: TensorRT could not deserialize the engine (built with "
                              "another TensorRT version or GPU?)")
        self.context = self.trt_engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.kv_device = "cuda"
        self._aliasing_checked: set[int] = set()  # profiles whose first step was checked

    def check_cache(self, cache: KVCache) -> None:
        """The common checks, and TensorRT's TopK limit: SelectPages ranks the attention budget
        beyond T0 with one TopK, whose K TensorRT bounds by TOPK_LIMIT."""
        super().check_cache(cache)
        from tieredkv.plugins.onnx_ops import TOPK_LIMIT

        pages = cache.budgets.attention_pages
        limit = min(TOPK_LIMIT, self.engine.max_attention_pages or TOPK_LIMIT)
        if pages is not None and pages > limit:
            raise ConfigError(f"attention budget {pages} pages per sequence-layer is over the {limit} pages this "
                              f"engine's TensorRT TopK selects ({limit * cache.config.page_size} tokens at page size "
                              f"{cache.config.page_size}; TensorRT's limit is {TOPK_LIMIT}, the engine's "
                              f"build.max_attention_pages {self.engine.max_attention_pages}); use a smaller "
                              "attention_budget, rebuild with a larger --max-attention-pages, or the onnxruntime / "
                              "torch backend")

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        trt, eng, ctx = self._trt, self.trt_engine, self.context
        # the builder's profiles: 0 = decode (T = 1), 1 = prefill (T > 1)
        profile = 0 if feeds["input_ids"].shape[1] == 1 else 1
        if ctx.active_optimization_profile != profile:
            ctx.set_optimization_profile_async(profile, self.stream.cuda_stream)
        names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
        inputs = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        keep = {}
        for name in inputs:
            t = feeds[name].contiguous().cuda()
            keep[name] = t
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outputs = {}
        for name in names:
            if name in keep:
                continue
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bool: torch.bool,
                     trt.int64: torch.int64, trt.int32: torch.int32}[eng.get_tensor_dtype(name)]
            outputs[name] = torch.empty(shape, dtype=dtype, device="cuda")
            ctx.set_tensor_address(name, outputs[name].data_ptr())
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise EngineError("TensorRT failed to run the step")
        self.stream.synchronize()
        if profile not in self._aliasing_checked:
            layers = layers_not_appended_in_place(keep, outputs)
            if layers:
                raise EngineError(
                    f"{self.engine.tensorrt_engine}: KVAppend did not write layer(s) {short(layers)} into the bound "
                    "pools in place: TensorRT gave its outputs other buffers, so every step copies every pool. "
                    "Rebuild the engine with TensorRT >= 10.7 (the builder enables "
                    "PreviewFeature.ALIASED_PLUGIN_IO_10_03) and the tieredkv plugin library")
            self._aliasing_checked.add(profile)
        return {n: t.cpu() for n, t in outputs.items()}


def layers_not_appended_in_place(inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> list[int]:
    """The layers whose bound pools (``inputs``: the graph's inputs as bound, ``k_pool_<l>``,
    ``v_pool_<l>``, ``write_slot``, ``write_offset``) do not hold the step's new K/V (``outputs``:
    ``k_new``, ``v_new`` [L, B, KVH, T, D]) at the slots written: KVAppend's outputs alias its
    inputs, so after an engine step the pools themselves hold the new rows (bit for bit)."""
    slot, offset = inputs["write_slot"], inputs["write_offset"].reshape(-1)  # [L, B, T], [B*T]
    bad = []
    for layer in range(slot.shape[0]):
        rows = slot[layer].reshape(-1)
        for kind in ("k", "v"):
            pool = inputs[f"{kind}_pool_{layer}"]
            new = outputs[f"{kind}_new"][layer]  # [B, KVH, T, D]
            want = new.permute(0, 2, 1, 3).reshape(-1, *new.shape[1:2], new.shape[-1])  # [B*T, KVH, D]
            got = pool[rows.to(pool.device), :, offset.to(pool.device)]
            if not torch.equal(got, want.to(got.device)):
                bad.append(layer)
                break
    return bad


BACKENDS = {"onnxruntime": OnnxRuntimeBackend, "tensorrt": TensorRTBackend}


def load_backend(engine_dir: str | Path, backend: str = "auto", **kwargs) -> _Backend:
    """The backend for ``engine_dir``: ``auto`` takes TensorRT when the directory holds a
    TensorRT engine and TensorRT is importable, else ONNX Runtime."""
    if backend == "auto":
        info = read_engine_dir(engine_dir)
        backend = "onnxruntime"
        if info.tensorrt_engine is not None and info.tensorrt_engine.is_file():
            try:
                import tensorrt  # noqa: F401

                backend = "tensorrt"
            except ImportError:
                pass
    if backend not in BACKENDS:
        raise ConfigError(f"unknown engine backend {backend!r}; expected auto or one of {sorted(BACKENDS)}")
    return BACKENDS[backend](engine_dir, **kwargs)


def load_engine(engine_dir: str | Path, backend: str = "auto", **kwargs):
    """An engine directory as a :class:`~tieredkv.models.loading.LoadedModel`: the backend in
    place of the model, and the tokenizer saved beside the graph."""
    from tieredkv.models.loading import LoadedModel
    from tieredkv.models.tokenizer import Tokenizer

    runner = load_backend(engine_dir, backend, **kwargs)
    tok_dir = runner.engine.raw.get("tokenizer")
    tokenizer = Tokenizer.from_hf_dir(_inside(runner.engine.path, tok_dir, "the tokenizer directory")) if tok_dir \
        else None
    return LoadedModel(model=runner, tokenizer=tokenizer, config=runner.config, source=runner.engine.path,
                       format=f"engine ({runner.name})")
