"""What one token is on the wire: its text and its exact bytes (for logprobs)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass(frozen=True)
class TokenPiece:
    text: str
    bytes: bytes  # exact, also for a token holding part of a UTF-8 character


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
    """Token id -> `TokenPiece`, cached; byte-level BPE vocabularies give exact bytes."""

    def __init__(self, tokenizer: TokenizerWrapper):
        self.tokenizer = tokenizer
        self._cache: dict[int, TokenPiece] = {}
        self._byte_level = type(tokenizer.detokenizer).__name__ == "BPEStreamingDetokenizer"

    def __call__(self, token_id: int) -> TokenPiece:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self._cache[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> TokenPiece:
        text = self.tokenizer.decode([token_id])
        if self._byte_level and token_id not in self.tokenizer.all_special_ids:
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if isinstance(raw, str) and all(char in decoder for char in raw):
                data = bytes(decoder[char] for char in raw)
                return TokenPiece(data.decode("utf-8", errors="replace"), data)
        return TokenPiece(text, text.encode())
