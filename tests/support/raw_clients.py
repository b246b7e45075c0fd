"""Misbehaving HTTP clients over raw sockets, for the end-to-end tests and the soak: requests sent
in part, and streams whose client never reads."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
)


def chat_request(body: dict[str, Any]) -> bytes:
    """A whole POST /v1/chat/completions request."""
    data = json.dumps(body).encode()
    return HEAD + f"Content-Length: {len(data)}\r\n\r\n".encode() + data


def half_headers(port: int) -> socket.socket:
    """A connection that sent part of a request's headers, and nothing more."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(HEAD)
    return sock


def half_body(port: int) -> socket.socket:
    """A connection that sent a request's headers and the start of its 100-byte body."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(HEAD + b'Content-Length: 100\r\n\r\n{"model": "')
    return sock


def long_stream(model: str, **extra: Any) -> dict[str, Any]:
    """A streamed chat request whose 8 choices run to `max_tokens` with 20 top logprobs each:
    many bytes a token, so a client that does not read fills its socket's buffers soon."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 2000,
        "n": 8,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
        "logit_bias": {"0": -100, "2": -100},  # no end of text
        **extra,
    }


def never_reading(port: int, body: dict[str, Any]) -> socket.socket:
    """A connection that sends a whole request and never reads a byte of the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(chat_request(body))
    return sock


def unsent_bytes(server_port: int, sock: socket.socket) -> int | None:
    """Bytes the server's end of `sock`'s connection has queued in the kernel, unread by
    `sock` (Linux's /proc/net/tcp); None once the server has closed its end, or without
    /proc."""
    client_port = sock.getsockname()[1]
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == (
            client_port
        ):
            established = fields[3] == "01"
            return int(fields[4].split(":")[0], 16) if established else None
    return None


def wait_stalled(server_port: int, sock: socket.socket, within: float) -> bool:
    """Wait until the server's kernel buffer towards `sock` is full (no longer growing):
    its writes now wait on the client. False if that did not happen within `within` s."""
    deadline, last = time.monotonic() + within, -1
    while time.monotonic() < deadline:
        queued = unsent_bytes(server_port, sock)
        if queued is None:
            return False
        if queued > 0 and queued == last:
            return True
        last = queued
        time.sleep(2)
    return False


def closed_within(sock: socket.socket, within: float) -> tuple[float, bytes] | None:
    """What the server sends until it closes the connection and how long that took; None if
    it is still open after `within` seconds."""
    began, got = time.monotonic(), b""
    sock.settimeout(within)
    try:
        while chunk := sock.recv(65536):
            got += chunk
            if time.monotonic() - began > within:
                return None
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return time.monotonic() - began, got
