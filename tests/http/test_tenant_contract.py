"""Fuzzing every route with one tenant's user key: no answer runs, lists or names another
tenant's adapter, unless the request itself named it (an error repeats what was asked).

The app holds `acme-a` (acme's) and `globex-secret` (globex's) mounted, and `globex-auto`
under the root for `--auto-mount`; schemathesis sends acme's key with every request, its
dictionaries steering the `model`, `adapter` and id fields to all three and to ids nobody has.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings

from hotlora.config.settings import Settings
from hotlora.server.app import create_app
from hotlora.server.http.keys_file import key_digest

from tests.http.test_tenants import start
from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter

ACME_KEY = "hl-fuzz-acme"
OTHERS = ("globex-secret", "globex-auto")
CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {"mode": "all", "max-examples": 15, "deterministic": True},
        "phases": {"coverage": {"enabled": True}},
        "output": {"sanitization": {"enabled": False}},
        "checks": {"enabled": False, "not_a_server_error": {"enabled": True}},
        "dictionaries": {
            "models": {"values": ["tiny", "acme-a", *OTHERS, "tiny:globex-secret", "tiny:acme-a"]},
            "adapters": {"values": ["acme-a", *OTHERS, "acme-a+globex-secret", "nobody"]},
        },
        "parameters": {
            "body.model": {"dictionary": "models", "probability": 0.8},
            "body.adapter": {"dictionary": "adapters", "probability": 0.8},
            "path.model_id": {"dictionary": "models", "probability": 0.8},
            "path.adapter_id": {"dictionary": "adapters", "probability": 0.8},
            "body.id": {"dictionary": "adapters", "probability": 0.5},
            "body.lora_name": {"dictionary": "adapters", "probability": 0.5},
        },
    }
)

schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi(), config=CONFIG)


@pytest.fixture(scope="module")
def acme_app(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("tenant-fuzz")
    model = tiny_model(quantize=True)
    for seed, name in enumerate(["acme-a", *OTHERS], start=1):
        write_mlx_adapter(folder / "adapters" / name, random_pairs(model, seed=seed))
    keys = folder / "keys.toml"
    keys.write_text(
        f'[[key]]\nname = "acme"\nsha256 = "{key_digest(ACME_KEY)}"\nadapters = ["acme-*"]\n'
        f'[[key]]\nname = "globex"\nsha256 = "{key_digest("hl-fuzz-globex")}"\n'
        'adapters = ["globex-*"]\n'
    )
    client = start(
        tiny_model_dir,
        folder / "home",
        keys=keys,
        adapter_root=folder / "adapters",
        auto_mount=True,
        max_n=2,
        startup_adapters={"acme-a": "acme-a", "globex-secret": "globex-secret"},
    )
    yield client
    client.__exit__(None, None, None)


def send(client: TestClient, case: schemathesis.Case) -> tuple[httpx.Response, str]:
    """Send `case` with acme's key; the response, and the request as text."""
    request = case.as_transport_kwargs()
    if "json" in request:
        request["data"] = json.dumps(request.pop("json")).encode()
    headers = {**(request["headers"] or {}), "Authorization": f"Bearer {ACME_KEY}"}
    response = client.request(
        request["method"],
        request["url"],
        params=request["params"],
        headers=headers,
        content=request.get("data"),
    )
    asked = f"{request['url']} {request['params']} {request.get('data', b'')!r}"
    return response, asked


def no_leak(response: httpx.Response, asked: str, mounted: set[str]) -> None:
    for other in OTHERS:
        if other in asked:
            # Named by the request: refused, never served, and nothing mounted for it.
            assert response.status_code >= 400, (asked, response.text)
            assert other == "globex-secret" or other not in mounted, (asked, mounted)
        else:
            assert other not in response.text, (asked, response.text)


@schema.parametrize()
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_no_route_leaks_another_tenants_adapters(case: schemathesis.Case, acme_app: TestClient):
    response, asked = send(acme_app, case)
    assert response.status_code < 500, (asked, response.text)
    runtime = acme_app.app.state.runtime  # type: ignore[attr-defined]
    mounted = {info.id for info in runtime.adapters.list()}
    no_leak(response, asked, mounted)
