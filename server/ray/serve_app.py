"""hotlora on Ray Serve: many replicas of the server behind Ray Serve's HTTP proxy, one port.

`hotlora serve --ray --replicas N` runs it; so does
`serve run hotlora.server.ray.serve_app:app` (settings from HOTLORA_* variables) or
`serve run hotlora.server.ray.serve_app:build replicas=2 ...`.

Two deployments. `HotloraIngress` is Serve's FastAPI ingress: it reads each request, names
its adapter set as Serve's multiplexed model id, so that requests for the same set prefer a
replica that already has it mounted, and relays it to a `HotloraReplica`, streaming the answer
back (server-sent events included). Each `HotloraReplica` runs the whole hotlora app, base
model, batching engine and admin routes, on what is relayed to it. Adapter changes go through
the one registry actor (`server/ray/cluster_registry.py`) that every replica follows.
"""

# No `from __future__ import annotations`: Serve's ingress rebuilds the route methods'
# signatures, and FastAPI must see `Request` itself, not its name.
import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve import Deployment

from hotlora.adapters import (
    AdapterNotFound,
    InvalidAdapterSpec,
    parse_adapter_spec,
    parse_selection,
    reset_scope,
    use_scope,
)
from hotlora.config.errors import InvalidRequest, ModelNotFound
from hotlora.config.log_text import printable
from hotlora.config.settings import Settings
from hotlora.server.app import create_app
from hotlora.server.http.auth import bearer_key
from hotlora.server.http.error_responses import error_body
from hotlora.server.http.keys_file import KeyRing, flag_keys
from hotlora.server.http.tenants import DEFAULT_TENANT, Tenant
from hotlora.server.ray.cluster_registry import ClusterMounts, RegistryClient, registry_actor
from hotlora.server.ray.relay import Lifespan, Part, RelayedRequest, call_app, relayed_response
from hotlora.server.render.chat_templates import for_replicas
from hotlora.server.routes import paths
from hotlora.server.runtime import base_model_id

log = logging.getLogger("hotlora")

APP_NAME = "hotlora"
REPLICA_HEADER = b"x-hotlora-replica"  # which replica answered: its Serve replica id
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
SETS_PER_REPLICA = 64  # adapter sets a replica is known to hold, for routing, with no cap
_REFRESH_S = 1.0  # how stale the ingress's list of adapter ids may be (routing only)


def settings_data(settings: Settings) -> dict[str, Any]:
    """The settings as plain data for the replicas (the config file already read; a chat
    template file as its text, since a replica may run on a machine without it)."""
    data = settings.model_dump(mode="json", exclude={"config"})
    data["chat_template"] = for_replicas(settings.chat_template)
    return data


def replica_options(settings: Settings) -> dict[str, Any]:
    """The replicas' Serve options: a fixed count, or autoscaling on the requests each has in
    flight, aiming at one full batch (`max_batch`) per replica."""
    options: dict[str, Any] = {
        # One batch decoding and one waiting; beyond that requests wait at the proxy, where
        # whichever replica frees up first takes them.
        "max_ongoing_requests": 2 * settings.max_batch,
        "graceful_shutdown_timeout_s": settings.drain_timeout,
        "health_check_period_s": 2.0,
    }
    if settings.max_replicas is not None and settings.max_replicas > settings.replicas:
        options["autoscaling_config"] = {
            "min_replicas": settings.replicas,
            "max_replicas": settings.max_replicas,
            "target_ongoing_requests": settings.max_batch,
        }
    else:
        options["num_replicas"] = settings.replicas
    return options


def wanted_adapters(
    request: RelayedRequest,
    base_id: str,
    registered: frozenset[str],
    tenant: Tenant = DEFAULT_TENANT,
) -> list[str]:
    """The adapter ids a request names (its `model` and `adapter` fields, read as the adapter
    manager reads them, with `registered` as the mounted ids; or the id in an admin path);
    input the app refuses names none, and the app answers it as on one machine. So does an id
    outside the `tenant`'s scope: no replica loads an adapter for a key that may not use it."""
    path = request.path
    for prefix in paths.BY_ID:
        if path.startswith(prefix) and len(path) > len(prefix):
            return [i for i in [path[len(prefix) :]] if tenant.may_see(i)]
    if request.method != "POST" or (
        path not in paths.INFERENCE and path != paths.UNLOAD_LORA_ADAPTER
    ):
        return []
    try:
        body = json.loads(request.body)
    except ValueError:
        return []
    if not isinstance(body, dict):
        return []
    if path == paths.UNLOAD_LORA_ADAPTER:
        name = body.get("lora_name")
        return [name] if isinstance(name, str) and tenant.may_see(name) else []
    model = body.get("model")
    if not isinstance(model, str):
        return []
    token = use_scope(tenant)
    try:
        refs = parse_selection(base_id, model, parse_adapter_spec(body.get("adapter")), registered)
    except (InvalidAdapterSpec, InvalidRequest, ModelNotFound, AdapterNotFound):
        return []
    finally:
        reset_scope(token)
    return sorted({ref.id for ref in refs})


def request_tenant(
    keys: KeyRing | None, request: RelayedRequest, unknown: Tenant | None
) -> Tenant | None:
    """The tenant of the request's bearer key (`DEFAULT_TENANT` when no keys are configured);
    `unknown` for a missing or wrong key (None where the replica will refuse it)."""
    if keys is None:
        return DEFAULT_TENANT
    for name, value in request.headers:
        if name.lower() == b"authorization":
            given = bearer_key(value.decode("latin-1"))
            if given is not None:
                return keys.lookup(given) or unknown
    return unknown


async def _rest(parts: Any) -> AsyncIterator[bytes]:
    """The body chunks after the start; a client that leaves cancels the replica's call."""
    try:
        async for part in parts:
            yield part
    finally:
        parts.cancel()


def _app_name() -> str:
    return serve.get_replica_context().app_name


# Defined before the deployments: Serve serializes them as they are declared.
ingress_app = FastAPI(title="hotlora", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(name="HotloraIngress", ray_actor_options={"num_cpus": 0})
@serve.ingress(ingress_app)
class HotloraIngress:
    """Relays every request to a replica, its adapter set as the multiplexed model id."""

    def __init__(self, replica: Any, settings: dict[str, Any]):
        self._replica = replica
        self._settings = Settings(**settings)
        self._base_id = base_model_id(self._settings)
        given = self._settings
        # The replicas check every key; the ingress reads them only to route by what a key
        # may use (the keys file must be at the same path on every node).
        keyed = given.keys is not None or given.api_key is not None or given.admin_api_key
        self._keys: KeyRing | None = None
        # Inference without a key is served where only --admin-api-key is set.
        self._unknown = DEFAULT_TENANT if given.keys is None and given.api_key is None else None
        if keyed:
            self._keys = KeyRing(given.keys, flag_keys(given.api_key, given.admin_api_key))
        self._registry: RegistryClient | None = None
        self._registered: frozenset[str] = frozenset()
        self._known: Any = None
        self._refreshed = 0.0

    @ingress_app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def relay(self, request: Request) -> Response:
        relayed = await RelayedRequest.read(request, self._settings.max_body_bytes)
        tenant = request_tenant(self._keys, relayed, self._unknown)
        registered = await self._registered_ids()
        wanted = []
        if tenant is not None:
            wanted = wanted_adapters(relayed, self._base_id, registered, tenant)
        inference = relayed.method == "POST" and relayed.path in paths.INFERENCE
        # Only inference is routed by adapter set; admin calls and the rest go anywhere.
        key = "+".join(wanted) if inference else ""
        handle = self._replica.options(method_name="relay", stream=True, multiplexed_model_id=key)
        parts = handle.remote(relayed, wanted)
        try:
            start = await parts.__anext__()
        except Exception as exc:  # noqa: BLE001 - no replica could take it; say so, as JSON
            parts.cancel()
            log.warning(
                "no replica answered %s %s: %s",
                printable(relayed.method),
                printable(relayed.path),
                printable(exc),
            )
            body = error_body(
                "No replica could answer; retry.", "service_unavailable", code="no_replica"
            )
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        # Serve's proxy puts its own x-request-id on the response (the client's, or a new id
        # that it also gave the replica): the replica's copy would repeat it.
        start["headers"] = [(k, v) for k, v in start["headers"] if k.lower() != b"x-request-id"]
        return relayed_response(start, _rest(parts))

    async def _registered_ids(self) -> frozenset[str]:
        """The registry's adapter ids, at most `_REFRESH_S` old: only routing reads them."""
        if time.monotonic() - self._refreshed < _REFRESH_S:
            return self._registered
        self._refreshed = time.monotonic()
        try:
            if self._registry is None:
                self._registry = RegistryClient(registry_actor(_app_name(), self._settings))
            snapshot = await self._registry.call_async("snapshot", self._known)
        except Exception as exc:  # noqa: BLE001 - routing goes on without the hint
            log.warning("could not read the adapter registry: %s", exc)
            return self._registered
        if snapshot is not None:
            generation, version, records = snapshot
            self._known = (generation, version)
            self._registered = frozenset(record.id for record in records)
        return self._registered


@serve.deployment(name="HotloraReplica")
class HotloraReplica:
    """One hotlora server (base model, batching engine, adapters) answering relayed requests."""

    async def __init__(self, settings: dict[str, Any]):  # type: ignore[misc]
        given = Settings(**settings)
        level = given.log_level.upper().replace("TRACE", "DEBUG")
        logging.basicConfig(level=level, format="%(levelname)s: %(name)s: %(message)s")
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id.encode()
        self._mounts = ClusterMounts(
            RegistryClient(registry_actor(context.app_name, given)),
            max_mounted=given.max_mounted_adapters,
            startup=given.startup_adapters,
        )
        # The registry records mounts for every replica; this one keeps no record of its own.
        # The registry keeps the replica's cap (ClusterMounts above): no budget of its own
        # (--adapter-memory-bytes and --auto-mount are refused with ray, by Settings).
        local = given.model_copy(
            update={"persist_mounts": False, "startup_adapters": {}, "max_mounted_adapters": None}
        )
        failures: list[BaseException] = []
        self._app = create_app(local, on_fatal=failures.append, mount_store=self._mounts)
        self._runtime = self._app.state.runtime
        self._lifespan = Lifespan(self._app)
        await self._lifespan.start()
        # Ready (for Serve: constructed) only once loaded, warmed and in step with the registry.
        while not self._runtime.ready:
            if failures or self._runtime.status == "failed":
                raise RuntimeError(f"the replica could not start: {failures or 'see its log'}")
            await asyncio.sleep(0.05)
        self._watching = asyncio.create_task(self._mounts.watch())
        mounts = self._mounts

        async def mount_set(key: str) -> str:
            # Serve's multiplexed loader: an adapter set is "loaded" once its ids are mounted,
            # and Serve routes requests for it here first from then on.
            (await mounts.admit(key.split("+")))()
            return key

        cap = given.max_mounted_adapters or SETS_PER_REPLICA
        self._hot = serve.multiplexed(max_num_models_per_replica=cap)(mount_set)
        log.info("replica %s ready (pid %d)", self._replica_id.decode(), os.getpid())

    async def relay(self, request: RelayedRequest, wanted: list[str]) -> AsyncIterator[Part]:
        """Answer one relayed request with the app: its start, then its body chunks."""
        key = serve.get_multiplexed_model_id()
        if key:
            await self._hot(key)
        release = await self._mounts.admit(wanted)
        try:
            async for part in call_app(self._app, request):
                if isinstance(part, dict):
                    part["headers"].append((REPLICA_HEADER, self._replica_id))
                yield part
        finally:
            release()

    def check_health(self) -> None:
        """Serve restarts a replica whose server failed."""
        if self._runtime.status == "failed" or self._watching.done():
            raise RuntimeError(f"replica unhealthy: {self._runtime.status}")


def build_app(settings: Settings) -> Any:
    """The Serve application: the ingress bound to the replicas, options from `settings`."""
    data = settings_data(settings)
    replicas = cast(Deployment, HotloraReplica).options(**replica_options(settings)).bind(data)
    return cast(Deployment, HotloraIngress).options(max_ongoing_requests=4096).bind(replicas, data)


def build(args: dict[str, str]) -> Any:
    """`serve run hotlora.server.ray.serve_app:build replicas=2 ...`: settings from the arguments
    (names as in the config file), then HOTLORA_* variables."""
    return build_app(Settings(**args))


def __getattr__(name: str) -> Any:
    # `serve run hotlora.server.ray.serve_app:app` reads `app`: built on first access, not at
    # import, from HOTLORA_* variables.
    if name == "app":
        return build_app(Settings())
    raise AttributeError(name)


def serve_on_ray(settings: Settings) -> int:
    """`hotlora serve --ray`: start a local Ray instance (or join the cluster RAY_ADDRESS
    names), run the app on `host:port` until Ctrl-C or SIGTERM, then take it down."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: delete the app
    ray.init()
    serve.start(http_options={"host": settings.host, "port": settings.port})
    try:
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        ray.shutdown()
    return 0
