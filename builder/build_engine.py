"""Build an engine directory from a Llama checkpoint.

    python builder/build_engine.py [--tiered-kv] [--model GGUF_FILE | HF_DIR | NAME] --output ENGINE_DIR
        [--force] [--page-size 16] [--selection-weights 1 0 0] [--precision fp16] [--tolerance T]
        [--external-data] [--max-batch 8 --max-context 8192 --prefill-chunk 512 --max-attention-pages N
        --plugin-library PATH]

``--model`` omitted builds the default model (SmolLM2-135M-Instruct, pulled on first use).
ENGINE_DIR receives ``step.onnx`` (the step graph of `tieredkv.builder.export`, one graph for
decode steps and chunked-prefill steps; with ``--tiered-kv`` it scores and selects pages
and returns their attention mass), the tokenizer (``tokenizer/``) and ``config.json``
(model config, tiered flag, op versions, build options, opset, date). ``--precision``
(fp16 by default) is the dtype of the graph's weights, K/V pools and activations (fp32: the
float32 graph). After export the builder runs the graph in ONNX Runtime on random pools,
pages, masks and budgets — a decode step and a 3-token prefill step — and compares every
output with the PyTorch reference (the model in the graph's dtype); over ``--tolerance`` on
any output (or any differing page selection) the build fails.

TensorRT: where ``tensorrt`` is importable the builder also builds ``step.plan`` — it loads
the plugin library (``--plugin-library``, the tieredkv plugins built from plugins/ with
CMake), checks the three plugin creators are registered (the parser then maps the nodes,
which carry ``plugin_namespace`` / ``plugin_version``, to them instead of inlining their
function bodies; `tensorrt_build.check_plugin_layers` names each node that did not become
its plugin), builds a strongly typed network (the graph's types, no precision flags; on
TensorRT 10 and 11) with KVAppend writing the pools in place, and adds two optimization
profiles from ``--max-batch`` / ``--max-context`` / ``--prefill-chunk`` (decode: T = 1;
prefill: T up to the chunk). Tiered engines check first that SelectPages' TopK stays within
TensorRT's limit (``--max-attention-pages``: 3840 pages at most). Where it is not importable
the build ends after the ONNX engine and says what was built and the command that builds
the TensorRT engine on a GPU machine.

The directory appears atomically: everything is built in a temporary sibling that is
renamed into place at the end; on any failure, Ctrl-C or SIGTERM nothing is left behind (a
build killed outright leaves a ``.<name>.building-<pid>-*`` sibling, removed by the next build
there). ``--force`` replaces an existing engine directory only (recognised by its
``config.json``), never a file, a link or another directory. Exit status: 0 built, 1
verification failed or an unexpected error, 2 bad input (missing checkpoint, existing
ENGINE_DIR without --force or not an engine, unwritable output, unsupported model), 143
SIGTERM. Never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout: import the installed package's modules
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tieredkv.plugins.codec import DEFAULT_CODEC  # noqa: E402
from tieredkv.errors import EngineBuildError, TieredKVError, short  # noqa: E402
from tieredkv.builder.polygraphy_kit import KIT_DIR, TRTEXEC_FILE  # noqa: E402
from tieredkv.builder.tensorrt_build import check_topk_limit, tensorrt_profiles  # noqa: E402
from tieredkv.runtime.engine import (  # noqa: E402
    CONFIG_FILE,
    ENGINE_FORMAT,
    ENGINE_FORMAT_VERSION,
    STEP_GRAPH,
    TRT_ENGINE,
)

EXIT_VERIFY, EXIT_INPUT = 1, 2
TOKENIZER_DIR = "tokenizer"
#: what an engine directory holds (anything else in one is the user's)
ENGINE_FILES = {CONFIG_FILE, STEP_GRAPH, f"{STEP_GRAPH}.data", TRT_ENGINE, TOKENIZER_DIR, KIT_DIR, TRTEXEC_FILE}
#: the random verification batches: (tokens per sequence with the new ones, new tokens), awkward on purpose
VERIFY_STEPS = (((45, 17, 3), 1), ((21, 9), 3))
#: the default verification tolerance per precision (largest |output(ORT) - output(PyTorch)|): the
#: float16 graph is compared with the model in float16 (export.model_at), which rounds at the same
#: points; what is left is float16 rounding of sums taken in another order, which grows with the
#: logits' size and the depth (SmolLM2: logits 0.067, new K/V 0.03 at most; docs/engine.md)
TOLERANCES = {"fp32": 1e-3, "fp16": 0.15}


class VerificationError(TieredKVError):
    """The exported graph fails the ONNX checker, or ONNX Runtime's logits differ from the
    PyTorch reference by more than the tolerance."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="build_engine.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiered-kv", action="store_true",
                    help="tiered graph: ImportanceScore + selection within the attention budget; outputs the "
                         "selection, relevance and attention mass of every page")
    ap.add_argument("--model", default=None,
                    help="a .gguf file, a Hugging Face model directory or a model name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--output", required=True, type=Path, help="the engine directory to create")
    ap.add_argument("--force", action="store_true", help="replace an existing engine directory")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (fixed in the graph; default 16)")
    ap.add_argument("--precision", choices=sorted(TOLERANCES), default="fp16",
                    help="dtype of the graph's weights, K/V pools and activations (default fp16; fp32: the exact "
                         "float32 graph); TensorRT builds the graph strongly typed, as it says")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest allowed |output(ORT) - output(PyTorch)| in the verification (default: "
                         + ", ".join(f"{t:g} at {p}" for p, t in TOLERANCES.items()) + ")")
    ap.add_argument("--external-data", action="store_true",
                    help=f"store the weights in {STEP_GRAPH}.data even below 2 GB (always done above)")
    ap.add_argument("--warm-codec", nargs="?", const=DEFAULT_CODEC, default=None, metavar="CODEC",
                    help="tiered graphs: also take each layer's warm (compressed) pool; TieredAttention reads those "
                         "pages from their encoded bytes (the runtime's --warm-codec: fp8, fp8-r2, int6-r2, int4, "
                         f"int4-g16, int2; bare: {DEFAULT_CODEC})")
    ap.add_argument("--selection-weights", type=float, nargs=3, default=[1.0, 0.0, 0.0],
                    metavar=("REL", "POS", "SAL"),
                    help="ImportanceScore mix that ranks pages for the attention budget (the runtime's "
                         "selection_weights; default 1 0 0)")
    trt = ap.add_argument_group("TensorRT (used only where tensorrt is importable)")
    trt.add_argument("--max-batch", type=int, default=8, help="largest batch of the optimization profiles")
    trt.add_argument("--max-context", type=int, default=8192, help="longest sequence (tokens) of the profiles")
    trt.add_argument("--prefill-chunk", type=int, default=512, help="largest prefill step (tokens) of the profiles")
    trt.add_argument("--max-attention-pages", type=int, default=None,
                     help="tiered engines: the largest attention budget (pages per sequence and layer) the engine "
                          "serves; TensorRT's TopK takes at most 3840 (default: every page of --max-context)")
    trt.add_argument("--plugin-library", type=Path, default=None,
                     help="the tieredkv TensorRT plugin library (libtieredkv_trt_plugins.so, built from "
                          "plugins/csrc with CMake)")
    args = ap.parse_args(argv)
    if args.warm_codec is not None and not args.tiered_kv:
        ap.error("--warm-codec needs --tiered-kv (plain graphs hold no warm tier)")
    if args.page_size <= 0:
        ap.error(f"--page-size must be a positive integer, got {args.page_size}")
    if args.tolerance is None:
        args.tolerance = TOLERANCES[args.precision]
    if not args.tolerance >= 0:
        ap.error(f"--tolerance must be >= 0, got {args.tolerance}")
    if any(not w >= 0 for w in args.selection_weights):
        ap.error(f"--selection-weights must be >= 0, got {args.selection_weights}")
    for name in ("max_batch", "max_context", "prefill_chunk") + (("max_attention_pages",) if args.max_attention_pages
                                                                 is not None else ()):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    return args


def check_output(output: Path, *, force: bool) -> None:
    """An existing ``output`` is replaced only with ``force``, and only when it is an engine
    directory (its ``config.json`` says so): never a file, a link, a directory of anything
    else, or a directory holding the current one."""
    if not (output.exists() or output.is_symlink()):
        return
    if not force:
        raise EngineBuildError(f"{output}: already exists; pass --force to replace it, or choose another --output")
    if output.is_symlink() or not output.is_dir():
        raise EngineBuildError(f"{output}: exists and is not a directory (a file or a link); refusing to replace it")
    if not is_engine_dir(output):
        raise EngineBuildError(f"{output}: exists and is not an engine directory (no tieredkv {CONFIG_FILE}); "
                               "--force replaces engine directories only: choose another --output")
    others = sorted(p.name for p in output.iterdir() if p.name not in ENGINE_FILES)
    if others:
        raise EngineBuildError(f"{output}: an engine directory that also holds {short(others)}; --force would delete "
                               "them: move them out first, or choose another --output")
    cwd = Path.cwd().resolve()
    if output.resolve() == cwd or output.resolve() in cwd.parents:
        raise EngineBuildError(f"{output}: is the current directory or holds it; refusing to replace it")


def is_engine_dir(path: Path) -> bool:
    """Whether ``path`` holds a tieredkv engine's ``config.json`` (any format version)."""
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("format") == ENGINE_FORMAT


def _remove_stale_work_dirs(output: Path) -> None:
    """Clean up after a build killed before it could (its process gone): remove its
    ``.<name>.building-<pid>-*`` sibling; and a ``.<name>.old-<pid>-*`` sibling holding the
    previous engine goes back to ``output`` when a kill between the two renames of _publish left
    ``output`` missing, and is removed otherwise."""
    from tieredkv.lifecycle import pid_alive

    for d in sorted(output.parent.glob(f".{output.name}.*-*-*")):
        kind, _, rest = d.name[len(output.name) + 2:].partition("-")
        pid = rest.split("-", 1)[0]
        if kind not in ("building", "old") or not pid.isdigit() or pid_alive(int(pid)) or d.is_symlink() \
                or not d.is_dir():
            continue
        if kind == "old" and not output.exists() and is_engine_dir(d / output.name):
            os.replace(d / output.name, output)
        shutil.rmtree(d, ignore_errors=True)


def _layers_progress(total: int):
    def wrap(it):
        try:
            from tqdm import tqdm
        except ImportError:
            return it
        return tqdm(it, total=total, desc="      layers", unit="layer", file=sys.stderr)

    return wrap


def verify(model, path: Path, kit: Path, *, options, tolerance: float) -> dict:
    """Draw the verification steps (:data:`VERIFY_STEPS`: a decode step and a prefill step),
    compute the PyTorch reference's outputs, write both as the engine's polygraphy kit into
    ``kit`` and compare ONNX Runtime running the graph at ``path`` against them with
    polygraphy's comparator; returns the max abs error per output; raises VerificationError
    when an output is over its tolerance (``tolerance``; the page selection exactly) or not finite."""
    import torch

    from tieredkv.builder.polygraphy_kit import compare_onnxruntime, make_steps, reference_results, write_kit

    from tieredkv.builder.export import model_at

    feeds = make_steps(model, options, VERIFY_STEPS)
    golden = reference_results(model_at(model, options.dtype), feeds, options)
    write_kit(kit, feeds, golden)
    result = compare_onnxruntime(path, feeds, golden, tolerance=tolerance, threads=torch.get_num_threads())
    if not result.passed:
        raise VerificationError("ONNX Runtime's outputs differ from the PyTorch reference (polygraphy): "
                                + "; ".join(result.failures) + "; the engine was not written")
    return result.errors


def build(args: argparse.Namespace) -> Path:
    """Build the engine directory of ``args``; returns it. Raises TieredKVError on bad input
    or a failed verification, leaving nothing behind."""
    output = args.output.expanduser().absolute()
    check_output(output, force=args.force)
    max_pages = None
    if args.tiered_kv:  # every engine directory carries its TensorRT profiles: they must be buildable
        max_pages = check_topk_limit(max_context=args.max_context, page_size=args.page_size,
                                     max_attention_pages=args.max_attention_pages)
    t_start = time.perf_counter()

    from tieredkv.models.hub import resolve_model

    log(f"[1/6] resolving and loading {args.model or 'the default model'}")
    source = resolve_model(args.model, log=log)

    import onnx
    import torch

    from tieredkv import __version__
    from tieredkv.builder.export import StepGraphOptions, build_step_graph, initializer_bytes, save_step_graph
    from tieredkv.builder.polygraphy_kit import plan_check_command, polygraphy_command, trtexec_script
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.plugins.onnx_ops import (DOMAIN, IMPORTANCE_SCORE, KV_APPEND, OPSET, PLUGIN_NAMESPACE,
                                           PLUGIN_VERSION, TIERED_ATTENTION)
    from tieredkv.runtime.tiered.engine_io import StepFeeds, StepOutputs

    loaded = load_checkpoint(source)
    model, config = loaded.model, loaded.config
    log(f"      {config.name}: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_parameters() / 1e6:.1f}M parameters ({loaded.format})")

    # every failure from here on removes the temporary directory
    created = _make_parents(output.parent)
    _remove_stale_work_dirs(output)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-{os.getpid()}-", dir=output.parent))
    except OSError as exc:
        _remove_dirs(created)
        raise EngineBuildError(f"{output.parent}: cannot create the engine directory there ({exc.strerror})") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the engine private to this user
        try:
            options = StepGraphOptions(tiered_kv=args.tiered_kv, page_size=args.page_size,
                                       selection_weights=tuple(args.selection_weights), warm_codec=args.warm_codec,
                                       precision=args.precision)
        except ValueError as exc:
            raise EngineBuildError(f"build options: {exc}") from None
        log(f"[2/6] building the {'tiered' if options.tiered_kv else 'plain paged'} step graph "
            f"(opset {OPSET}, page size {options.page_size}, {options.precision})")
        graph = build_step_graph(model, options, progress=_layers_progress(config.num_layers))
        weight_bytes = initializer_bytes(graph)
        log(f"[3/6] writing {STEP_GRAPH} ({weight_bytes / 2**20:.0f} MiB of {options.precision} weights) and the "
            "tokenizer")
        external = save_step_graph(graph, tmp / STEP_GRAPH, external_data=True if args.external_data else None)
        del graph
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_hf_dir(tmp / TOKENIZER_DIR)
        log("[4/6] onnx.checker (full check)")
        try:
            onnx.checker.check_model(str(tmp / STEP_GRAPH), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            raise VerificationError(f"{STEP_GRAPH}: the ONNX checker rejects the graph: {exc}") from None
        log("[5/6] verifying in ONNX Runtime against the PyTorch reference: "
            + "; ".join(f"batch {len(lens)} x {t} new token(s), tokens {list(lens)}" for lens, t in VERIFY_STEPS)
            + f" (K/V of random prompts on shuffled pages{', random residency, T0 and budgets' if options.tiered_kv else ''})")
        errors = verify(model, tmp / STEP_GRAPH, tmp / KIT_DIR, options=options, tolerance=args.tolerance)
        log(f"      max |logits error| = {errors['logits']:.3g} (tolerance {args.tolerance:g}); "
            + ", ".join(f"{k} {v:.3g}" for k, v in errors.items() if k != "logits"))
        profiles = tensorrt_profiles(config, page_size=options.page_size, max_batch=args.max_batch,
                                     max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                                     tiered_kv=options.tiered_kv, warm_codec=options.warm_codec)
        plan, trt_note = build_tensorrt_if_available(tmp / STEP_GRAPH, tmp / TRT_ENGINE, args, profiles,
                                                     tiered_kv=options.tiered_kv)
        build_seconds = time.perf_counter() - t_start
        n = config.num_layers
        engine_config = {
            "format": ENGINE_FORMAT,
            "format_version": ENGINE_FORMAT_VERSION,
            "model": config.to_dict(),
            "source": {"path": str(loaded.source), "format": loaded.format},
            "tiered_kv": options.tiered_kv,
            # the TieredKVConfig fields the graph bakes in (the runtime refuses a cache config that differs);
            # every other tier setting (budgets, policy, mode, thresholds, warm fraction) is the runtime's choice
            "tier_config": {"page_size": options.page_size, "selection_weights": list(options.selection_weights),
                            "warm_codec": options.warm_codec},
            "tokenizer": TOKENIZER_DIR if loaded.tokenizer is not None else None,
            "graphs": {"step": {"file": STEP_GRAPH, "steps": ["decode", "prefill"],
                                "inputs": StepFeeds.names(n, tiered_kv=options.tiered_kv,
                                                          warm=options.warm_codec is not None),
                                "outputs": StepOutputs.names(n, tiered_kv=options.tiered_kv)}},
            "ops": {"domain": DOMAIN, "plugin_namespace": PLUGIN_NAMESPACE,
                    "versions": {op: PLUGIN_VERSION for op in (TIERED_ATTENTION, KV_APPEND, IMPORTANCE_SCORE)
                                 if options.tiered_kv or op != IMPORTANCE_SCORE}},
            "opset": OPSET,
            "build": {"page_size": options.page_size, "selection_weights": list(options.selection_weights),
                      "warm_codec": options.warm_codec,
                      "precision": options.precision, "dtype": str(options.dtype).removeprefix("torch."),
                      "max_attention_pages": max_pages, "external_data": external, "tolerance": args.tolerance,
                      "verification_max_abs_error": errors, "tensorrt_engine": TRT_ENGINE if plan else None,
                      "tensorrt": trt_note, "plugin_library": str(args.plugin_library) if args.plugin_library else None,
                      "profiles": profiles,
                      "seconds": round(build_seconds, 2), "tieredkv_version": __version__,
                      "onnx_version": onnx.__version__, "torch_version": torch.__version__},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        outputs = StepOutputs.names(n, tiered_kv=options.tiered_kv)
        engine_config["debug"] = {  # run from inside the engine directory (docs/engine.md)
            "polygraphy_onnxrt": polygraphy_command(".", tolerance=args.tolerance, outputs=outputs),
            "polygraphy_trt": plan_check_command(plan=TRT_ENGINE, tolerance=args.tolerance, outputs=outputs,
                                                 profiles=profiles),
            "trtexec": f"./{TRTEXEC_FILE} PLUGIN_LIBRARY",
        }
        script = tmp / TRTEXEC_FILE
        script.write_text(trtexec_script(profiles, onnx=STEP_GRAPH, plan=TRT_ENGINE, tolerance=args.tolerance,
                                         outputs=outputs))
        script.chmod(0o777 & ~umask)
        (tmp / CONFIG_FILE).write_text(json.dumps(engine_config, indent=2) + "\n")
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise
    size = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    log(f"built {output} ({size / 2**20:.0f} MiB, {time.perf_counter() - t_start:.1f} s): "
        + ", ".join(sorted(p.name for p in output.iterdir())))
    log(trt_note)
    return output


def rebuild_command(args: argparse.Namespace) -> str:
    """The command that builds this engine on a GPU machine: every option of this build (the
    checkpoint and output as placeholders when they are paths of this machine), with the
    plugin library where CMake puts it."""
    defaults = parse_args(["--output", "x"])
    parts = ["python builder/build_engine.py"]
    if args.tiered_kv:
        parts.append("--tiered-kv")
    if args.warm_codec:
        parts.append(f"--warm-codec {args.warm_codec}")
    parts.append(f"--model {args.model if args.model and not Path(args.model).exists() else '<checkpoint>'}")
    parts.append("--output <ENGINE_DIR> --force")
    for flag in ("page_size", "precision", "tolerance", "max_batch", "max_context", "prefill_chunk",
                 "max_attention_pages"):
        if getattr(args, flag) is not None:
            parts.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}")
    if list(args.selection_weights) != list(defaults.selection_weights):
        parts.append("--selection-weights " + " ".join(f"{w:g}" for w in args.selection_weights))
    if args.external_data:
        parts.append("--external-data")
    parts.append(f"--plugin-library {args.plugin_library or 'build/plugins/libtieredkv_trt_plugins.so'}")
    return " ".join(parts)


def build_tensorrt_if_available(onnx_path: Path, plan_path: Path, args: argparse.Namespace, profiles: dict, *,
                                tiered_kv: bool) -> tuple[bool, str]:
    """Build ``plan_path`` from ``onnx_path`` where TensorRT is importable (a strongly typed
    network, `tensorrt_build.build_tensorrt`). Returns (built, a sentence saying what happened)."""
    from tieredkv.builder.tensorrt_build import TRT_MIN_VERSION, build_tensorrt

    rebuild = rebuild_command(args)
    try:
        import tensorrt as trt
    except ImportError:
        return False, (f"[6/6] TensorRT is not installed here, so no TensorRT engine was built: the engine holds the "
                       f"ONNX step graph ({STEP_GRAPH}), which ONNX Runtime runs (tieredkv generate --engine DIR). "
                       f"On a GPU machine with TensorRT >= {TRT_MIN_VERSION}, build the plugin library (cmake -S plugins/csrc -B "
                       f"build/plugins -DTRT_INCLUDE_DIR=... && cmake --build build/plugins) and run: {rebuild}")
    log(f"[6/6] building the TensorRT {trt.__version__} engine ({args.precision} graph, strongly typed)")
    try:
        size = build_tensorrt(trt, onnx_path, plan_path, profiles=profiles, plugin_library=args.plugin_library,
                              tiered_kv=tiered_kv, log=log)
    except RuntimeError as exc:
        raise VerificationError(str(exc)) from None
    return True, f"      TensorRT engine {TRT_ENGINE} built ({size / 2**20:.0f} MiB)"


def _make_parents(parent: Path) -> list[Path]:
    """Create ``parent`` and missing ancestors; returns those created, deepest first."""
    missing = []
    p = parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_dirs(missing)
        raise EngineBuildError(f"{parent}: cannot create the output directory ({exc.strerror})") from None
    return missing


def _remove_dirs(dirs: list[Path]) -> None:
    for d in dirs:  # deepest first; only if still empty
        try:
            d.rmdir()
        except OSError:
            break


def _publish(tmp: Path, output: Path) -> None:
    """Rename ``tmp`` to ``output``, replacing an existing engine directory (checked by
    check_output): the old one is moved aside, the new one moved in, then the old one removed;
    signals wait while the two renames run, so an interruption never leaves ``output`` missing
    (a SIGKILL between them is repaired by the next build, see _remove_stale_work_dirs)."""
    from tieredkv.lifecycle import signals_deferred

    if not output.exists():
        os.replace(tmp, output)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-{os.getpid()}-", dir=output.parent))
    try:
        with signals_deferred():
            os.replace(output, old / output.name)
            try:
                os.replace(tmp, output)
            except OSError:
                os.replace(old / output.name, output)
                raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    from tieredkv.lifecycle import received_exit, signals_exit, terminated

    args = parse_args(argv)
    try:
        with signals_exit():
            build(args)
    except SystemExit as exc:
        if not terminated(exc):
            raise
        log("terminated; nothing was written")
        return exc.code
    except VerificationError as exc:
        log(f"error: {exc}")
        return EXIT_VERIFY
    except TieredKVError as exc:
        log(f"error: {exc}")
        return EXIT_INPUT
    except KeyboardInterrupt:
        log("interrupted; nothing was written")
        return 130
    except Exception as exc:  # never a traceback; the temporary directory is already gone
        if (code := received_exit()) is not None:  # the signal landed inside an import's C code
            log("terminated; nothing was written")
            return code
        log(f"error: the build failed unexpectedly ({type(exc).__name__}: {exc}); nothing was written")
        return EXIT_VERIFY
    return 0


if __name__ == "__main__":
    sys.exit(main())
