"""Adapter admin: mount, list, inspect and unmount, what the adapter root holds, plus vLLM's
load/unload aliases, which answer as vLLM's server does: 200 and a line of text."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from hotlora.adapters import AdapterError, AdapterInfo, AdapterManager, AdapterNotFound
from hotlora.server.api.admin_models import (
    AdapterCard,
    AdapterList,
    AdapterRootEntry,
    AdapterRootList,
    LoadLoraAdapterRequest,
    MountAdapterRequest,
    UnloadLoraAdapterRequest,
)
from hotlora.server.deps import MetricsDep, RuntimeDep
from hotlora.server.http.auth import AdminRoute
from hotlora.server.routes import paths
from hotlora.server.telemetry.prometheus import Metrics

router = APIRouter(tags=["adapters"], route_class=AdminRoute)


def get_manager(runtime: RuntimeDep) -> AdapterManager:
    return runtime.require_adapters()


ManagerDep = Annotated[AdapterManager, Depends(get_manager)]


def _card(info: AdapterInfo) -> dict[str, Any]:
    return AdapterCard(**info.to_dict()).model_dump()


async def _mount(
    manager: AdapterManager,
    metrics: Metrics,
    adapter_id: str,
    path: str,
    replace: bool,
    pin: bool = False,
) -> tuple[AdapterInfo, bool]:
    """The adapter mounted (pinned: never evicted by the budget), and whether this call changed
    anything (False: the same revision was already there)."""
    try:
        before: AdapterInfo | None = manager.get(adapter_id)
    except AdapterNotFound:
        before = None
    try:
        # Reading and checking the files is blocking I/O; keep it off the event loop.
        info = await asyncio.to_thread(manager.mount, adapter_id, path, replace, pin=pin)
    except AdapterError as exc:
        metrics.adapter_refused("mount", exc.code)
        raise
    # The manager tells the metrics of the mount itself, as of every other.
    unchanged = before is not None and before.revision == info.revision
    return info, not unchanged


async def _unmount(manager: AdapterManager, metrics: Metrics, adapter_id: str) -> dict[str, Any]:
    try:
        info = await asyncio.to_thread(manager.unmount, adapter_id)
    except AdapterError as exc:
        metrics.adapter_refused("unmount", exc.code)
        raise
    return {"id": info.id, "object": "adapter", "deleted": True}


@router.post(paths.ADAPTERS, status_code=201, response_model=AdapterCard)
async def mount_adapter(
    body: MountAdapterRequest, manager: ManagerDep, metrics: MetricsDep
) -> JSONResponse:
    """201 when this call mounted something; 200 when the same revision was already there."""
    info, changed = await _mount(manager, metrics, body.id, body.path, body.replace, body.pin)
    return JSONResponse(_card(info), status_code=201 if changed else 200)


@router.get(paths.ADAPTERS)
async def list_adapters(manager: ManagerDep) -> AdapterList:
    return AdapterList(data=[AdapterCard(**info.to_dict()) for info in manager.list()])


@router.get(paths.ADAPTER_ROOT)
async def list_adapter_root(manager: ManagerDep) -> AdapterRootList:
    entries = await asyncio.to_thread(manager.root_entries)  # reads the root's directories
    return AdapterRootList(
        root=str(manager.adapter_root),
        auto_mount=manager.auto_mount,
        resident_bytes=manager.resident_bytes,
        max_mounted_adapters=manager.budget.max_adapters,
        adapter_memory_bytes=manager.budget.max_bytes,
        data=[AdapterRootEntry(**entry.to_dict()) for entry in entries],
    )


@router.get(paths.ADAPTERS + "/{adapter_id}")
async def get_adapter(adapter_id: str, manager: ManagerDep) -> AdapterCard:
    return AdapterCard(**manager.get(adapter_id).to_dict())


@router.delete(paths.ADAPTERS + "/{adapter_id}")
async def unmount_adapter(
    adapter_id: str, manager: ManagerDep, metrics: MetricsDep
) -> dict[str, Any]:
    return await _unmount(manager, metrics, adapter_id)


_TEXT_OK: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Done."}
}


@router.post(paths.LOAD_LORA_ADAPTER, response_class=PlainTextResponse, responses=_TEXT_OK)
async def load_lora_adapter(
    body: LoadLoraAdapterRequest, manager: ManagerDep, metrics: MetricsDep
) -> PlainTextResponse:
    """`load_inplace` swaps an adapter already mounted under the name."""
    await _mount(manager, metrics, body.lora_name, body.lora_path, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(paths.UNLOAD_LORA_ADAPTER, response_class=PlainTextResponse, responses=_TEXT_OK)
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, manager: ManagerDep, metrics: MetricsDep
) -> PlainTextResponse:
    await _unmount(manager, metrics, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
