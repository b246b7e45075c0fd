"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter

from hotlora.server.api.admin_models import ModelCard, ModelList
from hotlora.server.deps import RuntimeDep
from hotlora.server.http.auth import InferenceRoute
from hotlora.server.routes import paths

router = APIRouter(tags=["models"], route_class=InferenceRoute)


@router.get(paths.MODELS)
async def list_models(runtime: RuntimeDep) -> ModelList:
    runtime.require_inference()
    return ModelList(data=runtime.model_cards())


@router.get(paths.MODELS + "/{model_id:path}")
async def get_model(model_id: str, runtime: RuntimeDep) -> ModelCard:
    return runtime.model_card(model_id)
