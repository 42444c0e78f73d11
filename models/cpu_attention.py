"""Decode attention straight from a paged pool on the CPU: a C++ op built on first use.

The paged cache's torch path gathers every page of every sequence into a contiguous
[B, KVH, S, D] batch and then attends over the copy: per layer the pages are read, written and
read again. ``models/csrc/paged_attention.cpp`` reads each allowed key and value row once from
the pool, by page table, in torch's thread pool (one task per sequence and kv head). It is built
with ``torch.utils.cpp_extension`` (a C++ compiler and ninja, about 30 s the first time on a
machine; the build is kept in torch's extension cache, one per CPU feature set since it is
compiled for the CPU it runs on) by :func:`prepare` when a float32 model is loaded on the CPU,
else the first time a decode step needs it.

:func:`decode_attention_op` returns the op, or ``None`` — then callers take the torch path —
when it is switched off (``TIEREDKV_CPU_ATTENTION=torch`` or :func:`set_cpu_attention`) or
cannot be built here (the reason is warned once and kept in :func:`cpu_attention_status`).
The two paths agree to float32 rounding (tests/models/test_cpu_attention.py), not bit for bit.

The same extension carries the tier manager's step accounting and page moves
(``models/csrc/tier_step.cpp``, ``models/csrc/tier_moves.cpp``: :func:`tier_step_ops`, switched by
``TIEREDKV_CPU_MANAGER`` / :func:`set_cpu_manager`): a step's record folded into its access record
and the page table's statistics in one pass each, the victims and wanted pages ranked, evictions
and admissions made — equal to the manager's torch code (tests/runtime/tiered/test_tier_step_op.py,
tests/runtime/tiered/test_tier_moves_op.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import warnings
from pathlib import Path

import torch

from tieredkv.errors import ConfigError

CSRC = Path(__file__).resolve().parent / "csrc"
#: one extension: the attention ops, the tier manager's step accounting and page moves, the
#: linear layers' few-row path (``models.cpu_linear``) and the warm tier's page encoder
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "tier_step.cpp", CSRC / "tier_moves.cpp", CSRC / "tier_close.cpp",
           CSRC / "small_linear.cpp", CSRC / "kv_codec.cpp")
BACKENDS = ("paged", "torch")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-lmvec", "-fopenmp"]  # glibc's vector math (the softmax's exponentials); OpenMP: torch's own runtime
_STATE: dict = {"backend": "paged", "manager": "native", "built": False, "tried": False, "error": None}
MANAGER_BACKENDS = ("native", "torch")


def set_cpu_attention(backend: str) -> None:
    """``"paged"`` (the default: the C++ op) or ``"torch"`` (gather, then attend)."""
    if backend not in BACKENDS:
        raise ConfigError(f"cpu attention backend (set_cpu_attention or TIEREDKV_CPU_ATTENTION) must be one of "
                          f"{BACKENDS}, got {backend!r}")
    _STATE["backend"] = backend


set_cpu_attention(os.environ.get("TIEREDKV_CPU_ATTENTION", "paged"))


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: the build is compiled for them."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags + " ".join(FLAGS + LDFLAGS)).encode()).hexdigest()[:10]


def _build() -> bool:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the `ninja` wheel's binary, outside an activated venv
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

    load(name=f"tieredkv_cpu_attention_{_cpu_tag()}", sources=[str(f) for f in SOURCES], extra_cflags=FLAGS,
         extra_ldflags=LDFLAGS, is_python_module=False, verbose=False)
    return True


def _native() -> bool:
    """Whether the extension is built (building it the first time; a failure is warned once)."""
    if not _STATE["tried"]:
        _STATE["tried"] = True
        try:
            _STATE["built"] = _build()
        except Exception as exc:  # no compiler / ninja, a failed build: the torch paths stay
            _STATE["error"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"tieredkv: the CPU ops could not be built ({_STATE['error'][:300]}); decode attends "
                          "through torch's gather + matmul and the tier manager accounts through torch ops instead",
                          RuntimeWarning, stacklevel=3)
    return _STATE["built"]


def decode_attention_op():
    """The built op, or ``None`` (switched off, or it cannot be built here)."""
    if _STATE["backend"] != "paged" or not _native():
        return None
    return torch.ops.tieredkv_cpu.paged_decode_attention


def set_cpu_manager(backend: str) -> None:
    """How the tier manager does its per-step work on the CPU (the step's folds, the ranking of
    victims and wanted pages, evictions and admissions): ``"native"`` (the default: the ops of
    ``models/csrc/tier_step.cpp`` and ``tier_moves.cpp``) or ``"torch"`` (its torch code, the reference)."""
    if backend not in MANAGER_BACKENDS:
        raise ConfigError(f"cpu manager backend (set_cpu_manager or TIEREDKV_CPU_MANAGER) must be one of "
                          f"{MANAGER_BACKENDS}, got {backend!r}")
    _STATE["manager"] = backend


set_cpu_manager(os.environ.get("TIEREDKV_CPU_MANAGER", "native"))


def tier_step_ops():
    """The tier manager's ops (``fold_record``, ``fold_end``, ``wanted_pages``, ``pick_pages``,
    ``lfu_priority``, ``mask_pairs``, ``evict_pages``, ``admit_pages``, ``close_decode_step``:
    ``torch.ops.tieredkv_cpu``), or ``None`` when
    switched off or not built — then the manager runs its torch code."""
    if _STATE["manager"] != "native" or not _native():
        return None
    return torch.ops.tieredkv_cpu


def tiered_attention_op():
    """The tiered cache's variant of the op (pages from the pool, the warm pool read encoded, and
    pages read from the host; per-page attention mass out), or ``None`` as
    :func:`decode_attention_op`."""
    return None if decode_attention_op() is None else torch.ops.tieredkv_cpu.tiered_decode_attention


def layer_op():
    """One decode layer of the tiered cache in one call — the relevance, the selection, the tiered
    op and the layer's record written in place (``models/csrc/paged_attention.cpp``,
    ``tiered_decode_layer``; the same results as the three ops called apart) — or ``None`` as
    :func:`decode_attention_op`."""
    return None if decode_attention_op() is None else torch.ops.tieredkv_cpu.tiered_decode_layer


def relevance_op():
    """ImportanceScore's relevance by share over a layer's page summaries read by record (the
    selection's ranking with the default weights), or ``None`` as :func:`decode_attention_op`."""
    return None if decode_attention_op() is None else torch.ops.tieredkv_cpu.page_relevance


def encode_op():
    """The warm tier's encoder for the integer codecs the decode op reads (plugins.codec's
    ``encode_pages``, the same bytes), or ``None`` as :func:`decode_attention_op`."""
    return None if decode_attention_op() is None else torch.ops.tieredkv_cpu.encode_int_pages


def select_op():
    """SelectPages over [N, M] rows in float32 (the reference's result, bit for bit), or ``None`` as
    :func:`decode_attention_op`."""
    return None if decode_attention_op() is None else torch.ops.tieredkv_cpu.select_pages


def small_linear_op():
    """The linear layers' few-row product (``small_linear``: x [1-4, K] against row-major weights,
    outputs side by side), or ``None`` when the extension is not built here. Switched with the linear
    layers' backend (``models.cpu_linear``), not this module's."""
    return torch.ops.tieredkv_cpu.small_linear if _native() else None


def panel_linear_op():
    """The linear layers' product for more rows from panel-packed weights (``panel_linear``: x [M, K]
    against [ceil(N / 16), K, 16]), or ``None`` when the extension is not built here or was built
    without AVX-512. Switched with the linear layers' backend, as :func:`small_linear_op`."""
    return torch.ops.tieredkv_cpu.panel_linear if _native() and torch.ops.tieredkv_cpu.panel_linear_native() else None


def prepare(device: torch.device | str, dtype: torch.dtype, log=None) -> None:
    """Build (or load) the op before the first decode step where a model will use it (float32
    on the CPU), so the build's time is not a decode step's; says so through ``log`` when that
    took a while (the first time on a machine: a compile)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or _STATE["tried"]:
        return
    start = time.perf_counter()
    built = decode_attention_op() is not None
    if log is not None and time.perf_counter() - start > 2:
        log(f"CPU decode-attention op {'built' if built else 'not built'} in {time.perf_counter() - start:.1f}s "
            "(once per machine; TIEREDKV_CPU_ATTENTION=torch skips it)")


def cpu_attention_status() -> dict:
    """What decode attention runs on the CPU: the backend chosen, whether the op is built, the
    build error if any."""
    return {"backend": _STATE["backend"], "manager": _STATE["manager"], "built": _STATE["built"],
            "error": _STATE["error"]}
