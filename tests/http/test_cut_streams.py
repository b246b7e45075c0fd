"""A stream whose client is gone before its first event was asked for: its rows stop and its
adapters are released (the events' generator never started, so its own cleanup never ran)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "the cat"}]},
    "/v1/completions": {"prompt": "the cat"},
    "/v1/responses": {"input": "the cat"},
}


@pytest.fixture
def client(make_client, tmp_path: Path) -> TestClient:
    root = tmp_path / "adapters"
    write_mlx_adapter(root / "a", random_pairs(tiny_model(quantize=True), seed=1))
    return make_client(adapter_root=root, startup_adapters={"a": "a"}, max_batch=1)


async def _cut_before_the_first_event(app, path: str, body: dict, after: int = 0) -> None:
    """POST `body` as a client whose socket takes nothing, then goes away: the response's
    headers wait to be sent until the disconnect arrives. `after`: the events taken first."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    started, gone = asyncio.Event(), asyncio.Event()
    read = False

    async def receive() -> dict:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    taken = 0

    async def send(message: dict) -> None:
        nonlocal taken
        if message["type"] == "http.response.body" and b"data:" in message.get("body", b""):
            taken += 1
        if message["type"] == "http.response.start" and after == 0 or taken > after:
            started.set()
            await asyncio.sleep(3600)  # the socket's buffers are full: the write waits

    async def leave() -> None:
        await started.wait()
        gone.set()

    leaving = asyncio.ensure_future(leave())
    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    await leaving


@pytest.mark.parametrize("path", BODIES)
def test_a_stream_cut_before_its_first_event_lets_go(
    client: TestClient, path: str, caplog: pytest.LogCaptureFixture
):
    body = {"model": "a", "stream": True, **BODIES[path]}
    if path == "/v1/responses":
        body["max_output_tokens"] = 400
    else:
        body.update(max_tokens=400, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="hotlora.access"):
        client.portal.call(_cut_before_the_first_event, client.app, path, body)
    # It never ran: its line counts no tokens (rather than a prompt of 0).
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"POST {path}")]
    assert "finish=cancelled" in line and "prompt=" not in line
    runtime = client.app.state.runtime
    deadline = time.monotonic() + 20
    while runtime.load_snapshot().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.load_snapshot().running == 0
    assert client.get("/v1/adapters/a").json()["in_use"] == 0
    # The one batch slot is free: the next request is answered.
    answer = client.post(
        "/v1/chat/completions",
        json={"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert answer.status_code == 200, answer.text


def test_a_stream_its_client_stopped_counts_what_it_generated(client: TestClient):
    body = {**BODIES["/v1/chat/completions"], "model": "a", "stream": True, "max_tokens": 400}
    body["ignore_eos"] = True
    path = "/v1/chat/completions"
    paced = _tpot_count(client)
    client.portal.call(_cut_before_the_first_event, client.app, path, body, 6)
    # Its tokens' pace is observed, as a finished choice's is.
    assert _tpot_count(client) == paced + 1
    [tenant] = client.get("/v1/usage").json()["data"]
    used = tenant["adapters"]["a"]
    assert used["requests"] == 1
    assert used["prompt_tokens"] > 0
    # The tokens its events told of (a role chunk, then one or more tokens each), not all 400.
    assert 5 <= used["completion_tokens"] < 400


def _tpot_count(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("vllm:time_per_output_token_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
