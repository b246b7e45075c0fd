"""Bearer-key checks: `--api-key` guards inference, `--admin-api-key` guards adapter admin.

The check runs before the body is read: without a valid key, a request learns nothing about
what the server would make of its body (a bad body without a key is a 401, not a 400).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from hotlora.server.http.request_errors import Unauthorized
from hotlora.server.runtime import Runtime


def _check(request: Request, expected: str | None, what: str) -> None:
    if expected is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # Constant-time: the comparison's duration says nothing about how much of the key matched.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized(f"A valid {what} is required: send 'Authorization: Bearer <key>'.")


def require_api_key(request: Request) -> None:
    _check(request, _runtime(request).settings.api_key, "API key")


def require_admin_key(request: Request) -> None:
    # With only --api-key set, admin takes that key too: never open while inference is closed.
    settings = _runtime(request).settings
    _check(request, settings.admin_api_key or settings.api_key, "admin API key")


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class _GuardedRoute(APIRoute):
    """A route whose key check runs before FastAPI reads and validates the body."""

    guard: Callable[[Request], None]

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        guard = type(self).guard

        async def guarded(request: Request) -> Response:
            guard(request)
            return await handler(request)

        return guarded


class InferenceRoute(_GuardedRoute):
    guard = staticmethod(require_api_key)


class AdminRoute(_GuardedRoute):
    guard = staticmethod(require_admin_key)
