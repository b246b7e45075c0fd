"""POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter

from hotlora.server.api.token_requests import EmbeddingRequest, EmbeddingResponse
from hotlora.server.deps import EmbeddingsDep
from hotlora.server.http.auth import InferenceRoute
from hotlora.server.routes import paths

router = APIRouter(tags=["inference"], route_class=InferenceRoute)


@router.post(paths.EMBEDDINGS)
async def create_embeddings(body: EmbeddingRequest, service: EmbeddingsDep) -> EmbeddingResponse:
    return await service.embed(body)
