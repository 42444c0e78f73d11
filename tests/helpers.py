"""Test builders: tiny random Llamas, GGUF files written with the `gguf` package (with
llama.cpp's Q/K row permutation applied, as the real converter does), and a tiny
byte-level BPE vocabulary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from tieredkv.models.config import LlamaConfig, preset
from tieredkv.models.llama import Llama, init_random_weights
from tieredkv.models.loading import permute_rope_rows

#: a small tiered cache for the tiny model (8-token pages, 4 sinks, 16 recent tokens, 2 staging
#: pages), warm-less unless a test names its warm tier; its percentage budgets count the bytes of
#: the tiny model's own float32 pages (``budget_reference``: the tests' budgets were sized so;
#: tests/runtime/tiered/test_config.py checks the float16 reference, the default)
SMALL_KV = dict(page_size=8, sink_tokens=4, recent_tokens=16, staging_pages=2, warm_codec="off",
                budget_reference="float32")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ s", "o n"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_config(**overrides) -> LlamaConfig:
    return dataclasses.replace(preset("tiny"), **overrides)


def tiny_model(seed: int = 0, **overrides) -> Llama:
    return init_random_weights(Llama(tiny_config(**overrides)), seed=seed).eval()


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token_types): specials, the 256 byte-level symbols, merge results."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + alphabet + merged
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, list(MERGES), types


def write_gguf(path: Path, model: Llama, *, qtype: str = "F32", arch: str = "llama", with_tokenizer: bool = True,
               pre: str = "smollm", drop: tuple[str, ...] = (), raw_override: dict | None = None,
               meta: dict | None = None, extra_tensors: dict | None = None) -> Path:
    """Write ``model`` as a llama.cpp-style GGUF. ``qtype`` applies to 2-D weights (norms stay F32).
    ``drop`` omits tensors (GGUF names); ``raw_override`` maps a GGUF tensor name to
    (uint8 array, GGMLQuantizationType) written verbatim; ``meta`` replaces metadata values by
    key (``llama.embedding_length``: "abc" writes a string there), typed by their Python type;
    ``extra_tensors`` adds float32 tensors by GGUF name."""
    import gguf

    c = model.config
    meta = dict(meta or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    standard = {"block_count": c.num_layers, "context_length": c.max_position_embeddings,
                "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
                "attention.head_count": c.num_heads, "attention.head_count_kv": c.num_kv_heads,
                "rope.freq_base": c.rope_theta, "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
                "vocab_size": c.vocab_size}
    for key, value in standard.items():
        meta.setdefault(f"{arch}.{key}", value)
    for key, value in meta.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_array(key, list(value))
    if with_tokenizer:
        tokens, merges, types = tiny_vocab()
        tokens = tokens + [f"<unused{i}>" for i in range(c.vocab_size - len(tokens))]
        types = types + [5] * (c.vocab_size - len(types))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name in names:
            gname = names[name]
        else:
            _, idx, *rest = name.split(".")
            gname = f"blk.{idx}.{block['.'.join(rest[:-1])]}.weight"
        if gname in drop:
            continue
        if raw_override and gname in raw_override:
            data, raw_type = raw_override[gname]
            w.add_tensor(gname, data, raw_dtype=raw_type)
            continue
        arr = p.detach().float().numpy().copy()
        if gname in (extra_tensors or {}):
            arr = np.asarray(extra_tensors.pop(gname), dtype=np.float32)
        if gname.endswith("attn_q.weight"):
            arr = permute_rope_rows(arr, c.num_heads)
        elif gname.endswith("attn_k.weight"):
            arr = permute_rope_rows(arr, c.num_kv_heads)
        if arr.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(arr, qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(gname, arr.astype(np.float32))
    for gname, arr in (extra_tensors or {}).items():
        w.add_tensor(gname, np.asarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits_of(model: Llama, tokens: torch.Tensor, *, chunk: int = 512) -> torch.Tensor:
    """All-position logits [T, V] through a fresh contiguous cache."""
    from tieredkv.models.cache import ContiguousKVCache
    from tieredkv.models.llama import prefill

    cache = ContiguousKVCache(model.kv_spec())
    return prefill(model, cache, cache.add_sequence(), tokens, all_logits=True, chunk_size=chunk)
