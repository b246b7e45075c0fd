"""A request's key decides its place in the fair share: the tenant's name and weight reach the
engine with every inference route's request; without keys every request is tenant `default`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hotlora.server.engine import Share
from hotlora.server.engine.fair_share import DEFAULT_SHARE
from hotlora.server.http.keys_file import key_digest

KEYS = {"acme": "hl-test-acme-key", "globex": "hl-test-globex-key"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
]


def spied(client: TestClient) -> list[Share]:
    """The share of every request the worker is handed from now on."""
    worker = client.app.state.runtime.worker
    submit, shares = worker.submit, []

    def recording(jobs, share=DEFAULT_SHARE):  # noqa: ANN001, ANN202
        shares.append(share)
        return submit(jobs, share)

    worker.submit = recording
    return shares


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_the_key_s_tenant_and_weight_reach_the_engine(
    make_client: Callable[..., TestClient], tmp_path: Path, path: str, body: dict
):
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[key]]\nname = "acme"\nsha256 = "{key_digest(KEYS["acme"])}"\nweight = 2.5\n\n'
        f'[[key]]\nname = "globex"\nsha256 = "{key_digest(KEYS["globex"])}"\n'
    )
    client = make_client(keys=keys)
    shares = spied(client)
    for name in ("acme", "globex"):
        response = client.post(
            path, json={"model": "tiny", **body}, headers={"Authorization": f"Bearer {KEYS[name]}"}
        )
        assert response.status_code == 200, response.text
    assert shares == [Share("acme", 2.5), Share("globex", 1.0)]


def test_without_keys_every_request_is_the_default_tenant(make_client: Callable[..., TestClient]):
    client = make_client()
    shares = spied(client)
    assert client.post("/v1/chat/completions", json={"model": "tiny", **CHAT}).status_code == 200
    assert shares == [Share("default", 1.0)]
