import dataclasses
import json

import pytest

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
