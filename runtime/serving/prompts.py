"""Checks on a prompt before it costs anything: text that is valid Unicode, token ids that are
ids, and a lower bound on a text's token count from its length alone, so that a text that
cannot fit the served length is refused without being tokenized.

**The bound.** Every character of a text is covered by at least one of its tokens, and one
token covers at most ``max_chars_per_token`` characters, so a text of N characters has at
least ceil(N / max_chars_per_token) tokens. ``max_chars_per_token`` is the length of the
longest string in the tokenizer's vocabulary (its added tokens included): a byte-level BPE
token of k symbols is k bytes, which touch at most k characters; a SentencePiece-style
token (``▁the``, or a byte-fallback piece ``<0xE2>``) covers at most as many characters as
its string has. The bound needs the tokenizer to keep every character of the text (no
normalizer that merges or drops characters, no pre-tokenizer that drops them, no model that
fuses unknown characters into one token, no added token that swallows the whitespace beside
it); for a tokenizer that does not, :func:`max_chars_per_token` gives None and only the
tokenized length is checked. A bound of *bytes* per token would be wrong: a token of one
UTF-8 byte (a byte-fallback piece) covers part of a character, so characters, not bytes,
are what a token covers at least one of.
"""

from __future__ import annotations

import json
import numbers
import re
from typing import Any, Sequence

from tieredkv.errors import PromptError, short

_SURROGATE = re.compile("[\ud800-\udfff]")

# Normalizers and pre-tokenizers (the `tokenizers` library's types) that keep every character
# of the text: each input character becomes one or more symbols, none is merged or dropped.
_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "UnicodeScripts"}


def check_text(text: str, what: str) -> None:
    """PromptError when ``text`` is not valid Unicode: a lone surrogate (``"\\ud800"``, valid in
    JSON and in a Python str, but no character; no tokenizer can encode it)."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise PromptError(f"{what} contains a lone surrogate (U+{ord(m.group()):04X}) at character {m.start()}: "
                          "not a Unicode character; expected valid Unicode text (in JSON, a character beyond U+FFFF "
                          "is written as both halves of its surrogate pair, e.g. \"\\ud83d\\ude00\")")


def check_token_ids(ids: Sequence[Any], what: str, vocab_size: int | None) -> list[int]:
    """``ids`` as a list of ints, each in the vocabulary; PromptError naming the first bad one."""
    out = []
    for i, t in enumerate(ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise PromptError(f"{what}: element {i} is {short(t)}, not a token id; expected integers")
        t = int(t)
        out.append(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise PromptError(f"{what}: token id {t} (element {i}) is out of range; the vocabulary has "
                              f"{vocab_size} tokens")
    return out


def _keeps_characters(node: Any, keeping: set[str]) -> bool:
    """Whether a normalizer / pre-tokenizer (its JSON form) keeps every character."""
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        parts = node.get("normalizers", node.get("pretokenizers", []))
        return all(_keeps_characters(p, keeping) for p in parts)
    if kind == "Replace":  # a plain string replaced by one at least as long: no merge
        pattern = node.get("pattern", {})
        return "String" in pattern and len(node.get("content", "")) >= len(pattern["String"])
    if kind == "Split":
        return node.get("behavior") != "Removed"
    return kind in keeping


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of a text one token of ``tokenizer`` covers (the module docstring),
    or None when its normalizer, pre-tokenizer, model or added tokens may merge or drop
    characters (then no bound from the length holds)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")
                                      and not model.get("byte_fallback")):
        return None
    if not _keeps_characters(spec.get("normalizer"), _KEEPING_NORMALIZERS):
        return None
    if not _keeps_characters(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return None
    return max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=None)


def min_tokens(chars: int, chars_per_token: int | None) -> int:
    """The fewest tokens a text of ``chars`` characters can have (0 when no bound is known)."""
    return 0 if not chars_per_token else -(-chars // chars_per_token)


__all__ = ["check_text", "check_token_ids", "max_chars_per_token", "min_tokens"]
