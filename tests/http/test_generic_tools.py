"""Tools on a model whose chat template cannot show them, in-process on the tiny model: the
tools described in the generic format, the random model held by the grammar to valid calls
(`required`, named, parallel or not, streamed and not) or to calls or text (`auto`), the
round trip rendered back, and the same on /tokenize and /v1/responses."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from hotlora.server.api.generic_tools import GENERIC, GenericToolCalls
from hotlora.server.render.tool_prompt import generic_messages

from tests.http.test_responses_api import events
from tests.http.test_tools import sdk, steer
from tests.support.tiny import with_context, write_tiny_llama

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
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
            "properties": {
                "zone": {"type": "string", "enum": ["UTC", "CET"]},
                "hours": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "weather in paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (its template shows no tools) with room for the tools' description."""
    return with_context(write_tiny_llama(tmp_path_factory.mktemp("tiny"), quantize=True), 4096)


@pytest.fixture
def client(make_client, model_dir: Path) -> TestClient:
    return make_client(model=model_dir)


def check_calls(calls, names: set[str]) -> None:
    """Every call is to one of `names`, its arguments valid under the tool's parameters."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def create(client: TestClient, **fields: object):
    kwargs: dict = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 120}
    return sdk(client).chat.completions.create(**{**kwargs, **fields})


def gather(stream) -> tuple[str, list, str | None]:
    """A stream's text, its calls (joined from their deltas by index), its finish reason."""
    text, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or ():
            assert call.index not in calls  # each call comes whole, in one delta
            calls[call.index] = call
        finish = chunk.choices[0].finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", {"get_weather", "get_time"}), (NAMED, {"get_time"})],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_call_is_valid(client, choice, names, parallel):
    for seed in (1, 2):
        response = create(
            client, tool_choice=choice, parallel_tool_calls=parallel, temperature=1, seed=seed
        )
        [answer] = response.choices
        assert answer.finish_reason == "tool_calls", answer
        assert answer.message.content is None
        check_calls(answer.message.tool_calls, names)
        if not parallel:
            assert len(answer.message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_required_call_streams_as_deltas(client, choice):
    text, calls, finish = gather(
        create(client, tool_choice=choice, temperature=1, seed=3, stream=True)
    )
    assert (text, finish) == ("", "tool_calls")
    check_calls(calls, {"get_time"} if choice == NAMED else {"get_weather", "get_time"})
    assert [call.index for call in calls] == list(range(len(calls)))
    whole = create(client, tool_choice=choice, temperature=1, seed=3)
    # Streamed or not, the same calls (ids aside).
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_the_sdks_stream_helper_gathers_a_required_call_as_unstreamed(client, choice):
    # An answer that must call a tool opens with no empty content, so the message the SDK
    # gathers from the stream has content null, as the unstreamed answer's.
    fields = {"tool_choice": choice, "temperature": 1, "seed": 3}
    kwargs = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 120, **fields}
    with sdk(client).chat.completions.stream(**kwargs) as stream:
        gathered = stream.get_final_completion().choices[0].message
    whole = create(client, **fields).choices[0].message
    assert gathered.content is None and whole.content is None
    assert [c.function.name for c in gathered.tool_calls] == [
        c.function.name for c in whole.tool_calls
    ]


PARALLEL = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"zone": "CET"}}]}'
)


def test_parallel_calls_come_back_in_order(client):
    steer(client, PARALLEL)
    response = create(client, tool_choice="required")
    calls = response.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({c.id for c in calls}) == 2
    steer(client, PARALLEL)
    text, streamed, finish = gather(create(client, tool_choice="required", stream=True))
    assert finish == "tool_calls" and [c.function.name for c in streamed] == [
        "get_weather",
        "get_time",
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answers_a_call_or_text(client, stream):
    for script, called in [(PARALLEL, True), ("It is sunny {and warm}.", False)]:
        steer(client, script)
        if stream:
            text, calls, finish = gather(create(client, stream=True))
        else:
            [answer] = create(client).choices
            text, calls, finish = answer.message.content, answer.message.tool_calls, None
            finish = answer.finish_reason
        if called:
            assert not text and finish == "tool_calls"
            check_calls(calls, {"get_weather", "get_time"})
        else:
            assert (text, finish) == (script, "stop") and not calls


def test_auto_left_to_the_model_is_a_call_or_text(client):
    for seed in range(3):
        [answer] = create(client, temperature=1, seed=seed, max_tokens=60).choices
        if answer.message.tool_calls:
            assert answer.finish_reason == "tool_calls"
            check_calls(answer.message.tool_calls, {"get_weather", "get_time"})
        else:
            text = answer.message.content
            assert text and not text[0].isspace() and text[0] != "{"


ROUND_TRIP = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


def test_the_round_trip_renders_in_the_generic_format(client):
    steer(client, "It is sunny.")
    response = create(client, messages=ROUND_TRIP, tool_choice="auto")
    assert response.choices[0].message.content == "It is sunny."
    tokenizer = client.app.state.runtime.worker.engine.tokenizer
    written = generic_messages(
        [
            {"role": "user", "content": "weather in paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1"},
        ],
        GenericToolCalls(GENERIC, TOOLS),
    )
    rendered = tokenizer.apply_chat_template(written, add_generation_prompt=True, tokenize=False)
    assert (
        '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}]}<|im_end|>\n<|im_start|>user\n{"tool_results": [{"name": '
        '"get_weather", "content": "sunny, 21C"}]}<|im_end|>\n<|im_start|>assistant\n'
    ) in rendered
    assert rendered.startswith("<|im_start|>system\nYou can call tools.")
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    # With tool_choice none the tools are not described; the history is still written out.
    plain = create(client, messages=ROUND_TRIP, tool_choice="none", max_tokens=1)
    no_tools = tokenizer.apply_chat_template(
        written[1:], add_generation_prompt=True, tokenize=False
    )
    assert plain.usage.prompt_tokens == len(tokenizer.encode(no_tools, add_special_tokens=False))


COPIED = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'


@pytest.mark.parametrize("tools", [{"tools": TOOLS, "tool_choice": "none"}, {"tools": None}])
def test_an_answer_that_may_call_nothing_cannot_copy_the_history_s_calls(client, tools):
    """After a round trip in the generic format, an answer that may call no tool is held to
    text that cannot begin as the calls' object: a model copying the history's markup cannot
    send it as the answer's text."""
    fields = {k: v for k, v in tools.items() if v is not None}
    if "tools" not in fields:
        fields["tools"] = openai.NOT_GIVEN
    steer(client, COPIED)
    [answer] = create(client, messages=ROUND_TRIP, **fields).choices
    text = answer.message.content
    assert answer.message.tool_calls is None
    assert text and text[0] != "{" and not text[0].isspace()
    # Without calls in the conversation the same answer is free to begin with a brace.
    steer(client, COPIED)
    [free] = create(client, **fields).choices
    assert free.message.content == COPIED


@pytest.mark.parametrize(
    "fields",
    [{"min_tokens": 2}, {"allowed_token_ids": list(range(100))}],  # the tiny vocabulary: 128
)
def test_token_masks_after_a_round_trip_are_the_request_s_own(client, fields):
    """A request that asked for its own token masks is not held to text as well (the grammar's
    mask would override them): it is answered, not refused."""
    [answer] = create(
        client, messages=ROUND_TRIP, tools=openai.NOT_GIVEN, max_tokens=4, extra_body=fields
    ).choices
    assert answer.finish_reason in ("stop", "length")


def test_tokenize_renders_the_tools_as_chat_does(client):
    chat = create(client, max_tokens=1)
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS}
    tokenized = client.post("/tokenize", json=body)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["count"] == chat.usage.prompt_tokens


def test_responses_required_and_named_are_function_calls(client):
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    for choice in ("required", {"type": "function", "name": "get_time"}):
        response = client.post(
            "/v1/responses",
            json={
                "model": "tiny",
                "input": "weather in paris?",
                "tools": tools,
                "tool_choice": choice,
                "max_output_tokens": 120,
                "parallel_tool_calls": False,
            },
        )
        assert response.status_code == 200, response.text
        [call] = response.json()["output"]
        assert call["type"] == "function_call"
        assert choice == "required" or call["name"] == "get_time"
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_a_required_call_with_a_response_format_is_the_call(client):
    """OpenAI's pair: `response_format` holds a text answer, and this one must be calls. A
    schema that cannot be enforced is still refused; a vLLM constraint is refused beside it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for response_format in ({"type": "json_object"}, fmt):
        [answer] = create(client, tool_choice="required", response_format=response_format).choices
        check_calls(answer.message.tool_calls, {"get_weather", "get_time"})
    broken = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, tool_choice="required", response_format=broken)
    assert caught.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, tool_choice="required", extra_body={"guided_regex": "a+"})
    assert caught.value.body["param"] == "guided_regex"
    # With auto the answer is held to the response format, and still read for calls.
    steer(client, PARALLEL)
    answer = create(client, response_format={"type": "json_object"}).choices[0]
    assert [c.function.name for c in answer.message.tool_calls] == ["get_weather", "get_time"]


ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "forecast",
        "schema": {
            "type": "object",
            "properties": {"sky": {"type": "string", "enum": ["sunny", "rainy"]}},
            "required": ["sky"],
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_beside_a_schema_format_calls_tools_or_answers_in_the_format(client, stream):
    """An agent's tools beside its structured answer (the OpenAI Agents SDK sends both): the
    answer may call the tools or be the format's JSON, and nothing else."""
    steer(client, PARALLEL)
    if stream:
        text, calls, finish = gather(create(client, response_format=ANSWER_FORMAT, stream=True))
        assert (text, finish) == ("", "tool_calls")
        assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    else:
        [answer] = create(client, response_format=ANSWER_FORMAT).choices
        assert answer.finish_reason == "tool_calls"
        check_calls(answer.message.tool_calls, {"get_weather", "get_time"})
    steer(client, '{"sky": "rainy"}')
    [answer] = create(client, response_format=ANSWER_FORMAT).choices
    assert (answer.message.content, answer.message.tool_calls) == ('{"sky": "rainy"}', None)
    assert answer.finish_reason == "stop"
    # Text that is neither is never written: the steered words are masked off, and what the
    # model writes instead is a call or the format's JSON.
    steer(client, "It is sunny.")
    [answer] = create(client, response_format=ANSWER_FORMAT, max_tokens=60).choices
    if answer.message.tool_calls:
        check_calls(answer.message.tool_calls, {"get_weather", "get_time"})
    elif answer.finish_reason == "stop":
        schema = ANSWER_FORMAT["json_schema"]["schema"]
        jsonschema.validate(json.loads(answer.message.content), schema)
    else:
        assert answer.message.content.startswith("{"), answer


def test_parameters_that_cannot_be_held_to_are_400s(client):
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"not": {"type": "string"}}}},
        },
    }
    response = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "tools": [bad], "max_tokens": 4},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "tool's parameters" in error["message"]


def test_responses_stream_generic_calls_as_function_call_items(client):
    steer(client, PARALLEL)
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    body = {"model": "tiny", "input": "weather?", "tools": tools, "stream": True}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    sent = events(response)
    done = [data["item"] for name, data in sent if name == "response.output_item.done"]
    assert [(item["type"], item["name"]) for item in done] == [
        ("function_call", "get_weather"),
        ("function_call", "get_time"),
    ]
    assert json.loads(done[1]["arguments"]) == {"zone": "CET"}
    assert not [name for name, _ in sent if name == "response.output_text.delta"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_whole_call_of_an_answer_cut_short_is_completed(client, stream):
    """A response cut by `max_output_tokens` after one whole call is `incomplete`; the whole
    call in it is `completed`, streamed or not (the call cut short is dropped)."""
    script = steer(client, PARALLEL)
    cut = len(script()) - 6  # inside the second call
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    body = {"model": "tiny", "input": "weather?", "tools": tools, "max_output_tokens": cut}
    response = client.post("/v1/responses", json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        sent = events(response)
        whole = [data["response"] for name, data in sent if name == "response.incomplete"][0]
    else:
        whole = response.json()
    assert whole["status"] == "incomplete"
    [call] = whole["output"]
    assert (call["type"], call["name"], call["status"]) == (
        "function_call",
        "get_weather",
        "completed",
    )
