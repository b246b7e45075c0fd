"""A tenant: who a request's key belongs to, what it may run and mount, and its share and limits.

The key check puts one on every admitted request as `request.state.tenant`; a server started
without keys gives each request `DEFAULT_TENANT`, which may do everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

from fastapi import Request

from hotlora.adapters import current_scope

Role = Literal["user", "tenant-admin", "admin"]


@dataclass(frozen=True)
class Tenant:
    """One key's holder: a name (as logs and metrics show it), a fair-share weight, a scope.

    `adapters` holds ids and glob patterns (`acme-*`) this key may run; `base` whether it may run
    the base model alone. A tenant-admin mounts, replaces and unmounts only ids starting with
    `mount_prefix`, from `mount_dir` under `--adapter-root`, and pins `max_pinned` of them at
    most. The limits are None when unlimited.
    """

    name: str
    weight: float = 1.0
    role: Role = "admin"
    adapters: tuple[str, ...] = ("*",)
    base: bool = True
    mount_prefix: str | None = None
    mount_dir: str | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_streams: int | None = None
    max_pinned: int | None = None  # tenant-admin: its ids pinned at once, at most

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def may_use_base(self) -> bool:
        """Whether this key may run the base model alone."""
        return self.is_admin or self.base

    @property
    def may_administer(self) -> bool:
        """Whether the admin routes are open to this key at all (each id is checked apart)."""
        return self.role in ("admin", "tenant-admin")

    def may_use(self, adapter_id: str) -> bool:
        """Whether this key may run `adapter_id` (an admin runs every adapter)."""
        if self.is_admin:
            return True
        return any(fnmatchcase(adapter_id, pattern) for pattern in self.adapters)

    def may_see(self, adapter_id: str) -> bool:
        """Whether the admin routes show `adapter_id` to this key: it may run or mount it."""
        return self.may_use(adapter_id) or self.may_mount(adapter_id)

    def may_mount(self, adapter_id: str) -> bool:
        """Whether this key may mount, replace or unmount `adapter_id`."""
        if self.is_admin:
            return True
        if self.role != "tenant-admin" or not self.mount_prefix:
            return False
        return adapter_id.startswith(self.mount_prefix)


DEFAULT_TENANT = Tenant(name="default")


def request_tenant(request: Request) -> Tenant:
    """The tenant the key check resolved for `request` (the default one where none ran)."""
    tenant = getattr(request.state, "tenant", None)
    return tenant if isinstance(tenant, Tenant) else DEFAULT_TENANT


def current_tenant() -> Tenant:
    """The tenant of the request served in this context, where no `Request` is at hand (the
    key check holds the request to its tenant's scope: `adapters.scope`); the default one
    outside a request."""
    scope = current_scope()
    return scope if isinstance(scope, Tenant) else DEFAULT_TENANT
