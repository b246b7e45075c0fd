"""Many adapters end to end: a real uvicorn process on the embedded model with --auto-mount and
a budget of two, concurrent first requests, evictions under traffic, a broken adapter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from hotlora.adapters.projections import find_targets, linear_dims
from hotlora.models.loader import load_model_dir

from tests.support.server_process import ServerProcess, hotlora_spec

pytestmark = pytest.mark.e2e

IDS = ("r0", "r1", "r2")
MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def root(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three random rank-4 adapters on the attention projections, and a broken one."""
    root = tmp_path_factory.mktemp("many-adapters")
    targets = find_targets(load_model_dir(embedded_model_dir).model)
    dims = {p: linear_dims(m) for p, m in targets.items() if p.endswith(("q_proj", "v_proj"))}
    for seed, name in enumerate((*IDS, "broken")):
        mx.random.seed(seed)
        tensors = {}
        for path, d in dims.items():
            tensors[f"{path}.lora_a"] = 0.05 * mx.random.normal((d.in_dims, 4))  # [in, r]
            tensors[f"{path}.lora_b"] = 0.05 * mx.random.normal((4, d.out_dims))  # [r, out]
        (root / name).mkdir()
        mx.save_safetensors(str(root / name / "adapters.safetensors"), tensors)
        config = {"lora_parameters": {"rank": 4 if name != "broken" else 8, "scale": 20.0}}
        (root / name / "adapter_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path, root: Path) -> Iterator[ServerProcess]:
    spec = hotlora_spec(
        "--model",
        str(embedded_model_dir),
        "--adapter-root",
        str(root),
        "--auto-mount",
        "--max-mounted-adapters",
        "2",
        "--max-batch",
        "8",
    )
    with ServerProcess(spec) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=180) as client:
        yield client


def chat(http: httpx.Client, server: ServerProcess, adapter: str) -> httpx.Response:
    body: dict[str, Any] = {
        "model": server.model_id,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "adapter": adapter,
    }
    return http.post("/v1/chat/completions", json=body)


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_concurrent_first_requests_load_once_and_evictions_keep_answers(http, server):
    # Six requests at once for an adapter nobody mounted: one load, six answers alike.
    with ThreadPoolExecutor(6) as pool:
        first = list(pool.map(lambda _: chat(http, server, "r0"), range(6)))
    answers = {text(response) for response in first}
    assert len(answers) == 1
    assert metric(http, "hotlora_adapter_loads_total") == 1
    base = text(chat(http, server, "none"))
    assert answers != {base}  # the adapter really changes the answer

    # Traffic over three adapters with room for two: each answer is its adapter's, evicted or not.
    alone = {"r0": answers.pop(), **{i: text(chat(http, server, i)) for i in IDS[1:]}}
    with ThreadPoolExecutor(6) as pool:
        mixed = list(pool.map(lambda i: (i, chat(http, server, i)), [*IDS, *IDS, *IDS]))
    for adapter_id, response in mixed:
        assert text(response) == alone[adapter_id], adapter_id
    assert metric(http, "hotlora_adapter_evictions_total") >= 1
    resident = [card["id"] for card in http.get("/v1/adapters").json()["data"]]
    assert len(resident) <= 2
    listing = {e["id"]: e["state"] for e in http.get("/v1/adapter_root").json()["data"]}
    assert {listing[i] for i in IDS} == {"resident", "evicted"}


def test_a_broken_adapter_is_a_400_for_every_request_that_names_it(http, server):
    with ThreadPoolExecutor(4) as pool:
        refused = list(pool.map(lambda _: chat(http, server, "broken"), range(4)))
    for response in refused:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "'broken' could not be loaded" in error["message"] and "rank" in error["message"]
    assert "broken" not in [card["id"] for card in http.get("/v1/adapters").json()["data"]]
