"""POST /tokenize and POST /detokenize, as vLLM's server answers them."""

from __future__ import annotations

from fastapi import APIRouter

from hotlora.server.api.token_requests import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from hotlora.server.deps import TokenizingDep
from hotlora.server.http.auth import InferenceRoute
from hotlora.server.routes import paths

router = APIRouter(tags=["tokens"], route_class=InferenceRoute)


@router.post(paths.TOKENIZE)
async def tokenize(body: TokenizeRequest, service: TokenizingDep) -> TokenizeResponse:
    return await service.tokenize(body)


@router.post(paths.DETOKENIZE)
async def detokenize(body: DetokenizeRequest, service: TokenizingDep) -> DetokenizeResponse:
    return await service.detokenize(body)
