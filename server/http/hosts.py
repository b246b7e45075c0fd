"""Which names a request's `Host` header may give: a server listening on a loopback address
answers only requests sent to a loopback name (or the names allowed), so a web page whose own
name an attacker points at 127.0.0.1 (DNS rebinding) cannot reach it from a browser."""

from __future__ import annotations

import fnmatch
import ipaddress
import socket

from starlette.types import ASGIApp, Receive, Scope, Send

from hotlora.server.http.error_responses import json_error

ANY_HOST = "*"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 bare or in brackets) is this machine's
    loopback: `localhost`, a `.localhost` name, 127.0.0.0/8 or ::1."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(listen_host: str, configured: list[str]) -> list[str] | None:
    """The host patterns requests may name; None: any. `configured` when given; else, for a
    server listening on loopback, its loopback names and the machine's own name; else any."""
    if configured:
        # Lowercase and bare, as the header's name is made (the settings refuse a port).
        return None if ANY_HOST in configured else [_bare(h) for h in configured]
    if not is_loopback(listen_host):
        return None
    return [socket.gethostname().lower()]  # loopback names are always allowed


def _bare(name: str) -> str:
    return host_name(name.strip()).lower().rstrip(".")


def host_name(header: str) -> str:
    """The name in a `Host` header, without its port: `[::1]:8000` -> `::1`."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class TrustedHosts:
    """Refuses, with a 400 in OpenAI's error shape, a request whose `Host` names neither a
    loopback name nor one of `patterns` (shell-style: `*.example.com`). A request without a
    `Host` header (HTTP/1.0) is let through: a browser always sends one."""

    def __init__(self, app: ASGIApp, patterns: list[str]):
        self.app = app
        self.patterns = patterns

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        message = (
            "This server does not answer requests for the host this one names; start it with "
            "--allowed-hosts naming it (a proxy or another name for this machine), or call it "
            "at localhost."
        )
        refusal = json_error(400, message, "invalid_request_error", code="invalid_host")
        await refusal(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        header = dict(scope.get("headers", ())).get(b"host")
        if header is None:
            return True
        name = _bare(header.decode("latin-1"))
        if is_loopback(name):
            return True
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)
