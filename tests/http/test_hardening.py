"""Inputs an attacker or an unlucky client sends: every one is a 400 naming its field, no number
that is not finite reaches a response, and failures stay with the request that caused them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hotlora.server.engine import NonFiniteLogits
from hotlora.server.http.error_responses import install_error_handlers

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.server_process import LOCALHOST
from tests.support.sse import sse_events
from tests.support.tiny import ENDOFTEXT_ID, IM_START_ID

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}
CHAT_JSON = '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'


def chat(extra: str) -> str:
    """A valid chat body in raw JSON, with `extra` fields."""
    return '{"model": "tiny", ' + CHAT_JSON + ", " + extra + "}"


# (path, raw JSON body, param). The JSON escapes lone UTF-16 surrogates, which Python decodes
# into strings that no encoder can write out again.
RAW_BODIES = [
    ("/v1/chat/completions", '{"model": "\\ud800", ' + CHAT_JSON + "}", "model"),
    (
        "/v1/chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": '
        '[{"type": "text", "text": "\\udc00"}]}]}',
        "messages.0.content.0.text",
    ),
    ("/v1/chat/completions", chat('"stop": ["\\ud800"]'), "stop.0"),
    ("/v1/chat/completions", chat('"adapter": "\\ud800"'), "adapter"),
    ("/v1/chat/completions", chat('"user": "\\ud800"'), "user"),
    (
        "/v1/chat/completions",
        chat('"logit_bias": {"\\ud800": 1}'),
        "logit_bias.\\ud800",
    ),
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\udc00b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\ud800"]}', "prompt.1"),
    ("/v1/chat/completions", chat('"temperature": NaN'), None),
    ("/v1/chat/completions", chat('"top_p": Infinity'), None),
    ("/v1/adapters", '{"id": "a", "path": "\\ud800"}', "path"),
]


@pytest.mark.parametrize(("path", "raw", "param"), RAW_BODIES)
def test_text_that_is_not_unicode_and_non_finite_numbers_are_400s(client, path, raw, param):
    response = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    else:  # the number's field
        assert error["param"] in raw and "finite" in error["message"]


BODIES = [
    # logit_bias keys that `str.isdigit` takes but are no token id.
    ({**CHAT, "logit_bias": {"²": 1}}, "logit_bias", "token ids"),
    ({**CHAT, "logit_bias": {"١": 1}}, "logit_bias", "token ids"),
    ({**CHAT, "logit_bias": {"1e3": 1}}, "logit_bias", "token ids"),
    # More digits than Python reads as an int (4,300).
    ({**CHAT, "logit_bias": {"1" * 4301: 1}}, "logit_bias", "token ids"),
    ({**CHAT, "logit_bias": {"-" + "0" * 5000: 1}}, "logit_bias", "token ids"),
    # Adapter weights: finite and bounded, however they are spelled.
    ({**CHAT, "adapter": "x@1e308"}, "adapter", "between -10 and 10"),
    ({**CHAT, "adapter": "x@1e400"}, "adapter", "between -10 and 10"),
    ({**CHAT, "adapter": "x@nan"}, "adapter", "not a number like 0.5"),
    ({**CHAT, "adapter": [{"id": "x", "scale": 10**400}]}, "adapter", "between -10 and 10"),
    ({**CHAT, "adapter": [{"id": "x", "scale": -11}]}, "adapter", "between -10 and 10"),
    # A penalty that would scale the logits out of range.
    ({**CHAT, "repetition_penalty": 5e-324}, "repetition_penalty", "greater than or equal"),
    ({**CHAT, "repetition_penalty": 1e40}, "repetition_penalty", "less than or equal"),
    # A content part whose type is not even a string.
    (
        {**CHAT, "messages": [{"role": "user", "content": [{"type": {}, "text": ""}]}]},
        "messages.0.content",
        "",
    ),
    # Messages as OpenAI validates them.
    (
        {**CHAT, "messages": [{"role": "tool", "content": "42"}]},
        "messages.0",
        "tool_call_id",
    ),
    (
        {
            **CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ],
        },
        "messages.0.content",
        "images are not supported",
    ),
    (
        {
            **CHAT,
            "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        },
        "messages.0.content",
        "audio is",
    ),
]


@pytest.mark.parametrize(("body", "param", "says"), BODIES)
def test_refusals_name_the_field(client, body, param, says):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert says in error["message"]


COMPLETION = {"model": "tiny", "prompt": "the", "max_tokens": 2}
RESPONSE = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
# Numbers and booleans as OpenAI reads them: a string, a boolean or a fraction where an integer
# goes is refused, not converted. (path, body, param)
NOT_CONVERTED = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": "3"}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "3"}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": "1"}, "n"),
    ("/v1/chat/completions", {**CHAT, "seed": "7"}, "seed"),
    ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": True}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_k": False}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": "10"}}, "logit_bias.5"),
    ("/v1/chat/completions", {**CHAT, "stream": "true"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": "2", "logprobs": True}, "top_logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt": [5, "6"]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [5, True]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs"),
    ("/v1/responses", {**RESPONSE, "max_output_tokens": "3"}, "max_output_tokens"),
    ("/v1/responses", {**RESPONSE, "temperature": "1"}, "temperature"),
    ("/v1/responses", {**RESPONSE, "seed": True}, "seed"),
    ("/v1/adapters", {"id": "a", "path": "a", "replace": "yes"}, "replace"),
]


@pytest.mark.parametrize(("path", "body", "param"), NOT_CONVERTED)
def test_strings_and_booleans_are_not_numbers(client, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value")


def test_integral_numbers_serve_where_a_float_goes(client):
    body = {**CHAT, "temperature": 1, "top_p": 1, "logit_bias": {"5": 3}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_a_vanishing_temperature_samples_as_greedy(client):
    body = {"model": "tiny", "prompt": "the", "max_tokens": 6}
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()
    tiny = client.post("/v1/completions", json={**body, "temperature": 1e-300, "seed": 3}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


_CALL = {"id": "call_1", "type": "function", "function": {"name": "mul", "arguments": "{}"}}


def test_seed_minus_one_is_a_random_seed_as_in_llama_cpp(client):
    body = {"model": "tiny", "prompt": "the", "max_tokens": 12, "temperature": 1.5}
    fixed = [client.post("/v1/completions", json={**body, "seed": 7}).json() for _ in range(2)]
    assert fixed[0]["choices"][0]["text"] == fixed[1]["choices"][0]["text"]
    drawn = {
        client.post("/v1/completions", json={**body, "seed": -1}).json()["choices"][0]["text"]
        for _ in range(3)
    }
    assert len(drawn) > 1


def test_top_p_zero_keeps_the_top_token_alone(client):
    body = {"model": "tiny", "prompt": "the", "max_tokens": 6}
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()
    for seed in (1, 2):
        nucleus = {**body, "temperature": 1.5, "top_p": 0, "seed": seed}
        answer = client.post("/v1/completions", json=nucleus).json()
        assert answer["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_a_tool_reply_with_its_call_id_is_served(client):
    messages = [
        {"role": "user", "content": "what is 6 x 7?"},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    response = client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "before",
    [
        [],  # no call at all
        [{"role": "assistant", "content": None, "tool_calls": [{**_CALL, "id": "call_2"}]}],
    ],
)
def test_a_tool_reply_to_no_call_is_refused(client, before):
    messages = [
        {"role": "user", "content": "what is 6 x 7?"},
        *before,
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    response = client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert response.status_code == 400
    error = response.json()["error"]
    index = len(messages) - 1
    assert (error["param"], error["code"]) == (f"messages.{index}.tool_call_id", "invalid_value")
    assert "'call_1'" in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b'{"model": 5}'),
        ("/v1/completions", b"[]"),
        ("/v1/adapters", b'{"id": 7}'),
    ],
)
def test_the_key_is_checked_before_the_body(make_client, path, body):
    client = make_client(api_key="k")
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("Bearer k", 200),
        ("bearer  k", 200),
        ("BEARER k ", 200),
        ("Bearer  ", 401),
        ("Basic k", 401),
    ],
)
def test_the_bearer_scheme_is_read_as_http_has_it(make_client, header, status):
    client = make_client(api_key="k")
    assert client.get("/v1/models", headers={"authorization": header}).status_code == status


def test_control_tokens_add_no_text(client):
    request = {"model": "tiny", "prompt": "the", "max_tokens": 4, "temperature": 0}
    # <|im_start|>: a control token that does not end the answer (<|endoftext|> does).
    forced = {**request, "logit_bias": {str(IM_START_ID): 100, str(ENDOFTEXT_ID): -100}}
    response = client.post("/v1/completions", json=forced).json()
    assert response["choices"][0]["text"] == ""
    assert response["usage"]["completion_tokens"] == 4  # generated, counted, not shown
    streamed = client.post("/v1/completions", json={**forced, "stream": True})
    texts = [json.loads(e)["choices"][0]["text"] for e in sse_events(streamed)[:-1]]
    assert "".join(texts) == ""
    # Logprobs still name the token that was generated.
    with_logprobs = client.post("/v1/completions", json={**forced, "logprobs": 1}).json()
    assert with_logprobs["choices"][0]["logprobs"]["tokens"][0] == "<|im_start|>"


POISON = 77  # a prompt ending in this token gets NaN logits from the wrapped model


def poisoned(model):
    """The model, computing NaN logits for every row whose input ends in POISON."""

    def call(tokens: mx.array, cache=None):
        logits = model(tokens, cache=cache)
        bad = (tokens[:, -1:] == POISON)[..., None]  # [B, 1, 1]
        return mx.where(bad, mx.array(float("nan")), logits)

    return call


def test_non_finite_logits_fail_that_request_only(make_client, monkeypatch):
    client = make_client()
    scheduler = client.app.state.runtime.worker.scheduler
    monkeypatch.setattr(scheduler, "model", poisoned(scheduler.model))
    bad = {"model": "tiny", "prompt": [5, 6, POISON], "max_tokens": 4, "temperature": 0}
    good = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    alone = client.post("/v1/completions", json=good).json()["choices"][0]["text"]

    results: dict[str, object] = {}

    def send(name, body):
        results[name] = client.post("/v1/completions", json=body)

    threads = [threading.Thread(target=send, args=a) for a in (("bad", bad), ("good", good))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed, served = results["bad"], results["good"]
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == NonFiniteLogits.code and "non-finite" in error["message"]
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == alone

    stream = client.post("/v1/completions", json={**bad, "stream": True})
    events = sse_events(stream)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == NonFiniteLogits.code
    assert "NaN" not in "".join(events[:-2]).replace("non-finite values (NaN", "")
    assert client.post("/v1/completions", json=good).status_code == 200


def test_logprobs_are_finite_numbers(client):
    body = {**CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 20, "temperature": 0}
    body["logit_bias"] = {str(i): -100 for i in range(40)}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    text = response.text
    assert "NaN" not in text and "Infinity" not in text
    for token in response.json()["choices"][0]["logprobs"]["content"]:
        assert all(-1e4 < t["logprob"] <= 0 for t in [token, *token["top_logprobs"]])


def test_an_unexpected_error_is_a_500_object_and_not_re_raised():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("/secret/internal detail")

    # A re-raised error would surface here: TestClient raises server exceptions by default.
    with TestClient(app, base_url=LOCALHOST) as client:
        response = client.get("/boom")
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "/secret" not in response.text


def test_tokenizing_runs_off_the_event_loop(make_client, monkeypatch):
    client = make_client()
    tokenizer = client.app.state.runtime.worker.engine.tokenizer
    threads: list[str] = []
    template, encode = tokenizer.apply_chat_template, tokenizer._tokenizer.encode

    def recording_template(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return template(*args, **kwargs)

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", recording_template)
    monkeypatch.setattr(tokenizer._tokenizer, "encode", recording_encode)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert len(threads) == 4  # the template, its encoding, each of two prompts
    assert all(name.startswith("hotlora-tokenize") for name in threads), threads


def test_up_to_64_stop_strings_are_taken(client):
    stops = [f"zz{i}" for i in range(64)]
    assert client.post("/v1/chat/completions", json={**CHAT, "stop": stops}).status_code == 200
    response = client.post("/v1/chat/completions", json={**CHAT, "stop": [*stops, "zz64"]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stop" and "at most 64" in error["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_token_limit_past_the_server_s_names_the_field_sent(client, field):
    response = client.post("/v1/chat/completions", json={**CHAT, field: 100_000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field} is 100000; this server allows at most")


def test_an_adapter_that_overflows_fails_its_request_on_the_integer_products(
    make_client, tmp_path: Path
):
    """Trained into overflow, an adapter makes infinite activations; quantized for the integer
    products (the packed path's default) they must not become finite codes and a quiet answer,
    but the non-finite logits they are in float."""
    root = tmp_path / "adapters"
    mlp = ("gate_proj", "up_proj", "down_proj")  # gate * up overflows float32
    pairs = random_pairs(tiny_model(quantize=True), seed=3, keys=mlp)
    write_mlx_adapter(
        root / "boom", {p: (a * 3e4, b * 3e4) for p, (a, b) in pairs.items()}, scale=1e4
    )
    client = make_client(adapter_root=root, cpu_precision="fast")
    assert client.post("/v1/adapters", json={"id": "boom", "path": "boom"}).status_code == 201
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    failed = client.post("/v1/completions", json={**body, "adapter": "boom"})
    assert failed.status_code == 500, failed.text
    assert failed.json()["error"]["code"] == NonFiniteLogits.code
    assert client.post("/v1/completions", json=body).status_code == 200
