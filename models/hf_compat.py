"""Bridges to Hugging Face transformers (an optional dependency: the ``eval``/``dev`` extras).

Used to check our model against ``transformers.LlamaForCausalLM`` with the same weights
and to run kvpress presses on the weights we loaded, and to write HF checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tieredkv.models.config import LlamaConfig
from tieredkv.models.llama import Llama


def hf_config_dict(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` mapping of a LlamaForCausalLM with this shape."""
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else
        (config.eos_token_ids[0] if config.eos_token_ids else None),
    }
    rs = config.rope_scaling
    if rs is not None:
        d["rope_scaling"] = {"rope_type": rs.rope_type, "factor": rs.factor}
        if rs.rope_type == "llama3":
            d["rope_scaling"].update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                                     original_max_position_embeddings=rs.original_max_position_embeddings)
    return d


def hf_state_dict(model: Llama) -> dict[str, Any]:
    """Our parameters under HF LlamaForCausalLM names (tensors shared, not copied)."""
    sd = {f"model.{k}": v for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    if not model.config.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head.weight
    return sd


def to_transformers(model: Llama, *, attn_implementation: str = "eager"):
    """A ``transformers.LlamaForCausalLM`` holding the same weights (shared storage)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in hf_config_dict(model.config).items()
                                      if k not in ("architectures", "model_type")})
    cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(cfg)
    hf.load_state_dict(hf_state_dict(model), strict=False, assign=True)
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    # rotary inv_freq is a non-persistent buffer: rebuild it from ours (covers GGUF rope factors)
    for module in hf.modules():
        if hasattr(module, "inv_freq") and isinstance(module.inv_freq, torch.Tensor):
            module.inv_freq = model.inv_freq.clone()
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq = model.inv_freq.clone()
    return hf.to(model.dtype).eval()


def save_hf_checkpoint(model: Llama, path: str | Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` + safetensors (sharded with an index when ``max_shard_bytes``)."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2))
    sd = {k: v.detach().contiguous().clone() for k, v in hf_state_dict(model).items()}
    if max_shard_bytes is None:
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
