"""GGUF and safetensors loaders: weights arrive exactly (or within the quantization
error), llama.cpp's Q/K permutation is undone, and every bad input is a typed error."""

import json
import os

import numpy as np
import pytest
import torch

from helpers import logits_of, tiny_model, write_gguf
from tieredkv.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedModelError
from tieredkv.models.hf_compat import save_hf_checkpoint
from tieredkv.models.loading import load_checkpoint, permute_rope_rows, unpermute_rope_rows


def test_permutation_round_trip():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)
    assert not np.array_equal(permute_rope_rows(w, 4), w)


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_f32_is_exact(tmp_path, tied):
    model = tiny_model(seed=2, tie_word_embeddings=tied)
    loaded = load_checkpoint(write_gguf(tmp_path / "m.gguf", model))
    assert loaded.format == "gguf" and loaded.config.tie_word_embeddings == tied
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.model.state_dict().items()):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 512, (50,))
    assert torch.equal(logits_of(model, tokens), logits_of(loaded.model, tokens))


@pytest.mark.parametrize("qtype,tol", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 2e-2), ("Q4_1", 0.2), ("Q5_0", 0.1)])
def test_gguf_quantized_types(tmp_path, qtype, tol):
    model = tiny_model(seed=4, hidden_size=64, intermediate_size=128)
    loaded = load_checkpoint(write_gguf(tmp_path / "m.gguf", model, qtype=qtype))
    q = loaded.model.layers[0].self_attn.q_proj.weight
    ref = model.layers[0].self_attn.q_proj.weight
    rel = ((q - ref).norm() / ref.norm()).item()
    assert rel < tol, rel
    # a wrong permutation would make the error O(1), not the quantization error
    assert ((q - ref.flip(0)).norm() / ref.norm()).item() > 0.5


def test_gguf_tokenizer_from_vocab(tmp_path):
    loaded = load_checkpoint(write_gguf(tmp_path / "m.gguf", tiny_model()))
    tok = loaded.tokenizer
    text = "the cat sat on the mat 12345 <|im_end|> héllo"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("Ġthe") in ids  # merges applied
    assert len([i for i in ids if tok.decode([i]) in "12345"]) >= 5  # digits split one by one (smollm)
    assert tok.eos_token_ids == (2,) and tok.token_to_id("<|im_end|>") in ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_saved_tokenizer_round_trips_and_never_overwrites_a_model(tmp_path):
    from tieredkv.errors import DataFileError
    from tieredkv.models.tokenizer import Tokenizer

    tok = load_checkpoint(write_gguf(tmp_path / "m.gguf", tiny_model())).tokenizer
    saved = tok.save_hf_dir(tmp_path / "tok")
    again = Tokenizer.from_hf_dir(tok.save_hf_dir(saved))  # its own directory: written again
    text = "the cat sat <|im_end|>"
    assert again.encode(text) == tok.encode(text) and again.eos_token_ids == tok.eos_token_ids
    model_dir = save_hf_checkpoint(tiny_model(), tmp_path / "hf")
    config = (model_dir / "config.json").read_bytes()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    (tmp_path / "file").write_text("data")
    for target, match in ((model_dir, "model's files"), (notes, "todo.txt"), (tmp_path / "file", "not a directory")):
        with pytest.raises(DataFileError, match=match):
            tok.save_hf_dir(target)
    assert (model_dir / "config.json").read_bytes() == config and (notes / "todo.txt").read_text() == "mine"
    foreign = tmp_path / "foreign"  # only a config.json, but not one the tokenizer wrote
    foreign.mkdir()
    (foreign / "config.json").write_text('{"hidden_size": 64}')
    with pytest.raises(DataFileError, match="did not write"):
        tok.save_hf_dir(foreign)


@pytest.mark.parametrize("shard", [None, 20_000])
def test_hf_safetensors(tmp_path, shard):
    model = tiny_model(seed=5)
    path = save_hf_checkpoint(model, tmp_path / "hf", max_shard_bytes=shard)
    if shard:
        assert len(list(path.glob("*.safetensors"))) > 1
    loaded = load_checkpoint(path)
    assert loaded.format == "hf"
    tokens = torch.randint(0, 512, (40,))
    assert torch.equal(logits_of(model, tokens), logits_of(loaded.model, tokens))


# ----------------------------------------------------------------------------- bad input
def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nope.gguf"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(CorruptCheckpointError, match="magic"):
        load_checkpoint(p)


def test_truncated_gguf(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", tiny_model())
    data = p.read_bytes()
    for cut in (len(data) // 2, 200):
        t = tmp_path / f"cut{cut}.gguf"
        t.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError, match=str(t.name)):
            load_checkpoint(t)


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_with_a_lowered_tensor_count(tmp_path, tied):
    """A header counting one tensor fewer than the file holds (the last one, output.weight when
    untied) is refused: it must not load with that tensor dropped (embeddings silently tied)."""
    import struct

    p = write_gguf(tmp_path / "m.gguf", tiny_model(tie_word_embeddings=tied))
    data = bytearray(p.read_bytes())
    (count,) = struct.unpack_from("<Q", data, 8)  # magic, version, then the tensor count
    struct.pack_into("<Q", data, 8, count - 1)
    bad = tmp_path / "lowered.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="bytes after the last tensor"):
        load_checkpoint(bad)
    assert load_checkpoint(p).config.tie_word_embeddings == tied


def test_gguf_other_architecture(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", tiny_model(), arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="general.architecture='gpt2'"):
        load_checkpoint(p)


def test_gguf_missing_tensor(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", tiny_model(), drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CorruptCheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_checkpoint(p)


def test_gguf_tensor_type_without_dequantizer(tmp_path):
    import gguf

    model = tiny_model()
    rows, cols = model.layers[0].self_attn.v_proj.weight.shape
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((rows, cols // block * size), dtype=np.uint8)
    p = write_gguf(tmp_path / "m.gguf", model,
                   raw_override={"blk.0.attn_v.weight": (raw, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(UnsupportedModelError, match="Q8_1"):
        load_checkpoint(p)


def test_gguf_unsupported_tokenizer_pre(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", tiny_model(), pre="chatglm-bpe")
    with pytest.raises(UnsupportedModelError, match="chatglm-bpe"):
        load_checkpoint(p)


def test_hf_missing_shard_and_corrupt_file(tmp_path):
    path = save_hf_checkpoint(tiny_model(), tmp_path / "hf", max_shard_bytes=20_000)
    shard = sorted(path.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=shard.name):
        load_checkpoint(path)
    os.remove(shard)
    with pytest.raises(CheckpointNotFoundError, match=shard.name):
        load_checkpoint(path)


def test_hf_shape_mismatch(tmp_path):
    path = save_hf_checkpoint(tiny_model(), tmp_path / "hf")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptCheckpointError, match="expected"):
        load_checkpoint(path)


@pytest.mark.slow
def test_smollm2_tokenizer(smollm):
    tok = smollm.tokenizer
    text = "Hello world! The pass key is 71432.\n\nWhat is it?"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    digits = [tok.decode([i]) for i in ids if tok.decode([i]).isdigit()]
    assert digits == list("71432")
    assert tok.eos_token_ids == (2,) and not tok.add_bos
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template_bos", [True, False])
def test_hf_tokenizer_json(tmp_path, template_bos):
    """tokenizer.json + tokenizer_config.json; BOS comes from add_bos_token or, when that is
    absent (Llama 3), from the post-processor template."""
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers, processors

    from helpers import tiny_vocab

    tokens, merges, _ = tiny_vocab()
    backend = HFTok(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in tokens[:3]])
    if template_bos:
        backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                               special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>",
                                                                "eos_token": "<|im_end|>"}))
    from tieredkv.models.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.add_bos == template_bos
    ids = tok.encode("the cat")
    assert (ids[0] == 1) == template_bos and tok.decode(ids) == "the cat"


@pytest.mark.parametrize("meta,error,match", [
    ({"llama.embedding_length": "abc"}, CorruptCheckpointError, "llama.embedding_length must be an integer"),
    ({"llama.attention.head_count": 0}, CorruptCheckpointError, r"m.gguf: LlamaConfig.num_heads must be an integer in \[1, 1024\]"),
    ({"llama.attention.head_count": [4, 4]}, CorruptCheckpointError, "head_count must be an integer"),
    ({"llama.attention.layer_norm_rms_epsilon": "tiny"}, CorruptCheckpointError, "epsilon must be a finite number"),
    ({"llama.block_count": 100_000_000}, CorruptCheckpointError, r"num_layers must be an integer in \[1, 1024\]"),
    ({"llama.rope.freq_base": float("nan")}, CorruptCheckpointError, "freq_base must be a finite number"),
])
def test_gguf_metadata_is_typed(tmp_path, meta, error, match):
    p = write_gguf(tmp_path / "m.gguf", tiny_model(), meta=meta)
    with pytest.raises(error, match=match):
        load_checkpoint(p)


@pytest.mark.parametrize("extra,error,match", [
    ({"blk.x.attn_q.weight": np.zeros((4, 4))}, UnsupportedModelError, "unexpected tensor 'blk.x.attn_q.weight'"),
    ({"blk.99.attn_q.weight": np.zeros((4, 4))}, UnsupportedModelError, "blk.99.attn_q.weight' for a Llama model of 2"),
    ({"blk.0.attn_v.weight": np.zeros((3, 64))}, CorruptCheckpointError, r"has shape \(3, 64\); expected"),
    ({"rope_freqs.weight": np.ones(5)}, CorruptCheckpointError, "rope_freqs.weight must hold 8 finite positive"),
    ({"rope_freqs.weight": np.zeros(8)}, CorruptCheckpointError, "rope_freqs.weight must hold 8 finite positive"),
    ({"token_embd.weight": np.full((512, 64), np.nan)}, CorruptCheckpointError, "NaN or infinite"),
])
def test_gguf_tensors_are_checked_before_use(tmp_path, extra, error, match):
    p = write_gguf(tmp_path / "m.gguf", tiny_model(), extra_tensors=extra)
    with pytest.raises(error, match=match):
        load_checkpoint(p)


def test_safetensors_index_is_confined_and_typed(tmp_path):
    d = save_hf_checkpoint(tiny_model(), tmp_path / "hf")
    (d / "model.safetensors").rename(d / "shard.safetensors")
    for weight_map, match in (({"x": "../outside.safetensors"}, "not a file name"), ({"x": "/etc/passwd"}, "not a file name"),
                              ([1, 2], "not a safetensors index"), ({"x": 3}, "not a safetensors index")):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CorruptCheckpointError, match=match):
            load_checkpoint(d)
