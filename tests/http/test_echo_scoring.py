"""Prompt scoring (`echo` on /v1/completions) in-process on the tiny model with two adapters:
the legacy logprobs shape lm-evaluation-harness reads, `max_tokens: 0`, lists, token ids, `n`,
streaming, refusals, and scores that are the same bits alone, batched, beside other adapter
sets, in any prefill chunking and with or without a kept opening."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.sse import sse_events

CONTEXT = "the cat sat on the mat and the dog ran after the cat " * 3 + "so the cat"
CHOICES = [" ran", " sat", " slept on the mat", " hid"]
SETS = ["", "a", "b", "a@0.5+b"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    model = tiny_model(quantize=True)
    write_mlx_adapter(root / "a", random_pairs(model, seed=1), scale=20.0)
    write_mlx_adapter(root / "b", random_pairs(model, seed=2), scale=20.0)
    return root


@pytest.fixture
def scoring(make_client: Callable[..., TestClient], root: Path) -> Callable[..., TestClient]:
    """A client on the tiny model with adapters `a` and `b` mounted, and these settings."""

    def make(**overrides: object) -> TestClient:
        client = make_client(adapter_root=root, **overrides)
        for name in ("a", "b"):
            mounted = client.post("/v1/adapters", json={"id": name, "path": name})
            assert mounted.status_code == 201, mounted.text
        return client

    return make


def complete(client: TestClient, status: int = 200, **fields: Any) -> dict[str, Any]:
    body = {"model": "tiny", "temperature": 0, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    return dict(response.json())


def score(client: TestClient, prompt: Any, adapter: str = "", **fields: Any) -> list[Any]:
    """Each choice's (token_logprobs, top_logprobs) for echo, logprobs 1, max_tokens 0."""
    fields = {"echo": True, "logprobs": 1, "max_tokens": 0, "adapter": adapter, **fields}
    body = complete(client, prompt=prompt, **fields)
    return [
        (c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]) for c in body["choices"]
    ]


def test_echo_answers_the_legacy_shape(scoring):
    client = scoring()
    prompt = CONTEXT + CHOICES[0]
    body = complete(client, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    [choice] = body["choices"]
    assert choice["text"] == prompt
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    n = body["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == n
    assert len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == n
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == prompt
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(n)]
    assert logprobs["text_offset"] == offsets
    for token, value, top in zip(
        logprobs["tokens"][1:],
        logprobs["token_logprobs"][1:],
        logprobs["top_logprobs"][1:],
        strict=True,
    ):
        assert value <= 0 and top[token] == value  # the token itself, then the 2 most likely
        assert 2 <= len(top) <= 3 and max(top.values()) >= value
    assert choice["prompt_logprobs"] is None  # vLLM's field only when asked for
    # vLLM's prompt_logprobs beside it: the same scores.
    both = complete(client, prompt=prompt, echo=True, logprobs=2, max_tokens=0, prompt_logprobs=2)
    vllm = both["choices"][0]["prompt_logprobs"]
    ids = [next(iter(entry)) for entry in vllm[1:]]
    assert [vllm[i + 1][t]["logprob"] for i, t in enumerate(ids)] == logprobs["token_logprobs"][1:]


def test_echo_puts_the_prompt_before_the_completion(scoring):
    client = scoring()
    plain = complete(client, prompt=CONTEXT, max_tokens=3, logprobs=1)["choices"][0]
    echoed = complete(client, prompt=CONTEXT, max_tokens=3, logprobs=1, echo=True)["choices"][0]
    assert echoed["text"] == CONTEXT + plain["text"]
    prompt_tokens = len(echoed["logprobs"]["tokens"]) - 3
    tail = {key: value[prompt_tokens:] for key, value in echoed["logprobs"].items()}
    assert tail["tokens"] == plain["logprobs"]["tokens"]
    assert tail["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert [t - len(CONTEXT) for t in tail["text_offset"]] == plain["logprobs"]["text_offset"]
    text_only = complete(client, prompt=CONTEXT, max_tokens=3, echo=True)["choices"][0]
    assert text_only["text"] == echoed["text"] and text_only["logprobs"] is None


def test_echo_on_lists_token_ids_and_n(scoring):
    client = scoring()
    tokenizer = client.app.state.runtime.worker.engine.tokenizer
    ids = tokenizer.encode(CONTEXT + CHOICES[1])
    prompts = [CONTEXT + c for c in CHOICES]
    body = complete(client, prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    assert [c["text"] for c in body["choices"]] == prompts
    by_ids = complete(client, prompt=ids, echo=True, logprobs=1, max_tokens=0)["choices"][0]
    assert by_ids["text"] == tokenizer.decode(ids)
    assert by_ids["logprobs"] == body["choices"][1]["logprobs"]
    lists = complete(client, prompt=[ids, ids[:-1]], echo=True, logprobs=1, max_tokens=0)
    assert lists["choices"][0]["logprobs"] == by_ids["logprobs"]
    twice = complete(client, prompt=prompts[:2], echo=True, n=2, max_tokens=1)
    texts = [c["text"] for c in twice["choices"]]
    expected = [prompts[0]] * 2 + [prompts[1]] * 2
    assert all(t.startswith(p) for t, p in zip(texts, expected, strict=True))


def test_echo_streams_the_prompt_first(scoring):
    client = scoring()
    fields = {"prompt": CONTEXT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    whole = complete(client, **fields)["choices"][0]
    response = client.post("/v1/completions", json={"model": "tiny", **fields, "stream": True})
    assert response.status_code == 200
    chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    first = chunks[0]["choices"][0]
    assert first["text"] == CONTEXT and first["logprobs"]["token_logprobs"][0] is None
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == whole["text"]
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in merged:
            merged[key] += (chunk["choices"][0].get("logprobs") or {}).get(key, [])
    assert merged == {key: whole["logprobs"][key] for key in merged}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "logprobs": 1, "prompt_logprobs": 2}, "prompt_logprobs"),
        ({"echo": True, "best_of": 2}, "best_of"),
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ],
)
def test_echo_refusals_name_the_field(scoring, fields, param):
    body = complete(scoring(), status=400, prompt=CONTEXT, **fields)
    assert body["error"]["param"] == param


def test_scores_are_the_same_bits_alone_batched_chunked_and_cached(scoring):
    """Every (adapter set, choice) scored alone on a fresh server with the prompt cache off and
    prompts prefilled whole, then all at once on a server whose prefill takes 16-token chunks
    and keeps the openings the choices share: the same bits."""
    prompts = [CONTEXT + c for c in CHOICES]
    alone = scoring(prompt_cache_size=0, prefill_chunk=4096)
    expected = {(s, p): score(alone, p, s)[0] for s in SETS for p in prompts}
    assert len({str(expected[(s, prompts[0])]) for s in SETS}) == len(SETS)  # adapters change it

    busy = scoring(prefill_chunk=16, max_batch=16)
    jobs = [(s, p) for p in prompts for s in SETS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: score(busy, job[1], job[0])[0], jobs))
    assert dict(zip(jobs, together, strict=True)) == expected
    for s in SETS:  # again, from the openings kept meanwhile, and as one list
        assert score(busy, prompts, s) == [expected[(s, p)] for p in prompts]
        body = complete(busy, prompt=prompts[2], echo=True, logprobs=1, max_tokens=0, adapter=s)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > len(CONTEXT) // 4


def test_chat_echo_repeats_the_assistant_prefill(scoring):
    client = scoring()
    messages = [
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "the dog"},
    ]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0}
    body["continue_final_message"] = True
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = client.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "the dog" + plain["content"]
