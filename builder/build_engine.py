"""Build an engine directory from a Llama checkpoint.

    python builder/build_engine.py [--tiered-kv] [--model GGUF_FILE | HF_DIR | NAME] --output ENGINE_DIR
                                   [--force] [--page-size 16] [--tolerance 1e-3] [--external-data]

``--model`` omitted builds the default model (SmolLM2-135M-Instruct, pulled on first use).
ENGINE_DIR receives ``decode.onnx`` (the decode-step graph of `builder.export`; with
``--tiered-kv`` it also returns the per-layer page attention mass) and ``config.json``
(model config, tiered flag, op versions, build options, opset, date). After export the
builder runs the graph in ONNX Runtime on random pools, pages and masks and compares it
with the PyTorch reference model; over ``--tolerance`` on the logits the build fails.

The directory appears atomically: everything is built in a temporary sibling that is
renamed into place at the end; on any failure nothing is left behind. Exit status: 0 built,
1 verification failed or an unexpected error, 2 bad input (missing checkpoint, existing
ENGINE_DIR without --force, unwritable output, unsupported model). Never a traceback.

TensorRT: where ``tensorrt`` is not importable the build ends after the ONNX engine and
says so; the TensorRT engine is built on a GPU machine.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `builder` as a package when run as a script

from tieredkv.errors import TieredKVError  # noqa: E402

EXIT_VERIFY, EXIT_INPUT = 1, 2
DECODE_GRAPH = "decode.onnx"
ENGINE_FORMAT = "tieredkv-engine"
ENGINE_FORMAT_VERSION = 1
#: the random verification batch: tokens per sequence (new one included), awkward on purpose
VERIFY_SEQ_LENS = (45, 17, 3)


class VerificationError(TieredKVError):
    """The exported graph fails the ONNX checker, or ONNX Runtime's logits differ from the
    PyTorch reference by more than the tolerance."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="build_engine.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiered-kv", action="store_true",
                    help="tiered graph: page_mask is residency and selection, outputs the page attention mass")
    ap.add_argument("--model", default=None,
                    help="a .gguf file, a Hugging Face model directory or a model name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--output", required=True, type=Path, help="the engine directory to create")
    ap.add_argument("--force", action="store_true", help="replace an existing engine directory")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (fixed in the graph; default 16)")
    ap.add_argument("--tolerance", type=float, default=1e-3,
                    help="largest allowed |logits(ORT) - logits(PyTorch)| in the verification (default 1e-3)")
    ap.add_argument("--external-data", action="store_true",
                    help="store the weights in decode.onnx.data even below 2 GB (always done above)")
    args = ap.parse_args(argv)
    if args.page_size <= 0:
        ap.error(f"--page-size must be a positive integer, got {args.page_size}")
    if not args.tolerance >= 0:
        ap.error(f"--tolerance must be >= 0, got {args.tolerance}")
    return args


def check_output(output: Path, *, force: bool) -> None:
    if output.exists() or output.is_symlink():
        if not force:
            raise TieredKVError(f"{output}: already exists; pass --force to replace it, or choose another --output")
        if not output.is_dir():
            raise TieredKVError(f"{output}: exists and is not a directory; refusing to replace it")


def _layers_progress(total: int):
    def wrap(it):
        try:
            from tqdm import tqdm
        except ImportError:
            return it
        return tqdm(it, total=total, desc="      layers", unit="layer", file=sys.stderr)

    return wrap


def verify(model, path: Path, *, tiered_kv: bool, page_size: int, tolerance: float) -> dict:
    """Run the graph at ``path`` in ONNX Runtime and the reference model on the same random
    inputs; returns the max abs errors; raises VerificationError over ``tolerance``."""
    import numpy as np
    import torch

    from builder.export import random_decode_inputs, reference_decode_step, run_onnx

    feeds = random_decode_inputs(model, page_size=page_size, seq_lens=list(VERIFY_SEQ_LENS), tiered_kv=tiered_kv,
                                 seed=0, model_kv=True)
    got = run_onnx(path, feeds, threads=torch.get_num_threads())
    want = reference_decode_step(model, feeds, tiered_kv=tiered_kv)
    errors = {"logits": float(np.abs(got["logits"] - want["logits"]).max())}
    pools = [k for k in want if k.startswith(("k_pool_out", "v_pool_out"))]
    errors["pools"] = max(float(np.abs(got[k] - want[k]).max()) for k in pools)
    if tiered_kv:
        mass = [k for k in want if k.startswith("page_mass")]
        errors["page_mass"] = max(float(np.abs(got[k] - want[k]).max()) for k in mass)
    if not np.isfinite(errors["logits"]) or errors["logits"] > tolerance:
        raise VerificationError(
            f"ONNX Runtime logits differ from the PyTorch reference by {errors['logits']:.3g} "
            f"(tolerance {tolerance:g}); the engine was not written")
    return errors


def build(args: argparse.Namespace) -> Path:
    """Build the engine directory of ``args``; returns it. Raises TieredKVError on bad input
    or a failed verification, leaving nothing behind."""
    output = args.output.expanduser().absolute()
    check_output(output, force=args.force)
    t_start = time.perf_counter()

    from tieredkv.models.hub import resolve_model

    log(f"[1/5] resolving and loading {args.model or 'the default model'}")
    source = resolve_model(args.model, log=log)

    import onnx
    import torch

    from builder.export import DecodeGraphOptions, build_decode_graph, decode_input_names, decode_output_names
    from builder.export import initializer_bytes, save_decode_graph
    from tieredkv import __version__
    from tieredkv.models.loading import load_checkpoint
    from tieredkv.plugins.onnx_ops import (DOMAIN, KV_APPEND, OPSET, PLUGIN_NAMESPACE, PLUGIN_VERSION,
                                           TIERED_ATTENTION)

    loaded = load_checkpoint(source)
    model, config = loaded.model, loaded.config
    log(f"      {config.name}: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_parameters() / 1e6:.1f}M parameters ({loaded.format})")

    # every failure from here on removes the temporary directory
    created = _make_parents(output.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=output.parent))
    except OSError as exc:
        _remove_dirs(created)
        raise TieredKVError(f"{output.parent}: cannot create the engine directory there ({exc.strerror})") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the engine private to this user
        options = DecodeGraphOptions(tiered_kv=args.tiered_kv, page_size=args.page_size)
        log(f"[2/5] building the {'tiered' if options.tiered_kv else 'plain paged'} decode graph "
            f"(opset {OPSET}, page size {options.page_size})")
        graph = build_decode_graph(model, options, progress=_layers_progress(config.num_layers))
        weight_bytes = initializer_bytes(graph)
        log(f"[3/5] writing {DECODE_GRAPH} ({weight_bytes / 2**20:.0f} MiB of float32 weights)")
        external = save_decode_graph(graph, tmp / DECODE_GRAPH, external_data=True if args.external_data else None)
        del graph
        log("[4/5] onnx.checker (full check)")
        try:
            onnx.checker.check_model(str(tmp / DECODE_GRAPH), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            raise VerificationError(f"{DECODE_GRAPH}: the ONNX checker rejects the graph: {exc}") from None
        log(f"[5/5] verifying in ONNX Runtime against the PyTorch reference (batch {len(VERIFY_SEQ_LENS)}, "
            f"tokens {list(VERIFY_SEQ_LENS)}: K/V of random prompts on shuffled pages, "
            f"{'random page masks' if options.tiered_kv else 'every page attended'})")
        errors = verify(model, tmp / DECODE_GRAPH, tiered_kv=options.tiered_kv, page_size=options.page_size,
                        tolerance=args.tolerance)
        log(f"      max |logits error| = {errors['logits']:.3g} (tolerance {args.tolerance:g}); "
            f"pools {errors['pools']:.3g}" + (f", page mass {errors['page_mass']:.3g}" if "page_mass" in errors else ""))
        build_seconds = time.perf_counter() - t_start
        engine_config = {
            "format": ENGINE_FORMAT,
            "format_version": ENGINE_FORMAT_VERSION,
            "model": config.to_dict(),
            "source": {"path": str(loaded.source), "format": loaded.format},
            "tiered_kv": options.tiered_kv,
            "graphs": {"decode": {"file": DECODE_GRAPH, "inputs": decode_input_names(config.num_layers),
                                  "outputs": decode_output_names(config.num_layers, tiered_kv=options.tiered_kv)}},
            "ops": {"domain": DOMAIN, "plugin_namespace": PLUGIN_NAMESPACE,
                    "versions": {TIERED_ATTENTION: PLUGIN_VERSION, KV_APPEND: PLUGIN_VERSION}},
            "opset": OPSET,
            "build": {"page_size": options.page_size, "dtype": "float32", "external_data": external,
                      "tolerance": args.tolerance, "verification_max_abs_error": errors,
                      "tensorrt_engine": None, "seconds": round(build_seconds, 2),
                      "tieredkv_version": __version__, "onnx_version": onnx.__version__,
                      "torch_version": torch.__version__},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        (tmp / "config.json").write_text(json.dumps(engine_config, indent=2) + "\n")
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise
    size = sum(f.stat().st_size for f in output.iterdir())
    log(f"built {output} ({size / 2**20:.0f} MiB, {time.perf_counter() - t_start:.1f} s): {DECODE_GRAPH} + config.json")
    return output


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
        raise TieredKVError(f"{parent}: cannot create the output directory ({exc.strerror})") from None
    return missing


def _remove_dirs(dirs: list[Path]) -> None:
    for d in dirs:  # deepest first; only if still empty
        try:
            d.rmdir()
        except OSError:
            break


def _publish(tmp: Path, output: Path) -> None:
    """Rename ``tmp`` to ``output``, replacing an existing directory (checked by check_output)."""
    if not output.exists():
        os.replace(tmp, output)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    os.replace(output, old / output.name)
    try:
        os.replace(tmp, output)
    except OSError:
        os.replace(old / output.name, output)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def tensorrt_message(output: Path) -> str:
    try:
        import tensorrt
    except ImportError:
        return (f"TensorRT is not installed here, so no TensorRT engine was built: {output} holds the ONNX engine "
                f"({DECODE_GRAPH}, which ONNX Runtime runs). The TensorRT engine is built on a GPU machine with "
                "TensorRT installed.")
    return (f"TensorRT {tensorrt.__version__} is installed, but building the TensorRT engine is not implemented yet: "
            f"{output} holds the ONNX engine ({DECODE_GRAPH}, which ONNX Runtime runs).")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        output = build(args)
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
        log(f"error: the build failed unexpectedly ({type(exc).__name__}: {exc}); nothing was written")
        return EXIT_VERIFY
    log(tensorrt_message(output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
