"""Thinking models' reasoning: the text between think tags (`<think>...</think>` for Qwen3,
SmolLM3 and DeepSeek-R1's distills), told apart from the answer, whole or as the stream goes.

The tags are the tokenizer's (mlx-lm finds them in the vocabulary) when the chat template writes
them, else `<think>` and `</think>` when the template writes both. A template may open the
block itself at the end of the prompt (DeepSeek-R1's do): then the answer starts inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotlora.server.api.tool_calls import prefix_overlap

# The prompt's last tokens, decoded to see whether the template left a think block open.
PROMPT_TAIL_TOKENS = 32


@dataclass(frozen=True)
class ThinkTags:
    """How a model marks its reasoning."""

    start: str
    end: str

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkTags | None:
        """The think tags the chat template writes; None for a model that does not think."""
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str):
            return None
        start = getattr(tokenizer, "think_start", None)
        end = getattr(tokenizer, "think_end", None)
        if isinstance(start, str) and isinstance(end, str) and start in template:
            return cls(start, end)
        if "<think>" in template and "</think>" in template:
            return cls("<think>", "</think>")
        return None

    def opened_by(self, prompt_tail: str) -> bool:
        """The prompt ends inside a think block: the answer begins with reasoning."""
        return prompt_tail.rfind(self.start) > prompt_tail.rfind(self.end)


@dataclass(frozen=True)
class Reasoning:
    """One request's think tags, whether its answer starts inside a think block, and whether
    the reasoning is shown (vLLM's `include_reasoning: false` leaves it out of the answer)."""

    tags: ThinkTags
    inside: bool
    shown: bool = True

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer as (its reasoning, its answer)."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.flush()
        return reasoning + more_reasoning, content + more_content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.tags, self.inside)


class ReasoningStream:
    """Text in as it is generated; out, the reasoning and the answer text to show now.

    The answer's leading whitespace (a template's blank line after `</think>`) is dropped. A
    think block may start only before the answer's first visible character: tags written later
    are the answer's own text. Text that may begin a tag is held back until it is known not to.
    """

    def __init__(self, tags: ThinkTags, inside: bool):
        self.tags = tags
        self.inside = inside
        self._held = ""
        self._answering = False  # the answer has shown a visible character

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        pending, self._held = self._held + text, ""
        while pending:
            if self._answering:
                content.append(pending)
                break
            marker = self.tags.end if self.inside else self.tags.start
            at = pending.find(marker)
            if at < 0:
                keep = prefix_overlap(pending, marker)
                shown, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
                if self.inside:
                    reasoning.append(shown)
                else:
                    content.append(self._answer(shown))
                break
            if self.inside:
                reasoning.append(pending[:at])
            else:
                before = self._answer(pending[:at])
                if self._answering:  # the tag comes after the answer began: it is text
                    content.append(before + pending[at:])
                    break
            self.inside = not self.inside
            pending = pending[at + len(marker) :]
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The end of the answer: held text goes where it was going."""
        held, self._held = self._held, ""
        if self.inside:
            return held, ""
        return "", held if self._answering else self._answer(held)

    def _answer(self, text: str) -> str:
        """Answer text, its leading whitespace dropped."""
        if not self._answering:
            text = text.lstrip()
            self._answering = bool(text)
        return text
