"""Every answer of the OpenAI routes validated against OpenAI's own published schemas.

The schemas are the response schemas of OpenAI's OpenAPI document (openai/openai-openapi,
vendored in `tests/support/openai_schema`), the ones the typed clients (openai-go, openai-java,
openai-dotnet, Rust and TypeScript generators) are generated from. Chat, text completions,
embeddings, models and the Responses API, whole and streamed (each chunk, each event), with n > 1,
logprobs, echo, tool calls, reasoning and errors, on the tiny model whose template shows tools.
Only the places the document is stricter than OpenAI's own answers are allowed, each by name
where it applies (`tests.support.openai_schema.EXCEPTIONS`). Extensions (`adapter`, vLLM's
fields) may be added: the schemas do not close their objects.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from hotlora.config.settings import Settings
from hotlora.server.app import create_app
from hotlora.server.engine import Delta, Finished

from tests.http.test_reasoning import QWEN_THINKING
from tests.http.test_tools import SMALL_WEATHER, WEATHER, steer
from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.openai_schema import SOURCE, problems, source, stream_event_schemas
from tests.support.openai_schema.extract import ROOTS, _refs
from tests.support.server_process import LOCALHOST
from tests.support.tiny import TOOL_CHAT_TEMPLATE, write_tiny_llama

ASK = [{"role": "user", "content": "weather in paris?"}]
CHAT = {"model": "tiny", "messages": ASK, "max_tokens": 5, "temperature": 0}
TEXT = {"model": "tiny", "prompt": "the cat", "max_tokens": 5, "temperature": 0}
RESPOND = {"model": "tiny", "input": "weather in paris?", "max_output_tokens": 5, "temperature": 0}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
# vLLM's chat echo: the assistant's unfinished last message comes back before what follows.
CHAT_ECHO = {
    "messages": [*ASK, {"role": "assistant", "content": "It is"}],
    "echo": True,
    "continue_final_message": True,
    "add_generation_prompt": False,
}
TOOL = {"type": "function", **SMALL_WEATHER["function"]}  # the Responses API's flat form
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Each answer's schema: (method, path, streamed) -> the schema's name and exceptions allowed.
WHOLE = {
    ("POST", "/v1/chat/completions"): "CreateChatCompletionResponse",
    ("POST", "/v1/completions"): "CreateCompletionResponse",
    ("POST", "/v1/embeddings"): "CreateEmbeddingResponse",
    ("GET", "/v1/models"): "ListModelsResponse",
    ("GET", "/v1/models/{id}"): "Model",
    ("POST", "/v1/responses"): "Response",
}
CHUNKS = {
    "/v1/chat/completions": ("CreateChatCompletionStreamResponse", frozenset()),
    "/v1/completions": ("CreateCompletionResponse", frozenset({"streamed_finish_reason"})),
}
IN_PROGRESS = frozenset({"response.created", "response.in_progress"})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The app on the tiny model whose chat template shows tools, adapter `a` mounted."""
    home = tmp_path_factory.mktemp("schema-home")
    model = write_tiny_llama(home / "tiny", quantize=True, chat_template=TOOL_CHAT_TEMPLATE)
    write_mlx_adapter(home / "adapters" / "a", random_pairs(tiny_model(quantize=True), seed=1))
    settings = Settings(
        home=home,
        model=model,
        served_model_name="tiny",
        cpu_vector_jit=False,
        adapter_root=home / "adapters",
        startup_adapters={"a": "a"},
        max_n=4,
    )
    with TestClient(
        create_app(settings), base_url=LOCALHOST, raise_server_exceptions=False
    ) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.05)
        yield client


def _route(method: str, path: str) -> tuple[str, str]:
    if method == "GET" and path.startswith("/v1/models/"):
        return method, "/v1/models/{id}"
    return method, path


def _sse_data(response: httpx.Response) -> list[tuple[str | None, Any]]:
    """(event name, JSON data) of each server-sent event but `[DONE]`."""
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            if line != "data: [DONE]":
                out.append((name, json.loads(line[len("data: ") :])))
            name = None
    return out


def validate(response: httpx.Response, body: dict[str, Any] | None = None) -> list[Any]:
    """Check every document `response` carries against its schema; returns the documents."""
    method, path = _route(response.request.method, response.request.url.path)
    if response.status_code >= 400:
        found = response.json()
        assert not problems("ErrorResponse", found), (found, problems("ErrorResponse", found))
        return [found]
    assert response.status_code == 200, response.text
    if not (body or {}).get("stream"):
        allow = frozenset()
        if (body or {}).get("encoding_format") == "base64":
            allow = frozenset({"base64_embedding"})
        if (body or {}).get("echo"):
            allow = frozenset({"echoed_first_token"})
        found = response.json()
        wrong = problems(WHOLE[(method, path)], found, allow)
        assert not wrong, (found, wrong)
        return [found]
    documents = []
    for event, data in _sse_data(response):
        if "error" in data and set(data) == {"error"}:
            name, allow = "ErrorResponse", frozenset()
        elif path == "/v1/responses":
            assert event == data["type"], (event, data)
            name = stream_event_schemas()[data["type"]]
            allow = frozenset({"usage_in_progress"}) if event in IN_PROGRESS else frozenset()
        else:
            name, allow = CHUNKS[path]
            if body.get("echo"):
                allow |= {"echoed_first_token"}
        wrong = problems(name, data, allow)
        assert not wrong, (data, wrong)
        documents.append(data)
    assert documents
    return documents


def send(client: TestClient, method: str, path: str, body: dict[str, Any] | None) -> list[Any]:
    response = client.request(method, path, json=body)
    return validate(response, body)


# (case id, method, path, body, the status it must have)
CASES = [
    ("chat", "POST", "/v1/chat/completions", CHAT, 200),
    ("chat-n", "POST", "/v1/chat/completions", {**CHAT, "n": 3, "temperature": 1, "seed": 1}, 200),
    ("chat-logprobs", "POST", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 2}, 200),
    ("chat-adapter", "POST", "/v1/chat/completions", {**CHAT, "model": "a"}, 200),
    ("chat-tools-auto", "POST", "/v1/chat/completions", {**CHAT, "tools": [WEATHER]}, 200),
    ("chat-tool-required", "POST", "/v1/chat/completions",
     {**CHAT, "max_tokens": 200, "tools": [SMALL_WEATHER], "tool_choice": "required"}, 200),
    ("chat-tool-named", "POST", "/v1/chat/completions",
     {**CHAT, "max_tokens": 200, "tools": [SMALL_WEATHER], "tool_choice": NAMED}, 200),
    ("chat-json", "POST", "/v1/chat/completions",
     {**CHAT, "max_tokens": 20, "response_format": {"type": "json_object"}}, 200),
    ("chat-prompt-logprobs", "POST", "/v1/chat/completions", {**CHAT, "prompt_logprobs": 1}, 200),
    ("chat-echo", "POST", "/v1/chat/completions", {**CHAT, **CHAT_ECHO}, 200),
    ("chat-echo-stream", "POST", "/v1/chat/completions", {**CHAT, **CHAT_ECHO, **STREAM}, 200),
    ("chat-stream", "POST", "/v1/chat/completions", {**CHAT, **STREAM}, 200),
    ("chat-stream-n-logprobs", "POST", "/v1/chat/completions",
     {**CHAT, **STREAM, "n": 2, "logprobs": True, "top_logprobs": 2}, 200),
    ("chat-stream-continuous-usage", "POST", "/v1/chat/completions",
     {**CHAT, "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 200),
    ("chat-stream-tool-required", "POST", "/v1/chat/completions",
     {**CHAT, **STREAM, "max_tokens": 200, "tools": [SMALL_WEATHER], "tool_choice": "required"},
     200),
    ("text", "POST", "/v1/completions", TEXT, 200),
    ("text-n-list", "POST", "/v1/completions",
     {**TEXT, "prompt": ["the cat", "a dog"], "n": 2, "temperature": 1, "seed": 2}, 200),
    ("text-logprobs", "POST", "/v1/completions", {**TEXT, "logprobs": 3}, 200),
    ("text-logprobs-zero", "POST", "/v1/completions", {**TEXT, "logprobs": 0}, 200),
    ("text-adapter", "POST", "/v1/completions", {**TEXT, "model": "tiny:a"}, 200),
    # Prompt scoring as lm-evaluation-harness asks for it, and the prompt echoed alone.
    ("text-echo-logprobs", "POST", "/v1/completions",
     {**TEXT, "echo": True, "logprobs": 1, "max_tokens": 1}, 200),
    ("text-echo-only", "POST", "/v1/completions",
     {**TEXT, "prompt": ["the cat", "a dog"], "echo": True, "logprobs": 2, "max_tokens": 0},
     200),
    ("text-echo-stream", "POST", "/v1/completions", {**TEXT, **STREAM, "echo": True}, 200),
    ("text-stream", "POST", "/v1/completions", {**TEXT, **STREAM}, 200),
    ("text-stream-n-logprobs", "POST", "/v1/completions",
     {**TEXT, **STREAM, "n": 2, "logprobs": 2}, 200),
    ("text-stream-continuous-usage", "POST", "/v1/completions",
     {**TEXT, "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 200),
    ("embeddings", "POST", "/v1/embeddings", {"model": "tiny", "input": "the cat"}, 200),
    ("embeddings-many", "POST", "/v1/embeddings",
     {"model": "tiny", "input": ["the cat", "a dog"], "adapter": "a"}, 200),
    ("embeddings-base64", "POST", "/v1/embeddings",
     {"model": "tiny", "input": "the cat", "encoding_format": "base64"}, 200),
    ("models", "GET", "/v1/models", None, 200),
    ("model-base", "GET", "/v1/models/tiny", None, 200),
    ("model-adapter", "GET", "/v1/models/a", None, 200),
    ("responses", "POST", "/v1/responses", RESPOND, 200),
    ("responses-instructions", "POST", "/v1/responses",
     {**RESPOND, "instructions": "Be brief.", "metadata": {"k": "v"}, "model": "a"}, 200),
    ("responses-tool-required", "POST", "/v1/responses",
     {**RESPOND, "max_output_tokens": 200, "tools": [TOOL], "tool_choice": "required"}, 200),
    ("responses-json", "POST", "/v1/responses",
     {**RESPOND, "max_output_tokens": 20, "text": {"format": {"type": "json_object"}}}, 200),
    ("responses-stream", "POST", "/v1/responses", {**RESPOND, "stream": True}, 200),
    ("responses-stream-tool-required", "POST", "/v1/responses",
     {**RESPOND, "stream": True, "max_output_tokens": 200, "tools": [TOOL],
      "tool_choice": "required"}, 200),
    # Errors, each in OpenAI's error object.
    ("chat-unknown-model", "POST", "/v1/chat/completions", {**CHAT, "model": "nope"}, 404),
    ("chat-bad-value", "POST", "/v1/chat/completions", {**CHAT, "temperature": 9.0}, 400),
    ("chat-unknown-adapter", "POST", "/v1/chat/completions", {**CHAT, "adapter": "zz"}, 404),
    ("chat-refused-field", "POST", "/v1/chat/completions", {**CHAT, "use_beam_search": True}, 400),
    ("text-empty-prompt", "POST", "/v1/completions", {**TEXT, "prompt": ""}, 400),
    ("embeddings-empty", "POST", "/v1/embeddings", {"model": "tiny", "input": ""}, 400),
    ("model-unknown", "GET", "/v1/models/nope", None, 404),
    ("responses-refused", "POST", "/v1/responses", {**RESPOND, "previous_response_id": "r"}, 400),
    ("bad-json", "POST", "/v1/chat/completions", None, 400),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_every_answer_is_valid_under_openai_s_schema(
    served: TestClient, method: str, path: str, body: dict[str, Any] | None, status: int
):
    response = served.request(method, path, json=body)
    assert response.status_code == status, response.text
    validate(response, body)


def test_the_schemas_say_where_they_came_from():
    found = source()
    assert found["repository"] == "openai/openai-openapi" and len(found["commit"]) == 40


def test_tool_calls_whole_and_streamed_are_in_the_schema_s_shape(served: TestClient):
    body = {**CHAT, "max_tokens": 200, "tools": [SMALL_WEATHER], "tool_choice": "required"}
    [answer] = send(served, "POST", "/v1/chat/completions", body)
    message = answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["refusal"] is None
    chunks = send(served, "POST", "/v1/chat/completions", {**body, **STREAM})
    calls = [
        c
        for chunk in chunks
        for choice in chunk["choices"]
        for c in choice["delta"].get("tool_calls", [])
    ]
    assert [call["function"]["name"] for call in calls] == ["get_weather"]


def test_plain_answers_carry_no_null_tool_calls(served: TestClient):
    [answer] = send(served, "POST", "/v1/chat/completions", {**CHAT, "logprobs": True})
    choice = answer["choices"][0]
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["refusal"] is None
    assert choice["logprobs"]["refusal"] is None and choice["logprobs"]["content"]


def test_text_stream_chunks_carry_logprobs_null_unless_asked(served: TestClient):
    chunks = send(served, "POST", "/v1/completions", {**TEXT, "stream": True})
    assert all(choice["logprobs"] is None for c in chunks for choice in c["choices"])
    chunks = send(served, "POST", "/v1/completions", {**TEXT, "stream": True, "logprobs": 1})
    texts = [choice for c in chunks for choice in c["choices"] if choice["text"]]
    assert texts and all(choice["logprobs"]["tokens"] for choice in texts)


def test_responses_text_parts_and_usage_carry_what_the_schema_requires(served: TestClient):
    [answer] = send(served, "POST", "/v1/responses", RESPOND)
    [part] = answer["output"][0]["content"]
    assert part["logprobs"] == [] and part["annotations"] == []
    details = answer["usage"]["input_tokens_details"]
    assert set(details) == {"cached_tokens", "cache_write_tokens"}
    assert details["cache_write_tokens"] == 0
    events = send(served, "POST", "/v1/responses", {**RESPOND, "stream": True})
    parts = [e["part"] for e in events if e["type"].startswith("response.content_part")]
    assert parts and all(part["logprobs"] == [] for part in parts)


def _failing(service: Any) -> Any:
    original = service.events

    async def failing(submitted: Any) -> AsyncIterator[tuple[int, Delta | Finished]]:
        async with contextlib.aclosing(original(submitted)) as inner:
            async for item in inner:
                yield item
                raise RuntimeError("the generation thread broke")

    return failing


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, **STREAM}),
        ("/v1/completions", {**TEXT, **STREAM}),
        ("/v1/responses", {**RESPOND, "stream": True}),
    ],
)
def test_a_failure_after_the_200_streams_answers_in_the_schema(
    served: TestClient, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
):
    service = served.app.state.runtime.require_inference()
    monkeypatch.setattr(service, "events", _failing(service))
    documents = send(served, "POST", path, body)
    assert any("error" in document or document.get("type") == "error" for document in documents)
    if path == "/v1/responses":
        failed = documents[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert failed["usage"]["output_tokens"] >= 1


@pytest.fixture
def thinking(make_client: Any, tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-think"), chat_template=QWEN_THINKING)
    return make_client(model=model)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 200}),
        ("/v1/chat/completions", {**CHAT, **STREAM, "max_tokens": 200}),
        ("/v1/responses", {**RESPOND, "max_output_tokens": 200}),
        ("/v1/responses", {**RESPOND, "max_output_tokens": 200, "stream": True}),
    ],
)
def test_a_thinking_model_s_answers_are_in_the_schema(
    thinking: TestClient, path: str, body: dict[str, Any]
):
    steer(thinking, "<think>Paris is in France.</think>It is sunny.")
    text = json.dumps(send(thinking, "POST", path, body))
    assert '"reasoning_content": "' in text or '"type": "reasoning"' in text


def test_the_vendored_file_holds_only_what_the_roots_reach():
    """Every schema is reached from a root: nothing was added by hand."""
    found = json.loads(SOURCE.read_text(encoding="utf-8"))
    schemas = found["schemas"]
    reached, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(_refs(schemas[name]))
    assert reached == set(schemas)
    assert found["source"]["roots"] == list(ROOTS)


# For each allowed exception, an answer of OpenAI's own shape the document refuses without it.
_TEXT_ANSWER = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
_CHOICE = {"index": 0, "text": "ab", "finish_reason": "length", "logprobs": None}
EXCEPTION_CASES = {
    "base64_embedding": (
        "CreateEmbeddingResponse",
        {
            "object": "list",
            "model": "m",
            "data": [{"object": "embedding", "index": 0, "embedding": "AACAPw=="}],
            "usage": {"prompt_tokens": 1, "total_tokens": 1},
        },
    ),
    "streamed_finish_reason": (
        "CreateCompletionResponse",
        {**_TEXT_ANSWER, "choices": [{**_CHOICE, "finish_reason": None}]},
    ),
    "echoed_first_token": (
        "CreateCompletionResponse",
        {
            **_TEXT_ANSWER,
            "choices": [
                {
                    **_CHOICE,
                    "logprobs": {
                        "tokens": ["a", "b"],
                        "token_logprobs": [None, -1.5],
                        "top_logprobs": [None, {"b": -1.5}],
                        "text_offset": [0, 1],
                    },
                }
            ],
        },
    ),
}


@pytest.mark.parametrize("exception", sorted(EXCEPTION_CASES))
def test_each_allowed_exception_allows_only_what_it_names(exception: str):
    name, answer = EXCEPTION_CASES[exception]
    assert problems(name, answer)
    assert not problems(name, answer, frozenset({exception}))
    others = frozenset(EXCEPTION_CASES) - {exception} | {"usage_in_progress"}
    assert problems(name, answer, others)
