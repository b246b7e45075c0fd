"""End to end, over raw sockets: clients that send a request in part, or never read their answer,
cannot hold a connection, a batch row, an adapter or memory for ever."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.raw_clients import (
    closed_within,
    half_body,
    half_headers,
    long_stream,
    never_reading,
)
from tests.support.server_process import ServerProcess, hotlora_spec

pytestmark = pytest.mark.e2e

REQUEST_TIMEOUT_S = 2
# Longer than MAX_UNSENT tokens take to make: a client that stops reading has its request ended
# by the bound, then its connection cut.
SEND_TIMEOUT_S = 10
MAX_UNSENT = 64
ADAPTER = "x"


@pytest.fixture(scope="module")
def adapter_root(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random rank-4 adapter for the embedded model, as `x/` under a fresh adapter root."""
    import mlx.core as mx

    from hotlora.models.loader import load_model_dir

    from tests.support.adapter_builders import random_pairs, write_mlx_adapter

    root = tmp_path_factory.mktemp("adapters")
    model = load_model_dir(embedded_model_dir).model
    write_mlx_adapter(root / ADAPTER, random_pairs(model, rank=4), rank=4, scale=0.05)
    del model
    mx.clear_cache()
    return root


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path, adapter_root: Path) -> Iterator[ServerProcess]:
    spec = hotlora_spec(
        "--model",
        str(embedded_model_dir),
        "--adapter-root",
        str(adapter_root),
        f"--adapter={ADAPTER}={ADAPTER}",
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--send-timeout",
        str(SEND_TIMEOUT_S),
        "--max-unsent-tokens",
        str(MAX_UNSENT),
    )
    with ServerProcess(spec) as srv:
        yield srv


def test_a_half_sent_request_is_closed_within_the_request_timeout(server: ServerProcess):
    headers, body = half_headers(server.port), half_body(server.port)
    # New connections are answered meanwhile.
    for _ in range(3):
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    closed = closed_within(headers, REQUEST_TIMEOUT_S + 10)
    assert closed is not None, "half-sent headers: still open"
    assert closed[1] == b""
    closed = closed_within(body, REQUEST_TIMEOUT_S + 10)
    assert closed is not None, "half-sent body: still open"
    head, _, answer = closed[1].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), closed[1]
    assert json.loads(answer)["error"]["code"] == "request_timeout"
    for sock in (headers, body):
        sock.close()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert "Traceback" not in server.log(200)


def in_use(client: httpx.Client) -> int:
    cards = client.get("/v1/adapters").json()["data"]
    return next(card["in_use"] for card in cards if card["id"] == ADAPTER)


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_never_reads_ends_its_request_and_releases_its_adapter(
    server: ServerProcess,
):
    reader = never_reading(server.port, long_stream(server.model_id, adapter=ADAPTER))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        deadline = time.monotonic() + 30
        while in_use(client) != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.2)
        # Once the socket's buffers are full its rows end, MAX_UNSENT tokens later, and the
        # connection is cut SEND_TIMEOUT_S after: long before 8 x 2000 tokens are made.
        deadline = time.monotonic() + 120
        while in_use(client):
            assert time.monotonic() < deadline, "the adapter is still in use"
            time.sleep(0.5)
        assert metric(client, "hotlora_client_not_reading_total") == 1
        assert metric(client, "vllm:num_requests_running") == 0
        generated = metric(client, "vllm:generation_tokens_total")
        assert generated < 8 * 2000
        # Nothing goes on decoding for it.
        time.sleep(2)
        assert metric(client, "vllm:generation_tokens_total") == generated
    reader.close()
    assert "Traceback" not in server.log(200)
