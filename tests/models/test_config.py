import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st

from tieredkv.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UnsupportedModelError
from tieredkv.models.config import PRESETS, LlamaConfig, RopeScaling, preset
from tieredkv.models.hf_compat import hf_config_dict


def test_presets_have_real_shapes():
    assert preset("llama2-70b").num_kv_heads == 8 and preset("llama2-70b").head_dim == 128
    assert preset("llama3-8b").rope_scaling.rope_type == "llama3"
    s = preset("smollm2-135m")
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.rope_theta) == (30, 9, 3, 64, 1e5)
    assert s.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    # parameter counts of the real models (within 1%)
    assert abs(preset("llama2-7b").num_parameters() / 6.74e9 - 1) < 0.01
    assert abs(preset("llama3-8b").num_parameters() / 8.03e9 - 1) < 0.01
    assert abs(s.num_parameters() / 134.5e6 - 1) < 0.01


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="llama2-7b"):
        preset("llama9")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    cfg = PRESETS[name]
    back = LlamaConfig.from_hf_config(hf_config_dict(cfg))
    assert dataclasses.replace(back, name=cfg.name) == cfg
    assert LlamaConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("hidden_size", -1), ("num_kv_heads", 5)])
def test_bad_values_are_typed_errors(field, value):
    with pytest.raises(ConfigError, match=field if field != "num_kv_heads" else "multiple"):
        dataclasses.replace(preset("tiny"), **{field: value})


def test_rope_scaling_validation():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        RopeScaling(rope_type="yarn")
    with pytest.raises(ConfigError, match="high_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)


def test_hf_config_rejects_other_architectures(tmp_path):
    d = hf_config_dict(preset("tiny"))
    d.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        LlamaConfig.from_hf_config(d)
    d = hf_config_dict(preset("tiny"))
    d["attention_bias"] = True
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        LlamaConfig.from_hf_config(d)
    d = hf_config_dict(preset("tiny"))
    del d["hidden_size"]
    with pytest.raises(CorruptCheckpointError, match="hidden_size"):
        LlamaConfig.from_hf_config(d)


def test_hf_dir_errors(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="config.json"):
        LlamaConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        LlamaConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(preset("tiny"))))
    assert LlamaConfig.from_hf_dir(tmp_path).num_layers == 2


def test_transformers_5_rope_parameters_are_read():
    """transformers >= 5 writes RoPE as rope_parameters (rope_theta inside): read it, and refuse
    layouts that cannot be read rather than falling back to a default theta."""
    d = hf_config_dict(preset("smollm2-135m"))
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    assert LlamaConfig.from_hf_config(d).rope_theta == 100000.0
    d["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    cfg = LlamaConfig.from_hf_config(d)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    d["rope_parameters"] = {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e6}}
    with pytest.raises(UnsupportedModelError, match="rope_parameters"):
        LlamaConfig.from_hf_config(d)
    d["rope_parameters"] = {"rope_theta": 1e5, "rope_type": "yarn", "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        LlamaConfig.from_hf_config(d)
    d["rope_parameters"], d["rope_theta"] = {"rope_theta": 1e5}, 1e4
    with pytest.raises(CorruptCheckpointError, match="disagree"):
        LlamaConfig.from_hf_config(d)


def test_transformers_own_config_json_is_read(tmp_path):
    """The config.json the installed transformers writes for a Llama: same theta and scaling."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                  num_hidden_layers=2, vocab_size=100, rope_theta=123456.0, max_position_embeddings=16384,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    hf.save_pretrained(tmp_path)
    cfg = LlamaConfig.from_hf_dir(tmp_path)
    assert cfg.rope_theta == 123456.0 and cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0


@pytest.mark.parametrize("patch,error,match", [
    (dict(hidden_size=64.7), CorruptCheckpointError, "hidden_size must be an integer"),
    (dict(hidden_size="64"), CorruptCheckpointError, "hidden_size must be an integer"),
    (dict(num_attention_heads=0), CorruptCheckpointError, r"config.json: LlamaConfig.num_heads must be an integer in \[1, 1024\]"),
    (dict(num_hidden_layers=100_000_000), CorruptCheckpointError, r"num_layers must be an integer in \[1, 1024\]"),
    (dict(rope_scaling="llama3"), CorruptCheckpointError, "rope_scaling must be a table"),
    (dict(rope_theta=float("inf")), CorruptCheckpointError, "rope_theta must be a finite number"),
    (dict(rms_norm_eps="small"), CorruptCheckpointError, "rms_norm_eps must be a finite number"),
    (dict(tie_word_embeddings="yes"), CorruptCheckpointError, "tie_word_embeddings must be true or false"),
    (dict(eos_token_id=[1, "x"]), CorruptCheckpointError, "eos_token_id must be a token id"),
])
def test_config_json_values_are_typed(patch, error, match):
    d = hf_config_dict(preset("tiny"))
    d.update(patch)
    with pytest.raises(error, match=match):
        LlamaConfig.from_hf_config(d)


def test_a_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(CorruptCheckpointError, match="expected a JSON object"):
        LlamaConfig.from_hf_dir(tmp_path)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "vocab_size", "rope_theta", "rope_scaling", "rope_parameters",
                                        "max_position_embeddings", "eos_token_id", "tie_word_embeddings",
                                        "num_hidden_layers", "model_type"]),
                       st.none() | st.booleans() | st.integers(-5, 10**9) | st.floats() | st.text(max_size=5)
                       | st.dictionaries(st.text(max_size=5), st.floats() | st.text(max_size=3), max_size=3),
                       max_size=4))
def test_any_config_json_is_a_config_or_a_typed_error(patch):
    """Fuzz: config.json fields of any type give a LlamaConfig or a typed error, never another
    exception."""
    from tieredkv.errors import TieredKVError

    d = hf_config_dict(preset("tiny"))
    d.update(patch)
    try:
        LlamaConfig.from_hf_config(d)
    except TieredKVError as exc:
        assert len(str(exc)) < 2000
