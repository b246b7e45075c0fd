"""End to end: what a client writes reaches a real server's log escaped, never as a line of its
own (a forged access line) or as terminal control codes."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.support.server_process import ServerProcess, hotlora_spec
from tests.support.tiny import write_tiny_llama

pytestmark = pytest.mark.e2e

FORGED = "INFO:     hotlora.access: DELETE /v1/adapters/pirate 200 1.0ms id=forged"
# Request targets as sent on the wire: uvicorn decodes the %-escapes into the request's path.
TARGETS = [
    "/health%0a" + FORGED.replace(" ", "%20"),
    "/v1/models%0d%0a" + FORGED.replace(" ", "%20"),
    "/ready%e2%80%a8" + FORGED.replace(" ", "%20"),  # U+2028, a line break to many readers
    "/health%1b[2J%1b[31mred",  # clear the screen, paint it red
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-log"), quantize=True)
    spec = hotlora_spec("--model", str(model), "--served-model-name", "tiny")
    with ServerProcess(spec) as srv:
        yield srv


def send_raw(server: ServerProcess, target: str) -> bytes:
    """One GET of `target` exactly as written: no client normalises or re-escapes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        head = f"GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        sock.sendall(head.encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_request_text_cannot_forge_or_restyle_log_lines(server: ServerProcess):
    for target in TARGETS:
        assert send_raw(server, target).startswith(b"HTTP/1.1 "), target
    with httpx.Client(base_url=server.url, timeout=30) as client:
        bad_id = client.post("/v1/adapters", json={"id": "a\n" + FORGED, "path": "a"})
        assert bad_id.status_code == 400
        bad_model = client.post(
            "/v1/chat/completions",
            json={"model": "tiny\n" + FORGED, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert bad_model.status_code == 404
    server.stop()  # every line written and flushed
    text = server.log_path.read_text(encoding="utf-8")
    lines = text.split("\n")
    assert not [line for line in lines if "id=forged" in line and not line.startswith("INFO")]
    assert not [line for line in lines if line.startswith(FORGED)]
    # Each request has its one access line, the client's text escaped in it.
    assert "GET /health\\nINFO:     hotlora.access: DELETE /v1/adapters/pirate 200" in text
    assert "GET /v1/models\\r\\nINFO:" in text
    assert "GET /ready\\u2028INFO:" in text
    assert "GET /health\\x1b[2J\\x1b[31mred 404" in text
    assert not {"\r", "\x1b", "\u2028"} & set(text)
