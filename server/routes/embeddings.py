"""POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hotlora.server.api.token_requests import EmbeddingRequest, EmbeddingResponse
from hotlora.server.deps import EmbeddingsDep
from hotlora.server.http.auth import InferenceRoute
from hotlora.server.http.disconnects import until_disconnect
from hotlora.server.routes import paths

router = APIRouter(tags=["inference"], route_class=InferenceRoute)


@router.post(paths.EMBEDDINGS)
async def create_embeddings(
    body: EmbeddingRequest, request: Request, service: EmbeddingsDep
) -> EmbeddingResponse:
    """A client that leaves stops the work: no chunk runs after it is gone."""
    return await until_disconnect(request, service.embed(body))
