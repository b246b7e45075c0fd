"""Adapter admin: mount, list, inspect and unmount, what the adapter root holds, plus vLLM's
load/unload aliases, which answer as vLLM's server does: 200 and a line of text, a name already
loaded a 400, a path with nothing there a 404."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from hotlora.adapters import (
    AdapterConflict,
    AdapterError,
    AdapterInfo,
    AdapterManager,
    AdapterNotFound,
    AdapterPathMissing,
    AdapterPathRefused,
    PinQuota,
    resolve_under_root,
    shown_path,
)
from hotlora.config.errors import HotloraError, InvalidRequest
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
from hotlora.server.http.request_errors import LoraPathNotFound
from hotlora.server.http.tenants import Tenant, request_tenant
from hotlora.server.routes import paths
from hotlora.server.telemetry.prometheus import Metrics

router = APIRouter(tags=["adapters"], route_class=AdminRoute)


def get_manager(runtime: RuntimeDep) -> AdapterManager:
    return runtime.require_adapters()


ManagerDep = Annotated[AdapterManager, Depends(get_manager)]


def _card(info: AdapterInfo) -> AdapterCard:
    """An adapter's card, its path as the request may see it (`shown_path`)."""
    return AdapterCard(**{**info.to_dict(), "path": shown_path(str(info.path))})


def _folder(tenant: Tenant, manager: AdapterManager) -> Path:
    """A tenant-admin key's folder under the adapter root, which it mounts from."""
    return (manager.adapter_root / (tenant.mount_dir or "")).resolve()


def _check_mount(
    request: Request, manager: AdapterManager, adapter_id: str, path: str
) -> Path | None:
    """A tenant-admin key mounts only ids under its prefix, from its folder under the root:
    the folder every file of the mount must resolve under (None: the root, for an admin)."""
    tenant = request_tenant(request)
    if tenant.is_admin:
        return None
    _check_id(tenant, manager, adapter_id)
    folder = _folder(tenant, manager)
    if not resolve_under_root(path, manager.adapter_root).is_relative_to(folder):
        raise AdapterPathRefused(
            f"this key mounts adapters only from '{tenant.mount_dir}' under the adapter root"
        )
    return folder


def _check_id(tenant: Tenant, manager: AdapterManager, adapter_id: str) -> None:
    """An id outside what the key may mount is answered as an id that is not mounted."""
    if not tenant.may_mount(adapter_id):
        raise AdapterNotFound(adapter_id, [info.id for info in manager.list()])


async def _mount(
    manager: AdapterManager,
    metrics: Metrics,
    adapter_id: str,
    path: str,
    replace: bool,
    pin: bool = False,
    *,
    within: Path | None,
    pin_quota: PinQuota | None = None,
) -> tuple[AdapterInfo, bool]:
    """The adapter mounted (pinned: never evicted by the budget; its files all under `within`
    when given), and whether this call changed anything (False: the same revision was already
    there, or another call mounted it first)."""
    # Reading and checking the files is blocking I/O; keep it off the event loop. The manager
    # tells the metrics of the mount itself, as of every other; a refusal is told here.
    mount = functools.partial(
        manager.mount_reporting_change, pin=pin, within=within, pin_quota=pin_quota
    )
    with _refusals_counted(metrics, "mount"):
        return await asyncio.to_thread(mount, adapter_id, path, replace)


async def _unmount(manager: AdapterManager, metrics: Metrics, adapter_id: str) -> dict[str, Any]:
    with _refusals_counted(metrics, "unmount"):
        info = await asyncio.to_thread(manager.unmount, adapter_id)
    return {"id": info.id, "object": "adapter", "deleted": True}


@contextlib.contextmanager
def _refusals_counted(metrics: Metrics, op: str) -> Iterator[None]:
    """An adapter refusal raised within (a key's own limits included), told to the metrics by
    its code."""
    try:
        yield
    except AdapterError as exc:
        metrics.adapter_refused(op, exc.code)
        raise


@router.post(paths.ADAPTERS, status_code=201, response_model=AdapterCard)
async def mount_adapter(
    body: MountAdapterRequest, request: Request, manager: ManagerDep, metrics: MetricsDep
) -> JSONResponse:
    """201 when this call mounted something; 200 when the same revision was already there."""
    with _refusals_counted(metrics, "mount"):
        within = _check_mount(request, manager, body.id, body.path)
    tenant = request_tenant(request)
    quota = None
    if tenant.mount_prefix is not None and tenant.max_pinned is not None:
        quota = PinQuota(tenant.mount_prefix, tenant.max_pinned)
    info, changed = await _mount(
        manager,
        metrics,
        body.id,
        body.path,
        body.replace,
        body.pin,
        within=within,
        pin_quota=quota,
    )
    return JSONResponse(_card(info).model_dump(), status_code=201 if changed else 200)


@router.get(paths.ADAPTERS)
async def list_adapters(request: Request, manager: ManagerDep) -> AdapterList:
    tenant = request_tenant(request)
    shown = [info for info in manager.list() if tenant.may_see(info.id)]
    return AdapterList(data=[_card(info) for info in shown])


@router.get(paths.ADAPTER_ROOT)
async def list_adapter_root(request: Request, manager: ManagerDep) -> AdapterRootList:
    """An admin key: the whole root, its path absolute. A tenant-admin key: the adapters it may
    see, then those in its folder not mounted yet, paths relative to the root (as its mounts
    name them), `root` its folder."""
    tenant = request_tenant(request)
    root, resident = str(manager.adapter_root), manager.resident_bytes
    if tenant.is_admin:
        entries = await asyncio.to_thread(manager.root_entries)  # reads the root's directories
    else:
        folder = _folder(tenant, manager)
        entries = await asyncio.to_thread(manager.root_entries, folder, tenant.may_see)
        root = tenant.mount_dir or ""  # its folder, as its mounts name paths under the root
        # Its own adapters' memory: the whole would tell what other tenants keep resident.
        resident = sum(info.ram_bytes for info in manager.list() if tenant.may_see(info.id))
    return AdapterRootList(
        root=root,
        auto_mount=manager.auto_mount,
        resident_bytes=resident,
        max_mounted_adapters=manager.budget.max_adapters,
        adapter_memory_bytes=manager.budget.max_bytes,
        data=[
            AdapterRootEntry(**{**entry.to_dict(), "path": shown_path(entry.path)})
            for entry in entries
        ],
    )


@router.get(paths.ADAPTERS + "/{adapter_id}")
async def get_adapter(adapter_id: str, request: Request, manager: ManagerDep) -> AdapterCard:
    if not request_tenant(request).may_see(adapter_id):
        raise AdapterNotFound(adapter_id, [info.id for info in manager.list()])
    return _card(manager.get(adapter_id))


@router.delete(paths.ADAPTERS + "/{adapter_id}")
async def unmount_adapter(
    adapter_id: str, request: Request, manager: ManagerDep, metrics: MetricsDep
) -> dict[str, Any]:
    with _refusals_counted(metrics, "unmount"):
        _check_id(request_tenant(request), manager, adapter_id)
    return await _unmount(manager, metrics, adapter_id)


_TEXT_OK: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Done."}
}


def _is_loaded(manager: AdapterManager, name: str) -> bool:
    try:
        manager.get(name)
    except AdapterNotFound:
        return False
    return True


def _loaded_before(metrics: Metrics, name: str) -> InvalidRequest:
    """vLLM's answer, word for word, to loading a name already loaded without `load_inplace`."""
    metrics.adapter_refused("mount", "adapter_already_loaded")
    return InvalidRequest(
        f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
        "in place, set 'load_inplace' to True.",
        param="lora_name",
        code="adapter_already_loaded",
    )


# The admin API's fields as vLLM's routes call them, for a refusal's `param`.
_VLLM_PARAMS = {"path": "lora_path", "id": "lora_name", "adapter": "lora_name"}


@contextlib.contextmanager
def _in_vllm_words() -> Iterator[None]:
    """A refusal of vLLM's adapter routes names the field the request sent (`lora_path`,
    `lora_name`), not the admin API's (`path`, `id`)."""
    try:
        yield
    except HotloraError as exc:
        exc.param = _VLLM_PARAMS.get(exc.param or "", exc.param)
        raise


@router.post(paths.LOAD_LORA_ADAPTER, response_class=PlainTextResponse, responses=_TEXT_OK)
async def load_lora_adapter(
    body: LoadLoraAdapterRequest, request: Request, manager: ManagerDep, metrics: MetricsDep
) -> PlainTextResponse:
    """As vLLM's: a name already loaded is a 400 unless `load_inplace`, which swaps it; a path
    with nothing there is a 404."""
    with _in_vllm_words():
        return await _load_lora_adapter(body, request, manager, metrics)


async def _load_lora_adapter(
    body: LoadLoraAdapterRequest, request: Request, manager: AdapterManager, metrics: Metrics
) -> PlainTextResponse:
    name, inplace = body.lora_name, body.load_inplace
    with _refusals_counted(metrics, "mount"):
        within = _check_mount(request, manager, name, body.lora_path)
    if not inplace and _is_loaded(manager, name):
        raise _loaded_before(metrics, name)
    try:
        _, changed = await _mount(manager, metrics, name, body.lora_path, inplace, within=within)
    except AdapterPathMissing as exc:
        raise LoraPathNotFound(exc.message) from None
    except AdapterConflict:
        if inplace:
            raise
        raise _loaded_before(metrics, name) from None  # another load of the name came first
    if not (changed or inplace):
        raise _loaded_before(metrics, name)  # the same files, loaded by a call beside this one
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post(paths.UNLOAD_LORA_ADAPTER, response_class=PlainTextResponse, responses=_TEXT_OK)
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, request: Request, manager: ManagerDep, metrics: MetricsDep
) -> PlainTextResponse:
    with _in_vllm_words():
        with _refusals_counted(metrics, "unmount"):
            _check_id(request_tenant(request), manager, body.lora_name)
        await _unmount(manager, metrics, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
