"""GET /metrics: Prometheus' text format; like vLLM's, open without a key and not in OpenAPI,
unless a keys file scopes tenants (then an admin key's alone)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from hotlora.server.deps import MetricsDep
from hotlora.server.http.auth import require_metrics_key
from hotlora.server.telemetry.prometheus import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False, dependencies=[Depends(require_metrics_key)])
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type=CONTENT_TYPE)
