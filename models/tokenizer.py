"""Tokenizers built with the `tokenizers` library: from a ``tokenizer.json`` or from the
vocabulary and merges stored in a GGUF file (byte-level BPE: GPT-2, Llama 3, SmolLM)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from tieredkv.errors import (CheckpointNotFoundError, CorruptCheckpointError, DataFileError, UnsupportedModelError,
                             short)

#: what :meth:`Tokenizer.save_hf_dir` writes, and the only keys of its config.json
_SAVED_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "config.json"})
_SAVED_IDS = frozenset({"bos_token_id", "eos_token_id"})

# llama.cpp's token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

# The pre-tokenizer regex of Llama 3 ("llama-bpe" in llama.cpp).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str, source: str):
    """The pre-tokenizer llama.cpp names ``tokenizer.ggml.pre = pre``."""
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in ("gpt-2", "gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise UnsupportedModelError(
        f"{source}: tokenizer.ggml.pre={pre!r} is not supported; expected one of "
        "'smollm', 'starcoder', 'llama-bpe', 'gpt-2', 'default'"
    )


@dataclass
class Tokenizer:
    """Text <-> token ids, plus the special ids and chat template generation needs."""

    backend: HFTokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        # encode_batch gives the same ids as encode but releases the GIL while it works, so a
        # server encoding a long prompt on a worker thread keeps its event loop running
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's own (Jinja) chat template."""
        if not self.chat_template:
            raise UnsupportedModelError("this model ships no chat template; pass the prompt as plain text")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], source: str) -> "Tokenizer":
        kind = fields.get("tokenizer.ggml.model")
        tokens = fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CorruptCheckpointError(f"{source}: no tokenizer.ggml.tokens; the GGUF carries no vocabulary")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"{source}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') vocabularies can be "
                "rebuilt from GGUF. Put the model's tokenizer.json next to the GGUF file instead."
            )
        merges = fields.get("tokenizer.ggml.merges")
        if merges is None:
            raise CorruptCheckpointError(f"{source}: tokenizer.ggml.merges missing for a BPE vocabulary")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pre = str(fields.get("tokenizer.ggml.pre", "default"))
        bpe = models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],
            ignore_merges=pre in ("llama-bpe", "llama3", "smaug-bpe"),
        )
        backend = HFTokenizer(bpe)
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre, source)
        backend.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type") or []
        special = [i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
        bos = fields.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend=backend,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
            special_ids=frozenset(special),
        )

    def save_hf_dir(self, path: str | Path) -> Path:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and a ``config.json`` with the
        special ids into directory ``path``, which :meth:`from_hf_dir` reads back.

        ``path`` must be new, empty, or a directory this method wrote before (nothing in it but
        those three files, its ``config.json`` holding only the special ids): a Hugging Face
        model directory's ``config.json`` is never overwritten (:class:`DataFileError`)."""
        path = Path(path)
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise DataFileError(f"{path}: not a directory; the tokenizer is saved into a new or empty directory")
        if path.is_dir():
            others = sorted(p.name for p in path.iterdir() if p.name not in _SAVED_FILES)
            config = path / "config.json"
            ours = True
            if config.exists():
                try:
                    ours = config.is_file() and set(json.loads(config.read_text(encoding="utf-8"))) <= _SAVED_IDS
                except (OSError, ValueError, TypeError):
                    ours = False
            if others or not ours:
                held = short(others) if others else "a config.json this method did not write"
                raise DataFileError(f"{path}: holds {held}; the tokenizer is saved into a new or empty directory "
                                    "(or one it was saved into before), never over a model's files")
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        name = lambda i: self.backend.id_to_token(i) if i is not None else None  # noqa: E731
        tc = {"bos_token": name(self.bos_token_id), "eos_token": name(self.eos_token_ids[0]) if self.eos_token_ids
              else None, "add_bos_token": self.add_bos, "chat_template": self.chat_template}
        (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=1) + "\n")
        ids = {"bos_token_id": self.bos_token_id, "eos_token_id": list(self.eos_token_ids)}
        (path / "config.json").write_text(json.dumps(ids, indent=1) + "\n")
        return path

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From ``tokenizer.json`` (+ ``tokenizer_config.json`` when present)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointNotFoundError(f"{tok_file}: not found; a Hugging Face model directory needs tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises plain Exception
            raise CorruptCheckpointError(f"{tok_file}: cannot be parsed by `tokenizers` ({exc})") from exc
        tc: dict[str, Any] = {}
        tc_file = path / "tokenizer_config.json"
        if tc_file.is_file():
            try:
                tc = json.loads(tc_file.read_text())
            except json.JSONDecodeError as exc:
                raise CorruptCheckpointError(f"{tc_file}: not valid JSON ({exc})") from exc

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        cfg: dict[str, Any] = {}
        if (path / "config.json").is_file():
            cfg = json.loads((path / "config.json").read_text())
        bos = token_id(tc.get("bos_token"))
        if bos is None:
            bos = cfg.get("bos_token_id")
        eos_ids: list[int] = []
        if token_id(tc.get("eos_token")) is not None:
            eos_ids.append(token_id(tc.get("eos_token")))
        cfg_eos = cfg.get("eos_token_id")
        for e in cfg_eos if isinstance(cfg_eos, list) else ([cfg_eos] if cfg_eos is not None else []):
            if e not in eos_ids:
                eos_ids.append(int(e))
        added = backend.get_added_tokens_decoder()
        if "add_bos_token" in tc:
            add_bos = bool(tc["add_bos_token"])
        else:  # e.g. Llama 3: the post-processor template adds BOS
            add_bos = bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            backend=backend,
            bos_token_id=bos,
            eos_token_ids=tuple(eos_ids),
            add_bos=add_bos,
            chat_template=tc.get("chat_template") if isinstance(tc.get("chat_template"), str) else None,
            special_ids=frozenset(i for i, t in added.items() if t.special),
        )
