"""The Host header a loopback server answers: loopback names, its machine's name and those
allowed, so that a page whose name is pointed at 127.0.0.1 cannot reach it (DNS rebinding)."""

from __future__ import annotations

import logging
import socket

import pytest
from pydantic import ValidationError

from hotlora.config.settings import Settings
from hotlora.server.http.hosts import host_name, is_loopback

ADAPTER_ROOT = "/v1/adapter_root"  # an admin route: what a rebinding page would be after


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8000", "127.0.0.1:8000", "127.1.2.3", "[::1]:8000", "app.localhost"],
)
def test_a_loopback_server_answers_loopback_names(client, host):
    assert client.get(ADAPTER_ROOT, headers={"host": host}).status_code == 200


@pytest.mark.parametrize("host", ["rebind.attacker.example:8000", "10.0.0.5", "[2001:db8::1]:80"])
def test_a_loopback_server_refuses_other_names(client, host):
    for method, path in [("GET", ADAPTER_ROOT), ("POST", "/v1/adapters"), ("GET", "/health")]:
        response = client.request(method, path, headers={"host": host})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_host")
        assert "--allowed-hosts" in error["message"]


def test_its_machine_s_own_name_is_answered(client):
    name = socket.gethostname()
    assert client.get(ADAPTER_ROOT, headers={"host": f"{name}:8000"}).status_code == 200


def test_allowed_hosts_name_more(make_client):
    client = make_client(allowed_hosts="*.example.com, proxy.internal, Upper.Example.")
    for host, status in [
        ("api.example.com", 200),
        ("proxy.internal:443", 200),
        ("upper.example:80", 200),
        ("localhost", 200),
        ("example.com", 400),
        ("evil.example.org", 400),
    ]:
        assert client.get(ADAPTER_ROOT, headers={"host": host}).status_code == status, host


@pytest.mark.parametrize(
    ("overrides", "host"),
    [({"host": "0.0.0.0"}, "10.0.0.5:8000"), ({"allowed_hosts": "*"}, "anything.example")],
)
def test_a_server_on_another_address_or_allowing_any_answers_every_name(
    make_client, overrides, host
):
    client = make_client(**overrides)
    assert client.get(ADAPTER_ROOT, headers={"host": host}).status_code == 200


def test_host_names_and_loopback():
    assert [host_name(h) for h in ["a.b:80", "[::1]:8000", "[::1]", "::1", "x"]] == [
        "a.b",
        "::1",
        "::1",
        "::1",
        "x",
    ]
    assert is_loopback("LOCALHOST.") and is_loopback("127.0.0.9") and is_loopback("[::1]")
    assert not is_loopback("localhost.example.com") and not is_loopback("0.0.0.0")


@pytest.mark.parametrize("hosts", ["proxy.internal:8080", "*:8080", "http://x.example", "a b"])
def test_a_name_with_a_port_or_a_scheme_is_refused_at_start(hosts):
    """The Host header's port is not matched: a pattern naming one would match other ports (or,
    as `*:8080`, every name)."""
    with pytest.raises(ValidationError, match="not a host name or pattern"):
        Settings(allowed_hosts=hosts)


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        ({"host": "0.0.0.0"}, True),
        ({"host": "0.0.0.0", "api_key": "hl-secret"}, False),
        ({}, False),  # loopback: a key is the operator's choice
    ],
)
def test_a_server_open_to_the_network_with_no_key_says_so(make_client, caplog, overrides, warned):
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        make_client(**overrides)
    said = [r.getMessage() for r in caplog.records if "with no key" in r.getMessage()]
    assert len(said) == warned
    assert all("0.0.0.0" in line and "--keys" in line for line in said)
