"""End to end: a real server with a keys file, through the official `openai` client: scoped
models, a tenant's streams limit while one stream runs, 429 with Retry-After on the wire, a
new key taken on SIGHUP, and access lines that name tenants but never a key or its hash."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hotlora.server.http.keys_file import key_digest

from tests.support.server_process import ServerProcess, hotlora_spec

pytestmark = pytest.mark.e2e

ACME, GLOBEX, LATE = "hl-e2e-acme", "hl-e2e-globex", "hl-e2e-late"
MESSAGES = [{"role": "user", "content": "Count from one to one hundred, in words."}]


def table(name: str, key: str, extra: str = "") -> str:
    return f'[[key]]\nname = "{name}"\nsha256 = "{key_digest(key)}"\n{extra}\n'


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(
        table("acme", ACME, 'adapters = ["acme-*"]\nmax_streams = 1')
        + table("globex", GLOBEX, "base = false")
    )
    return path


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path, keys_file: Path) -> Iterator[ServerProcess]:
    spec = hotlora_spec("--model", str(embedded_model_dir), "--keys", str(keys_file))
    with ServerProcess(spec) as srv:
        yield srv


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_scopes_limits_and_sighup(server: ServerProcess, keys_file: Path):
    acme, globex = client(server, ACME), client(server, GLOBEX)
    model = server.model_id
    assert [card.id for card in acme.models.list().data] == [model]
    assert globex.models.list().data == []  # no adapters, and not the base alone
    with pytest.raises(openai.NotFoundError) as refused:
        globex.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert refused.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client(server, "hl-nobody").models.list()

    # One stream runs (acme may hold one at a time): the next request is a 429.
    stream = acme.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    assert first.choices
    raw = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 2},
        headers={"Authorization": f"Bearer {ACME}"},
        timeout=60,
    )
    assert raw.status_code == 429, raw.text
    assert raw.headers["retry-after"] == "1"
    assert raw.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        acme.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    stream.close()
    deadline = time.monotonic() + 30
    while True:  # the closed stream's place is given back once the server sees it gone
        try:
            answer = acme.chat.completions.create(  # sampled: two tokens, whatever they are
                model=model, messages=MESSAGES, max_tokens=2, extra_body={"ignore_eos": True}
            )
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert answer.usage is not None and answer.usage.completion_tokens == 2

    # A key added to the file works once the server is told (SIGHUP), not before it reads it.
    late = client(server, LATE)
    with keys_file.open("a") as file:
        file.write(table("late", LATE))
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            late.models.list()
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert server.proc.poll() is None  # SIGHUP reads the keys; it does not stop the server

    server.stop()
    log = server.log_path.read_text(encoding="utf-8")
    access = [line for line in log.splitlines() if "hotlora.access" in line]
    assert any("tenant=acme" in line and " 429 " in line for line in access), "\n".join(access)
    assert any("tenant=globex" in line and " 404 " in line for line in access)
    assert "read again: 3 keys of 3 tenant(s)" in log
    for secret in (ACME, GLOBEX, LATE):
        assert secret not in log and key_digest(secret) not in log
