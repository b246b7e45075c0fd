"""Bearer-key checks: `--api-key` guards inference, `--admin-api-key` guards adapter admin."""

from __future__ import annotations

import hmac

from fastapi import Request

from hotlora.server.deps import RuntimeDep
from hotlora.server.request_errors import Unauthorized


def _check(request: Request, expected: str | None, what: str) -> None:
    if expected is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # Constant-time: the comparison's duration says nothing about how much of the key matched.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized(f"A valid {what} is required: send 'Authorization: Bearer <key>'.")


def require_api_key(request: Request, runtime: RuntimeDep) -> None:
    _check(request, runtime.settings.api_key, "API key")


def require_admin_key(request: Request, runtime: RuntimeDep) -> None:
    # With only --api-key set, admin takes that key too: never open while inference is closed.
    settings = runtime.settings
    _check(request, settings.admin_api_key or settings.api_key, "admin API key")
