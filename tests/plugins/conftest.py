"""Fixtures of the op tests: the CUDA kernels library for the ``cuda`` implementation."""

from __future__ import annotations

import shutil

import pytest
import torch

from tieredkv.errors import KernelLibraryError
from tieredkv.plugins import cuda_ops


@pytest.fixture(scope="session")
def kernels(tmp_path_factory):
    """libtieredkv_kernels.so: ``$TIEREDKV_KERNELS`` or the default build path, else built here
    with CMake when nvcc is on PATH; skips without a CUDA device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        return cuda_ops.load_library()
    except KernelLibraryError as exc:
        if not (shutil.which("nvcc") and shutil.which("cmake")):
            pytest.fail(f"a CUDA GPU but no kernels library: {exc}")
        from csrc_build import load_kernels

        return load_kernels(tmp_path_factory)
