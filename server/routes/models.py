"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hotlora.config.errors import ModelNotFound
from hotlora.server.api.admin_models import ModelCard, ModelList
from hotlora.server.deps import RuntimeDep
from hotlora.server.http.auth import InferenceRoute
from hotlora.server.http.tenants import request_tenant
from hotlora.server.routes import paths
from hotlora.server.runtime import Runtime

router = APIRouter(tags=["models"], route_class=InferenceRoute)


@router.get(paths.MODELS)
async def list_models(request: Request, runtime: RuntimeDep) -> ModelList:
    """What the request's key may use: the base (unless it may not run it alone), then the
    adapters in its scope."""
    runtime.require_inference()
    return ModelList(data=_visible(request, runtime))


@router.get(paths.MODELS + "/{model_id:path}")
async def get_model(model_id: str, request: Request, runtime: RuntimeDep) -> ModelCard:
    runtime.require_inference()
    cards = _visible(request, runtime)
    for card in cards:
        if card.id == model_id:
            return card
    raise ModelNotFound(model_id, [card.id for card in cards])


def _visible(request: Request, runtime: Runtime) -> list[ModelCard]:
    tenant = request_tenant(request)
    return [
        card
        for card in runtime.model_cards()
        if (tenant.may_use(card.id) if card.parent is not None else tenant.may_use_base)
    ]
