"""`tool_choice` required and named on templates whose calls are not JSON in tags, in-process on
the tiny random model: Llama 3's bare JSON, Mistral's `[TOOL_CALLS]` (a list, or
`name[ARGS]{...}` with control tokens), LFM2's pythonic calls, Qwen3-Coder's and GLM's XML-like
parameters and Gemma's `call:name{...}`, each held by the grammar to valid calls in its own
format, whole and streamed; and Llama 3's calls and results going back through its template."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from fastapi.testclient import TestClient

from tests.http.test_tools import sdk, steer
from tests.support.tiny import with_control_tokens, write_tiny_llama
from tests.unit.test_tool_families import (
    FUNCTION_GEMMA_TOKENS,
    GEMMA4_TOKENS,
    GLM_TEMPLATE,
    LLAMA3_TEMPLATE,
    MISTRAL_ARGS_TEMPLATE,
    MISTRAL_TEMPLATE,
    PYTHONIC_TEMPLATE,
    QWEN3_CODER_TEMPLATE,
    TOOLS,
)

PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
# The random model writes any string it may: held short, so a call ends well within max_tokens.
TOOLS = [
    {
        "type": "function",
        "function": {
            **tool["function"],
            "parameters": {
                **tool["function"]["parameters"],
                "properties": {
                    key: {**value, "maxLength": 6} if value.get("type") == "string" else value
                    for key, value in tool["function"]["parameters"]["properties"].items()
                },
            },
        },
    }
    for tool in TOOLS
]
ASK = [{"role": "user", "content": "weather in paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
PYTHONIC_CALL = "<|tool_call_start|>[name(key=value)]<|tool_call_end|>"
MISTRAL_TOKENS = ["[TOOL_CALLS]", "[ARGS]"]
TEMPLATES = {  # family: (chat template, its control tokens)
    "llama3": (LLAMA3_TEMPLATE, []),
    "mistral": (MISTRAL_TEMPLATE, MISTRAL_TOKENS),
    "mistral_args": (MISTRAL_ARGS_TEMPLATE, MISTRAL_TOKENS),
    "pythonic": (PYTHONIC_TEMPLATE, ["<|tool_call_start|>", "<|tool_call_end|>"]),
    "qwen3_coder": (QWEN3_CODER_TEMPLATE, []),
    "glm47": (GLM_TEMPLATE, []),
    **{
        family: (PYTHONIC_TEMPLATE.replace(PYTHONIC_CALL, " ".join(tokens)), tokens)
        for family, tokens in [
            ("function_gemma", FUNCTION_GEMMA_TOKENS),
            ("gemma4", GEMMA4_TOKENS),
        ]
    },
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    template, control = TEMPLATES[request.param]
    dir = write_tiny_llama(tmp_path_factory.mktemp(request.param), chat_template=template)
    return with_control_tokens(dir, control) if control else dir


@pytest.fixture
def client(make_client, model_dir: Path) -> TestClient:
    return make_client(model=model_dir)


def create(client: TestClient, **fields: object):
    kwargs: dict = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 150}
    return sdk(client).chat.completions.create(**{**kwargs, **fields})


def check(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize(
    ("choice", "names"), [("required", {"get_weather", "get_time"}), (NAMED, {"get_time"})]
)
def test_a_required_call_is_held_to_the_family_format(client, choice, names):
    [answer] = create(client, tool_choice=choice, parallel_tool_calls=False, seed=4).choices
    assert answer.finish_reason == "tool_calls", answer
    assert not answer.message.content
    check(answer.message.tool_calls, names)
    assert len(answer.message.tool_calls) == 1
    stream = create(client, tool_choice=choice, parallel_tool_calls=False, seed=4, stream=True)
    calls, text, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (text, finish) == ("", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in answer.message.tool_calls
    ]


def test_llama3_calls_and_results_go_back_through_its_template(make_client, tmp_path):
    client = make_client(model=write_tiny_llama(tmp_path / "llama3", chat_template=LLAMA3_TEMPLATE))
    steer(client, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    [answer] = create(client).choices  # auto: read as a call
    assert answer.finish_reason == "tool_calls"
    [call] = answer.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    steer(client, "Sunny.")
    messages = [
        *ASK,
        answer.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    response = create(client, messages=messages)
    assert response.choices[0].message.content == "Sunny."
    tokenizer = client.app.state.runtime.worker.engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [
            *ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": call.id},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in rendered
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_parameters_a_format_cannot_hold_are_a_400(make_client, tmp_path):
    client = make_client(
        model=write_tiny_llama(tmp_path / "coder", chat_template=QWEN3_CODER_TEMPLATE)
    )
    patterned = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "pattern": "^a+$"}},
            },
        },
    }
    body = {"model": "tiny", "messages": ASK, "tools": [patterned], "max_tokens": 4}
    refused = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "tools" and "cannot be held raw" in error["message"]
    assert "send 'auto'" in error["message"]
    assert client.post("/v1/chat/completions", json=body).status_code == 200
