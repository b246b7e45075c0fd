"""GET /health (the process is alive), GET /ready (the model is loaded and warmed), GET /version."""

from __future__ import annotations

from importlib.metadata import version as package_version

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from hotlora.server.deps import RuntimeDep
from hotlora.server.engine import WorkerStopped
from hotlora.server.http.error_responses import error_response
from hotlora.server.http.request_errors import NotReady
from hotlora.server.routes import paths

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(runtime: RuntimeDep) -> dict[str, str] | JSONResponse:
    if runtime.draining:
        return error_response(WorkerStopped("The server is shutting down."))
    if not runtime.ready:
        return error_response(NotReady(f"The model is not ready yet ({runtime.status})."))
    return {"status": "ready", "model": runtime.base_id or ""}


@router.get(paths.VERSION)
async def version() -> dict[str, str]:
    """The server's version, as vLLM's /version answers."""
    return {"version": package_version("hotlora")}
