"""Llama model configuration: Llama 2, Llama 3 / 3.1 (llama3 rope scaling), SmolLM2.

One frozen dataclass, built from a Hugging Face ``config.json``, from GGUF metadata, or
from a named shape preset (random weights, for benchmarks).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tieredkv.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UnsupportedModelError, short

#: the largest value of each shape field a checkpoint may describe (a Llama-3.1-405B is far
#: inside: hidden 16,384, 126 layers, 128 heads, vocabulary 128,256, context 131,072)
LIMITS = {"vocab_size": 1 << 21, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_layers": 1024,
          "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 1024, "max_position_embeddings": 1 << 24}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style frequency-dependent RoPE scaling (``rope_type = "llama3"``)
    or plain linear position interpolation (``rope_type = "linear"``)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise UnsupportedModelError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; expected 'llama3' or 'linear'"
            )
        for fname in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, fname)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"rope_scaling.{fname} must be a finite number > 0, got {short(value)}")
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= LIMITS["max_position_embeddings"]:
            raise ConfigError(f"rope_scaling.original_max_position_embeddings must be an integer in [1, "
                              f"{LIMITS['max_position_embeddings']}], got {short(value)}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                "rope_scaling.high_freq_factor must be greater than low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder.

    ``num_kv_heads < num_heads`` is grouped-query attention; ``head_dim`` defaults to
    ``hidden_size // num_heads``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = "llama"

    def __post_init__(self) -> None:
        for fname, limit in LIMITS.items():
            value = getattr(self, fname)
            if fname == "head_dim" and value == 0:
                continue  # derived below
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
                raise ConfigError(f"LlamaConfig.{fname} must be an integer in [1, {limit}], got {short(value)}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
            if self.head_dim == 0:
                raise ConfigError(f"LlamaConfig: hidden_size ({self.hidden_size}) < num_heads ({self.num_heads}) "
                                  "gives a head dim of 0; expected head_dim >= 1")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for fname in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, fname)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"LlamaConfig.{fname} must be a finite number > 0, got {short(value)}")

    # ------------------------------------------------------------------ derived figures
    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + head + h

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LlamaConfig":
        """Inverse of :meth:`to_dict` (used by engine directories)."""
        data = dict(data)
        scaling = data.pop("rope_scaling", None)
        eos = data.pop("eos_token_ids", (2,))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown LlamaConfig fields {unknown}; expected a subset of {sorted(known)}")
        return cls(
            rope_scaling=RopeScaling(**scaling) if scaling else None,
            eos_token_ids=tuple(eos),
            **data,
        )

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "LlamaConfig":
        """From a Hugging Face ``config.json`` mapping of a LlamaForCausalLM, in the layouts the
        supported transformers versions write: RoPE as ``rope_theta`` + ``rope_scaling``
        (transformers 4) or as ``rope_parameters`` (transformers 5). Every field is read with its
        type checked (an integer is never a rounded float); a layout it cannot read is refused."""
        if not isinstance(cfg, Mapping):
            raise CorruptCheckpointError(f"{source}: expected a JSON object of settings, got {type(cfg).__name__}")
        read = _HFReader(cfg, source)
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type != "llama" and (not isinstance(archs, list) or "LlamaForCausalLM" not in archs):
            raise UnsupportedModelError(
                f"{source}: model_type={short(model_type)}, architectures={short(archs)}; expected a Llama "
                "checkpoint (model_type 'llama', LlamaForCausalLM)"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if read.boolean(flag, False):
                raise UnsupportedModelError(f"{source}: {flag}=true is not supported; expected false")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act={short(act)}; expected 'silu'")
        rope_theta, scaling = read.rope()
        eos = cfg.get("eos_token_id", 2)
        eos_ids = tuple(read.token_ids("eos_token_id", eos if isinstance(eos, list) else ([] if eos is None else [eos])))
        bos = cfg.get("bos_token_id")
        num_heads = read.integer("num_attention_heads")
        hidden = read.integer("hidden_size")
        head_dim = read.integer("head_dim", None)
        return cls._described_by(
            source,
            vocab_size=read.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=read.integer("intermediate_size"),
            num_layers=read.integer("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=read.integer("num_key_value_heads", num_heads) or num_heads,
            head_dim=head_dim or 0,
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=read.number("rms_norm_eps", 1e-6),
            max_position_embeddings=read.integer("max_position_embeddings", 4096),
            tie_word_embeddings=read.boolean("tie_word_embeddings", False),
            bos_token_id=read.token_ids("bos_token_id", [bos])[0] if bos is not None else None,
            eos_token_ids=eos_ids,
            name=str(cfg.get("_name_or_path") or "llama")[:200],
        )

    @classmethod
    def _described_by(cls, source: str, **fields: Any) -> "LlamaConfig":
        """The config a checkpoint's metadata describes; its bounds errors name the file."""
        try:
            return cls(**fields)
        except ConfigError as exc:
            raise CorruptCheckpointError(f"{source}: {exc}") from None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "LlamaConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointNotFoundError(f"{cfg_file}: not found; a Hugging Face model directory needs config.json")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(f"{cfg_file}: not valid JSON ({exc})") from exc
        config = cls.from_hf_config(cfg, source=str(cfg_file))
        if config.name == "llama":
            config = dataclasses.replace(config, name=path.name)
        return config

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], source: str, *, has_output_weight: bool,
                         rope_freq_factors: bool = False) -> "LlamaConfig":
        """From GGUF metadata (``fields`` maps key -> python value).

        ``has_output_weight``: whether the file stores ``output.weight`` (else embeddings are tied).
        """
        arch = fields.get("general.architecture")
        if arch != "llama":
            raise UnsupportedModelError(
                f"{source}: general.architecture={short(arch)}; expected 'llama'"
            )

        read = _HFReader(fields, source)  # the same typed reads: a GGUF key is a field name here
        hidden = read.integer("llama.embedding_length")
        heads = read.integer("llama.attention.head_count")
        kv_heads = read.integer("llama.attention.head_count_kv", heads)
        head_dim = read.integer("llama.attention.key_length", None) or read.integer("llama.rope.dimension_count", None)
        vocab = read.integer("llama.vocab_size", None)
        if vocab is None:
            tokens = fields.get("tokenizer.ggml.tokens")
            if not isinstance(tokens, list):
                raise CorruptCheckpointError(f"{source}: neither llama.vocab_size nor tokenizer.ggml.tokens present")
            vocab = len(tokens)
        scaling = None
        stype = fields.get("llama.rope.scaling.type")
        if stype == "linear":
            scaling = RopeScaling(rope_type="linear", factor=read.number("llama.rope.scaling.factor"))
        elif stype not in (None, "none"):
            raise UnsupportedModelError(f"{source}: llama.rope.scaling.type={short(stype)}; expected 'linear' or none")
        if rope_freq_factors and scaling is not None:
            raise UnsupportedModelError(f"{source}: both rope_freqs.weight and llama.rope.scaling.type are set")
        eos_ids = tuple(dict.fromkeys(read.token_ids(key, [fields[key]])[0] for key in (
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if fields.get(key) is not None))
        bos = fields.get("tokenizer.ggml.bos_token_id")
        return cls._described_by(
            source,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=read.integer("llama.feed_forward_length"),
            num_layers=read.integer("llama.block_count"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim or 0,
            rope_theta=read.number("llama.rope.freq_base", 10000.0),
            rope_scaling=scaling,
            rms_norm_eps=read.number("llama.attention.layer_norm_rms_epsilon", 1e-5),
            max_position_embeddings=read.integer("llama.context_length", 4096),
            tie_word_embeddings=not has_output_weight,
            bos_token_id=read.token_ids("tokenizer.ggml.bos_token_id", [bos])[0] if bos is not None else None,
            eos_token_ids=eos_ids,
            name=str(fields.get("general.name") or Path(source).stem)[:200],
        )


class _HFReader:
    """Typed reads of a Hugging Face config.json mapping (or of GGUF metadata, key -> value);
    CorruptCheckpointError naming the file and the field when a value is missing or of the
    wrong type."""

    _MISSING = object()

    def __init__(self, cfg: Mapping[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def _get(self, key: str, default: Any, table: Mapping[str, Any] | None = None) -> Any:
        value = (self.cfg if table is None else table).get(key, default)
        if value is self._MISSING:
            raise CorruptCheckpointError(f"{self.source}: missing required field {key!r}")
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy scalar (GGUF metadata)
            value = value.item()
        return value

    def _bad(self, key: str, value: Any, expected: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.source}: {key} must be {expected}, got {short(value)}")

    def integer(self, key: str, default: Any = _MISSING, table: Mapping[str, Any] | None = None) -> Any:
        value = self._get(key, default, table)
        if value is None or value is default:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, value, "an integer")
        return value

    def number(self, key: str, default: Any = _MISSING, table: Mapping[str, Any] | None = None) -> float:
        value = self._get(key, default, table)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(key, value, "a finite number")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def token_ids(self, key: str, values: list) -> list[int]:
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                   for v in values):
            raise self._bad(key, self.cfg.get(key), "a token id or a list of token ids")
        return values

    def rope(self) -> tuple[float, RopeScaling | None]:
        """(rope_theta, scaling) from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` and
        ``rope_scaling`` (transformers 4); both given must agree."""
        params = self.cfg.get("rope_parameters")
        if params is not None:
            if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
                raise UnsupportedModelError(
                    f"{self.source}: rope_parameters {short(params)} is not one table of RoPE settings (per-layer-type "
                    "RoPE is not a Llama layout); expected {\"rope_theta\": ..., \"rope_type\": ...}")
            theta = self.number("rope_theta", 10000.0, params)
            if "rope_theta" in self.cfg and self.number("rope_theta") != theta:
                raise CorruptCheckpointError(f"{self.source}: rope_theta {self.cfg['rope_theta']} and "
                                             f"rope_parameters.rope_theta {theta} disagree")
            scaling = params
            if self.cfg.get("rope_scaling") not in (None, {}) and self.cfg.get("rope_scaling") != params:
                raise CorruptCheckpointError(f"{self.source}: rope_scaling and rope_parameters disagree; expected one")
        else:
            theta = self.number("rope_theta", 10000.0)
            scaling = self.cfg.get("rope_scaling")
        return theta, self._scaling(scaling)

    def _scaling(self, rs: Any) -> RopeScaling | None:
        if rs is None or rs == {}:
            return None
        if not isinstance(rs, Mapping):
            raise self._bad("rope_scaling", rs, "a table (rope_type, factor, ...)")
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype in (None, "default"):
            return None
        if rtype == "llama3":
            return RopeScaling(rope_type="llama3", factor=self.number("factor", self._MISSING, rs),
                               low_freq_factor=self.number("low_freq_factor", 1.0, rs),
                               high_freq_factor=self.number("high_freq_factor", 4.0, rs),
                               original_max_position_embeddings=self.integer("original_max_position_embeddings", 8192,
                                                                             rs))
        if rtype == "linear":
            return RopeScaling(rope_type="linear", factor=self.number("factor", self._MISSING, rs))
        raise UnsupportedModelError(f"{self.source}: rope type {short(rtype)} is not supported; expected 'llama3', "
                                    "'linear' or 'default'")


_LLAMA31_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)

#: Named shapes for benchmarks with random weights. ``tiny`` is the unit-test model.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
                        num_kv_heads=2, rope_theta=10000.0, max_position_embeddings=2048, name="tiny"),
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, rope_theta=100000.0, max_position_embeddings=8192,
                                tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), name="smollm2-135m"),
    "llama2-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                             num_heads=32, num_kv_heads=32, rope_theta=10000.0, max_position_embeddings=4096,
                             name="llama2-7b"),
    "llama2-70b": LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
                              num_heads=64, num_kv_heads=8, rope_theta=10000.0, max_position_embeddings=4096,
                              name="llama2-70b"),
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
                             max_position_embeddings=131072, bos_token_id=128000,
                             eos_token_ids=(128001, 128008, 128009), name="llama3-8b"),
    "llama3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                              num_heads=64, num_kv_heads=8, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
                              max_position_embeddings=131072, bos_token_id=128000,
                              eos_token_ids=(128001, 128008, 128009), name="llama3-70b"),
}


def preset(name: str) -> LlamaConfig:
    """The named shape preset; raises ConfigError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown shape preset {name!r}; expected one of {sorted(PRESETS)}") from None

