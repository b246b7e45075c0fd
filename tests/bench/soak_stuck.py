"""The soak test's stuck clients: a stream that is never read, a request body sent in part, and
headers sent a byte at a time. Each one waits for the server to close its connection, files how
long that took, and starts again."""

from __future__ import annotations

import socket
import time

from tests.bench.soak_traffic import Traffic
from tests.support.raw_clients import (
    HEAD,
    closed_within,
    half_body,
    long_stream,
    never_reading,
    unsent_bytes,
)

CLOSE_MARGIN_S = 5.0  # beyond --request-timeout, for a loaded machine
SLOW_HEADER_EVERY_S = 0.5  # one header byte this often: never done within the request timeout


def half_body_client(traffic: Traffic, port: int, request_timeout: float) -> None:
    """Headers and part of a body, then silence: closed with a 408 within the request timeout."""
    bound = request_timeout + CLOSE_MARGIN_S
    while not traffic.stop.is_set():
        with half_body(port) as sock:
            closed = closed_within(sock, bound)
        if closed is None:
            traffic.tally.fail("half-sent body not closed", f"still open after {bound:.0f}s")
        elif not closed[1].startswith(b"HTTP/1.1 408 "):
            traffic.tally.fail("half-sent body not answered 408", repr(closed[1][:200]))
        else:
            traffic.tally.closed("half-sent body", closed[0])


def slow_headers_client(traffic: Traffic, port: int, request_timeout: float) -> None:
    """Headers a byte at a time, never finished in time: closed within the request timeout of
    the first byte."""
    bound = request_timeout + CLOSE_MARGIN_S
    while not traffic.stop.is_set():
        with socket.create_connection(("127.0.0.1", port)) as sock:
            began = time.monotonic()
            took = _trickle(sock, began + bound)
        if took is None:
            traffic.tally.fail("slow headers not closed", f"still open after {bound:.0f}s")
        else:
            traffic.tally.closed("slow headers", took)


def _trickle(sock: socket.socket, deadline: float) -> float | None:
    """Send HEAD byte by byte (then header lines for ever) until the server closes; the seconds
    that took, or None at the deadline."""
    began = time.monotonic()
    data = HEAD + b"X-Slow: " + b"a" * 10_000
    sock.settimeout(SLOW_HEADER_EVERY_S)
    for byte in data:
        if time.monotonic() > deadline:
            return None
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(1) == b"":
                return time.monotonic() - began
        except TimeoutError:
            continue  # nothing to read: the connection is open
        except OSError:
            return time.monotonic() - began  # reset by the server
    return None


def never_reading_client(traffic: Traffic, port: int, bound_s: float, adapter: str) -> None:
    """A long stream (with `adapter`) whose client never reads: the server must cut the
    connection within `bound_s` (its buffers fill, the request's tokens reach the server's
    bound, then the send timeout passes); its adapter lease is then released."""
    body = long_stream(traffic.base_id, adapter=adapter, n=4, max_tokens=1500)
    while not traffic.stop.is_set():
        with never_reading(port, body) as sock:
            began = time.monotonic()
            took = _wait_cut(traffic, port, sock, began + bound_s)
        if took is None and not traffic.stop.is_set():
            traffic.tally.fail("never-reading stream not cut", f"still open after {bound_s:.0f}s")
        elif took is not None:
            traffic.tally.closed("never-reading stream", took - began)


def _wait_cut(traffic: Traffic, port: int, sock: socket.socket, deadline: float) -> float | None:
    """When the server's end of `sock` vanished, or None at the deadline or the soak's end."""
    time.sleep(1)  # the server's end exists once the request is accepted
    while unsent_bytes(port, sock) is not None:
        if time.monotonic() > deadline or traffic.stop.wait(1):
            return None
    return time.monotonic()
