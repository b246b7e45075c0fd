"""GET /metrics: Prometheus' text format; like vLLM's, open without a key and not in OpenAPI."""

from __future__ import annotations

from fastapi import APIRouter, Response

from hotlora.server.deps import MetricsDep
from hotlora.server.telemetry.prometheus import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type=CONTENT_TYPE)
