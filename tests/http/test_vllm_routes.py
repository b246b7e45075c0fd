"""vLLM's and OpenAI's other routes, in-process on the tiny model: /tokenize, /detokenize,
/version, `max_model_len` on the model cards, and /v1/embeddings."""

from __future__ import annotations

import base64
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from mlx_lm.utils import load

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.tiny import MAX_POSITION_EMBEDDINGS, VOCAB_SIZE, tiny_args

MESSAGES = [{"role": "user", "content": "the cat sat"}]


@pytest.fixture
def api(make_client, tmp_path: Path) -> TestClient:
    root = tmp_path / "adapters"
    write_mlx_adapter(root / "a", random_pairs(tiny_model(quantize=True), seed=1), scale=20.0)
    client = make_client(adapter_root=root)
    assert client.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code == 201
    return client


def ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_tokenize_a_prompt_as_completions_count_it(api: TestClient):
    tokens = ok(api.post("/tokenize", json={"model": "tiny", "prompt": "the cat sat"}))
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_POSITION_EMBEDDINGS
    completion = ok(
        api.post(
            "/v1/completions", json={"model": "tiny", "prompt": "the cat sat", "max_tokens": 1}
        )
    )
    assert completion["usage"]["prompt_tokens"] == tokens["count"]
    # The ids are the prompt: completing them is completing the text.
    by_ids = ok(
        api.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": tokens["tokens"], "max_tokens": 4, "temperature": 0},
        )
    )
    by_text = ok(
        api.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "the cat sat", "max_tokens": 4, "temperature": 0},
        )
    )
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    strs = ok(api.post("/tokenize", json={"prompt": "the cat", "return_token_strs": True}))
    assert "".join(strs["token_strs"]) == "the cat"


def test_tokenize_messages_as_chat_renders_them(api: TestClient):
    rendered = ok(api.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}))
    chat = ok(
        api.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
        )
    )
    assert rendered["count"] == chat["usage"]["prompt_tokens"]
    text = ok(api.post("/detokenize", json={"model": "tiny", "tokens": rendered["tokens"]}))
    assert text["prompt"] == "<|im_start|>user\nthe cat sat<|im_end|>\n<|im_start|>assistant\n"
    bare = ok(api.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}))
    assert rendered["tokens"][: bare["count"]] == bare["tokens"]
    assert bare["count"] < rendered["count"]


def test_a_developer_message_is_a_system_message(api: TestClient):
    # The tiny model's ChatML template does not name OpenAI's developer role: its messages are
    # rendered as system ones, on chat as on /tokenize, as /v1/responses renders them.
    sent = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    rendered = ok(api.post("/tokenize", json={"model": "tiny", "messages": sent}))
    text = ok(api.post("/detokenize", json={"model": "tiny", "tokens": rendered["tokens"]}))
    assert text["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    as_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0}
    chat = ok(api.post("/v1/chat/completions", json={**body, "messages": sent}))
    system = ok(api.post("/v1/chat/completions", json={**body, "messages": as_system}))
    assert chat["usage"]["prompt_tokens"] == rendered["count"] == system["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"] == system["choices"][0]["message"]


def test_detokenize_round_trips(api: TestClient):
    tokens = ok(api.post("/tokenize", json={"prompt": "zebras, 42!"}))["tokens"]
    assert ok(api.post("/detokenize", json={"tokens": tokens})) == {"prompt": "zebras, 42!"}


TOKEN_REFUSALS = [
    # (route, body, status, param)
    ("/tokenize", {"model": "tiny"}, 400, None),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, None),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0"),
    ("/detokenize", {"tokens": [1, VOCAB_SIZE]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    # llama.cpp's spellings of this route's fields name the ones to send.
    ("/tokenize", {"prompt": "x", "with_pieces": True}, 400, "with_pieces"),
    ("/tokenize", {"prompt": "x", "add_special": False}, 400, "add_special"),
    ("/tokenize", {"prompt": "x", "parse_special": False}, 400, "parse_special"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), TOKEN_REFUSALS)
def test_token_refusals(api: TestClient, route: str, body: dict, status: int, param: str | None):
    refused = error(api.post(route, json=body), status)
    assert refused["param"] == param
    assert set(refused) == {"message", "type", "param", "code"}


def test_version_and_model_lengths(api: TestClient):
    assert ok(api.get("/version")) == {"version": version("hotlora")}
    cards = ok(api.get("/v1/models"))["data"]
    assert [card["id"] for card in cards] == ["tiny", "a"]
    assert all(card["max_model_len"] == MAX_POSITION_EMBEDDINGS for card in cards)
    assert ok(api.get("/v1/models/a"))["max_model_len"] == MAX_POSITION_EMBEDDINGS


def embed(api: TestClient, **body: object) -> dict:
    return ok(api.post("/v1/embeddings", json={"model": "tiny", **body}))


def vectors(answer: dict) -> np.ndarray:
    assert [item["index"] for item in answer["data"]] == list(range(len(answer["data"])))
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)


# A short input, and one of several prefill chunks (192 tokens each by default).
@pytest.mark.parametrize("text", ["the cat sat", "zebras! " * 60])
def test_embeddings_are_mean_pooled_final_norm_states(
    api: TestClient, tiny_model_dir: Path, text: str
):
    answer = embed(api, input=text)
    assert answer["object"] == "list" and answer["model"] == "tiny"
    [vector] = vectors(answer)
    assert vector.shape == (tiny_args().hidden_size,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    # The same pooling done here on mlx-lm's own load of the checkpoint, in one call.
    model, tokenizer = load(str(tiny_model_dir))
    tokens = tokenizer.encode(text)
    assert answer["usage"] == {"prompt_tokens": len(tokens), "total_tokens": len(tokens)}
    mean = model.model(mx.array([tokens]))[0].astype(mx.float32).mean(axis=0)
    expected = np.array(mean / mx.linalg.norm(mean))
    assert float(vector @ expected) > 0.999


def test_embeddings_are_the_same_bits_in_any_chunking(make_client, api: TestClient):
    """A long input pooled in chunks of 16 tokens and of 192: each query token's attention is
    computed on its own, as in generation, so the vectors are the same bits."""
    text = "zebras! " * 60
    small = make_client(prefill_chunk=16)
    np.testing.assert_array_equal(
        vectors(embed(small, input=text)), vectors(embed(api, input=text))
    )


def test_embeddings_of_many_inputs_token_ids_and_base64(api: TestClient):
    texts = ["the cat sat", "a zebra", "the cat sat"]
    many = vectors(embed(api, input=texts))
    alone = [vectors(embed(api, input=text))[0] for text in texts[:2]]
    np.testing.assert_allclose(many[0], alone[0], atol=1e-5)
    np.testing.assert_allclose(many[1], alone[1], atol=1e-5)
    np.testing.assert_allclose(many[2], many[0], atol=1e-6)
    assert float(many[0] @ many[1]) < 0.9999  # different texts, different vectors
    ids = ok(api.post("/tokenize", json={"prompt": "a zebra"}))["tokens"]
    np.testing.assert_allclose(vectors(embed(api, input=ids))[0], alone[1], atol=1e-5)
    both = vectors(embed(api, input=[ids, ids]))
    np.testing.assert_allclose(both[1], alone[1], atol=1e-5)
    packed = embed(api, input=texts[:2], encoding_format="base64")
    unpacked = [
        np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in packed["data"]
    ]
    np.testing.assert_array_equal(np.stack(unpacked), many[:2])
    full = embed(api, input="a zebra", dimensions=tiny_args().hidden_size)
    np.testing.assert_allclose(vectors(full)[0], alone[1], atol=1e-5)


def test_embeddings_of_an_adapter_set(api: TestClient):
    base = vectors(embed(api, input="the cat sat"))[0]
    by_field = embed(api, input="the cat sat", adapter="a")
    assert by_field["model"] == "tiny:a"
    by_model = embed(api, input="the cat sat", model="a")
    np.testing.assert_allclose(vectors(by_field)[0], vectors(by_model)[0], atol=1e-6)
    assert float(base @ vectors(by_field)[0]) < 0.9999
    # The lease is given back: the adapter is not left counted in use.
    assert ok(api.get("/v1/adapters/a"))["in_use"] == 0


EMBEDDING_REFUSALS = [
    # (body, status, param, code)
    ({"input": ""}, 400, "input", None),
    ({"input": []}, 400, "input", None),
    ({"input": ["x", ""]}, 400, "input", None),
    ({"input": [1, VOCAB_SIZE]}, 400, "input", None),
    ({"input": "x", "dimensions": 8}, 400, "dimensions", None),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
    ({"input": "x", "model": "nope"}, 404, "model", "model_not_found"),
    ({"input": "x", "adapter": "missing"}, 404, "adapter", "adapter_not_found"),
    ({"input": "ab" * MAX_POSITION_EMBEDDINGS}, 400, "input", "context_length_exceeded"),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), EMBEDDING_REFUSALS)
def test_embedding_refusals(
    api: TestClient, body: dict, status: int, param: str | None, code: str | None
):
    refused = error(api.post("/v1/embeddings", json={"model": "tiny", **body}), status)
    assert refused["param"] == param
    if code is not None:
        assert refused["code"] == code
