"""The HTTP API in-process on the tiny random model, with the real engine and worker."""

from __future__ import annotations

import json
from functools import partial

import mlx.core as mx
import pytest
from fastapi.testclient import TestClient

from hotlora.server.engine import generate

from tests.support.tiny import MAX_POSITION_EMBEDDINGS

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}]}


def sse_events(response) -> list[str]:
    return [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]


def test_health_ready_and_models(client: TestClient, tiny_model_dir):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json()["status"] == "ready"
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == "tiny"
    assert card["root"] == str(tiny_model_dir.resolve())
    assert card["owned_by"] and isinstance(card["created"], int)


def test_chat_completion_shape_and_usage(client: TestClient):
    body = client.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 5, "temperature": 0}
    ).json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    # "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n" in the tiny tokenizer
    tokenizer_ids = client.app.state.runtime.worker.engine.tokenizer.apply_chat_template(
        CHAT["messages"], add_generation_prompt=True
    )
    assert usage["prompt_tokens"] == len(tokenizer_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 5


def test_greedy_is_deterministic_and_stream_equals_whole(client: TestClient):
    req = {**CHAT, "max_tokens": 12, "temperature": 0}
    first = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    second = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"][
        "content"
    ]
    assert first == second
    streamed = client.post("/v1/chat/completions", json={**req, "stream": True})
    events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == first
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stream_usage_chunk(client: TestClient):
    req = {
        **CHAT,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = [json.loads(e) for e in sse_events(client.post("/v1/chat/completions", json=req))[:-1]]
    assert chunks[-1]["choices"] == []
    whole = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "temperature": 0})
    streamed_usage, whole_usage = chunks[-1]["usage"], whole.json()["usage"]
    # The second request reuses the first one's prompt cache; the counts are the same.
    assert streamed_usage.pop("prompt_tokens_details")["cached_tokens"] == 0
    assert whole_usage.pop("prompt_tokens_details")["cached_tokens"] > 0
    assert streamed_usage == whole_usage


def test_seed_reproduces_sampling(client: TestClient):
    req = {**CHAT, "max_tokens": 16, "temperature": 1.5, "seed": 7}
    a = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    b = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    assert a == b
    others = {
        client.post("/v1/chat/completions", json={**req, "seed": s}).json()["choices"][0][
            "message"
        ]["content"]
        for s in range(8, 12)
    }
    assert len(others | {a}) > 1  # a random model at high temperature differs across seeds


def test_top_k_one_is_greedy(client: TestClient):
    greedy = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "the cat", "max_tokens": 10, "temperature": 0},
    )
    top1 = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "the cat",
            "max_tokens": 10,
            "temperature": 1.8,
            "top_k": 1,
            "seed": 3,
        },
    )
    assert top1.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_stop_sequence_is_cut_and_never_leaks(client: TestClient):
    req = {"model": "tiny", "prompt": "the cat", "max_tokens": 24, "temperature": 0}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert len(full) > 6
    stop = full[3:6]  # a stop string that may span tokens
    cut = client.post("/v1/completions", json={**req, "stop": stop}).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)]
    assert cut["finish_reason"] == "stop"
    streamed = client.post("/v1/completions", json={**req, "stop": [stop], "stream": True})
    pieces = [json.loads(e)["choices"][0]["text"] for e in sse_events(streamed)[:-1]]
    assert "".join(pieces) == full[: full.index(stop)]


def test_n_choices_and_logprobs(client: TestClient):
    body = client.post(
        "/v1/chat/completions",
        json={
            **CHAT,
            "max_tokens": 3,
            "n": 2,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == body["choices"][1]["message"]
    content = body["choices"][0]["logprobs"]["content"]
    assert content and all(len(e["top_logprobs"]) == 2 for e in content)
    for entry in content:  # greedy: the chosen token is the most likely one
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        assert entry["logprob"] <= 0


def test_completion_logprobs_and_token_prompt(client: TestClient):
    body = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 1,
        },
    ).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == body["usage"]["completion_tokens"]
    assert body["usage"]["prompt_tokens"] == 3


ERRORS = [
    # (path, body, status, param, code)
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "temperature": 5}, 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "n": 99}, 400, "n", None),
    (
        "/v1/chat/completions",
        {**CHAT, "max_tokens": MAX_POSITION_EMBEDDINGS},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "model", "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "prompt", None),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": 100000},
        400,
        "max_tokens",
        None,
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), ERRORS)
def test_error_table(client: TestClient, path, body, status, param, code):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    if code is not None:
        assert error["code"] == code


def test_context_overflow_names_both_numbers(client: TestClient):
    error = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 600}).json()["error"]
    assert str(MAX_POSITION_EMBEDDINGS) in error["message"] and "600" in error["message"]


def test_invalid_json_unknown_route_and_method(client: TestClient):
    bad = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_body_limit(make_client):
    client = make_client(max_body_bytes=200)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 500}]}
    response = client.post("/v1/chat/completions", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunked():
        yield json.dumps(big).encode()

    response = client.post(
        "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    ok = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert ok.status_code == 200


def test_internal_error_hides_details(make_client, monkeypatch):
    client = make_client(raise_server_exceptions=False)
    engine = client.app.state.runtime.worker.engine

    def explode(job):
        raise RuntimeError("/secret/path/file.py exploded")
        yield

    monkeypatch.setattr(engine, "generate", explode)
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert response.status_code == 500
    assert "/secret" not in response.text and "Traceback" not in response.text
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200


def test_a_template_that_refuses_the_messages_is_a_400(make_client, monkeypatch):
    client = make_client()
    tokenizer = client.app.state.runtime.worker.engine.tokenizer

    def refuse(*args, **kwargs):
        from jinja2 import TemplateError

        raise TemplateError("Conversation roles must alternate user/assistant")

    monkeypatch.setattr(tokenizer, "apply_chat_template", refuse)
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "must alternate" in error["message"]


def test_a_repeated_prompt_reuses_the_prompt_cache(client: TestClient):
    request = {
        **CHAT,
        "messages": [{"role": "user", "content": "cache me"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    first = client.post("/v1/chat/completions", json=request).json()
    second = client.post("/v1/chat/completions", json=request).json()
    assert first["choices"] == second["choices"]
    prompt_tokens = second["usage"]["prompt_tokens"]
    # All but the last prompt token come from the cache; that one is re-run for fresh logits.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt_tokens - 1


def test_top_k_beyond_the_vocabulary_filters_nothing(client: TestClient):
    request = {**CHAT, "max_tokens": 8, "temperature": 1.5, "seed": 5}
    plain = client.post("/v1/chat/completions", json=request)
    huge = client.post("/v1/chat/completions", json={**request, "top_k": 10**6})
    assert huge.status_code == 200, huge.text
    assert huge.json()["choices"] == plain.json()["choices"]


def test_a_failed_sampler_does_not_break_later_requests(make_client, monkeypatch):
    client = make_client(raise_server_exceptions=False)
    sampled = {**CHAT, "max_tokens": 6, "temperature": 1.0}  # no seed: the RNG state carries on

    # Compiled over MLX's global random state, as mlx-lm's own samplers are: failing half-way
    # leaves that state holding a traced value that later sampling cannot evaluate.
    @partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
    def failing(logprobs: mx.array) -> mx.array:
        mx.random.categorical(logprobs)
        raise RuntimeError("the sampler failed")

    monkeypatch.setattr(generate, "build_sampler", lambda params: failing)
    failed = client.post("/v1/chat/completions", json=sampled)
    assert failed.status_code == 500
    monkeypatch.undo()
    for _ in range(2):
        after = client.post("/v1/chat/completions", json=sampled)
        assert after.status_code == 200, after.text


def test_seeded_choices_differ_but_reproduce(client: TestClient):
    request = {**CHAT, "max_tokens": 12, "temperature": 1.5, "n": 3, "seed": 11}
    first = [
        c["message"]["content"]
        for c in client.post("/v1/chat/completions", json=request).json()["choices"]
    ]
    again = [
        c["message"]["content"]
        for c in client.post("/v1/chat/completions", json=request).json()["choices"]
    ]
    assert first == again
    assert len(set(first)) > 1


def test_logit_bias_forces_a_token(client: TestClient):
    request = {"model": "tiny", "prompt": "the cat", "max_tokens": 4, "temperature": 0}
    forced = client.post("/v1/completions", json={**request, "logit_bias": {"70": 100}}).json()
    text = forced["choices"][0]["text"]
    tokenizer = client.app.state.runtime.worker.engine.tokenizer
    assert text == tokenizer.decode([70] * 4)


def test_stream_failure_becomes_an_error_event(make_client, monkeypatch):
    client = make_client(raise_server_exceptions=False)
    engine = client.app.state.runtime.worker.engine
    real = engine.generate

    def fail_midway(job):
        for n, event in enumerate(real(job)):
            if n == 2:
                raise RuntimeError("/secret/path exploded")
            yield event

    monkeypatch.setattr(engine, "generate", fail_midway)
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "stream": True})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "/secret" not in error["message"]


MORE_ERRORS = [
    ({**CHAT, "seed": 2**70}, "seed"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ({**CHAT, "logit_bias": {"5": 500}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"99999": 1}}, "logit_bias"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("body", "param"), MORE_ERRORS)
def test_unsupported_or_out_of_range_fields_are_refused(client: TestClient, body, param):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_batch_prompts_count_against_max_n(client: TestClient):
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}
    error = client.post("/v1/completions", json=body).json()["error"]
    assert error["param"] == "prompt" and "9" in error["message"]
    ok = client.post("/v1/completions", json={**body, "n": 2})
    assert [c["index"] for c in ok.json()["choices"]] == list(range(6))


def test_negative_seed_is_accepted(client: TestClient):
    assert (
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "seed": -1}).status_code
        == 200
    )


def test_auth_headers_on_refusals(make_client):
    client = make_client(api_key="k")
    response = client.get("/v1/models")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    # With only an inference key, the admin routes take that key rather than staying open.
    assert client.get("/v1/adapters").status_code == 401
    assert client.get("/v1/adapters", headers={"Authorization": "Bearer k"}).status_code == 200


def test_empty_keys_are_refused():
    from pydantic import ValidationError

    from hotlora.config.settings import Settings

    with pytest.raises(ValidationError, match="must not be empty"):
        Settings(api_key="")
