"""Tool calls: the model's tool-call markup, found in its text and turned into OpenAI's
`tool_calls`, whole or as the stream goes.

The markup and its parser are mlx-lm's, inferred from the chat template (`<tool_call>...
</tool_call>` with JSON inside for SmolLM3 and Qwen, `[TOOL_CALLS]` for Mistral, ...). Markup the
parser cannot read (say, cut short by `max_tokens`) stays in the answer as text.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotlora.config.log_text import printable
from hotlora.server.api.completion_answers import OutputFunctionCall, OutputToolCall
from hotlora.server.api.completion_requests import ChatMessage

log = logging.getLogger("hotlora")

ToolParser = Callable[[str, Any], Any]  # (markup body, tools) -> a call dict, or a list of them


def tool_parameters(tools: list[dict[str, Any]], name: str | None) -> list[tuple[str, Any]]:
    """(name, arguments schema) of each of `tools`, or of the one named `name`."""
    out = []
    for tool in tools:
        function = tool["function"]
        if name is None or function["name"] == name:
            arguments = dict(function.get("parameters") or {"type": "object"})
            # Arguments the function does not declare are never wanted: held to its own.
            if arguments.get("type") == "object":
                arguments.setdefault("additionalProperties", False)
            out.append((function["name"], arguments))
    return out


def call_schema(
    tools: list[dict[str, Any]], name: str | None, key: str = "arguments"
) -> dict[str, Any]:
    """The JSON schema of one call `{"name": ..., "arguments": {...}}` (`key` for arguments) to
    `name` (any of `tools` when None), its arguments held to the function's `parameters`.

    Each function's parameters get an `$id` of their own (unless they have one), so that their
    references (`#/$defs/Item`, `#`) resolve against them, not against the answer's schema."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function},
                key: {"$id": f"urn:hotlora:tools:{number}", **arguments},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for number, (function, arguments) in enumerate(tool_parameters(tools, name))
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a tool call: between `start` and `end` (None: to the end of the text)."""

    start: str
    end: str | None
    parse: ToolParser
    json_body: bool = False  # the markup holds {"name": ..., "arguments": {...}}: enforceable
    family: str = ""  # mlx-lm's name for the format (its parser's module), or this server's
    # When the calls are the whole answer (no markup around them): the stream that reads them.
    answer_stream: Callable[[ToolCalls], ToolCallStream] | None = None

    def call_schema(self, tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
        """The JSON schema of one call to `name` (any of `tools` when None)."""
        return call_schema(tools, name)

    @classmethod
    def of(cls, tokenizer: Any) -> ToolFormat | None:
        """The tokenizer's tool-call format, or None when its chat template cannot show tools."""
        template = getattr(tokenizer, "chat_template", None)
        if not getattr(tokenizer, "has_tool_calling", False) or not isinstance(template, str):
            return None
        if "tools" not in template:
            return None
        parse = tokenizer.tool_parser
        family = getattr(parse, "__module__", "").rsplit(".", 1)[-1]
        if family == "mistral" and "[ARGS]" in template:
            family = "mistral_args"  # `[TOOL_CALLS]name[ARGS]{...}`, not a JSON list
        json_body = family == "json_tools"
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, parse, json_body, family)


@dataclass(frozen=True)
class ToolCalls:
    """One request's tools, and how its answer's tool calls are read."""

    format: ToolFormat
    tools: list[dict[str, Any]]  # as the chat template and the parser see them
    parallel: bool = True  # several calls in one answer (`parallel_tool_calls`)
    use: str = "auto"  # 'auto', 'required', or the name of the function it must call

    @property
    def text_allowed(self) -> bool:
        """The answer may be text instead of calls (`tool_choice` 'auto')."""
        return self.use == "auto"

    def split(self, text: str) -> tuple[str, list[OutputToolCall]]:
        """A whole answer as (its text outside tool calls, the calls in order)."""
        stream = self.stream()
        content, calls = stream.feed(text)
        tail, more = stream.flush()
        return content + tail, calls + more

    def stream(self) -> ToolCallStream:
        make = self.format.answer_stream
        return make(self) if make is not None else ToolCallStream(self)

    def read(self, body: str) -> list[OutputToolCall] | None:
        """The calls in one markup body; None when the parser cannot read it."""
        try:
            parsed = self.format.parse(body, self.tools)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            problem = printable(exc)  # it may quote the model's text
            log.info(
                "could not read a tool call (%s: %s); kept as text", type(exc).__name__, problem
            )
            return None
        return output_calls(parsed)


@dataclass
class ToolCallStream:
    """Text in as it is generated; out, the text to show now and the calls completed so far.

    Text that may begin a call's markup is held back until it is known not to.
    """

    calls: ToolCalls
    _held: str = ""
    _body: str | None = None  # inside a call's markup: its text so far
    _count: int = 0

    def feed(self, text: str) -> tuple[str, list[OutputToolCall]]:
        fmt = self.calls.format
        shown: list[str] = []
        found: list[OutputToolCall] = []
        pending = self._held + text
        self._held = ""
        while pending:
            if self._body is None:
                at = pending.find(fmt.start)
                if at < 0:
                    keep = prefix_overlap(pending, fmt.start)
                    shown.append(pending[: len(pending) - keep])
                    self._held = pending[len(pending) - keep :]
                    break
                shown.append(pending[:at])
                self._body, pending = "", pending[at + len(fmt.start) :]
            else:
                body = self._body + pending
                end = body.find(fmt.end) if fmt.end else -1
                if end < 0:
                    self._body, pending = body, ""
                    break
                self._body, pending = None, body[end + len(fmt.end or "") :]
                text_out, calls = self._finish(body[:end], closed=True)
                shown.append(text_out)
                found.extend(calls)
        return "".join(shown), found

    def flush(self) -> tuple[str, list[OutputToolCall]]:
        """The end of the answer: an open call is read as it stands, held text is shown."""
        held, self._held = self._held, ""
        if self._body is None:
            return held, []
        body, self._body = self._body, None
        text, calls = self._finish(body, closed=False)
        return text + held, calls

    def _finish(self, body: str, *, closed: bool) -> tuple[str, list[OutputToolCall]]:
        calls = self.calls.read(body)
        if calls is None:
            fmt = self.calls.format
            return fmt.start + body + ((fmt.end or "") if closed else ""), []
        self._count += len(calls)
        return "", calls

    @property
    def count(self) -> int:
        """Calls completed so far."""
        return self._count


def output_calls(parsed: Any) -> list[OutputToolCall] | None:
    """A parser's call dict (or list of them) as OpenAI's tool calls, each with an id; None when
    one is not a call (no string `name`)."""
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            OutputToolCall(
                id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                function=OutputFunctionCall(name=call["name"], arguments=arguments),
            )
        )
    return calls


def prefix_overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: tool calls with their arguments as objects."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    return out


def _arguments(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
