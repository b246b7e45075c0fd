"""A key's adapter scope where a request's selection is read: refusals as for ids not mounted,
listings cut to the scope, and the Ray ingress routing by what the key may use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hotlora.adapters import (
    EVERYTHING,
    AdapterNotFound,
    parse_selection,
    reset_scope,
    shown_path,
    use_scope,
)
from hotlora.adapters.spec import AdapterRef
from hotlora.config.errors import ModelNotFound
from hotlora.server.http.keys_file import KeyRing, key_digest
from hotlora.server.http.tenants import DEFAULT_TENANT, Tenant, current_tenant

MOUNTED = ["acme-a", "acme-b", "globex-a"]
ACME = Tenant("acme", role="user", adapters=("acme-*",), base=True)
GLOBEX = Tenant("globex", role="user", adapters=("globex-*",), base=False)


def select(tenant: Tenant, model: str, refs: tuple[AdapterRef, ...] = ()) -> list[str]:
    token = use_scope(tenant)
    try:
        return [ref.id for ref in parse_selection("base", model, refs, MOUNTED)]
    finally:
        reset_scope(token)


def test_in_scope_selections_pass():
    assert select(ACME, "base") == []
    assert select(ACME, "acme-a") == ["acme-a"]
    assert select(ACME, "base:acme-a+acme-b") == ["acme-a", "acme-b"]
    assert select(ACME, "base", (AdapterRef("acme-b"),)) == ["acme-b"]
    assert select(GLOBEX, "globex-a") == ["globex-a"]


@pytest.mark.parametrize(
    ("tenant", "model", "refs", "error", "listed"),
    [
        (ACME, "globex-a", (), ModelNotFound, "Available models: base, acme-a, acme-b."),
        (ACME, "base:globex-a", (), AdapterNotFound, "Mounted adapters: acme-a, acme-b."),
        (ACME, "base", (AdapterRef("globex-a"),), AdapterNotFound, "adapters: acme-a, acme-b."),
        (GLOBEX, "base", (), ModelNotFound, "Available models: globex-a."),
        (GLOBEX, "base:none", (), ModelNotFound, "Available models: globex-a."),
        (GLOBEX, "acme-a", (), ModelNotFound, "Available models: globex-a."),
    ],
)
def test_outside_the_scope_is_not_found_and_lists_only_the_scope(
    tenant: Tenant, model: str, refs: tuple[AdapterRef, ...], error: type, listed: str
):
    with pytest.raises(error) as refused:
        select(tenant, model, refs)
    assert refused.value.message.endswith(listed), refused.value.message


def test_without_a_scope_everything_is_listed():
    everything = "Mounted adapters: acme-a, acme-b, globex-a."
    assert AdapterNotFound("ghost", MOUNTED).message.endswith(everything)
    token = use_scope(ACME)
    try:
        cut = AdapterNotFound("ghost", MOUNTED).message
    finally:
        reset_scope(token)
    assert cut.endswith("Mounted adapters: acme-a, acme-b.")


@pytest.mark.parametrize(
    ("tenant", "path", "body", "wanted"),
    [
        (ACME, "/v1/chat/completions", {"model": "base", "adapter": "acme-a"}, ["acme-a"]),
        (ACME, "/v1/chat/completions", {"model": "base", "adapter": "globex-a"}, []),
        (ACME, "/v1/completions", {"model": "globex-a"}, []),
        (GLOBEX, "/v1/completions", {"model": "globex-a"}, ["globex-a"]),
        (ACME, "/v1/adapters/globex-a", None, []),
        (ACME, "/v1/models/acme-b", None, ["acme-b"]),
        (ACME, "/v1/unload_lora_adapter", {"lora_name": "globex-a"}, []),
    ],
)
def test_the_ray_ingress_routes_only_by_what_the_key_may_use(
    tenant: Tenant, path: str, body: object, wanted: list[str]
):
    pytest.importorskip("ray")
    from hotlora.server.ray.relay import RelayedRequest
    from hotlora.server.ray.serve_app import wanted_adapters

    method = "GET" if body is None else "POST"
    request = RelayedRequest(method, path, b"", b"", [], json.dumps(body).encode())
    assert wanted_adapters(request, "base", frozenset(MOUNTED), tenant) == wanted


def test_the_ray_ingress_reads_the_key(tmp_path):
    pytest.importorskip("ray")
    from hotlora.server.ray.relay import RelayedRequest
    from hotlora.server.ray.serve_app import request_tenant

    path = tmp_path / "keys.toml"
    path.write_text(f'[[key]]\nname = "acme"\nsha256 = "{key_digest("k")}"\n')
    keys = KeyRing(path)

    def with_key(header: bytes) -> RelayedRequest:
        return RelayedRequest("GET", "/v1/models", b"", b"", [(b"authorization", header)], b"")

    for header in (b"Bearer k", b"bearer  k"):  # read as the replicas read it
        found = request_tenant(keys, with_key(header), None)
        assert found is not None and found.name == "acme"
    assert request_tenant(keys, with_key(b"Bearer nope"), None) is None
    assert request_tenant(None, with_key(b"Bearer nope"), None) is not None  # no keys at all


def test_current_tenant_is_the_scope_held():
    assert current_tenant() is DEFAULT_TENANT
    token = use_scope(GLOBEX)
    try:
        assert current_tenant() is GLOBEX
    finally:
        reset_scope(token)


def test_a_hidden_roots_paths_are_shown_under_it():
    """A key short of admin is told paths relative to the adapter root; the root itself by
    name; a path beside it (`/srv/adapters2`) as it is."""
    token = use_scope(EVERYTHING, hidden_root=Path("/srv/adapters"))
    try:
        told = [
            shown_path("/srv/adapters/acme/b links outside /srv/adapters/acme/b, where"),
            shown_path("under /srv/adapters."),
            shown_path("/srv/adapters2/x and /srv/adapters.old/y"),
        ]
    finally:
        reset_scope(token)
    assert told == [
        "acme/b links outside acme/b, where",
        "under the adapter root.",
        "/srv/adapters2/x and /srv/adapters.old/y",
    ]
    assert shown_path("/srv/adapters/acme/b") == "/srv/adapters/acme/b"  # outside a request
