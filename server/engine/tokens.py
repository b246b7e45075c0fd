"""What one token is on the wire: its text and its exact bytes (for logprobs); each row's
streaming detokenizer."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property, lru_cache

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    StreamingDetokenizer,
    TokenizerWrapper,
)


@dataclass(frozen=True)
class TokenPiece:
    text: str
    bytes: bytes  # exact, also for a token holding part of a UTF-8 character

    @cached_property
    def whole(self) -> bool:
        """Whether its bytes are whole UTF-8 characters (not part of one split over tokens)."""
        try:
            self.bytes.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    @property
    def label(self) -> str:
        """The token as log-probabilities name it: its text, or, where its bytes hold part of
        a UTF-8 character, those bytes escaped (`\\xf0\\x9f`), as OpenAI's chat logprobs write
        such a token; two such tokens are never both `\ufffd`."""
        return self.text if self.whole else self.bytes.decode("utf-8", "backslashreplace")

    @property
    def legacy_label(self) -> str:
        """As OpenAI's legacy completions name it: `bytes:` before the escaped bytes of one
        holding part of a character."""
        return self.text if self.whole else f"bytes:{self.label}"


_SPM_SPACE = "\u2581".encode()  # SentencePiece's word boundary, a space in the text


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for raw bytes, inverted (byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    stand_ins = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            stand_ins.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, stand_ins, strict=True)}


class TokenPieces:
    """Token id -> `TokenPiece`, cached; byte-level BPE and SentencePiece vocabularies give
    exact bytes, a word's opening space included (SentencePiece's `▁`, which a tokenizer's
    decode of the token alone drops), so that a row's tokens join into its text."""

    def __init__(self, tokenizer: TokenizerWrapper):
        self.tokenizer = tokenizer
        self._cache: dict[int, TokenPiece] = {}
        detokenizer = tokenizer.detokenizer
        self._byte_level = type(detokenizer) is BPEStreamingDetokenizer
        # mlx-lm's SentencePiece detokenizer's own map: each piece's bytes, `▁` still in them.
        self._pieces: list[bytes] | None = (
            detokenizer.tokenmap if isinstance(detokenizer, SPMStreamingDetokenizer) else None
        )

    def __call__(self, token_id: int) -> TokenPiece:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self._cache[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> TokenPiece:
        text = self.tokenizer.decode([token_id])
        pieces = self._pieces
        if pieces and token_id < len(pieces) and token_id not in self.tokenizer.all_special_ids:
            data = pieces[token_id].replace(_SPM_SPACE, b" ")  # as the detokenizer writes it
            return TokenPiece(data.decode("utf-8", errors="replace"), data)
        if self._byte_level and token_id not in self.tokenizer.all_special_ids:
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if isinstance(raw, str) and all(char in decoder for char in raw):
                data = bytes(decoder[char] for char in raw)
                return TokenPiece(data.decode("utf-8", errors="replace"), data)
        return TokenPiece(text, text.encode())


class _OpeningSpaceBPE(BPEStreamingDetokenizer):
    """mlx-lm's byte-level BPE detokenizer, less its trim of the text's opening space."""

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


class RowDetokenizers:
    """Fresh streaming detokenizers for generated rows, one a row, that keep a space opening the
    generated text.

    mlx-lm's BPE and SentencePiece detokenizers drop it, as a tokenizer's decode of a whole text
    does; generated text continues a prompt, so the space before its first word is its own (as
    OpenAI's and vLLM's answers keep it, and as the first token's `logprobs` entry and
    `text_offset` say: " a", not "a"). Other detokenizers are taken as they are."""

    def __init__(self, tokenizer: TokenizerWrapper):
        prototype = tokenizer.detokenizer
        if type(prototype) is BPEStreamingDetokenizer:
            prototype.__class__ = _OpeningSpaceBPE  # the same state: its vocabulary's map
        elif isinstance(prototype, SPMStreamingDetokenizer):
            prototype.trim_space = False
        self._prototype = prototype

    def __call__(self) -> StreamingDetokenizer:
        detokenizer = copy.copy(self._prototype)
        detokenizer.reset()
        return detokenizer
