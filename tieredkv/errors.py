"""Typed errors of tieredkv.

Every error names what is wrong (the file, field or value) and what was expected, so a
user can fix the input without reading a traceback. All derive from `TieredKVError`;
the CLI prints `error: <message>` and exits with status 2 for these, never a traceback.
"""

from __future__ import annotations

import reprlib
from typing import Any


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` bounded in size, for error messages about user input: never the whole of
    a huge or self-referencing value (a YAML alias bomb expands to gigabytes when printed)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 6
    r.maxlevel = 3
    return r.repr(value)[: limit + 20]


class TieredKVError(Exception):
    """Base class of every error tieredkv raises on purpose."""


class CheckpointError(TieredKVError):
    """A checkpoint (GGUF file or Hugging Face directory) cannot be used."""


class CheckpointNotFoundError(CheckpointError):
    """The checkpoint path does not exist or lacks a required file."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint exists but is truncated, malformed or fails its checksum."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable but describes something tieredkv does not run
    (another architecture, a tensor type that cannot be dequantized, ...)."""


class UnknownModelError(TieredKVError):
    """A model name is neither a known name nor an existing path."""


class ConfigError(TieredKVError):
    """A configuration value is out of range or inconsistent."""


class PromptError(TieredKVError):
    """A prompt cannot be used: not text or token ids, text that is not valid Unicode (a lone
    surrogate), a token id outside the vocabulary."""


class ContextLengthError(TieredKVError):
    """A prompt (plus the tokens to generate) does not fit the model context."""


class DownloadError(TieredKVError):
    """Fetching the default model or evaluation text from PyPI failed."""


class KVCacheFullError(TieredKVError):
    """A KV cache with a fixed capacity has no free page for a sequence that must grow."""


class DataFileError(TieredKVError):
    """An input data file (evaluation text, haystack, config file) is missing or unreadable."""


class EngineBuildError(TieredKVError):
    """An engine cannot be built as asked: bad build options, an output that exists (without
    --force) or cannot be written, a missing plugin library or plugin creator."""


class TopKLimitError(EngineBuildError):
    """A tiered engine would ask TensorRT's TopK for more than its largest K (3840): the
    attention budget it is built for (``--max-attention-pages``, by default every page of
    ``--max-context``) is over the limit."""


class KernelLibraryError(TieredKVError):
    """libtieredkv_kernels.so (the CUDA kernels' C ABI, bound by tieredkv.plugins.cuda_ops) is
    missing, cannot be loaded, or does not match the binding."""
