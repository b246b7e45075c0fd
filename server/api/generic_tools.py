"""The generic tool-call format, for models whose chat template cannot show tools: the answer's
calls as one JSON object, `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`, held to
the tools by a grammar, and read back as OpenAI's `tool_calls`, whole or as the stream goes.

With `tool_choice` `auto` the answer is either that object or plain text (which then cannot
begin with `{` or whitespace): ordinary answers stream as they always do. llama.cpp's generic
format asks for `{"response": ...}` instead; plain text keeps a chat client's text a text.
How the tools are described to the model: `server/render/tool_prompt.py`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from hotlora.config.log_text import printable
from hotlora.server.api.completion_answers import OutputToolCall
from hotlora.server.api.tool_calls import (
    ToolCalls,
    ToolCallStream,
    ToolFormat,
    call_schema,
    output_calls,
)

log = logging.getLogger("hotlora")

CALLS_KEY = "tool_calls"
# How the answer's calls begin, as the grammar writes them (no free whitespace).
CALLS_PREFIX = '{"tool_calls": ['
_COMPACT_PREFIX = '{"tool_calls":['
_WHITESPACE = re.compile(r"\s+")


def _parse(body: str, tools: Any) -> Any:
    """The calls in the text after `CALLS_PREFIX` (the rest of the answer)."""
    answer = json.loads(CALLS_PREFIX + body)
    if not isinstance(answer, dict) or set(answer) != {CALLS_KEY}:
        raise ValueError("not a tool-call object")
    return answer[CALLS_KEY]


@dataclass(frozen=True)
class GenericToolCalls(ToolCalls):
    """One request's tools in the generic format: what the answer may be, and how it is read."""

    def answer_schema(self) -> dict[str, Any]:
        """The JSON schema of an answer that calls tools: one or more calls (one when not
        `parallel`), to the named function when `use` names one."""
        named = None if self.use in ("auto", "required") else self.use
        calls: dict[str, Any] = {
            "type": "array",
            "items": call_schema(self.tools, named),
            "minItems": 1,
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return {
            "type": "object",
            "properties": {CALLS_KEY: calls},
            "required": [CALLS_KEY],
            "additionalProperties": False,
        }


@dataclass
class GenericCallStream(ToolCallStream):
    """Text in as it is generated; out, the text to show now and each call once it is whole.

    An answer that starts as the calls' object might is held back until it is known not to be
    one; inside it, each call comes out as soon as its closing brace arrives. An answer that
    does not read as calls is shown as text (all of it when no call was read); a last call cut
    short by `max_tokens` after whole ones is dropped.
    """

    _seen: str = ""  # the answer so far, while it is not known to be text
    _mode: str = "open"  # open (not known yet), text, calls, broken (unreadable) or closed
    _read: int = 0  # in calls mode: where the unread rest of `_seen` starts

    def feed(self, text: str) -> tuple[str, list[OutputToolCall]]:
        if self._mode == "text":
            return text, []
        self._seen += text
        if self._mode == "open":
            compact = _WHITESPACE.sub("", self._seen)
            if _COMPACT_PREFIX.startswith(compact):
                return "", []  # may still become the calls' object
            if not compact.startswith(_COMPACT_PREFIX):
                self._mode = "text"
                shown, self._seen = self._seen, ""
                return shown, []
            self._mode, self._read = "calls", self._seen.index("[") + 1
        return "", self._calls()

    def flush(self) -> tuple[str, list[OutputToolCall]]:
        """The end of the answer: what was held and never read as calls is shown as text."""
        mode, seen, rest = self._mode, self._seen, self._seen[self._read :]
        self._mode, self._seen, self._read = "text", "", 0
        if mode == "text" or (mode == "closed" and rest.strip() in ("", "}")):
            return "", []
        if self._count == 0:
            return seen, []
        if mode == "calls":  # a call cut short (by `max_tokens`) after whole ones: dropped
            log.info("an answer's last tool call was cut short; the calls before it are kept")
            return "", []
        log.info("could not read the rest of a tool-call answer; kept as text")
        return rest.lstrip().removeprefix(",").lstrip(), []

    def _calls(self) -> list[OutputToolCall]:
        """The calls completed in the text not yet read."""
        found: list[OutputToolCall] = []
        while self._mode == "calls":
            span = next_object(self._seen, self._read)
            if span is None:
                break  # the next call is not whole yet
            start, end = span
            if start < 0:
                self._mode, self._read = "closed", end
                break
            calls = self._read_call(self._seen[start:end])
            if calls is None:
                self._mode = "broken"
                break
            found.extend(calls)
            self._count += len(calls)
            self._read = end
        return found

    def _read_call(self, text: str) -> list[OutputToolCall] | None:
        try:
            call = json.loads(text)
        except ValueError as exc:
            log.info("could not read a tool call (%s); kept as text", printable(str(exc)))
            return None
        names = {tool["function"]["name"] for tool in self.calls.tools}
        if not isinstance(call, dict) or call.get("name") not in names:
            log.info("a tool call names no tool of the request; kept as text")
            return None
        return output_calls({"name": call["name"], "arguments": call.get("arguments", {})})


GENERIC = ToolFormat(
    CALLS_PREFIX, None, _parse, json_body=True, family="generic", answer_stream=GenericCallStream
)


def next_object(text: str, at: int, separator: str = ",") -> tuple[int, int] | None:
    """Where the next JSON object of a list's text lies, from `at`, after whitespace and
    `separator`s: (start, end); (-1, end past the `]`) when the list closes first; None when it
    is not whole yet. Anything else gives the span from `at` to the end, which does not read as
    an object."""
    i = at
    while i < len(text) and (text[i].isspace() or text[i] == separator):
        i += 1
    if i == len(text):
        return None
    if text[i] == "]":
        return -1, i + 1
    if text[i] != "{":
        return at, len(text)
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        char = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i, j + 1
    return None
