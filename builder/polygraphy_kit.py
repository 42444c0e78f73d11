"""The engine directory's polygraphy kit: step inputs that are valid for the engine, and the
PyTorch reference's outputs for them, in the formats NVIDIA's polygraphy reads.

An engine's step graph has many inputs that must agree with one another (pools, page
tables, masks, residency, budgets, key summaries, the warm pool and its rows): random
tensors of the right shapes are not valid inputs. The builder draws valid ones
(:func:`~tieredkv.builder.export.random_step_inputs`: a decode step and a prefill step,
K/V the model itself computed, shuffled pages, random residency and budgets, the warm pool
when the engine has a codec), runs the PyTorch reference on them, verifies ONNX Runtime
against it with polygraphy's comparator, and writes both into ``ENGINE/polygraphy/``:

* ``inputs.npz`` — every step's feeds (``<step>/<input name>`` arrays);
* ``data_loader.py`` — polygraphy's ``--data-loader-script`` convention: ``load_data()``
  yields the steps' feed dicts (numpy only: it runs where tieredkv is not installed, e.g. on
  a TensorRT machine);
* ``golden.json`` — the reference outputs as polygraphy ``RunResults`` (runner
  ``pytorch-reference``), for ``--load-outputs``.

so that ``polygraphy run ENGINE/step.onnx --onnxrt --data-loader-script
ENGINE/polygraphy/data_loader.py --load-outputs ENGINE/polygraphy/golden.json`` with the
tolerances of :func:`polygraphy_command` compares ONNX Runtime against the reference, and
``--trt --plugins <library>`` does the same for TensorRT (docs/engine.md).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KIT_DIR = "polygraphy"
INPUTS_FILE = "inputs.npz"
GOLDEN_FILE = "golden.json"
LOADER_FILE = "data_loader.py"
TRTEXEC_FILE = "trtexec.sh"
REFERENCE_RUNNER = "pytorch-reference"
#: outputs compared exactly (a page selected by one and not the other is a different step)
EXACT_OUTPUTS = ("page_selected",)

DATA_LOADER = '''"""polygraphy data loader for this tieredkv engine (polygraphy run --data-loader-script).

load_data() yields the feeds of the engine's verification steps, stored beside this file in
inputs.npz by the builder; golden.json holds the PyTorch reference's outputs for them.
Written by tieredkv's builder; numpy is all it needs."""

from pathlib import Path

import numpy as np

INPUTS = Path(__file__).with_name("inputs.npz")


def load_data():
    with np.load(INPUTS) as z:
        steps = {}
        for key in z.files:
            step, name = key.split("/", 1)
            steps.setdefault(int(step), {})[name] = z[key]
    for step in sorted(steps):
        yield steps[step]
'''


def make_steps(model, options, steps) -> list[dict[str, np.ndarray]]:
    """Valid feeds for the graph of ``options`` (a StepGraphOptions): one per (sequence
    lengths, new tokens) of ``steps``, seeded by its index."""
    from tieredkv.builder.export import random_step_inputs

    return [random_step_inputs(model, page_size=options.page_size, seq_lens=list(lens), new_tokens=new, seed=seed,
                               tiered_kv=options.tiered_kv, model_kv=True, warm_codec=options.warm_codec,
                               kv_dtype=options.dtype)
            for seed, (lens, new) in enumerate(steps)]


def reference_results(model, feeds: list[dict[str, np.ndarray]], options):
    """The PyTorch reference's outputs for ``feeds``, as polygraphy RunResults (``model``: the
    reference in the graph's dtype, ``export.model_at``)."""
    from polygraphy.comparator import IterationResult, RunResults

    from tieredkv.builder.export import reference_step

    results = RunResults()
    results.append((REFERENCE_RUNNER, [
        IterationResult(reference_step(model, f, tiered_kv=options.tiered_kv, warm_codec=options.warm_codec,
                                       selection_weights=options.selection_weights), runner_name=REFERENCE_RUNNER)
        for f in feeds]))
    return results


def tolerances(tolerance: float, outputs) -> dict[str, float]:
    """Absolute tolerance per output: ``tolerance`` for the float outputs, 0 for the selection."""
    return {name: 0.0 if name in EXACT_OUTPUTS else float(tolerance) for name in outputs}


@dataclass
class Comparison:
    """ONNX Runtime (or another runner) against the reference: the max abs error per output
    over every step, and a sentence per output over its tolerance."""

    errors: dict[str, float]
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


def compare_onnxruntime(path: Path, feeds: list[dict[str, np.ndarray]], golden, *, tolerance: float,
                        threads: int = 1) -> Comparison:
    """Run the graph at ``path`` in ONNX Runtime (CPU) through polygraphy's runner on
    ``feeds`` and compare every output with ``golden`` (polygraphy's simple comparison, max
    absolute error, per-output tolerances of :func:`tolerances`)."""
    from polygraphy import comparator
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    from tieredkv.builder.export import onnx_session

    # SimpleCompareFunc from polygraphy 0.53 on; CompareFunc.simple (deprecated there) before
    simple = getattr(comparator, "SimpleCompareFunc", None) or comparator.CompareFunc.simple

    with G_LOGGER.verbosity(G_LOGGER.ERROR), np.errstate(all="ignore"):  # relative errors of 0/0
        runner = OnnxrtRunner(lambda: onnx_session(path, threads=threads), name="onnxruntime")
        results = Comparator.run([runner], data_loader=feeds)
        for run in golden:
            results.append(run)
        names = list(golden[0][1][0].keys())
        atol = tolerances(tolerance, names)
        accuracy = Comparator.compare_accuracy(
            results, compare_func=simple(atol=atol, rtol=0.0, check_error_stat="max"))
    errors = {name: 0.0 for name in names}
    failures = []
    # polygraphy >= 0.53 returns one AccuracyResult per comparison function, older versions the one
    per_func = [accuracy] if hasattr(accuracy, "values") else list(accuracy)
    for iterations in (it for result in per_func for it in result.values()):
        for step, per_output in enumerate(iterations):
            for name, result in per_output.items():
                if isinstance(result, bool):  # a shape or dtype mismatch: polygraphy has no error figure
                    if not result:
                        errors[name] = float("inf")
                        failures.append(f"{name}: shapes or types differ in step {step}")
                    continue
                err = float(result.max_absdiff)
                # max() would drop a NaN: a non-finite error is kept as it is
                errors[name] = err if not np.isfinite(err) else max(errors[name], err)
                if not bool(result):
                    failures.append(f"{name} by {err:.3g} in step {step} (tolerance {atol[name]:g})")
    return Comparison(errors, failures)


def write_kit(directory: Path, feeds: list[dict[str, np.ndarray]], golden) -> None:
    """Write ``inputs.npz``, ``data_loader.py`` and ``golden.json`` into ``directory``."""
    from polygraphy.logger import G_LOGGER

    directory.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(directory / INPUTS_FILE, **{f"{i}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
    (directory / LOADER_FILE).write_text(DATA_LOADER)
    with G_LOGGER.verbosity(G_LOGGER.ERROR):
        golden.save(str(directory / GOLDEN_FILE))


def load_kit(engine_dir: Path):
    """(feeds, golden RunResults) of an engine directory's kit."""
    import importlib.util

    from polygraphy.comparator import RunResults

    kit = Path(engine_dir) / KIT_DIR
    spec = importlib.util.spec_from_file_location("tieredkv_engine_data_loader", kit / LOADER_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.load_data()), RunResults.load(str(kit / GOLDEN_FILE))


def _atol_args(tolerance: float, outputs) -> list[str]:
    per_output = [f"{n}:{t:g}" for n, t in tolerances(tolerance, outputs).items() if n in EXACT_OUTPUTS]
    return ["--atol", f"{tolerance:g}", *per_output, "--rtol", "0", "--check-error-stat", "max"]


def polygraphy_command(engine: str, *, tolerance: float, outputs, runner: str = "--onnxrt",
                       plugin_library: str | None = None, graph: str | None = None,
                       profile: int | None = None) -> str:
    """The ``polygraphy run`` command that compares ``runner`` on the engine directory
    ``engine`` against its golden outputs (``--trt`` with ``plugin_library``: TensorRT with
    the tieredkv plugins; ``graph``: another file than the step graph, e.g. a TensorRT plan,
    with the optimization ``profile`` its steps fit)."""
    args = ["polygraphy", "run", graph or f"{engine}/step.onnx", runner]
    if plugin_library:
        args += ["--plugins", plugin_library]
    if profile is not None:
        args += ["--optimization-profile", str(profile)]
    args += ["--data-loader-script", f"{engine}/{KIT_DIR}/{LOADER_FILE}",
             "--load-outputs", f"{engine}/{KIT_DIR}/{GOLDEN_FILE}", *_atol_args(tolerance, outputs)]
    return shlex.join(args)


def trtexec_args(profiles: dict[str, dict[str, list[list[int]]]], *, onnx: str, plugin_library: str,
                 save_engine: str) -> list[str]:
    """The ``trtexec`` arguments that build the step graph into a TensorRT plan: strongly
    typed (``--stronglyTyped``: the graph's own types, as the builder does; a no-op on
    TensorRT 11, where every network is), with the builder's optimization profiles
    (``--profile=i --minShapes/--optShapes/--maxShapes``, one group per profile, in the
    builder's order), the tieredkv plugin library loaded dynamically and serialized into the
    plan, and no inference run (trtexec's random inputs are not valid page tables: check the
    plan with polygraphy and the kit instead)."""
    args = ["trtexec", f"--onnx={onnx}", f"--dynamicPlugins={plugin_library}",
            f"--setPluginsToSerialize={plugin_library}", "--stronglyTyped"]
    for i, shapes in enumerate(profiles.values()):
        args.append(f"--profile={i}")
        for flag, which in (("--minShapes", 0), ("--optShapes", 1), ("--maxShapes", 2)):
            spec = ",".join(f"{name}:{'x'.join(str(d) for d in dims[which])}" for name, dims in shapes.items())
            args.append(f"{flag}={spec}")
    return args + [f"--saveEngine={save_engine}", "--skipInference"]


TRTEXEC_SCRIPT = """#!/usr/bin/env bash
# Build this tieredkv engine's TensorRT plan ({plan}) with trtexec, on a machine with TensorRT
# >= 10.7 and the tieredkv plugin library (docs/engine.md); written by tieredkv's builder.
# usage: ./{script} PLUGIN_LIBRARY [more trtexec flags]
# Then compare the plan against the PyTorch reference (profile {profile} holds every kit step):
#   {check}
set -euo pipefail
PLUGINS="$(realpath "${{1:?usage: {script} PLUGIN_LIBRARY [more trtexec flags]}}")"
shift
cd "$(dirname "$0")"
exec {command} "$@"
"""


def plan_check_command(*, plan: str, tolerance: float, outputs, profiles) -> str:
    """The polygraphy command (run in the engine directory) that compares the TensorRT plan
    ``plan`` with the kit's goldens, in the last profile (*prefill*: T from 1 up, so the decode
    step fits it too)."""
    return polygraphy_command(".", tolerance=tolerance, outputs=outputs, runner="--trt", graph=plan,
                              plugin_library="PLUGIN_LIBRARY", profile=len(profiles) - 1)


def trtexec_script(profiles: dict[str, dict[str, list[list[int]]]], *, onnx: str, plan: str, tolerance: float,
                   outputs) -> str:
    """``trtexec.sh`` of an engine directory: :func:`trtexec_args` with the plugin library
    given as its first argument, and the polygraphy command that checks the plan."""
    args = trtexec_args(profiles, onnx=onnx, plugin_library="$PLUGINS", save_engine=plan)
    command = " ".join(f'"{a}"' if "$PLUGINS" in a else shlex.quote(a) for a in args)
    check = plan_check_command(plan=plan, tolerance=tolerance, outputs=outputs, profiles=profiles)
    return TRTEXEC_SCRIPT.format(plan=plan, script=TRTEXEC_FILE, profile=len(profiles) - 1, check=check,
                                 command=command)
