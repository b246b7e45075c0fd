"""GET /v1/usage: each tenant's requests, tokens, errors and limits hit since start (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hotlora.server.api.usage_objects import TenantUsageRow, UsageList
from hotlora.server.http.auth import AdminRoute
from hotlora.server.http.tenancy import Tenancy
from hotlora.server.http.tenants import request_tenant
from hotlora.server.routes import paths

router = APIRouter(tags=["adapters"], route_class=AdminRoute)


@router.get(paths.USAGE)
async def usage(request: Request) -> UsageList:
    """Every tenant's usage for an admin key; a tenant-admin key sees its own tenant's."""
    tenancy: Tenancy = request.app.state.tenancy
    tenant = request_tenant(request)
    rows = tenancy.usage.report(None if tenant.is_admin else [tenant.name])
    return UsageList(
        data=[
            TenantUsageRow(**row, in_flight=tenancy.limits.in_flight(row["tenant"])) for row in rows
        ]
    )
