"""Tool-call formats whose calls are not JSON in tags: Llama 3's bare JSON (found and read here;
mlx-lm has no parser for it), and the grammars that hold `tool_choice` required or named to a
family's own format (Llama 3's JSON, Mistral's `[TOOL_CALLS]` list or `name[ARGS]{...}`).

A format with no grammar here (pythonic calls, XML-like parameters) serves `auto` only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotlora.server.api.completion_answers import OutputToolCall
from hotlora.server.api.generic_tools import next_object
from hotlora.server.api.tool_calls import (
    ToolCalls,
    ToolCallStream,
    ToolFormat,
    call_schema,
    tool_parameters,
)

log = logging.getLogger("hotlora")

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's mark of a call (to a built-in tool, mostly)
MISTRAL_START = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"

Literal = Callable[[str], str]  # text -> a Lark expression matching it as the model writes it
JsonRule = Callable[[dict[str, Any]], str]  # schema -> a Lark expression of JSON valid under it


def llama3_format(tokenizer: Any) -> ToolFormat | None:
    """Llama 3.1-3.3's format when the chat template is theirs: it shows tools and writes a
    call as `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` for built-in tools)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template or PYTHON_TAG not in template:
        return None
    return ToolFormat(
        PYTHON_TAG, None, parse_llama3, json_body=True, family="llama3", answer_stream=Llama3Stream
    )


def parse_llama3(body: str, tools: Any) -> list[dict[str, Any]]:
    """The calls in a Llama 3 answer: JSON objects, `;`-separated, each with its `name` and
    its arguments as `parameters` (or `arguments`)."""
    text = body.strip().removeprefix(PYTHON_TAG)
    calls, at = [], 0
    while True:
        span = next_object(text, at, ";")
        if span is None:
            if text[at:].strip(" \n;"):
                raise ValueError("a call is not whole")
            break
        start, end = span
        call = json.loads(text[start:end])
        arguments = call.get("parameters", call.get("arguments"))
        if set(call) - {"name", "parameters", "arguments", "type"} or not isinstance(
            arguments, dict
        ):
            raise ValueError("not a call")
        calls.append({"name": call["name"], "arguments": arguments})
        at = end
    if not calls:
        raise ValueError("no call")
    return calls


@dataclass
class Llama3Stream(ToolCallStream):
    """A Llama 3 answer: text, or (when it begins with `{` or `<|python_tag|>`) held and read
    as calls at its end; an answer that does not read as calls is shown as text then."""

    _seen: str = ""
    _mode: str = "open"  # open (not known yet), text or calls

    def feed(self, text: str) -> tuple[str, list[OutputToolCall]]:
        if self._mode == "text":
            return text, []
        self._seen += text
        head = self._seen.lstrip()
        if self._mode == "open" and head:
            if head.startswith(("{", PYTHON_TAG)):
                self._mode = "calls"
            elif not PYTHON_TAG.startswith(head):
                self._mode, shown, self._seen = "text", self._seen, ""
                return shown, []
        return "", []

    def flush(self) -> tuple[str, list[OutputToolCall]]:
        seen, mode = self._seen, self._mode
        self._seen, self._mode = "", "text"
        if mode != "calls":
            return seen, []
        calls = self.calls.read(seen)
        names = {tool["function"]["name"] for tool in self.calls.tools}
        if not calls or any(call.function.name not in names for call in calls):
            return seen, []
        self._count += len(calls)
        return "", calls


def writes_control_tokens(form: ToolFormat | None, is_control: Callable[[str], bool]) -> bool:
    """Whether the format's markup is control tokens (Mistral's `[TOOL_CALLS]`, Llama 3's
    `<|python_tag|>`): generated, they add no text unless the row keeps them, and the parser
    reads them in the text."""
    if form is None:
        return False
    markers = [form.start, form.end or ""]
    if form.family == "mistral_args":
        markers.append(MISTRAL_ARGS)
    return any(marker and is_control(marker) for marker in markers)


def family_grammar(calls: ToolCalls, use: str, literal: Literal, json_rule: JsonRule) -> str | None:
    """The Lark grammar of an answer that is calls in `calls.format`'s own format, to one of
    the tools (`use` 'required') or the named one; None when the format has none here."""
    named = None if use == "required" else use
    family = calls.format.family
    if family == "llama3":  # one call a turn, as Llama 3.1's template asks
        return f"start: {json_rule(call_schema(calls.tools, named, 'parameters'))}\n"
    if family == "mistral":
        listed: dict[str, Any] = {
            "type": "array",
            "items": call_schema(calls.tools, named),
            "minItems": 1,
        }
        if not calls.parallel:
            listed["maxItems"] = 1
        return f'start: {literal(MISTRAL_START)} " "? {json_rule(listed)}\n'
    if family == "mistral_args":
        options = [
            f"{json.dumps(name)} {literal(MISTRAL_ARGS)} {json_rule(parameters)}"
            for name, parameters in tool_parameters(calls.tools, named)
        ]
        repeat = "+" if calls.parallel else ""
        return f"start: call{repeat}\ncall: {literal(MISTRAL_START)} ({' | '.join(options)})\n"
    return None
