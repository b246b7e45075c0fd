"""Tool-call formats that are not JSON in tags, on the tiny model's tokenizer: Llama 3's bare
JSON read from answers whole and streamed, and the grammars that hold `required` and named
calls to Llama 3's and Mistral's own formats, control tokens included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hotlora.models.loader import load_model_dir
from hotlora.server.api.tool_calls import ToolCalls, ToolFormat
from hotlora.server.api.tool_families import family_grammar, llama3_format
from hotlora.server.engine import Engine

from tests.support.tiny import with_control_tokens, write_tiny_llama

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
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
# Enough of Llama 3.1's template for its format to be told: it shows tools and names the tag.
LLAMA3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>"
    "{{ message.role }}\n{% if message.tool_calls %}{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ message.content or '' }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{# built-in tools are called after <|python_tag|> #}"
)
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message.tool_calls %}[TOOL_CALLS]"
    "{{ message.tool_calls | tojson }}{% else %}{{ message.content or '' }}{% endif %}"
    "<|im_end|>{% endfor %}"
)
MISTRAL_ARGS_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "{{ message.tool_calls | tojson }}", "{{ call.name }}[ARGS]{{ call.arguments | tojson }}"
)


def engine_for(dir: Path) -> Engine:
    return Engine(load_model_dir(dir), base_id="tiny")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return engine_for(
        write_tiny_llama(tmp_path_factory.mktemp("llama3"), chat_template=LLAMA3_TEMPLATE)
    )


@pytest.fixture(scope="module", params=["text", "control tokens"])
def mistral(tmp_path_factory: pytest.TempPathFactory, request) -> Engine:
    dir = write_tiny_llama(tmp_path_factory.mktemp("mistral"), chat_template=MISTRAL_TEMPLATE)
    if request.param == "control tokens":
        with_control_tokens(dir, ["[TOOL_CALLS]", "[ARGS]"])
    return engine_for(dir)


@pytest.fixture(scope="module")
def mistral_args(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    dir = write_tiny_llama(tmp_path_factory.mktemp("args"), chat_template=MISTRAL_ARGS_TEMPLATE)
    return engine_for(with_control_tokens(dir, ["[TOOL_CALLS]", "[ARGS]"]))


def tool_calls(engine: Engine, parallel: bool = True) -> ToolCalls:
    form = ToolFormat.of(engine.tokenizer) or llama3_format(engine.tokenizer)
    assert form is not None
    return ToolCalls(form, TOOLS, parallel=parallel)


def accepts(engine: Engine, calls: ToolCalls, use: str, answer: str) -> bool:
    """Whether `answer`, then the end, is allowed by the family's grammar for `use`."""
    grammars = engine.grammars
    lark = family_grammar(calls, use, grammars.literal, grammars.json_rule)
    assert lark is not None
    constraint = grammars.tool_lark(lark).start()
    tokenizer = engine.tokenizer
    for token in [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]:
        constraint.consume(token)
        if constraint.error:
            return False
    return True


def test_the_formats_are_told_from_the_templates(llama3, mistral, mistral_args):
    assert tool_calls(llama3).format.family == "llama3"
    assert tool_calls(mistral).format.family == "mistral"
    assert tool_calls(mistral_args).format.family == "mistral_args"


LLAMA3_CALL = '{"name": "get_time", "parameters": {"zone": "UTC"}}'


@pytest.mark.parametrize(
    ("use", "answer", "allowed"),
    [
        ("required", LLAMA3_CALL, True),
        ("required", '{"name": "get_weather", "parameters": {"city": "Paris"}}', True),
        ("required", LLAMA3_CALL.replace("parameters", "arguments"), False),
        ("required", LLAMA3_CALL.replace("UTC", "PST"), False),
        ("required", "It is noon.", False),
        ("get_weather", LLAMA3_CALL, False),
        ("get_time", LLAMA3_CALL, True),
    ],
)
def test_llama3_calls_are_held_to_its_json(llama3, use, answer, allowed):
    assert accepts(llama3, tool_calls(llama3), use, answer) is allowed


def test_llama3_answers_are_read_whole_and_streamed(llama3):
    calls = tool_calls(llama3)
    text, [call] = calls.split(LLAMA3_CALL)
    assert text == "" and call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"zone": "UTC"}
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ' + (
        LLAMA3_CALL
    )
    assert [c.function.name for c in calls.split(tagged)[1]] == ["get_weather", "get_time"]
    for answer in ["It is noon.", '{"zone": "UTC"}', '{"name": "nope", "parameters": {}}', "{"]:
        assert calls.split(answer) == (answer, [])
    stream = calls.stream()
    assert stream.feed(" {") == ("", [])  # may be a call: held to the end
    assert stream.feed(LLAMA3_CALL[1:]) == ("", [])
    text, [call] = stream.flush()
    assert text == "" and stream.count == 1
    stream = calls.stream()
    assert stream.feed("<|py") == ("", []) and stream.feed("x") == ("<|pyx", [])


MISTRAL_CALLS = (
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, '
    '{"name": "get_weather", "arguments": {"city": "Paris"}}]'
)


@pytest.mark.parametrize(
    ("use", "parallel", "answer", "allowed"),
    [
        ("required", True, MISTRAL_CALLS, True),
        ("required", True, MISTRAL_CALLS.replace("[TOOL_CALLS] ", "[TOOL_CALLS]"), True),
        ("required", False, MISTRAL_CALLS, False),
        ("required", True, MISTRAL_CALLS.replace("[TOOL_CALLS] ", ""), False),
        ("required", True, MISTRAL_CALLS.replace("Paris", "Paris", 1).replace("UTC", "X"), False),
        ("get_time", True, MISTRAL_CALLS, False),
        ("get_time", False, MISTRAL_CALLS.split(", {")[0] + "]", True),
    ],
)
def test_mistral_calls_are_held_to_its_list(mistral, use, parallel, answer, allowed):
    calls = tool_calls(mistral, parallel)
    assert accepts(mistral, calls, use, answer) is allowed
    if allowed:
        text, read = calls.split(answer)
        assert (
            text == ""
            and read
            and all(c.function.name in ("get_time", "get_weather") for c in read)
        )


ARGS_CALLS = (
    '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
)


@pytest.mark.parametrize(
    ("use", "parallel", "answer", "allowed"),
    [
        ("required", True, ARGS_CALLS, True),
        ("required", False, ARGS_CALLS, False),
        ("required", False, ARGS_CALLS.split("[TOOL_CALLS]get_weather")[0], True),
        ("required", True, ARGS_CALLS.replace("CET", "PST"), False),
        ("get_weather", True, ARGS_CALLS, False),
        ("get_weather", True, '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', True),
    ],
)
def test_mistral_header_calls_are_held_to_their_form(mistral_args, use, parallel, answer, allowed):
    calls = tool_calls(mistral_args, parallel)
    assert accepts(mistral_args, calls, use, answer) is allowed
    if allowed:
        text, read = calls.split(answer)
        assert text == "" and read


def test_a_control_token_is_matched_as_itself(mistral_args):
    grammars = mistral_args.grammars
    [token] = mistral_args.tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)
    assert grammars.literal("[TOOL_CALLS]") == f"<[{token}]>"
    assert grammars.literal("get_time") == '"get_time"'


def test_formats_without_a_grammar_here_have_none(mistral):
    pythonic = ToolFormat(
        "<|tool_call_start|>", "<|tool_call_end|>", lambda b, t: {}, False, "pythonic"
    )
    grammars = mistral.grammars
    assert (
        family_grammar(ToolCalls(pythonic, TOOLS), "required", grammars.literal, grammars.json_rule)
        is None
    )
