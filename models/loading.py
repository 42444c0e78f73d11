"""Checkpoint loaders: GGUF (via the `gguf` package) and Hugging Face safetensors
directories (single file or sharded index).

Weights are assigned one tensor at a time into a model built on the ``meta`` device, so
loading never holds a second full copy of the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from tieredkv.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedModelError,
    short,
)
from tieredkv.models.config import LlamaConfig
from tieredkv.models.llama import Llama, rope_inv_freq
from tieredkv.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: Llama
    tokenizer: Tokenizer | None
    config: LlamaConfig
    source: Path
    format: str  # "gguf" | "hf"


def _empty_model(config: LlamaConfig) -> Llama:
    with torch.device("meta"):
        model = Llama(config)
    return model


def _parameter(model: Llama, name: str, source: str) -> tuple[nn.Module, str, nn.Parameter]:
    """(module, attribute, the parameter) a checkpoint tensor ``name`` fills; CorruptCheckpointError
    when the model of this config has no such parameter."""
    module_name, _, pname = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        module = None
    current = getattr(module, pname, None)
    if not isinstance(current, nn.Parameter):
        raise CorruptCheckpointError(f"{source}: tensor {short(name)} does not belong to a Llama model of this config")
    return module, pname, current


def _check_shape(model: Llama, name: str, shape: tuple[int, ...], source: str) -> None:
    expected = tuple(_parameter(model, name, source)[2].shape)
    if tuple(shape) != expected:
        raise CorruptCheckpointError(f"{source}: tensor {name!r} has shape {tuple(shape)}; expected {expected} from "
                                     "the config")


def _assign(model: Llama, name: str, tensor: torch.Tensor, source: str) -> None:
    module, pname, _ = _parameter(model, name, source)
    _check_shape(model, name, tuple(tensor.shape), source)
    if not bool(torch.isfinite(tensor).all()):
        raise CorruptCheckpointError(f"{source}: tensor {name!r} holds NaN or infinite values")
    setattr(module, pname, nn.Parameter(tensor, requires_grad=False))


def _finish(model: Llama, config: LlamaConfig, source: str, inv_freq: torch.Tensor | None = None) -> Llama:
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CorruptCheckpointError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.inv_freq = rope_inv_freq(config) if inv_freq is None else inv_freq
    return model.eval()


# ---------------------------------------------------------------------------- GGUF
_GGUF_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time permutation of Q/K projection rows.

    llama.cpp stores each head's rows interleaved (pairs (0,1), (2,3), ... rotate together);
    HF stores them as two halves (rotate-half). ``w`` is [n_head * head_dim, in].
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF rotate-half rows -> interleaved pairs); inverse of the above."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception as exc:  # malformed field payload
        raise CorruptCheckpointError(f"GGUF metadata field {field.name!r} is malformed ({exc})") from exc


def read_gguf(path: Path):
    """Open a GGUF file; returns (reader, fields dict). Typed errors for bad files."""
    import gguf

    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: GGUF file not found")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise CorruptCheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # gguf raises ValueError/IndexError/struct.error on truncation
        raise CorruptCheckpointError(f"{path}: GGUF file is truncated or malformed ({type(exc).__name__}: {exc})") from exc
    fields = {name: _gguf_field_value(f) for name, f in reader.fields.items()}
    # every byte of the data section belongs to a listed tensor (plus alignment padding): bytes
    # past the last one are a tensor the header does not list (a lowered tensor count)
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    trailing = path.stat().st_size - end
    if reader.tensors and trailing >= max(int(getattr(reader, "alignment", 32)), 1):
        raise CorruptCheckpointError(f"{path}: {trailing} bytes after the last tensor the header lists; the file holds "
                                     "data of tensors its header does not count (truncated header or lowered count)")
    return reader, fields


def _dequantize(tensor: Any, source: str) -> np.ndarray:
    import gguf

    try:
        arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedModelError(
            f"{source}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf package cannot "
            "dequantize; expected one of F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, K-quants, IQ-quants"
        ) from exc
    expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if arr.size != int(np.prod(expected)):
        raise CorruptCheckpointError(f"{source}: tensor {tensor.name!r} holds {arr.size} values; expected {expected}")
    return arr.reshape(expected)


def load_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32,
              progress: Callable[[Iterator], Iterator] | None = None) -> LoadedModel:
    path = Path(path)
    source = str(path)
    reader, fields = read_gguf(path)
    names = {t.name for t in reader.tensors}
    config = LlamaConfig.from_gguf_fields(
        fields, source, has_output_weight="output.weight" in names, rope_freq_factors="rope_freqs.weight" in names
    )
    tokenizer = Tokenizer.from_gguf_fields(fields, source) if "tokenizer.ggml.tokens" in fields else None
    if tokenizer is None and (path.parent / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_hf_dir(path.parent)
    model = _empty_model(config)
    inv_freq = None
    tensors = reader.tensors if progress is None else progress(reader.tensors)
    for t in tensors:
        arr = _dequantize(t, source)
        if t.name == "rope_freqs.weight":
            # llama.cpp's frequency factors (Llama 3.1): theta_i = base^(-2i/d) / factor_i
            factors = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
            if factors.shape != (config.head_dim // 2,) or not (np.isfinite(factors) & (factors > 0)).all():
                raise CorruptCheckpointError(f"{source}: rope_freqs.weight must hold {config.head_dim // 2} finite "
                                             f"positive factors (head dim {config.head_dim}), got {factors.size} values")
            inv_freq = rope_inv_freq(config) / torch.from_numpy(factors)
            continue
        if t.name in _GGUF_GLOBAL:
            name = _GGUF_GLOBAL[t.name]
        else:
            parts = t.name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_BLOCK or parts[3] != "weight" \
                    or not parts[1].isdigit() or int(parts[1]) >= config.num_layers:
                raise UnsupportedModelError(f"{source}: unexpected tensor {short(t.name)} for a Llama model of "
                                            f"{config.num_layers} layers")
            name = f"layers.{int(parts[1])}.{_GGUF_BLOCK[parts[2]]}.weight"
            _check_shape(model, name, arr.shape, source)  # before the permutation reshapes it
            if parts[2] == "attn_q":
                arr = unpermute_rope_rows(arr, config.num_heads)
            elif parts[2] == "attn_k":
                arr = unpermute_rope_rows(arr, config.num_kv_heads)
        arr = arr if arr.flags.writeable else arr.copy()  # F32/F16 tensors are views of the memory map
        _assign(model, name, torch.from_numpy(np.ascontiguousarray(arr)).to(dtype), source)
    return LoadedModel(_finish(model, config, source, inv_freq), tokenizer, config, path, "gguf")


# ---------------------------------------------------------------------------- HF safetensors
def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a table of tensor name -> file name")
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise CorruptCheckpointError(f"{index}: not a safetensors index ({short(str(exc), 120)}); expected a JSON "
                                         "object whose 'weight_map' maps tensor names to shard file names") from None
        files = []
        for name in dict.fromkeys(weight_map.values()):
            if Path(name).name != name or name in (".", ".."):
                raise CorruptCheckpointError(f"{index}: shard {short(name)} is not a file name in the model directory")
            files.append(path / name)
        for f in files:
            if not f.is_file():
                raise CheckpointNotFoundError(f"{f}: shard listed in {index.name} not found")
        return files
    if single.is_file():
        return [single]
    raise CheckpointNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json; expected a Hugging Face safetensors checkpoint"
    )


def load_hf(path: str | Path, *, dtype: torch.dtype = torch.float32,
            progress: Callable[[Iterator], Iterator] | None = None) -> LoadedModel:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: not a directory")
    config = LlamaConfig.from_hf_dir(path)
    files = _safetensor_files(path)
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    model = _empty_model(config)
    for f in (files if progress is None else progress(files)):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    name = key[len("model."):] if key.startswith("model.") else key
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    _assign(model, name, sf.get_tensor(key).to(dtype), str(f))
        except CorruptCheckpointError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError / OSError on bad headers or truncation
            raise CorruptCheckpointError(f"{f}: cannot read safetensors ({type(exc).__name__}: {exc})") from exc
    return LoadedModel(_finish(model, config, str(path)), tokenizer, config, path, "hf")


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32,
                    progress: Callable[[Iterator], Iterator] | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory (by what ``path`` is)."""
    path = Path(path)
    if path.is_dir():
        return load_hf(path, dtype=dtype, progress=progress)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or directory; expected a .gguf file or an HF model directory")
    return load_gguf(path, dtype=dtype, progress=progress)
