"""End to end: the routes and metrics that vLLM's clients and dashboards use, on a real uvicorn
process serving the embedded model, through the official client and plain HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http.test_vllm_dashboard import DASHBOARD, metric_names, queries
from tests.support.server_process import ServerProcess, hotlora_spec

pytestmark = pytest.mark.e2e

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(hotlora_spec("--model", str(embedded_model_dir))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=180)


def test_embeddings_place_a_paraphrase_nearer_than_another_topic(
    client: openai.OpenAI, server: ServerProcess, embedded_model_id: str
):
    texts = [
        "The cat sat on the mat.",
        "A cat was sitting on the mat.",
        "Quarterly revenue rose by five percent.",
    ]
    # The official client asks for base64 and decodes it.
    answer = client.embeddings.create(model=embedded_model_id, input=texts)
    vectors = np.array([item.embedding for item in answer.data])
    assert vectors.shape == (3, 576)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    near, far = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert near > far, (near, far)
    floats = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": embedded_model_id, "input": texts, "encoding_format": "float"},
        timeout=180,
    ).json()
    np.testing.assert_array_equal(
        np.array([item["embedding"] for item in floats["data"]], dtype=np.float32), vectors
    )
    assert floats["usage"]["prompt_tokens"] == answer.usage.prompt_tokens > 0


def test_tokenize_counts_what_chat_counts(
    client: openai.OpenAI, server: ServerProcess, embedded_model_id: str
):
    rendered = httpx.post(
        f"{server.url}/tokenize", json={"model": embedded_model_id, "messages": FRANCE}
    ).json()
    assert rendered["max_model_len"] == 8192
    chat = client.chat.completions.create(
        model=embedded_model_id, messages=FRANCE, max_tokens=2, temperature=0
    )
    assert rendered["count"] == chat.usage.prompt_tokens
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": rendered["tokens"]}).json()
    assert text["prompt"].endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert httpx.get(f"{server.url}/version").json() == {"version": version("hotlora")}
    [card] = client.models.list().data
    assert card.model_extra is not None and card.model_extra["max_model_len"] == 8192


def test_vllm_dashboard_queries_read_a_real_scrape(
    client: openai.OpenAI, server: ServerProcess, embedded_model_id: str
):
    client.chat.completions.create(
        model=embedded_model_id, messages=FRANCE, max_tokens=4, temperature=0
    )
    scraped = httpx.get(f"{server.url}/metrics").text
    names = {
        sample.name
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
        if sample.labels.get("model_name") == embedded_model_id
    }
    wanted = set().union(*(metric_names(q) for q in queries(json.loads(DASHBOARD.read_text()))))
    assert wanted and not wanted - names, sorted(wanted - names)
    # The start-up phases the log names, the served process's imports among them.
    phases = {
        sample.labels["phase"]
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
        if sample.name == "hotlora_startup_phase_seconds"
    }
    assert {"imports", "model load", "warm-up"} <= phases, phases
