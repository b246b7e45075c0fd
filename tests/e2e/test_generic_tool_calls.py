"""End to end: tool calls on the embedded model, whose chat template cannot show tools, through
the official `openai` client against a real server. The tools are described in the generic
format and the grammar holds the answer to them: `required` and a named function answer valid
calls, streamed and not, several at once when allowed; `auto` answers a call or text; the
conversation with a call and its result goes back to the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.support.server_process import ServerProcess, hotlora_spec

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def client(embedded_model_dir: Path) -> Iterator[openai.OpenAI]:
    spec = hotlora_spec("--model", str(embedded_model_dir), "--served-model-name", "smol")
    with ServerProcess(spec) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def create(client: openai.OpenAI, **fields: object):
    kwargs: dict = {"model": "smol", "messages": ASK, "tools": TOOLS, "max_tokens": 60}
    return client.chat.completions.create(**{**kwargs, **fields, "temperature": 0})


def check_calls(calls, names: set[str]) -> None:
    """Calls to `names`, their arguments valid under the tool's parameters."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def gather(stream) -> tuple[str, list, str | None]:
    text, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return text, calls, finish


@pytest.mark.parametrize(
    ("choice", "names"), [("required", {"get_weather", "get_time"}), (NAMED, {"get_time"})]
)
def test_a_required_call_is_valid_streamed_and_not(client, choice, names):
    [answer] = create(client, tool_choice=choice, parallel_tool_calls=False).choices
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    [call] = answer.message.tool_calls
    check_calls([call], names)
    stream = create(client, tool_choice=choice, parallel_tool_calls=False, stream=True)
    text, calls, finish = gather(stream)
    assert (text, finish) == ("", "tool_calls")
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, call.function.name, call.function.arguments)
    ]


def test_parallel_calls(client):
    """With parallel calls allowed the small model lists calls, often until `max_tokens`: each
    one it finishes is valid, one cut short is dropped."""
    [answer] = create(client, tool_choice="required", max_tokens=40).choices
    assert answer.finish_reason in ("tool_calls", "length") and answer.message.content is None
    calls = answer.message.tool_calls
    check_calls(calls, {"get_weather", "get_time"})
    text, streamed, finish = gather(
        create(client, tool_choice="required", max_tokens=40, stream=True)
    )
    assert text == "" and finish == answer.finish_reason
    assert [c.index for c in streamed] == list(range(len(calls)))
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_auto_answers_a_call_or_text(client):
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        [answer] = create(client, messages=messages, max_tokens=24).choices
        if answer.message.tool_calls:
            assert answer.finish_reason == "tool_calls"
            check_calls(answer.message.tool_calls, {"get_weather", "get_time"})
        else:
            assert answer.message.content and answer.message.content[0] not in "{ \n"


def test_the_result_goes_back_to_the_model(client):
    first = create(client, tool_choice=NAMED)
    message = first.choices[0].message
    [call] = message.tool_calls
    messages = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "It is 14:05 in Paris."},
    ]
    answer = create(client, messages=messages, tool_choice="none", max_tokens=8)
    # The call and its result are in the prompt (the tools' description is not, with `none`).
    without_tools = create(client, tools=None, max_tokens=1)
    extra = answer.usage.prompt_tokens - without_tools.usage.prompt_tokens
    assert extra >= len(call.function.arguments) // 4 + 10
    assert answer.choices[0].finish_reason in ("stop", "length")
