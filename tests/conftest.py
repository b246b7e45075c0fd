"""Shared fixtures: a tiny random model directory and the app served on it in-process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hotlora.config.settings import Settings
from hotlora.server.app import create_app

from tiny import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), quantize=True)


def wait_ready(client: TestClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get("/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"app not ready: {client.get('/ready').json()}")


def tiny_settings(model_dir: Path, home: Path, **overrides: object) -> Settings:
    return Settings(model=model_dir, home=home, served_model_name="tiny", **overrides)


@pytest.fixture
def make_client(tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    """Build an app on the tiny model with setting overrides; returns a ready TestClient."""
    clients: list[TestClient] = []

    def make(*, raise_server_exceptions: bool = True, **overrides: object) -> TestClient:
        app = create_app(tiny_settings(tiny_model_dir, tmp_path / "home", **overrides))
        client = TestClient(app, raise_server_exceptions=raise_server_exceptions)
        client.__enter__()
        clients.append(client)
        wait_ready(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client) -> TestClient:
    return make_client()
