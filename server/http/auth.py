"""Bearer-key checks: which tenant a request's key is, and whether it may use the route.

Keys are `--api-key`, `--admin-api-key` and the keys file's (`keys_file`); a server with none
serves every request as the tenant `default`. The check runs before the body is read: without
a valid key, a request learns nothing about what the server would make of its body (a bad body
without a key is a 401, not a 400); a valid key where its tenant may not go (an inference key on
the admin API) is a 403. An admitted request carries its `Tenant` as
`request.state.tenant`, is held to its key's adapter scope (`adapters.scope`; a key short of
admin is not shown the adapter root's path), and on the
inference routes is counted against its tenant's limits (a limit reached: 429).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from hotlora.adapters import use_scope
from hotlora.server.http.request_errors import Forbidden, Unauthorized
from hotlora.server.http.tenancy import Tenancy
from hotlora.server.http.tenant_limits import RateLimited
from hotlora.server.http.tenants import DEFAULT_TENANT, Tenant, request_tenant
from hotlora.server.telemetry.access_log import current_record


def bearer_key(authorization: str) -> str | None:
    """The key of an `Authorization: Bearer <key>` header's value (the scheme in any case, any
    spaces after it); None for another scheme or no key."""
    scheme, _, given = authorization.partition(" ")
    given = given.strip(" ")
    return given if scheme.lower() == "bearer" and given else None


def _bearer(request: Request) -> str | None:
    return bearer_key(request.headers.get("authorization", ""))


def _tenant(request: Request, *, admin: bool) -> Tenant:
    """The tenant of the request's key; `Unauthorized` when the route needs a key it lacks,
    `Forbidden` when the key's tenant may not use the admin routes."""
    tenancy = _tenancy(request)
    given = _bearer(request)
    # Looked up by hash, in constant time: the time taken says nothing about the key.
    tenant = tenancy.keys.lookup(given) if given is not None else None
    if tenant is None:
        if not (tenancy.admin_open if admin else tenancy.inference_open):
            what = "admin API key" if admin else "API key"
            raise Unauthorized(f"A valid {what} is required: send 'Authorization: Bearer <key>'.")
        tenant = DEFAULT_TENANT
    if admin and not tenant.may_administer:
        raise Forbidden("This API key may not use the admin API: send an admin API key.")
    return tenant


def _admit(request: Request, *, admin: bool) -> Tenant:
    tenant = _tenant(request, admin=admin)
    request.state.tenant = tenant  # read as `TENANT` from the scope state
    record = current_record()
    if record is not None:
        record.tenant = tenant.name
    # Until the request is answered (`TenantAccounts` resets it). Where the server keeps its
    # files is for an admin key (or anyone, on a server with no key at all): others, a request
    # without a key beside keys included, are told paths relative to the adapter root.
    manager = request.app.state.runtime.adapters
    hidden = None if sees_server_paths(request) or manager is None else manager.adapter_root
    use_scope(tenant, hidden_root=hidden)
    return tenant


def sees_server_paths(request: Request) -> bool:
    """Whether the request may be told where the server keeps its files: it came with an
    admin key, or the server guards nothing with a key."""
    tenant = request_tenant(request)
    return tenant.is_admin and (tenant is not DEFAULT_TENANT or _tenancy(request).admin_open)


def require_api_key(request: Request) -> None:
    """An inference route's check: any valid key, counted against its tenant's limits."""
    tenant = _admit(request, admin=False)
    tenancy = _tenancy(request)
    try:
        admission = tenancy.limits.admit(tenant)
    except RateLimited as exc:
        tenancy.usage.limit_hit(tenant.name, exc.limit)
        raise
    request.state.tenant_admission = admission  # `ADMISSION`


def require_admin_key(request: Request) -> None:
    """An admin route's check: an admin or tenant-admin key (with only --api-key set, that key;
    never open while inference is closed). Which ids it may touch, the route checks."""
    _admit(request, admin=True)


def require_metrics_key(request: Request) -> None:
    """/metrics' check: open, like vLLM's, unless a keys file scopes tenants; then its series
    (every tenant's name, usage and adapters) are for an admin key alone."""
    if _tenancy(request).keys.path is None:
        return
    tenant = _tenant(request, admin=False)
    if not tenant.is_admin:
        raise Forbidden(
            "This API key may not read /metrics: while a keys file is set, every tenant's "
            "usage is for an admin API key."
        )


def _tenancy(request: Request) -> Tenancy:
    return request.app.state.tenancy


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
