"""The app factory: settings in, FastAPI app out; the lifespan owns the base model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from hotlora.adapters import MountStore
from hotlora.config.log_text import printable
from hotlora.config.settings import Settings
from hotlora.config.sources import log_setting_notes
from hotlora.server.http.cors import install_cors
from hotlora.server.http.error_responses import install_error_handlers
from hotlora.server.http.hosts import TrustedHosts, allowed_hosts, is_loopback
from hotlora.server.http.lifecycle import InFlight
from hotlora.server.http.limits import BodyLimit
from hotlora.server.http.openapi import install_openapi
from hotlora.server.http.request_ids import RequestIds
from hotlora.server.http.tenancy import Tenancy, TenantAccounts
from hotlora.server.routes import (
    adapters,
    completions,
    embeddings,
    health,
    metrics,
    models,
    responses_api,
    tokenize,
    usage,
)
from hotlora.server.routes.page import install_page
from hotlora.server.runtime import Runtime


def create_app(
    settings: Settings | None = None,
    *,
    on_fatal: Callable[[BaseException], None] | None = None,
    mount_store: MountStore | None = None,
) -> FastAPI:
    """Build an app; the model loads in the background once it starts (see GET /ready).

    `mount_store` is where the mounted set is recorded and restored from instead of the mount
    record of `persist_mounts` (a Ray replica passes its link to the cluster's registry).
    """
    settings = settings or Settings()
    log_setting_notes()  # old names of renamed settings, misspelt variables
    logging.getLogger("hotlora").setLevel(settings.log_level.upper().replace("TRACE", "DEBUG"))
    runtime = Runtime(settings, on_fatal=on_fatal, mount_store=mount_store)
    tenancy = Tenancy.from_settings(settings, runtime.metrics)  # a bad keys file stops here
    if not is_loopback(settings.host) and not (
        settings.api_key or settings.admin_api_key or settings.keys
    ):
        logging.getLogger("hotlora").warning(
            "listening on %s with no key (--api-key, --admin-api-key or --keys): whoever reaches "
            "it may run every route, mounting and unmounting adapters included",
            printable(settings.host),
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(runtime.start(), name="load-model")
        stop_listening = tenancy.listen_for_sighup()
        try:
            yield
        finally:
            stop_listening()
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await runtime.stop()

    # The docs pages are served by `install_page`, from files in the package, not a CDN.
    # No redirect to a route without its trailing slash: a 404 (a redirect answers a DELETE or
    # POST with a 307 to wherever the Host header says).
    app = FastAPI(
        title="hotlora",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,
    )
    app.state.runtime = runtime
    app.state.tenancy = tenancy
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    install_error_handlers(app)
    app.add_middleware(InFlight, runtime=runtime)
    install_cors(app, settings.allowed_origin_list)
    app.add_middleware(TenantAccounts, tenancy=tenancy)
    hosts = allowed_hosts(settings.host, settings.allowed_host_list)
    if hosts is not None:
        app.add_middleware(TrustedHosts, patterns=hosts)
    app.add_middleware(RequestIds)  # outermost: a 413 or 500 carries the id too
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(models.router)
    app.include_router(completions.router)
    app.include_router(responses_api.router)
    app.include_router(embeddings.router)
    app.include_router(tokenize.router)
    app.include_router(adapters.router)
    app.include_router(usage.router)
    install_page(app)
    install_openapi(app)
    return app
