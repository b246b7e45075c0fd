"""The generic tool-call format: its answers read whole and as they stream, the conversation
written for a template that cannot show tools, and its grammars on the tiny model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hotlora.models.loader import load_model_dir
from hotlora.server.api.generic_tools import GENERIC, GenericToolCalls
from hotlora.server.engine import Engine
from hotlora.server.engine.grammar import Grammar, UnsupportedSchema
from hotlora.server.render.tool_prompt import (
    generic_messages,
    takes_system_messages,
    tool_description,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
TWO_CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa]}ris \\"x\\""}}, '
    '{"name": "get_time", "arguments": {"zone": "UTC"}}]}'
)


def generic(use: str = "auto", parallel: bool = True) -> GenericToolCalls:
    return GenericToolCalls(GENERIC, TOOLS, use=use, parallel=parallel)


def feed_in_pieces(text: str, size: int) -> tuple[list[str], list, list[int]]:
    """The stream's shown text per piece, its calls, and after how many pieces each came."""
    stream = generic().stream()
    shown, calls, when = [], [], []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for n, piece in enumerate(pieces, start=1):
        out, found = stream.feed(piece)
        shown.append(out)
        calls += found
        when += [n] * len(found)
    out, found = stream.flush()
    shown.append(out)
    return shown, calls + found, when


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_each_call_comes_out_when_its_object_closes(size):
    shown, calls, when = feed_in_pieces(TWO_CALLS, size)
    assert "".join(shown) == ""
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": 'Pa]}ris "x"'}
    assert json.loads(calls[1].function.arguments) == {"zone": "UTC"}
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    if size == 1:
        # The first call is out once its closing brace is, well before the answer ends.
        first_end = TWO_CALLS.index("}}, ") + 2
        assert when[0] == first_end < when[1]


def test_text_streams_as_it_comes():
    stream = generic().stream()
    assert stream.feed("Hel") == ("Hel", [])
    assert stream.feed('lo {"tool_calls": [') == ('lo {"tool_calls": [', [])
    assert stream.flush() == ("", []) and stream.count == 0


def test_a_brace_is_held_until_it_cannot_begin_the_calls():
    stream = generic().stream()
    assert stream.feed('{"tool') == ("", [])
    assert stream.feed('s": 1}') == ('{"tools": 1}', [])
    assert stream.flush() == ("", [])


@pytest.mark.parametrize(
    "answer",
    [
        '{"tool_calls": [{"name": "get_weather", "arguments": {"ci',  # cut by max_tokens
        '{"tool_calls": [{"name": "nope", "arguments": {}}]}',  # no such tool
        '{"tool_calls": [{"name": "get_weather" "arguments": {}}]}',  # not JSON
        '{"tool_',
    ],
)
def test_an_answer_that_does_not_read_as_calls_stays_text(answer):
    text, calls = generic().split(answer)
    assert (text, calls) == (answer, [])


def test_after_a_whole_call_an_unreadable_rest_stays_text():
    answer = TWO_CALLS[: TWO_CALLS.index("}}, ") + 4] + '{"name": "get_time" "arguments": {}}]}'
    text, calls = generic().split(answer)
    assert [c.function.name for c in calls] == ["get_weather"]
    assert text == '{"name": "get_time" "arguments": {}}]}'


def test_after_a_whole_call_one_cut_short_is_dropped():
    answer = TWO_CALLS[: TWO_CALLS.index("}}, ") + 4] + '{"name": "get_ti'
    text, calls = generic().split(answer)
    assert [c.function.name for c in calls] == ["get_weather"] and text == ""


def test_calls_written_with_other_whitespace_are_read():
    answer = '{ "tool_calls" :[\n {"name": "get_time", "arguments": {"zone": "CET"}}\n]\n}\n'
    text, [call] = generic().split(answer)
    assert text == "" and call.function.name == "get_time"


def test_the_answer_schema_follows_tool_choice_and_parallel_calls():
    schema = generic("required").answer_schema()
    calls = schema["properties"]["tool_calls"]
    assert calls["minItems"] == 1 and "maxItems" not in calls
    assert [o["properties"]["name"]["const"] for o in calls["items"]["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    one = generic("get_time", parallel=False).answer_schema()["properties"]["tool_calls"]
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"] == {"const": "get_time"}
    assert one["items"]["properties"]["arguments"]["additionalProperties"] is False


CONVERSATION = [
    {"role": "user", "content": "weather and time in paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": {"zone": "CET"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


def test_calls_and_results_are_written_in_the_generic_format():
    out = generic_messages(CONVERSATION, None)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert json.loads(out[1]["content"]) == {
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "get_time", "arguments": {"zone": "CET"}},
        ]
    }
    assert "tool_calls" not in out[1]
    assert json.loads(out[2]["content"]) == {
        "tool_results": [
            {"name": "get_weather", "content": "sunny"},
            {"name": "get_time", "content": "14:05"},
        ]
    }
    # The calls are written as the grammar has the model write them.
    assert out[1]["content"].startswith('{"tool_calls": [{"name": "get_weather", "arguments": {')
    assert CONVERSATION[1]["tool_calls"]  # the request's messages are left as they were


def test_the_tools_are_described_in_the_system_message():
    calls = generic("required")
    out = generic_messages(CONVERSATION, calls)
    assert out[0] == {"role": "system", "content": tool_description(calls)}
    with_system = generic_messages([{"role": "system", "content": "Be brief."}, *ASK], calls)
    assert with_system[0]["content"] == "Be brief.\n\n" + tool_description(calls)
    no_system_role = generic_messages(ASK, calls, system_role=False)
    assert no_system_role == [
        {"role": "user", "content": tool_description(calls) + "\n\nweather in paris?"}
    ]


def test_the_description_lists_the_tools_and_what_the_answer_must_be():
    auto = tool_description(generic())
    listed = [json.loads(line) for line in auto.splitlines() if line.startswith('{"name"')]
    assert listed == [
        {k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")}
        for t in TOOLS
    ]
    assert "plain text" in auto and "several calls" in auto
    assert "must call a tool" in tool_description(generic("required"))
    named = tool_description(generic("get_time", parallel=False))
    assert 'must call the tool "get_time"' in named and "one call at a time" in named


ASK = [{"role": "user", "content": "weather in paris?"}]


class _Template:
    """A tokenizer's `apply_chat_template` that refuses system messages, as some do."""

    def apply_chat_template(self, messages, **kwargs):
        if messages[0]["role"] == "system":
            raise ValueError("System role not supported")
        return "x"


def test_a_template_that_refuses_system_messages_is_told(tiny_model_dir: Path):
    assert takes_system_messages(load_model_dir(tiny_model_dir).tokenizer)
    assert not takes_system_messages(_Template())


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model_dir(tiny_model_dir), base_id="tiny")


def accepts(engine: Engine, grammar: Grammar, text: str) -> bool:
    """Whether `text`, then the end of the answer, is allowed by `grammar`."""
    constraint = grammar.start()
    tokenizer = engine.tokenizer
    for token in [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]:
        constraint.consume(token)
        if constraint.error:
            return False
    return True


ONE_CALL = '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}'


@pytest.mark.parametrize(
    ("use", "parallel", "answer", "allowed"),
    [
        ("required", True, ONE_CALL, True),
        ("required", True, TWO_CALLS.replace(' \\"x\\"', ""), True),
        ("required", False, TWO_CALLS.replace(' \\"x\\"', ""), False),
        ("required", True, '{"tool_calls": []}', False),
        ("required", True, "It is noon.", False),
        ("required", True, ONE_CALL.replace("UTC", "PST"), False),  # not in the enum
        ("required", True, ONE_CALL.replace('"UTC"', '"UTC", "x": 1'), False),  # undeclared
        ("required", True, ONE_CALL.replace(": ", ":"), False),  # the grammar's separators
        ("get_weather", True, ONE_CALL, False),
        ("get_time", False, ONE_CALL, True),
        ("auto", True, ONE_CALL, True),
        ("auto", True, "It is noon {in paris}.\nBye.", True),
        ("auto", True, "", True),
        ("auto", True, " It is noon.", False),  # text cannot begin as a call might
        ("auto", True, '{"time": "noon"}', False),
    ],
)
def test_the_grammar_holds_the_answer_to_the_tools(engine, use, parallel, answer, allowed):
    calls = GenericToolCalls(GENERIC, TOOLS, use=use, parallel=parallel)
    grammar = engine.grammars.tool_answer(calls.answer_schema(), text=use == "auto")
    assert accepts(engine, grammar, answer) is allowed


def _order_tool(name: str, item: dict) -> dict:
    """A function whose parameters name a definition of their own, as SDKs write nested models."""
    parameters = {
        "type": "object",
        "$defs": {"Item": item},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
        "required": ["items"],
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


SKU = {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}
COUNT = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}


@pytest.mark.parametrize(
    ("answer", "allowed"),
    [
        ('{"name": "order", "arguments": {"items": [{"sku": "a"}]}}', True),
        ('{"name": "order", "arguments": {"items": [{"count": 2}]}}', False),
        ('{"name": "tally", "arguments": {"items": [{"count": 2}]}}', True),
        ('{"name": "tally", "arguments": {"items": [{"sku": "a"}]}}', False),
    ],
)
def test_a_tool_s_references_resolve_in_its_own_parameters(engine, answer, allowed):
    """Two tools with a definition of the same name each hold their calls to their own."""
    tools = [_order_tool("order", SKU), _order_tool("tally", COUNT)]
    calls = GenericToolCalls(GENERIC, tools, use="required")
    grammar = engine.grammars.tool_answer(calls.answer_schema(), text=False)
    assert accepts(engine, grammar, '{"tool_calls": [' + answer + "]}") is allowed


def test_a_reference_that_does_not_resolve_is_refused_without_the_grammar(engine):
    tool = _order_tool("order", SKU)
    tool["function"]["parameters"]["properties"]["items"]["items"] = {"$ref": "#/$defs/Gone"}
    calls = GenericToolCalls(GENERIC, [tool], use="auto")
    with pytest.raises(UnsupportedSchema) as caught:
        engine.grammars.tool_answer(calls.answer_schema(), text=True)
    error = caught.value
    assert (error.param, error.code) == ("tools", "invalid_function_parameters")
    assert "/$defs/Gone" in error.message
    assert "\n" not in error.message and "start:" not in error.message


def test_a_regular_expression_s_error_says_why_on_one_line(engine):
    """llguidance reports a regex's error at a place in its grammar, quoting it: the client
    reads the reason, not the grammar."""
    with pytest.raises(UnsupportedSchema) as caught:
        engine.grammars.regex("a(b", param="guided_regex")
    message = caught.value.message
    assert "unclosed group" in message
    assert "\n" not in message and "start:" not in message
