"""Token pieces on the embedded model's real tokenizer: exact bytes, even inside a character."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from hotlora.server.engine.tokens import TokenPieces


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir):
    return load_tokenizer(embedded_model_dir)


@pytest.mark.parametrize("text", ["😀 hi", "héllo wörld", "日本語", "tab\there", "x = 12345"])
def test_piece_bytes_concatenate_to_the_text(tokenizer, text: str):
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(pieces(i).bytes for i in ids) == text.encode()


def test_a_split_character_keeps_its_bytes(tokenizer):
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is split across tokens
    assert [pieces(i).bytes for i in ids][0] == "😀".encode()[: len(pieces(ids[0]).bytes)]
    assert all(pieces(i).text == "\ufffd" for i in ids)


def test_special_tokens_are_their_own_text(tokenizer):
    pieces = TokenPieces(tokenizer)
    [end] = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert pieces(end).text == "<|im_end|>" and pieces(end).bytes == b"<|im_end|>"


def test_a_split_characters_tokens_are_named_by_their_bytes(tokenizer):
    """As OpenAI's logprobs name such tokens: escaped bytes (chat), `bytes:` before them (the
    legacy completions), never two alike as U+FFFD; whole tokens by their text."""
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode("😀日", add_special_tokens=False)
    parts = [pieces(i) for i in ids]
    assert all(not part.whole for part in parts)
    assert [part.label for part in parts] == [
        "".join(f"\\x{byte:02x}" for byte in part.bytes) for part in parts
    ]
    assert [part.legacy_label for part in parts] == [f"bytes:{part.label}" for part in parts]
    assert len({part.label for part in parts}) == len({part.bytes for part in parts}) > 1
    [word] = tokenizer.encode(" cat", add_special_tokens=False)
    assert pieces(word).whole and pieces(word).label == pieces(word).legacy_label == " cat"
