"""A completion's echoed prompt (`echo`): its text, and the legacy log-probabilities over the
prompt and the completion, as OpenAI's legacy completions and vLLM answer them.

The prompt's tokens come first: `tokens` each token's text (`bytes:\\xe7\\x9a` for one holding
part of a character split over tokens, as OpenAI's legacy completions write it),
`token_logprobs` its log-probability given the tokens before it (`null` for the first: nothing
predicts it), `top_logprobs` the token and the most likely alternatives there (`null` first),
`text_offset` where each token's text starts in the choice's text. The completion's tokens
follow.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hotlora.server.api.completion_answers import CompletionLogprobs
from hotlora.server.engine.generate import PromptLogprobs
from hotlora.server.engine.tokens import TokenPiece, TokenPieces


@dataclass(frozen=True)
class EchoedPrompt:
    """One prompt as a choice echoes it: its text, each of its tokens' text, and where each
    starts in that text."""

    text: str
    pieces: tuple[str, ...]
    offsets: tuple[int, ...]

    @property
    def length(self) -> int:
        """Where the completion's first token starts: after the prompt's text."""
        return len(self.text)


def _offsets(text: str, pieces: Sequence[TokenPiece]) -> tuple[int, ...]:
    """Where each token starts in `text`, matched on their bytes: a token the text does not
    hold (a BOS the tokenizer adds) takes none of it, and a word's opening space that the text
    does not open with (SentencePiece's space prefix) is left out; a token inside a character
    (byte fallback) starts where that character does."""
    data = text.encode()
    # The characters wholly before each byte offset of `data`.
    chars = [0]
    for i, char in enumerate(text):
        chars += [i] * (len(char.encode()) - 1) + [i + 1]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(chars[at])
        if data.startswith(piece.bytes, at):
            at += len(piece.bytes)
        elif piece.bytes.startswith(b" ") and data.startswith(piece.bytes[1:], at):
            at += len(piece.bytes) - 1
    return tuple(offsets)


def echoed_prompts(
    tokenizer: Any,
    pieces: TokenPieces,
    sent: Sequence[object],
    encoded: Sequence[list[int]],
    prompts: Sequence[list[int]],
) -> list[EchoedPrompt]:
    """Each prompt as echoed: a text prompt as sent, token ids (and a prompt that
    `truncate_prompt_tokens` cut: `prompts` shorter than `encoded`) decoded."""
    echoed = []
    for original, whole, kept in zip(sent, encoded, prompts, strict=True):
        if isinstance(original, str) and len(kept) == len(whole):
            text = original
        else:
            text = str(tokenizer.decode(kept))
        kept_pieces = [pieces(t) for t in kept]
        offsets = _offsets(text, kept_pieces)
        echoed.append(EchoedPrompt(text, tuple(p.legacy_label for p in kept_pieces), offsets))
    return echoed


def legacy_top(
    label: str, logprob: float, alternatives: Iterable[tuple[str, float]]
) -> dict[str, float]:
    """A position's `top_logprobs` in the legacy shape: its own token first, then the most
    likely alternatives; the token's own value under its name, whatever alternative shares
    the name."""
    top = {label: logprob}
    for other, value in alternatives:
        top.setdefault(other, value)
    return top


def prompt_part(echo: EchoedPrompt, reported: PromptLogprobs | None) -> CompletionLogprobs:
    """The prompt's tokens in the legacy shape, from its scores (`reported`)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for i, piece in enumerate(echo.pieces):
        entry = reported[i] if reported is not None and i < len(reported) else None
        tokens.append(piece)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry[0].logprob)  # the prompt's own token comes first
        tops.append(
            legacy_top(entry[0].label, entry[0].logprob, ((e.label, e.logprob) for e in entry[1:]))
        )
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=list(echo.offsets)
    )


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """The prompt's entries, then the completion's."""
    return CompletionLogprobs(
        tokens=[*first.tokens, *then.tokens],
        token_logprobs=[*first.token_logprobs, *then.token_logprobs],
        top_logprobs=[*(first.top_logprobs or []), *(then.top_logprobs or [])],
        text_offset=[*first.text_offset, *then.text_offset],
    )
