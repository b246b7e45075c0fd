"""GET /health (the process is alive), GET /ready (the model is loaded and warmed), GET /version;
HEAD on the first two, as load balancers probe, with the status alone."""

from __future__ import annotations

from importlib.metadata import version as package_version

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

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


@router.head("/health", include_in_schema=False)
async def health_head() -> Response:
    return Response(status_code=200)


@router.head("/ready", include_in_schema=False)
async def ready_head(runtime: RuntimeDep) -> Response:
    answer = await ready(runtime)
    if not isinstance(answer, Response):
        return Response(status_code=200)
    retry = answer.headers.get("retry-after")
    return Response(
        status_code=answer.status_code, headers={"Retry-After": retry} if retry else None
    )
