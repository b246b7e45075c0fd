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
# Long enough to watch a paused request before its connection is cut.
SEND_TIMEOUT_S = 10
MAX_UNSENT = 64  # its rows pause at 32 untaken events
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


def rss_mb(server: ServerProcess) -> float:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))


def test_a_client_that_never_reads_is_paused_then_ends_and_releases_its_adapter(
    server: ServerProcess,
):
    reader = never_reading(server.port, long_stream(server.model_id, adapter=ADAPTER))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        deadline = time.monotonic() + 30
        while in_use(client) != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.2)
        # Once the socket's buffers are full its rows pause: the server's memory stops growing
        # (it holds their KV cache, no more events nor positions).
        deadline = time.monotonic() + 120
        while metric(client, "hotlora_requests_paused") != 1:
            assert time.monotonic() < deadline, "the request never paused"
            time.sleep(0.2)
        paused_at = rss_mb(server)
        time.sleep(4)
        assert metric(client, "hotlora_requests_paused") == 1
        assert rss_mb(server) - paused_at < 8 * 1024, "memory grew while paused (kB)"
        # The connection is cut SEND_TIMEOUT_S after the buffers filled: the request ends.
        while in_use(client):
            assert time.monotonic() < deadline, "the adapter is still in use"
            time.sleep(0.5)
        # The lease ends with the response; the worker drops the paused row at its next wake.
        deadline = time.monotonic() + 10
        while metric(client, "hotlora_requests_paused") != 0:
            assert time.monotonic() < deadline, "the ended request's rows are still paused"
            time.sleep(0.2)
        assert metric(client, "hotlora_client_not_reading_total") == 1
        assert metric(client, "vllm:num_requests_running") == 0
        generated = metric(client, "vllm:generation_tokens_total")
        assert generated < 8 * 2000
        # Nothing goes on decoding for it.
        time.sleep(2)
        assert metric(client, "vllm:generation_tokens_total") == generated
    reader.close()
    log = server.log(200)
    assert "the request's 8 rows are paused, holding only their KV cache" in log
    assert "Traceback" not in log
