"""Tool-call formats whose calls are not JSON in tags: Llama 3's bare JSON (found and read here;
mlx-lm has no parser for it), and the grammars that hold `tool_choice` required or named to a
family's own format (Llama 3's JSON, Mistral's `[TOOL_CALLS]` list or `name[ARGS]{...}`).

A format with no grammar here (pythonic calls, XML-like parameters) serves `auto` only.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotlora.config.errors import InvalidRequest
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
        if not isinstance(call, dict):
            raise ValueError("not a call")
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
    if family == "pythonic":
        return _pythonic(calls, named, literal, json_rule)
    if family == "qwen3_coder":
        return _qwen3_coder(calls, named, literal, json_rule)
    if family == "glm47":
        return _glm47(calls, named, literal, json_rule)
    if family in _GEMMA_QUOTES:
        return _gemma(calls, named, literal, json_rule)
    return None


def _pythonic(calls: ToolCalls, named: str | None, literal: Literal, json_rule: JsonRule) -> str:
    """LFM2's `<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>`: each value
    JSON, which reads as the Python literal the parser takes (`true`, `null` included)."""
    options = []
    for name, parameters in tool_parameters(calls.tools, named):
        arguments = [
            (f"{json.dumps(key + '=')} {json_rule(schema)}", required)
            for key, schema, required in _properties(parameters)
        ]
        options.append(f'{json.dumps(name + "(")} {_joined(arguments, json.dumps(", "))} ")"')
    more = ' ("," " "? call)*' if calls.parallel else ""
    form = calls.format
    start, end = literal(form.start), literal(form.end or "")
    return f'start: {start} "[" call{more} "]" {end}\ncall: {" | ".join(options)}\n'


def _qwen3_coder(calls: ToolCalls, named: str | None, literal: Literal, json_rule: JsonRule) -> str:
    """Qwen3-Coder's `<tool_call>` holding `<function=name>` and one `<parameter=key>` block per
    argument: a string as its raw text (no `<` in it), anything else as JSON."""
    options = []
    for name, parameters in tool_parameters(calls.tools, named):
        arguments = []
        for key, schema, required in _properties(parameters):
            opening = json.dumps(f"<parameter={key}>\n")
            value = _raw_value(schema, json_rule, "\n</parameter>\n")
            arguments.append((f"{opening} {value}", required))
        head = json.dumps(f"<function={name}>\n")
        options.append(f'{head} {_joined(arguments, "")} "</function>\\n"')
    form = calls.format
    start, end = literal(form.start), literal(form.end or "")
    repeat = ' ("\\n" call)*' if calls.parallel else ""
    return (
        f'start: call{repeat}\ncall: {start} "\\n" function {end}\n'
        f"function: {' | '.join(options)}\n"
    )


def _glm47(calls: ToolCalls, named: str | None, literal: Literal, json_rule: JsonRule) -> str:
    """GLM's `<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value>...</tool_call>`
    (4.5 puts a newline after the name and each tag): a string raw, anything else as JSON."""
    options = []
    for name, parameters in tool_parameters(calls.tools, named):
        arguments = []
        for key, schema, required in _properties(parameters):
            opening = json.dumps(f"<arg_key>{key}</arg_key>")
            value = _raw_value(schema, json_rule, "</arg_value>")
            arguments.append((f'{opening} "\\n"? "<arg_value>" {value} "\\n"?', required))
        options.append(f'{json.dumps(name)} "\\n"? {_joined(arguments, "")}')
    form = calls.format
    start, end = literal(form.start), literal(form.end or "")
    repeat = ' ("\\n"? call)*' if calls.parallel else ""
    return f"start: call{repeat}\ncall: {start} function {end}\nfunction: {' | '.join(options)}\n"


# Gemma's call formats: how a string argument is quoted.
_GEMMA_QUOTES = {"function_gemma": "<escape>", "gemma4": '<|"|>'}


def _gemma(calls: ToolCalls, named: str | None, literal: Literal, json_rule: JsonRule) -> str:
    """FunctionGemma's and Gemma 4's `call:name{key:value,...}` between the format's marks."""
    quote = _GEMMA_QUOTES[calls.format.family]
    options = []
    for name, parameters in tool_parameters(calls.tools, named):
        arguments = [
            (f"{json.dumps(key + ':')} {_delimited_value(schema, json_rule, literal, quote)}", req)
            for key, schema, req in _properties(parameters)
        ]
        options.append(f'{json.dumps(f"call:{name}{{")} {_joined(arguments, json.dumps(","))} "}}"')
    form = calls.format
    start, end = literal(form.start), literal(form.end or "")
    repeat = "+" if calls.parallel else ""
    return f"start: call{repeat}\ncall: {start} ({' | '.join(options)}) {end}\n"


class UnenforceableArguments(InvalidRequest):
    """A tool's parameters that a family's format cannot be held to by the grammar."""

    code = "invalid_function_parameters"  # OpenAI's, as for parameters no grammar can enforce

    def __init__(self, problem: str):
        super().__init__(
            f"tool_choice cannot be enforced for these tools in this model's tool-call format: "
            f"{problem}; send 'auto' and the model may still call a tool.",
            param="tools",
        )


def _properties(parameters: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(key, schema, required) of an object schema's properties, the required first; a schema
    that is not a plain object of named properties cannot be written key by key."""
    keys = set(parameters) - {"type", "properties", "required", "additionalProperties"}
    keys -= {"description", "title", "$schema"}
    if parameters.get("type") != "object" or keys or parameters.get("additionalProperties"):
        raise UnenforceableArguments("its parameters are not a plain object of properties")
    properties = parameters.get("properties") or {}
    listed = parameters.get("required") or []
    if not isinstance(properties, dict) or not (
        isinstance(listed, list) and all(isinstance(key, str) for key in listed)
    ):
        raise UnenforceableArguments("its properties are not an object or required a list of names")
    required = set(listed)
    out = [(key, schema, key in required) for key, schema in properties.items()]
    return sorted(out, key=lambda item: not item[2])


def _raw_value(schema: Any, json_rule: JsonRule, closing: str) -> str:
    """A Lark expression of one argument as an XML-like format writes it, then `closing`: a
    string raw (its `enum` or its length held), anything else as JSON. Free text and its
    closing are one regular expression: the lexer would run a free text's match past it."""
    enum = _string_enum(schema)
    if enum is not None:
        return f"({' | '.join(json.dumps(value) for value in enum)}) {json.dumps(closing)}"
    if schema.get("type") == "string":
        return _free_text(schema, "<", closing)
    if "type" not in schema:
        raise UnenforceableArguments("an argument has no type")
    return f"{json_rule(schema)} {json.dumps(closing)}"


def _delimited_value(schema: Any, json_rule: JsonRule, literal: Literal, quote: str) -> str:
    """A Lark expression of one argument as Gemma's `call:name{key:value,...}` writes it: a
    string raw between two `quote`s (no `<`, `{` or `}` in it), a number or boolean as JSON."""
    enum = _string_enum(schema)
    mark = literal(quote)
    if enum is not None:
        return f"{mark} ({' | '.join(json.dumps(value) for value in enum)}) {mark}"
    if schema.get("type") == "string":
        if mark.startswith("<["):  # a control token: free text cannot run past it
            return f"{mark} {_free_text(schema, '<{}', '')} {mark}"
        return f"{mark} {_free_text(schema, '<{}', quote)}"
    if schema.get("type") not in ("integer", "number", "boolean"):
        raise UnenforceableArguments("an argument is not a string, number or boolean")
    return json_rule(schema)


def _string_enum(schema: Any) -> list[str] | None:
    """A string argument's `enum`; None for any other argument."""
    if not isinstance(schema, dict):
        raise UnenforceableArguments("an argument's schema is not an object")
    enum = schema.get("enum")
    if not isinstance(enum, list) or not all(isinstance(value, str) for value in enum):
        return None
    return enum if schema.get("type", "string") == "string" else None


def _free_text(schema: dict[str, Any], excluded: str, closing: str) -> str:
    """A regular expression of a string argument's raw text (no character of `excluded`, its
    length held), then `closing`."""
    if set(schema) - {"type", "description", "title", "minLength", "maxLength"}:
        raise UnenforceableArguments("a string argument's constraints cannot be held raw")
    low, high = schema.get("minLength", 0), schema.get("maxLength", "")
    if not all(type(n) is int and n >= 0 for n in (low, high) if n != ""):
        raise UnenforceableArguments("a string argument's length bounds are not counts")
    escaped = "".join({"\n": "\\n", "/": "\\/"}.get(c, re.escape(c)) for c in closing)
    return f"/[^{re.escape(excluded)}]{{{low},{high}}}{escaped}/"


def _joined(items: list[tuple[str, bool]], separator: str) -> str:
    """Lark of `items` in order, separated by `separator` (a Lark expression, or ""), each
    optional one (`required` false) free to be left out; "" when there are none."""
    sep = f"{separator} " if separator else ""
    required = [item for item, needed in items if needed]
    optional = [item for item, needed in items if not needed]
    if required:
        return " ".join([f"{sep}{item}" if i else item for i, item in enumerate(required)]) + (
            "".join(f" ({sep}{item})?" for item in optional)
        )
    if not optional:
        return ""
    firsts = [
        item + "".join(f" ({sep}{later})?" for later in optional[i + 1 :])
        for i, item in enumerate(optional)
    ]
    return "(" + " | ".join(firsts) + ")?"
