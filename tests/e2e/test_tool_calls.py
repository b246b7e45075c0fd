"""End to end: tool calls through the official `openai` client against a real server on a tiny
model whose chat template shows tools (Qwen's `<tool_call>` JSON). `tool_choice` "required" holds
the random model to a call, so the whole path runs: template, grammar, parser, wire format."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.support.server_process import ServerProcess, hotlora_spec
from tests.support.tiny import TOOL_CHAT_TEMPLATE, write_tiny_llama

pytestmark = pytest.mark.e2e

CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
DICE = {
    "type": "function",
    "function": {
        "name": "roll",
        "parameters": {
            "type": "object",
            "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 20}},
            "required": ["sides"],
        },
    },
}
ASK = [{"role": "user", "content": "what time is it in paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = write_tiny_llama(
        tmp_path_factory.mktemp("tiny-tools"), quantize=True, chat_template=TOOL_CHAT_TEMPLATE
    )
    spec = hotlora_spec("--model", str(model), "--served-model-name", "tiny")
    with ServerProcess(spec) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def check_call(name: str, arguments: str) -> None:
    values = json.loads(arguments)
    if name == "get_time":
        assert values["zone"] in ("UTC", "CET", "PST")
    else:
        assert name == "roll" and 2 <= values["sides"] <= 20


def test_a_required_call_comes_back_as_tool_calls(client: openai.OpenAI):
    response = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[CLOCK, DICE],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)


def test_a_named_call_streams_as_deltas(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[CLOCK, DICE],
        tool_choice={"type": "function", "function": {"name": "roll"}},
        max_tokens=200,
        temperature=0.8,
        seed=5,
        stream=True,
    )
    calls, text, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        calls.extend(delta.tool_calls or [])
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in text
    [call] = calls
    assert call.function.name == "roll"
    check_call(call.function.name, call.function.arguments)


def test_the_tool_result_goes_back_to_the_model(client: openai.OpenAI):
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[CLOCK], tool_choice="required", max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "14:05"},
    ]
    answer = client.chat.completions.create(
        model="tiny", messages=messages, tools=[CLOCK], max_tokens=4, temperature=0
    )
    # The conversation with the call and its result renders through the template: a longer
    # prompt than the question alone, by at least the call's markup.
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
