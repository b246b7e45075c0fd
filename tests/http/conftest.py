"""The app in-process on the tiny model: a ready TestClient per test, with setting overrides."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hotlora.adapters import MountStore
from hotlora.config.settings import Settings
from hotlora.server.app import create_app

from tests.support.server_process import LOCALHOST


def wait_ready(client: TestClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get("/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"app not ready: {client.get('/ready').json()}")


@pytest.fixture
def make_client(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """Build an app on the tiny model with setting overrides; returns a started TestClient.

    `ready=False` returns as soon as the app starts (its model loads in the background), and
    `on_fatal` is the app factory's hook for a start that fails; `mount_store` its record of
    mounts in place of `persist_mounts`'s.
    """
    clients: list[TestClient] = []

    def make(
        *,
        raise_server_exceptions: bool = True,
        ready: bool = True,
        on_fatal: Callable[[BaseException], None] | None = None,
        mount_store: MountStore | None = None,
        **overrides: object,
    ) -> TestClient:
        # An app in this process leaves the test process's PATH and TMPDIR alone.
        fields = {
            "model": tiny_model_dir,
            "served_model_name": "tiny",
            "cpu_vector_jit": False,
            **overrides,
        }
        settings = Settings(home=tmp_path / "home", **fields)
        app = create_app(settings, on_fatal=on_fatal, mount_store=mount_store)
        client = TestClient(
            app, base_url=LOCALHOST, raise_server_exceptions=raise_server_exceptions
        )
        client.__enter__()
        clients.append(client)
        if ready:
            wait_ready(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()
