"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotlora.adapters import parse_selection
from hotlora.config.errors import HotloraError, ModelNotFound
from hotlora.server.api.admin_models import ModelCard, ModelList
from hotlora.server.deps import RuntimeDep
from hotlora.server.http.auth import InferenceRoute, sees_server_paths
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
    """A card of the list, or of a selection `model` may name (`<base-id>:sft+dpo`, as an
    answer's `model` echoes it) when its adapters are mounted and in the key's scope."""
    if not model_id:  # a trailing slash: no route, as on every other path
        raise StarletteHTTPException(404)
    runtime.require_inference()
    cards = _visible(request, runtime)
    for card in cards:
        if card.id == model_id:
            return card
    selection = _selection_card(model_id, runtime.model_cards())
    if selection is None:
        raise ModelNotFound(model_id, [card.id for card in cards])
    return _shown(selection, request)


def _selection_card(model_id: str, cards: list[ModelCard]) -> ModelCard | None:
    """The card of the adapter selection `model_id` names; None when it names none that can
    be served now."""
    base, adapters = cards[0], {card.id: card for card in cards[1:]}
    try:
        refs = parse_selection(base.id, model_id, (), adapters)
    except HotloraError:
        return None
    if not refs:  # `<base-id>:none`: the base alone
        return base.model_copy(update={"id": model_id})
    if any(ref.id not in adapters for ref in refs):
        return None
    return base.model_copy(
        update={
            "id": model_id,
            "created": max(adapters[ref.id].created for ref in refs),
            "root": None,
            "parent": base.id,
        }
    )


def _visible(request: Request, runtime: Runtime) -> list[ModelCard]:
    """The cards a key may use, as `_shown` shows them."""
    tenant = request_tenant(request)
    return [
        _shown(card, request)
        for card in runtime.model_cards()
        if (tenant.may_use(card.id) if card.parent is not None else tenant.may_use_base)
    ]


def _shown(card: ModelCard, request: Request) -> ModelCard:
    """`card` without its `root`, where the server keeps the files, unless an admin asks: an
    admin key, or any request to a server that guards nothing with a key."""
    return card if sees_server_paths(request) else card.model_copy(update={"root": None})
