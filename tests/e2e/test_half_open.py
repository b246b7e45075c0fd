"""End to end, over raw sockets: connections that send half a request line cannot lock new
clients out. At the connection limit the oldest of them makes way, so a whole request from a new
connection is answered at once however many sit half-sent."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hotlora.server.http.connections import UNFINISHED_PER_PEER

from tests.support.server_process import ServerProcess, hotlora_spec
from tests.support.sockets import closed

pytestmark = pytest.mark.e2e

HALF_OPEN = 300  # beyond the default --max-connections (256)
HALF_LINE = b"GET /health HTTP/1.1\r\nHo"
MAX_CONNECTIONS = 256  # the default


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path) -> Iterator[ServerProcess]:
    # The default request timeout (30 s): only making room can free a place in time.
    with ServerProcess(hotlora_spec("--model", str(embedded_model_dir))) as srv:
        yield srv


def half_open(port: int, count: int, peers: range) -> list[socket.socket]:
    """`count` connections that each sent half a request line, from the loopback addresses
    127.0.0.N for N in `peers` in turn (Linux routes all of 127/8 to loopback)."""
    socks = []
    for i in range(count):
        source = (f"127.0.0.{peers[i % len(peers)]}", 0)
        sock = socket.create_connection(("127.0.0.1", port), source_address=source)
        sock.sendall(HALF_LINE)
        socks.append(sock)
    return socks


def timed(call: object) -> tuple[float, httpx.Response]:
    assert callable(call)
    began = time.monotonic()
    response = call()
    return time.monotonic() - began, response


def test_a_burst_of_whole_requests_from_one_address_is_answered(server: ServerProcess):
    """Three times the per-address cap of clients connect at once, each sending its request at
    once: all are taken in before any request is read, and every one is answered."""
    chat = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 1,
    }
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            sent = [client.get("/health") for _ in range(2 * UNFINISHED_PER_PEER)]
            sent += [
                client.post("/v1/chat/completions", json=chat) for _ in range(UNFINISHED_PER_PEER)
            ]
            return [r.status_code for r in await asyncio.gather(*sent)]

    # On a thread of its own: the test process's main thread may hold a running event loop.
    with ThreadPoolExecutor(1) as thread:
        statuses = thread.submit(asyncio.run, burst()).result()
    assert statuses == [200] * (3 * UNFINISHED_PER_PEER)


def test_whole_requests_from_new_connections_are_answered_beside_300_half_sent(
    server: ServerProcess,
):
    chat = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    with httpx.Client(base_url=server.url, timeout=10) as warm:
        assert warm.post("/v1/chat/completions", json=chat).status_code == 200
    crowd = range(10, 20)  # ten addresses, each under the per-address bound
    held = half_open(server.port, HALF_OPEN, crowd)
    try:
        time.sleep(0.5)
        for _ in range(3):
            # A new connection each time (one client per request: no pooled connection).
            took, response = timed(lambda: httpx.get(f"{server.url}/health", timeout=10))
            assert response.status_code == 200 and took < 1.0, took
            took, response = timed(
                lambda: httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=10)
            )
            assert response.status_code == 200 and took < 1.0, took
            held += half_open(server.port, 100, crowd)  # any number: more keep coming
            time.sleep(0.2)
        open_ = [sock for sock in held if not closed(sock)]
        # Each place beyond the limit was made by closing a half-sent one, oldest first.
        assert len(open_) <= MAX_CONNECTIONS
        assert not any(sock in open_ for sock in held[:100])
        assert all(sock in open_ for sock in held[-100:])
        # One address alone keeps only so many half-sent: its oldest make way for its newest
        # (at the connection limit, as the address holding the most, and by its cap).
        one = half_open(server.port, 2 * UNFINISHED_PER_PEER, range(20, 21))

        def kept() -> list[bool]:
            return [not closed(sock) for sock in one]

        # The server closes them a second after they arrive: a few seconds on a busy machine.
        deadline = time.monotonic() + 5
        while sum(kept()) > UNFINISHED_PER_PEER and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # every close seen
        states = kept()
        newest = sum(states)
        assert 0 < newest <= UNFINISHED_PER_PEER
        assert states == [False] * (len(states) - newest) + [True] * newest, states
        held += one
        took, response = timed(lambda: httpx.get(f"{server.url}/health", timeout=10))
        assert response.status_code == 200 and took < 1.0, took
    finally:
        for sock in held:
            sock.close()
    log = server.log(400)
    assert "that had not sent a whole request, to make room for new ones" in log
    assert "Traceback" not in log
