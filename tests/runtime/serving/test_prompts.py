"""The prompt checks a server runs before tokenizing (runtime/serving/prompts.py): the bound
"N characters are at least ceil(N / max_chars_per_token) tokens" holds on texts made to break
it (the longest tokens back to back, special tokens, multi-byte characters, byte-fallback
pieces), and tokenizers for which it would not hold get no bound."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers

from helpers import tiny_model, write_gguf
from tieredkv.errors import PromptError
from tieredkv.models.loading import load_checkpoint
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.serving.prompts import check_text, check_token_ids, max_chars_per_token, min_tokens


def hostile_texts(tok, m: int, seed: int = 0) -> list[str]:
    """Texts that pack the most characters into each token: the longest vocabulary strings back
    to back (decoded), special tokens written out, and a mix with multi-byte characters."""
    rng = random.Random(seed)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    longest = sorted(vocab.items(), key=lambda kv: -len(kv[0]))[:50]
    pieces = [tok.decode([i], skip_special_tokens=False) for _, i in longest]
    pieces = [p for p in pieces if p and "\ufffd" not in p]
    assert pieces
    other = ["é", "漢字", "😀", " ", "\n", "ab", "Ω", "\u0301"]
    texts = ["".join(rng.choice(pieces) for _ in range(k)) for k in (1, 7, 40, 200)]
    texts += ["".join(rng.choice(pieces + other) for _ in range(k)) for k in (5, 60, 300)]
    texts += ["x" * (m * 10), " " * (m * 10 + 3), "😀" * 50]
    return texts


def assert_bound_holds(tok) -> int:
    m = max_chars_per_token(tok)
    assert m is not None and m >= 1
    for text in hostile_texts(tok, m):
        n = len(tok.encode(text, add_bos=False))
        assert n >= min_tokens(len(text), m), (len(text), n, m)
    return m


def test_the_bound_holds_on_the_tiny_byte_level_tokenizer(tmp_path):
    tok = load_checkpoint(write_gguf(tmp_path / "t.gguf", tiny_model(seed=2))).tokenizer
    m = assert_bound_holds(tok)
    assert m == max(len(t) for t in tok.backend.get_vocab(with_added_tokens=True))


def _sentencepiece_like() -> Tokenizer:
    """A Llama-2-style BPE: Prepend + Replace normalizer, byte fallback, fused unknowns."""
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, "▁ab": 5, "ab": 6, "▁abab": 7}
    vocab.update({f"<0x{i:02X}>": 8 + i for i in range(256)})
    bpe = models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b"), ("▁a", "b"), ("▁ab", "ab")], unk_token="<unk>",
                     fuse_unk=True, byte_fallback=True)
    hf = HFTokenizer(bpe)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return Tokenizer(backend=hf)


def test_the_bound_holds_with_byte_fallback_pieces():
    tok = _sentencepiece_like()
    m = max_chars_per_token(tok)
    assert m == len("<0x00>")  # a byte-fallback piece's string, longer than what it covers
    for text in ("abab abab ab", "é漢😀" * 20, "▁" * 30, "ab" * 100 + "ü" * 7):
        assert len(tok.encode(text)) >= min_tokens(len(text), m)


def _with(**parts) -> Tokenizer:
    hf = HFTokenizer(parts.pop("model", models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")])))
    for name, value in parts.items():
        setattr(hf, name, value)
    return Tokenizer(backend=hf)


@pytest.mark.parametrize("make", [
    lambda: _with(normalizer=normalizers.NFKC()),  # composes characters: fewer than typed
    lambda: _with(normalizer=normalizers.Strip()),  # drops characters
    lambda: _with(normalizer=normalizers.Replace("  ", " ")),  # a replacement shorter than its pattern
    lambda: _with(pre_tokenizer=pre_tokenizers.Whitespace()),  # drops whitespace
    lambda: _with(model=models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),  # a word of [UNK]
    lambda: _with(model=models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True)),
], ids=["nfkc", "strip", "shorter-replace", "whitespace", "wordpiece", "fused-unk"])
def test_no_bound_for_tokenizers_that_merge_or_drop_characters(make):
    assert max_chars_per_token(make()) is None


def test_no_bound_when_an_added_token_swallows_whitespace():
    tok = _with()
    tok.backend.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    assert max_chars_per_token(tok) is None
    assert max_chars_per_token(object()) is None and min_tokens(10, None) == 0


def test_text_and_token_id_checks():
    check_text("fine 😀 \ud7ff\ue000", "the prompt")
    for bad, pos in (("\ud800", 0), ("ab\udfff", 2), ("x" * 10 + "\udbff\n", 10)):
        with pytest.raises(PromptError, match=f"lone surrogate .* at character {pos}"):
            check_text(bad, "the prompt")
    assert check_token_ids((1, 2, 3), "p", 10) == [1, 2, 3]
    for bad in ([1, -1], [10], [1, "2"], [None], [2.0], [False]):
        with pytest.raises(PromptError):
            check_token_ids(bad, "p", 10)


@pytest.mark.slow
def test_the_bound_holds_on_smollm2(smollm):
    assert assert_bound_holds(smollm.tokenizer) == 81
