"""Tenants in-process on the tiny model: each key × route × adapter case, admin scope, limits,
the keys file read again while requests run, usage, and `hotlora keys add`.

One app (`tenants`) serves the case table: adapters `acme-a` and `globex-a` mounted, `acme-b`
ready in acme's folder, and `acme-auto` / `globex-auto` under the root for `--auto-mount`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hotlora.config.settings import Settings
from hotlora.server.app import create_app
from hotlora.server.cli import main
from hotlora.server.http.keys_file import key_digest

from tests.http.conftest import wait_ready
from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.server_process import LOCALHOST

KEYS = {name: f"hl-test-{name}-key" for name in ("acme", "globex", "acme-admin", "ops")}


def entry(name: str, key: str, **fields: Any) -> str:
    lines = ["[[key]]", f'name = "{name}"', f'sha256 = "{key_digest(key)}"']
    for field, value in fields.items():
        if isinstance(value, bool):
            shown = "true" if value else "false"
        elif isinstance(value, str):
            shown = f'"{value}"'
        elif isinstance(value, list):
            shown = "[" + ", ".join(f'"{item}"' for item in value) + "]"
        else:
            shown = str(value)
        lines.append(f"{field} = {shown}")
    return "\n".join(lines) + "\n\n"


# acme's tenant-admin key's rights: its ids, its prefix, its folder under the root.
ACME_ADMIN: dict[str, Any] = {
    "role": "tenant-admin",
    "adapters": ["acme-*"],
    "mount_prefix": "acme-",
    "mount_dir": "acme",
}
KEYS_FILE = (
    entry("acme", KEYS["acme"], adapters=["acme-*"], base=True)
    + entry("globex", KEYS["globex"], adapters=["globex-*"], base=False)
    + entry("acme", KEYS["acme-admin"], **ACME_ADMIN)
    + entry("ops", KEYS["ops"], role="admin")
)


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def write_root(root: Path) -> Path:
    model = tiny_model(quantize=True)
    for seed, folder in enumerate(
        ["acme/a", "acme/b", "globex/a", "globex/b", "acme-auto", "globex-auto"], start=1
    ):
        write_mlx_adapter(root / folder, random_pairs(model, seed=seed), scale=20.0)
    return root


def start(tiny_model_dir: Path, home: Path, **overrides: Any) -> TestClient:
    settings = Settings(
        home=home,
        model=tiny_model_dir,
        served_model_name="tiny",
        cpu_vector_jit=False,
        max_tokens_limit=8,
        default_max_tokens=3,
        **overrides,
    )
    client = TestClient(create_app(settings), base_url=LOCALHOST)
    client.__enter__()
    wait_ready(client)
    return client


@pytest.fixture(scope="module")
def tenants(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("tenants")
    keys = folder / "keys.toml"
    keys.write_text(KEYS_FILE)
    client = start(
        tiny_model_dir,
        folder / "home",
        keys=keys,
        adapter_root=write_root(folder / "adapters"),
        auto_mount=True,
        startup_adapters={"acme-a": "acme/a", "globex-a": "globex/a"},
    )
    yield client
    client.__exit__(None, None, None)


# --- The case table: key × route × selection ------------------------------------------------

MESSAGES = [{"role": "user", "content": "the cat"}]
ROUTES: dict[str, Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]] = {
    "chat": lambda s: ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **s}),
    "completions": lambda s: ("/v1/completions", {"prompt": "the cat", "max_tokens": 2, **s}),
    "responses": lambda s: ("/v1/responses", {"input": "the cat", "max_output_tokens": 2, **s}),
    "embeddings": lambda s: ("/v1/embeddings", {"input": "the cat", **s}),
}
# What a request selects: (`model`, `adapter`); None leaves the field out.
SELECTIONS = {
    "base": ("tiny", None),
    "acme-a": ("tiny", "acme-a"),
    "globex-a": ("tiny", "globex-a"),
    "model=acme-a": ("acme-a", None),
    "model=globex-a": ("globex-a", None),
    "model=tiny:globex-a": ("tiny:globex-a", None),
    "acme-a+globex-a": ("tiny", "acme-a+globex-a"),
    "globex-a@0": ("tiny", "globex-a@0"),  # the base alone
    "model=tiny:globex-a@0": ("tiny:globex-a@0", None),
}
OK, NO_ADAPTER, NO_MODEL = 200, (404, "adapter_not_found"), (404, "model_not_found")
EXPECTED = {
    "acme": {
        "base": OK,
        "acme-a": OK,
        "globex-a": NO_ADAPTER,
        "model=acme-a": OK,
        "model=globex-a": NO_MODEL,
        "model=tiny:globex-a": NO_ADAPTER,
        "acme-a+globex-a": NO_ADAPTER,
        "globex-a@0": NO_ADAPTER,
        "model=tiny:globex-a@0": NO_ADAPTER,
    },
    "globex": {
        "base": NO_MODEL,  # base = false
        "acme-a": NO_ADAPTER,
        "globex-a": OK,
        "model=acme-a": NO_MODEL,
        "model=globex-a": OK,
        "model=tiny:globex-a": OK,
        "acme-a+globex-a": NO_ADAPTER,
        "globex-a@0": NO_MODEL,  # base = false, and an adapter at weight 0 adds nothing
        "model=tiny:globex-a@0": NO_MODEL,
    },
    "ops": dict.fromkeys(SELECTIONS, OK),
}
CASES = [
    pytest.param(who, route, selection, expected, id=f"{who}-{route}-{selection}")
    for who, table in EXPECTED.items()
    for route in ROUTES
    for selection, expected in table.items()
]


def selection_fields(selection: str) -> dict[str, Any]:
    model, adapter = SELECTIONS[selection]
    return {"model": model} | ({"adapter": adapter} if adapter is not None else {})


@pytest.mark.parametrize(("who", "route", "selection", "expected"), CASES)
def test_key_route_adapter_case(
    tenants: TestClient, who: str, route: str, selection: str, expected: Any
):
    path, body = ROUTES[route](selection_fields(selection))
    response = tenants.post(path, json=body, headers=auth(who))
    if expected == OK:
        assert response.status_code == 200, response.text
        return
    status, code = expected
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    # The refusal lists nothing outside the key's scope (it repeats what was asked, only).
    listing = error["message"].rsplit(": ", 1)[1]
    others = "acme" if who == "globex" else "globex"
    assert f"{others}-" not in listing, error["message"]


@pytest.mark.parametrize(
    ("who", "model", "status"),
    [
        ("acme", "acme-a", 200),
        ("acme", "globex-a", 404),
        ("acme", None, 200),
        ("globex", "globex-a", 200),
        ("globex", "acme-a", 404),
        ("globex", "tiny", 404),
    ],
)
def test_tokenize_holds_the_model_to_the_scope(
    tenants: TestClient, who: str, model: str | None, status: int
):
    body = {"prompt": "the cat"} | ({"model": model} if model else {})
    response = tenants.post("/tokenize", json=body, headers=auth(who))
    assert response.status_code == status, response.text


def test_outside_the_scope_reads_as_not_mounted(tenants: TestClient):
    """A mounted adapter of another tenant and an id nobody mounted get the same answer."""
    theirs = tenants.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "the", "adapter": "globex-a"},
        headers=auth("acme"),
    )
    nobodys = tenants.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "the", "adapter": "acme-ghost"},
        headers=auth("acme"),
    )
    assert theirs.status_code == nobodys.status_code == 404
    assert theirs.json()["error"]["message"].replace("globex-a", "X") == nobodys.json()["error"][
        "message"
    ].replace("acme-ghost", "X")
    assert "Mounted adapters: acme-a" in theirs.json()["error"]["message"]
    unknown_model = tenants.post(
        "/v1/completions", json={"model": "globex-a", "prompt": "the"}, headers=auth("acme")
    )
    assert "Available models: tiny, acme-a." in unknown_model.json()["error"]["message"]


@pytest.mark.parametrize(
    ("who", "listed"),
    [
        ("acme", ["tiny", "acme-a"]),
        ("globex", ["globex-a"]),
        ("ops", ["tiny", "acme-a", "globex-a"]),
    ],
)
def test_models_lists_what_the_key_may_use(tenants: TestClient, who: str, listed: list[str]):
    cards = tenants.get("/v1/models", headers=auth(who)).json()["data"]
    ids = [card["id"] for card in cards]
    assert [i for i in ids if i in {"tiny", "acme-a", "globex-a"}] == listed
    # Where the server keeps its files is an admin's to know, on a selection's card too.
    assert all((card["root"] is not None) == (who == "ops") for card in cards)
    base_alone = tenants.get("/v1/models/tiny:none", headers=auth(who))
    if "tiny" in listed:
        assert (base_alone.json()["root"] is not None) == (who == "ops")
    for model in ("tiny", "acme-a", "globex-a"):
        one = tenants.get(f"/v1/models/{model}", headers=auth(who))
        assert one.status_code == (200 if model in listed else 404), (model, one.text)
    for adapter in ("acme-a", "globex-a"):  # as `model` names a selection: in the scope only
        one = tenants.get(f"/v1/models/tiny:{adapter}", headers=auth(who))
        assert one.status_code == (200 if adapter in listed else 404), (adapter, one.text)


def test_auto_mount_never_mounts_outside_the_scope(tenants: TestClient):
    def mounted() -> set[str]:
        data = tenants.get("/v1/adapters", headers=auth("ops")).json()["data"]
        return {card["id"] for card in data}

    refused = tenants.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "the", "adapter": "globex-auto", "max_tokens": 2},
        headers=auth("acme"),
    )
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "adapter_not_found"
    assert "globex-auto" not in mounted()
    served = tenants.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "the", "adapter": "acme-auto", "max_tokens": 2},
        headers=auth("acme"),
    )
    assert served.status_code == 200, served.text
    assert "acme-auto" in mounted()


def test_no_key_or_a_wrong_one_is_401(tenants: TestClient):
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    assert tenants.post("/v1/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer hl-not-a-key"}
    assert tenants.post("/v1/completions", json=body, headers=wrong).status_code == 401
    assert tenants.get("/v1/models", headers=wrong).status_code == 401


# --- Admin routes: a tenant-admin under its prefix, from its folder -----------------------


def test_tenant_admin_mounts_under_its_prefix_from_its_folder(tenants: TestClient):
    admin = auth("acme-admin")
    mounted = tenants.post("/v1/adapters", json={"id": "acme-b", "path": "acme/b"}, headers=admin)
    assert mounted.status_code == 201, mounted.text
    listed = [c["id"] for c in tenants.get("/v1/adapters", headers=admin).json()["data"]]
    assert listed and all(i.startswith("acme-") for i in listed) and "acme-b" in listed
    # acme's users may run it now.
    ran = tenants.post(
        "/v1/completions",
        json={"model": "acme-b", "prompt": "the", "max_tokens": 2},
        headers=auth("acme"),
    )
    assert ran.status_code == 200, ran.text
    unmounted = tenants.delete("/v1/adapters/acme-b", headers=admin)
    assert unmounted.status_code == 200, unmounted.text


def test_a_tenant_admin_pins_no_more_than_its_max_pinned(make_client, tmp_path: Path):
    """One tenant's pins cannot take the budget every tenant's adapters share."""
    keys = tmp_path / "keys.toml"
    keys.write_text(entry("acme", KEYS["acme-admin"], **ACME_ADMIN, max_pinned=1))
    root = write_root(tmp_path / "adapters")
    client = make_client(keys=keys, adapter_root=root, max_mounted_adapters=3)
    admin = auth("acme-admin")

    def mount(adapter_id: str, path: str, **fields: Any):
        body = {"id": adapter_id, "path": path, **fields}
        return client.post("/v1/adapters", json=body, headers=admin)

    assert mount("acme-a", "acme/a", pin=True).status_code == 201
    refused = mount("acme-b", "acme/b", pin=True)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("adapter_over_budget", "pin")
    assert "acme-a already pinned" in error["message"] and "max_pinned" in error["message"]
    cards = client.get("/v1/adapters", headers=admin).json()["data"]
    assert [(c["id"], c["pinned"]) for c in cards] == [("acme-a", True)]  # nothing mounted
    assert mount("acme-b", "acme/b").status_code == 201  # unpinned, it mounts
    assert mount("acme-b", "acme/b", pin=True).status_code == 400  # pinning it later: refused too
    assert mount("acme-a", "acme/a", replace=True).status_code == 200  # unpinned
    assert mount("acme-b", "acme/b", pin=True).status_code == 200
    cards = client.get("/v1/adapters", headers=admin).json()["data"]
    assert sorted((c["id"], c["pinned"]) for c in cards) == [("acme-a", False), ("acme-b", True)]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        # Another tenant's id: answered as one that is not mounted.
        ("POST", "/v1/adapters", {"id": "globex-b", "path": "acme/b"}, 404, "adapter_not_found"),
        (
            "POST",
            "/v1/adapters",
            {"id": "globex-a", "path": "acme/b", "replace": True},
            404,
            "adapter_not_found",
        ),
        ("DELETE", "/v1/adapters/globex-a", None, 404, "adapter_not_found"),
        ("GET", "/v1/adapters/globex-a", None, 404, "adapter_not_found"),
        (
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "globex-b", "lora_path": "acme/b"},
            404,
            "adapter_not_found",
        ),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "globex-a"}, 404, "adapter_not_found"),
        # Its own prefix, from another tenant's folder (or the root's top).
        (
            "POST",
            "/v1/adapters",
            {"id": "acme-x", "path": "globex/b"},
            400,
            "adapter_path_refused",
        ),
        (
            "POST",
            "/v1/adapters",
            {"id": "acme-x", "path": "acme-auto"},
            400,
            "adapter_path_refused",
        ),
        (
            "POST",
            "/v1/adapters",
            {"id": "acme-x", "path": "acme/../globex/b"},
            400,
            "adapter_path_refused",
        ),
    ],
)
def test_tenant_admin_cannot_touch_another_tenants_adapters(
    tenants: TestClient, method: str, path: str, body: Any, status: int, code: str
):
    op = "unmount" if method == "DELETE" or "unload" in path else "mount"
    refusals = _refusals(tenants, op, code)
    response = tenants.request(method, path, json=body, headers=auth("acme-admin"))
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    # The metrics count a refused mount or unmount (a look is none).
    assert _refusals(tenants, op, code) == refusals + (method != "GET")
    message = response.json()["error"]["message"]
    sent = [path.rsplit("/", 1)[-1], *(body or {}).values()]  # what the case names itself
    for value in sent:
        message = message.replace(str(value), "")
    assert "globex" not in message, message
    ids = {c["id"] for c in tenants.get("/v1/adapters", headers=auth("ops")).json()["data"]}
    assert "globex-a" in ids and "globex-b" not in ids and "acme-x" not in ids


@pytest.mark.parametrize("linked", ["adapters.safetensors", "adapter_config.json"])
def test_tenant_admin_cannot_mount_another_tenants_file_through_a_link(
    tenants: TestClient, linked: str
):
    """A file in the tenant's own folder that links into another tenant's is refused, and
    nothing is mounted."""
    root = tenants.app.state.runtime.require_adapters().adapter_root
    folder = root / "acme" / f"linked-{linked}"
    shutil.copytree(root / "acme" / "b", folder)
    (folder / linked).unlink()
    (folder / linked).symlink_to(root / "globex" / "b" / linked)
    body = {"id": "acme-linked", "path": f"acme/{folder.name}"}
    response = tenants.post("/v1/adapters", json=body, headers=auth("acme-admin"))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "adapter_path_refused"
    ids = {c["id"] for c in tenants.get("/v1/adapters", headers=auth("ops")).json()["data"]}
    assert "acme-linked" not in ids
    # An admin mounts what the root holds, links within it included.
    mounted = tenants.post("/v1/adapters", json=body, headers=auth("ops"))
    assert mounted.status_code == 201, mounted.text
    assert tenants.delete("/v1/adapters/acme-linked", headers=auth("ops")).status_code == 200


def test_a_first_use_mount_reads_only_its_own_directory(tenants: TestClient):
    """A directory in the root named as an id acme may run, whose weights link into globex's
    folder: mounting it on first use is refused, and nothing is mounted."""
    root = tenants.app.state.runtime.require_adapters().adapter_root
    folder = root / "acme-linked-auto"
    shutil.copytree(root / "acme" / "b", folder)
    (folder / "adapters.safetensors").unlink()
    (folder / "adapters.safetensors").symlink_to(root / "globex" / "b" / "adapters.safetensors")
    body = {"model": "acme-linked-auto", "prompt": "the", "max_tokens": 2}
    response = tenants.post("/v1/completions", json=body, headers=auth("acme"))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "adapter_path_refused"
    # Named as the root's own paths, not where the server keeps them.
    message = response.json()["error"]["message"]
    assert str(root) not in message
    assert "acme-linked-auto/adapters.safetensors links outside acme-linked-auto," in message
    ids = {c["id"] for c in tenants.get("/v1/adapters", headers=auth("ops")).json()["data"]}
    assert "acme-linked-auto" not in ids


def _refusals(client: TestClient, op: str, reason: str) -> float:
    scraped = client.get("/metrics", headers=auth("ops")).text
    for family in text_string_to_metric_families(scraped):
        for sample in family.samples:
            if sample.name == "hotlora_adapter_refusals_total" and sample.labels == {
                "op": op,
                "reason": reason,
            }:
                return sample.value
    return 0.0


def test_admin_routes_refuse_user_keys(tenants: TestClient):
    """A valid key where its tenant may not go: 403, not the 401 of a wrong key."""
    for who in ("acme", "globex"):
        assert tenants.get("/v1/adapters", headers=auth(who)).status_code == 403
        assert tenants.get("/v1/usage", headers=auth(who)).status_code == 403
        refused = tenants.post(
            "/v1/adapters", json={"id": "acme-b", "path": "acme/b"}, headers=auth(who)
        )
        assert refused.status_code == 403
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("permission_error", "permission_denied")
        assert "may not use the admin API" in error["message"]
    assert tenants.get("/v1/adapters", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert tenants.get("/v1/adapters").status_code == 401


def test_a_tenant_admin_sees_its_folder_and_no_server_path(tenants: TestClient):
    """Its listing holds its folder's adapters not mounted yet (no id until a mount gives one),
    and every path it is told, in listings, cards and errors, is relative to the root."""
    root = tenants.app.state.runtime.require_adapters().adapter_root
    admin = auth("acme-admin")
    listing = tenants.get("/v1/adapter_root", headers=admin)
    assert listing.status_code == 200, listing.text
    assert str(root) not in listing.text
    assert listing.json()["root"] == "acme"
    entries = {(e["id"], e["path"], e["state"]) for e in listing.json()["data"]}
    assert ("acme-a", "acme/a", "resident") in entries
    assert (None, "acme/b", "on disk") in entries
    assert all(path != "acme/a" for adapter_id, path, _ in entries if adapter_id is None)
    assert not any("globex" in path for _, path, _ in entries)
    # An admin key is told the whole root, absolute, and no id-less entry.
    everything = tenants.get("/v1/adapter_root", headers=auth("ops")).json()
    assert everything["root"] == str(root)
    assert {"id": "acme-a", "path": str(root / "acme" / "a")}.items() <= next(
        e for e in everything["data"] if e["id"] == "acme-a"
    ).items()
    assert all(e["id"] is not None for e in everything["data"])
    # Cards.
    card = tenants.get("/v1/adapters/acme-a", headers=admin).json()
    assert card["path"] == "acme/a"
    assert tenants.get("/v1/adapters/acme-a", headers=auth("ops")).json()["path"] == str(
        root / "acme" / "a"
    )
    # Errors: a mount of nothing, and of the same id from other files.
    missing = tenants.post("/v1/adapters", json={"id": "acme-x", "path": "acme/x"}, headers=admin)
    assert missing.status_code == 400, missing.text
    assert "acme/x" in missing.json()["error"]["message"] and str(root) not in missing.text
    clash = tenants.post("/v1/adapters", json={"id": "acme-a", "path": "acme/b"}, headers=admin)
    assert clash.status_code == 409, clash.text
    assert "mounted from acme/a" in clash.json()["error"]["message"]
    assert str(root) not in clash.text
    told = tenants.post(
        "/v1/adapters", json={"id": "acme-x", "path": "acme/x"}, headers=auth("ops")
    )
    assert str(root / "acme" / "x") in told.json()["error"]["message"]


def test_adapter_root_shows_a_tenant_admin_its_own(tenants: TestClient):
    root = tenants.get("/v1/adapter_root", headers=auth("acme-admin")).json()
    ids = {entry["id"] for entry in root["data"]} - {None}  # its folder's, never mounted
    assert ids and all(i.startswith("acme-") for i in ids)
    everything = tenants.get("/v1/adapter_root", headers=auth("ops")).json()
    assert {"globex-a", "globex-auto"} <= {entry["id"] for entry in everything["data"]}
    # The memory it is told of is its own adapters'.
    cards = tenants.get("/v1/adapters", headers=auth("ops")).json()["data"]
    sizes = {card["id"]: card["ram_bytes"] for card in cards}
    assert everything["resident_bytes"] == sum(sizes.values())
    own = sum(size for adapter_id, size in sizes.items() if adapter_id.startswith("acme-"))
    assert root["resident_bytes"] == own < everything["resident_bytes"]


def test_usage_per_tenant(tenants: TestClient):
    for _ in range(2):
        tenants.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "the cat", "max_tokens": 2},
            headers=auth("acme"),
        )
    tenants.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth("globex"))
    rows = {
        row["tenant"]: row for row in tenants.get("/v1/usage", headers=auth("ops")).json()["data"]
    }
    assert {"acme", "globex"} <= set(rows)
    acme, globex = rows["acme"], rows["globex"]
    assert acme["requests"] >= 2 and acme["prompt_tokens"] > 0 and acme["completion_tokens"] > 0
    assert acme["adapters"]["tiny"]["requests"] >= 2
    assert globex["errors"] >= 1  # the base alone is outside its scope
    before = rows["acme"]["adapters"].get("acme-a", {}).get("prompt_tokens", 0)
    embedded = tenants.post(
        "/v1/embeddings",
        json={"model": "tiny", "input": "the cat sat", "adapter": "acme-a"},
        headers=auth("acme"),
    )
    used = embedded.json()["usage"]["prompt_tokens"]
    rows = {r["tenant"]: r for r in tenants.get("/v1/usage", headers=auth("ops")).json()["data"]}
    assert rows["acme"]["adapters"]["acme-a"]["prompt_tokens"] == before + used
    own = tenants.get("/v1/usage", headers=auth("acme-admin")).json()["data"]
    assert [row["tenant"] for row in own] == ["acme"]
    metrics = tenants.get("/metrics", headers=auth("ops")).text
    assert 'hotlora_tenant_requests_total{adapter="tiny",tenant="acme"}' in metrics
    assert 'hotlora_tenant_errors_total{code="model_not_found",tenant="globex"}' in metrics


def test_a_tenant_reads_only_its_own_cached_prompts(tenants: TestClient):
    """Another tenant's cached prompt would tell, through `cached_tokens` or the first token's
    time, what that tenant asked; vLLM's `cache_salt` parts a tenant's requests likewise."""
    body = {"model": "tiny", "prompt": "the dog sat by the door and the cat sat", "max_tokens": 1}

    def cached(who: str, **fields: Any) -> int:
        answer = tenants.post("/v1/completions", json={**body, **fields}, headers=auth(who))
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("ops") == 0
    again = cached("ops")
    assert again > 0
    assert cached("acme") < again  # ops's prompt is ops's (acme's own may open alike)
    assert cached("acme-admin") == again  # a tenant's keys share its own
    assert cached("acme", cache_salt="s1") == 0
    assert cached("acme", cache_salt="s1") == again
    assert cached("acme", cache_salt="s2") == 0


@pytest.mark.parametrize("who", [None, "acme", "globex", "acme-admin"])
def test_metrics_need_an_admin_key_while_keys_scope_tenants(tenants: TestClient, who: str | None):
    """Its series name every tenant and adapter: a user key, a tenant-admin's or none reads
    nothing of them."""
    answer = tenants.get("/metrics", headers=auth(who) if who else {})
    assert answer.status_code == (401 if who is None else 403), answer.text
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert "globex" not in answer.text and "acme-" not in answer.text


def test_access_log_names_the_tenant_and_no_key(
    tenants: TestClient, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="hotlora"):
        tenants.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "the", "max_tokens": 2},
            headers=auth("acme"),
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "hotlora.access"]
    assert any("POST /v1/completions 200" in line and "tenant=acme" in line for line in lines)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert KEYS["acme"] not in text and key_digest(KEYS["acme"]) not in text


# --- Limits ----------------------------------------------------------------------------------


def limited(
    make_client: Callable[..., TestClient], tmp_path: Path, **limits: Any
) -> tuple[TestClient, str]:
    key = "hl-limited-key"
    path = tmp_path / "keys.toml"
    path.write_text(
        entry("small", key, adapters=["*"], **limits) + entry("ops", KEYS["ops"], role="admin")
    )
    return make_client(keys=path), key


def test_requests_per_minute_429_with_retry_after(make_client, tmp_path: Path):
    client, key = limited(make_client, tmp_path, requests_per_minute=2)
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    assert [
        client.post("/v1/completions", json=body, headers=headers).status_code for _ in "ab"
    ] == [
        200,
        200,
    ]
    refused = client.post("/v1/completions", json=body, headers=headers)
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert set(error) == {"message", "type", "param", "code"}
    # Listing counts too, and a limit hit is counted for the tenant.
    assert client.get("/v1/models", headers=headers).status_code == 429
    assert client.get("/v1/usage").status_code == 401  # no key: closed


def test_tokens_per_minute_429_once_used(make_client, tmp_path: Path):
    client, key = limited(make_client, tmp_path, tokens_per_minute=4)
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 3}
    first = client.post("/v1/completions", json=body, headers=headers)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] >= 4
    refused = client.post("/v1/completions", json=body, headers=headers)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "tokens"
    assert int(refused.headers["retry-after"]) >= 1
    metrics = client.get("/metrics", headers=auth("ops")).text
    assert 'hotlora_tenant_limited_total{limit="tokens_per_minute",tenant="small"} 1.0' in metrics


def test_max_streams_counts_requests_in_flight(make_client, tmp_path: Path):
    client, key = limited(make_client, tmp_path, max_streams=1)
    headers = {"Authorization": f"Bearer {key}"}
    tenancy = client.app.state.tenancy  # type: ignore[attr-defined]
    small = tenancy.keys.lookup(key)
    held = tenancy.limits.admit(small)  # one request of its own in flight
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    refused = client.post("/v1/completions", json=body, headers=headers)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    held.end(0)
    assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
    assert tenancy.limits.in_flight("small") == 0  # the answered request let its place go


# --- The keys file read again ---------------------------------------------------------------


def keyed_client(make_client, tmp_path: Path, text: str) -> tuple[TestClient, Path]:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    client = make_client(keys=path)
    client.app.state.tenancy.keys.check_every = 0.0  # type: ignore[attr-defined]
    return client, path


def rewrite(path: Path, text: str) -> None:
    """Replace the file's text so that its modification time surely differs."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    while path.stat().st_mtime_ns == before:
        time.sleep(0.01)
        path.write_text(text)


def eventually(send: Callable[[], Any], status: int = 200, within: float = 2.0) -> bool:
    """Whether `send()` answers `status` within `within` seconds (the file settles first)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if send().status_code == status:
            return True
        time.sleep(0.02)
    return False


def test_reload_while_requests_run(make_client, tmp_path: Path):
    client, path = keyed_client(make_client, tmp_path, entry("acme", KEYS["acme"]))
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    statuses: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            response = client.post("/v1/completions", json=body, headers=auth("acme"))
            statuses.append(response.status_code)

    runner = threading.Thread(target=traffic)
    runner.start()
    try:
        for round_ in range(5):
            extra = entry(f"t{round_}", f"hl-new-{round_}")
            rewrite(path, entry("acme", KEYS["acme"]) + extra)
            fresh = {"Authorization": f"Bearer hl-new-{round_}"}
            send = functools.partial(client.post, "/v1/completions", json=body, headers=fresh)
            assert eventually(send)
    finally:
        stop.set()
        runner.join()
    assert statuses and set(statuses) == {200}
    # A key taken out of the file stops working.
    rewrite(path, entry("acme", KEYS["acme"]))
    gone = {"Authorization": "Bearer hl-new-4"}
    assert eventually(lambda: client.post("/v1/completions", json=body, headers=gone), 401)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[[key]\nname = 1", "not TOML"),
        ("\n", "is empty"),  # as a file being written is, between truncation and text
        (entry("acme", "k", role="owner"), "key[0].role"),
        (entry("acme", "k", colour="red"), "key[0].colour: Extra inputs are not permitted"),
        (entry("acme", "k", role="tenant-admin"), "needs both mount_prefix and mount_dir"),
        (entry("acme", "k", mount_prefix="acme-"), "are for role 'tenant-admin'"),
        (entry("acme", "k", max_pinned=2), "are for role 'tenant-admin'"),
        (entry("a", "k") + entry("b", "k"), "key[1] has the same sha256 as key[0]"),
        (entry("acme", "k", requests_per_minute=0), "key[0].requests_per_minute"),
        (entry("acme", "k", mount_dir="/etc", role="tenant-admin", mount_prefix="a"), "relative"),
        ('[[key]]\nname = "acme"\nsha256 = "abc"\n', "key[0].sha256"),
    ],
)
def test_a_bad_file_is_refused_and_the_old_keys_stay(
    make_client, tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, problem: str
):
    client, path = keyed_client(make_client, tmp_path, entry("acme", KEYS["acme"]))
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    with caplog.at_level(logging.ERROR, logger="hotlora"):
        rewrite(path, text)
        time.sleep(0.1)  # settled
        for _ in range(3):  # reported once, however many requests come
            assert (
                client.post("/v1/completions", json=body, headers=auth("acme")).status_code == 200
            )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and problem in errors[0], errors
    assert "keeping the 1 keys read before" in errors[0]
    assert key_digest("k") not in errors[0] and "abc" not in errors[0].split(":", 1)[1]


def test_a_bad_file_at_start_stops_the_start(tiny_model_dir: Path, tmp_path: Path):
    path = tmp_path / "keys.toml"
    path.write_text(entry("acme", "k", role="owner"))
    with pytest.raises(ValueError, match=r"keys file .*: key\[0\]\.role"):
        create_app(Settings(home=tmp_path / "home", model=tiny_model_dir, keys=path))


def test_sighup_reads_the_file_again(make_client, tmp_path: Path):
    """The handler SIGHUP runs (the main thread's loop takes the signal itself; a test's app
    runs on another thread, so the handler is called as the loop would)."""
    client, path = keyed_client(make_client, tmp_path, entry("acme", KEYS["acme"]))
    tenancy = client.app.state.tenancy  # type: ignore[attr-defined]
    tenancy.keys.check_every = 3600.0  # only the signal reads it now
    path.write_text(entry("acme", KEYS["acme"]) + entry("late", "hl-late"))
    late = {"Authorization": "Bearer hl-late"}
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    assert client.post("/v1/completions", json=body, headers=late).status_code == 401
    assert tenancy.keys.reload() is True
    assert client.post("/v1/completions", json=body, headers=late).status_code == 200


def test_flag_keys_keep_working(make_client, tmp_path: Path):
    path = tmp_path / "keys.toml"
    path.write_text(entry("acme", KEYS["acme"], adapters=["acme-*"]))
    client = make_client(keys=path, api_key="user-secret", admin_api_key="admin-secret")
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    for key in ("user-secret", "admin-secret", KEYS["acme"]):
        headers = {"Authorization": f"Bearer {key}"}
        assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
    user = {"Authorization": "Bearer user-secret"}
    admin = {"Authorization": "Bearer admin-secret"}
    assert client.get("/v1/adapters", headers=user).status_code == 403
    assert client.get("/v1/adapters", headers=admin).status_code == 200
    tenants = {row["tenant"] for row in client.get("/v1/usage", headers=admin).json()["data"]}
    assert tenants == {"api-key", "admin", "acme"}


def test_with_only_an_admin_key_a_keyless_request_sees_no_root(make_client):
    """Inference open to all, administration behind its key: the files' place is the admin's."""
    client = make_client(admin_api_key="admin-secret")
    keyless = client.get("/v1/models").json()["data"]
    admin = {"Authorization": "Bearer admin-secret"}
    keyed = client.get("/v1/models", headers=admin).json()["data"]
    assert [card["root"] for card in keyless] == [None]
    assert keyed[0]["root"] is not None
    assert make_client().get("/v1/models").json()["data"][0]["root"] is not None  # no key at all


def test_with_only_an_admin_key_a_keyless_request_is_told_no_server_path(
    make_client, tmp_path: Path
):
    """A first-use mount refused for a keyless request names its files under the root, not
    where the server keeps them; the admin key is told the whole path."""
    root = write_root(tmp_path / "adapters")
    folder = root / "linked"
    shutil.copytree(root / "acme" / "b", folder)
    (folder / "adapters.safetensors").unlink()
    (folder / "adapters.safetensors").symlink_to(root / "globex" / "b" / "adapters.safetensors")
    client = make_client(admin_api_key="admin-secret", adapter_root=root, auto_mount=True)
    body = {"model": "linked", "prompt": "the", "max_tokens": 2}
    keyless = client.post("/v1/completions", json=body)
    assert keyless.status_code == 400, keyless.text
    assert "linked/adapters.safetensors" in keyless.json()["error"]["message"]
    assert str(root) not in keyless.text
    admin = {"Authorization": "Bearer admin-secret"}
    told = client.post("/v1/completions", json=body, headers=admin).json()["error"]["message"]
    assert str(folder / "adapters.safetensors") in told


def test_without_keys_every_request_is_the_default_tenant(client: TestClient):
    body = {"model": "tiny", "prompt": "the", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    rows = client.get("/v1/usage").json()["data"]
    assert [row["tenant"] for row in rows] == ["default"]


# --- hotlora keys add -------------------------------------------------------------------------


def test_keys_add_prints_a_key_once_and_stores_its_hash(
    make_client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = tmp_path / "keys.toml"
    argv = ["keys", "add", "acme", "--adapters", "acme-*", "--no-base", "--file", str(path)]
    assert main([*argv, "--requests-per-minute", "100"]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert key.startswith("hl-") and len(key) > 40
    text = path.read_text()
    assert key not in text and hashlib.sha256(key.encode()).hexdigest() in text
    assert main(["keys", "add", "ops", "--role", "admin", "--file", str(path)]) == 0
    said, admin_key = capsys.readouterr().out.strip().splitlines()[-2:]
    assert said.startswith("added an admin key for 'ops'")
    assert path.stat().st_mode & 0o077 == 0  # only its owner reads it
    client = make_client(keys=path)
    headers = {"Authorization": f"Bearer {key}"}
    refused = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers)
    assert refused.status_code == 404  # --no-base
    rows = client.get("/v1/usage", headers={"Authorization": f"Bearer {admin_key}"})
    assert rows.status_code == 200
    # A bad entry writes nothing.
    before = path.read_text()
    assert main(["keys", "add", "x", "--role", "tenant-admin", "--file", str(path)]) == 1
    assert "needs both mount_prefix and mount_dir" in capsys.readouterr().err
    assert path.read_text() == before
    # A file in a folder that is not there: named as asked.
    nowhere = tmp_path / "none" / "keys.toml"
    assert main(["keys", "add", "x", "--file", str(nowhere)]) == 1
    err = capsys.readouterr().err
    assert err == f"hotlora keys: {nowhere}: its folder {nowhere.parent} does not exist\n"
