"""The HTTP API in-process on the tiny random model, real engine and worker: what it serves."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.support.sse import sse_events

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}]}


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
    # Every chat chunk before it says `usage` null, as OpenAI's do; without the option none has it.
    assert len(chunks) > 2 and all(c["usage"] is None for c in chunks[:-1])
    plain = client.post("/v1/chat/completions", json={**req, "stream_options": None})
    assert all("usage" not in json.loads(e) for e in sse_events(plain)[:-1])
    text = client.post("/v1/completions", json={**req, "messages": None, "prompt": "hi"})
    text_chunks = [json.loads(e) for e in sse_events(text)[:-1]]
    assert text_chunks[-1]["choices"] == [] and text_chunks[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" not in c for c in text_chunks[:-1])  # not nullable in its schema
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


@pytest.mark.parametrize("at", [1, 3, 6])
def test_logprobs_end_with_the_text_a_stop_sequence_cuts(client: TestClient, at: int):
    # The tokens that make up the stop sequence (and any after it) were generated but are not
    # in the answer: their log-probabilities are not either, streamed or not.
    req = {"model": "tiny", "prompt": "the cat", "max_tokens": 24, "temperature": 0, "logprobs": 1}
    full = client.post("/v1/completions", json=req).json()["choices"][0]
    stop = full["text"][at : at + 3]
    cut = client.post("/v1/completions", json={**req, "stop": stop}).json()["choices"][0]
    text, logprobs = cut["text"], cut["logprobs"]
    assert text == full["text"][: full["text"].index(stop)]
    tokens = logprobs["tokens"]
    assert tokens == full["logprobs"]["tokens"][: len(tokens)]
    assert "".join(tokens).startswith(text)
    assert len("".join(tokens[:-1])) < len(text) if tokens else text == ""
    assert all(offset < len(text) for offset in logprobs["text_offset"])
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(tokens)
    streamed = client.post("/v1/completions", json={**req, "stop": stop, "stream": True})
    chunks = [json.loads(e)["choices"][0] for e in sse_events(streamed)[:-1]]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == tokens
    assert "".join(c["text"] for c in chunks) == text


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


def test_completion_top_logprobs_hold_the_sampled_token(client: TestClient):
    # OpenAI's legacy shape: "up to logprobs + 1" entries, the sampled token always among them,
    # where sampling picked one outside the most likely `logprobs`.
    body = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "the cat", "max_tokens": 12, "logprobs": 1}
        | {"temperature": 2.0, "seed": 4},
    ).json()
    lp = body["choices"][0]["logprobs"]
    tops = lp["top_logprobs"]
    assert len(tops) == len(lp["tokens"]) == 12
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], tops, strict=True):
        assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= 2
        assert all(value >= logprob - 1e-6 for value in top.values())  # the other: likelier
    assert any(len(top) == 2 for top in tops)  # some sampled token was not the most likely


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


def test_negative_seed_is_accepted(client: TestClient):
    assert (
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "seed": -1}).status_code
        == 200
    )
