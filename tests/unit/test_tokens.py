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
