"""Shared by the tests of plugins/csrc (tests/plugins: test_cuda_build.py, test_codec.py,
test_cuda_ops.py): one CMake build of the CUDA libraries per test session, and
libtieredkv_kernels.so of that build loaded through ``tieredkv.plugins.cuda_ops`` (its ctypes
binding). Building needs nvcc and cmake, no GPU (a few minutes on two cores: the TieredAttention
split kernels are 24 instantiations); the TensorRT plugin library and its harness
(libtieredkv_trt_harness.so, tests/plugins/test_trt_plugins.py) are built too when
``TRT_INCLUDE_DIR`` names a directory holding NvInfer.h. A build with a compiler warning fails."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tieredkv.plugins import cuda_ops

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "plugins" / "csrc"

#: skip marker for modules that need the CUDA toolchain
needs_nvcc = pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("cmake")),
                                reason="needs nvcc and cmake on PATH")

_builds: dict[str, Path] = {}


def trt_include() -> Path | None:
    value = os.environ.get("TRT_INCLUDE_DIR")
    if value and (Path(value) / "NvInfer.h").is_file():
        return Path(value)
    return None


def run(cmd: list[str], timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def build_plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Configure and build plugins/csrc (once per session and TRT_INCLUDE_DIR); the build dir."""
    key = str(trt_include())
    if key in _builds:
        return _builds[key]
    build = tmp_path_factory.mktemp("plugins_build")
    cmd = ["cmake", "-S", str(SOURCE), "-B", str(build)]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    if trt_include() is not None:
        cmd.append(f"-DTRT_INCLUDE_DIR={trt_include()}")
    configure = run(cmd)
    if trt_include() is None:
        assert "skipping tieredkv_trt_plugins" in configure.stdout
    built = run(["cmake", "--build", str(build), "-j2"], timeout=1800)
    # the kernels and plugins compile without a warning (nvcc, ptxas and the host compiler)
    assert "warning" not in (built.stdout + built.stderr).lower(), built.stdout + built.stderr
    _builds[key] = build
    return build


def load_kernels(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """libtieredkv_kernels.so of the session build, loaded by ``cuda_ops.load_library`` (no GPU needed)."""
    return cuda_ops.load_library(build_plugins(tmp_path_factory) / "libtieredkv_kernels.so")
