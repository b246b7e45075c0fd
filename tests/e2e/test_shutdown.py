"""End to end: SIGTERM and Ctrl-C drain a real server. New requests get 503 at once, requests in
flight finish (or, past `--drain-timeout`, end with an error), and the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.raw_clients import (
    chat_request,
    half_body,
    half_headers,
    long_stream,
    never_reading,
    wait_stalled,
)
from tests.support.server_process import ServerProcess, hotlora_spec

pytestmark = pytest.mark.e2e

PROMPT = "Write a long story about a dragon who learns to bake bread."


class Requests:
    """A streamed and a plain request running in threads, with what each got."""

    def __init__(self, url: str, model: str, max_tokens: int):
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
            # <|endoftext|>, <|im_end|>: the answer runs to max_tokens.
            "logit_bias": {"0": -100, "2": -100},
        }
        self.url, self.body = url, body
        self.stream_events: list[str] = []
        self.streaming = threading.Event()
        self.plain: httpx.Response | None = None
        self.threads = [
            threading.Thread(target=self._stream, daemon=True),
            threading.Thread(target=self._plain, daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _stream(self) -> None:
        with httpx.stream(
            "POST",
            f"{self.url}/v1/chat/completions",
            json={**self.body, "stream": True},
            timeout=120,
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.stream_events.append(line[len("data: ") :])
                    self.streaming.set()

    def _plain(self) -> None:
        self.plain = httpx.post(f"{self.url}/v1/chat/completions", json=self.body, timeout=120)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=120)
            assert not thread.is_alive()


def start(model_dir: Path, *args: str) -> ServerProcess:
    server = ServerProcess(hotlora_spec("--model", str(model_dir), *args))
    server.start()
    server.wait_ready()
    return server


def refused_while_draining(url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "shutting_down"
    assert "retry-after" in response.headers
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 503
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def drain(
    model_dir: Path, drain_timeout: str, max_tokens: int, sig: signal.Signals, *, twice=False
) -> tuple[ServerProcess, Requests]:
    """A server with a stream and a plain request in flight, sent `sig` (`twice`: again once
    the drain began): what each got, once the process has exited 0; new requests are refused
    meanwhile."""
    server = start(model_dir, "--drain-timeout", drain_timeout)
    try:
        running = Requests(server.url, server.model_id, max_tokens=max_tokens)
        assert running.streaming.wait(60)
        time.sleep(0.2)  # the plain request is admitted too
        assert server.proc is not None
        server.proc.send_signal(sig)
        time.sleep(0.3)
        refused_while_draining(server.url, server.model_id)
        if twice:
            server.proc.send_signal(sig)
        running.join()
        assert server.proc.wait(timeout=10 if twice else 60) == 0
    finally:
        server.stop()
    assert running.stream_events[-1] == "[DONE]"
    return server, running


def test_sigterm_lets_requests_in_flight_finish(embedded_model_dir: Path):
    # Long enough that both requests are still running while the refusal is checked.
    server, running = drain(embedded_model_dir, "60", 400, signal.SIGTERM)
    last = json.loads(running.stream_events[-2])
    assert last["choices"][0]["finish_reason"] == "length"
    assert running.plain is not None and running.plain.status_code == 200
    assert running.plain.json()["usage"]["completion_tokens"] == 400
    assert "waiting up to 60s" in server.log(80)


def test_at_the_drain_deadline_requests_end_with_an_error(embedded_model_dir: Path):
    _, running = drain(embedded_model_dir, "1", 2000, signal.SIGINT)  # Ctrl-C drains too
    assert json.loads(running.stream_events[-2])["error"]["code"] == "shutting_down"
    assert running.plain is not None and running.plain.status_code == 503
    assert running.plain.json()["error"]["code"] == "shutting_down"


def test_a_second_signal_ends_the_requests_in_flight_at_once(embedded_model_dir: Path):
    # A minute's drain and answers longer than that: only the second signal ends them.
    server, running = drain(embedded_model_dir, "60", 4000, signal.SIGTERM, twice=True)
    assert json.loads(running.stream_events[-2])["error"]["code"] == "shutting_down"
    assert running.plain is not None and running.plain.status_code == 503
    log = server.log(80)
    assert "a second signal: ending 2 requests still in flight" in log
    assert "Application shutdown complete." in log and "Traceback" not in log


def test_the_drain_timeout_holds_whatever_the_clients_do(embedded_model_dir: Path):
    # The client timeouts are longer than the whole test: only the drain may end these.
    server = start(
        embedded_model_dir,
        "--drain-timeout",
        "2",
        "--request-timeout",
        "300",
        "--send-timeout",
        "300",
        "--max-unsent-tokens",
        "100000",
    )
    clients: list[socket.socket] = []
    try:
        stream = never_reading(server.port, long_stream(server.model_id))
        clients = [stream, half_body(server.port), half_headers(server.port)]
        assert wait_stalled(server.port, stream, within=120), "the stream never filled its buffers"
        assert server.proc is not None
        began = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # The drain timeout, the ended requests' last writes (5 s), and a margin.
        assert server.proc.wait(timeout=2 + 5 + 10) == 0
        took = time.monotonic() - began
    finally:
        server.stop()
        for sock in clients:
            sock.close()
    assert took < 2 + 5 + 10
    assert "Traceback" not in server.log(200)


@pytest.fixture(scope="module")
def limited(embedded_model_dir: Path) -> Iterator[ServerProcess]:
    server = start(embedded_model_dir, "--max-connections", "4", "--keep-alive-timeout", "1")
    yield server
    server.stop()


def test_connections_are_bounded(limited: ServerProcess):
    server = limited
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    time.sleep(0.2)
    # Beyond the bound a new connection takes the place of the oldest that sent no request.
    extra = socket.create_connection(("127.0.0.1", server.port))
    silent[0].settimeout(1)
    assert silent[0].recv(1) == b""
    # A connection that sends nothing is closed after the keep-alive timeout.
    for sock in [*silent[1:], extra]:
        sock.settimeout(5)
        assert sock.recv(1) == b""
    # With every connection answering a request, a new one is closed at once.
    endless = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 400,
        "stream": True,
        "logit_bias": {"0": -100, "2": -100},
    }
    busy = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    for sock in busy:
        sock.sendall(chat_request(endless))
        sock.settimeout(30)
        assert sock.recv(12).startswith(b"HTTP/1.1 200")
    refused = socket.create_connection(("127.0.0.1", server.port))
    refused.settimeout(5)
    assert refused.recv(1) == b""
    for sock in [*silent, extra, *busy, refused]:
        sock.close()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_an_error_leaves_the_connection_usable(limited: ServerProcess):
    server = limited
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(30)
        reader = sock.makefile("rb")
        bad = json.dumps({"model": server.model_id, "messages": []}).encode()
        good = json.dumps(
            {
                "model": server.model_id,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
            }
        ).encode()
        statuses = []
        for body in (bad, b"{not json", good):
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            statuses.append(read_response(reader))
    assert statuses == [400, 400, 200]


def read_response(reader: Any) -> int:
    """One HTTP/1.1 response with a Content-Length from the socket; its status."""
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    reader.read(length)
    return status
