"""One app's tenants: its keys, their limits and their usage, and the middleware that closes
each request's account once it is answered (a stream: after its last byte)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotlora.adapters import EVERYTHING, reset_scope, use_scope
from hotlora.config.settings import Settings
from hotlora.server.http.keys_file import KeyRing, flag_keys
from hotlora.server.http.tenant_limits import Admission, TenantLimits
from hotlora.server.http.tenants import Tenant
from hotlora.server.telemetry.access_log import current_record
from hotlora.server.telemetry.prometheus import Metrics
from hotlora.server.telemetry.tenant_usage import TenantUsage

log = logging.getLogger("hotlora")

# Where the key check leaves what it found, in the request's scope state.
TENANT = "tenant"
ADMISSION = "tenant_admission"


@dataclass
class Tenancy:
    """The keys in use, every tenant's limits and usage, and which routes need no key."""

    keys: KeyRing
    limits: TenantLimits
    usage: TenantUsage
    inference_open: bool  # no key configured for inference: requests without one are served
    admin_open: bool

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics) -> Tenancy:
        """`--api-key`, `--admin-api-key` and `--keys` read; a bad keys file raises
        `KeysFileError` (a `ValueError`), stopping the start."""
        keys = KeyRing(settings.keys, flag_keys(settings.api_key, settings.admin_api_key))
        inference_open = settings.api_key is None and settings.keys is None
        return cls(
            keys=keys,
            limits=TenantLimits(),
            usage=TenantUsage(metrics),
            inference_open=inference_open,
            admin_open=inference_open and settings.admin_api_key is None,
        )

    def listen_for_sighup(self) -> Callable[[], None]:
        """Read the keys file again on SIGHUP; returns what stops listening. Only the main
        thread's event loop can take signals: elsewhere (a test's, a Ray replica's) the file
        is still read again when it changes."""
        if self.keys.path is None or not hasattr(signal, "SIGHUP"):
            return lambda: None
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self.keys.reload)
        except (RuntimeError, ValueError, NotImplementedError):
            log.debug("SIGHUP not taken in this thread: the keys file is read when it changes")
            return lambda: None

        def stop() -> None:
            loop.remove_signal_handler(signal.SIGHUP)

        return stop


class TenantAccounts:
    """Closes each request's account when it is answered: its tenant's request in flight ends,
    with the tokens it used, and its usage is counted. Also holds the request to the adapter
    scope the key check gives it, and to none after."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy):
        self.app = app
        self.tenancy = tenancy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = use_scope(EVERYTHING)  # the key check narrows it
        status: int | None = None

        async def noted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noted)
        finally:
            reset_scope(token)
            self._close(scope, status)

    def _close(self, scope: Scope, status: int | None) -> None:
        state = scope.get("state", {})
        tenant, admission = state.get(TENANT), state.get(ADMISSION)
        record = current_record()
        tokens = 0
        if record is not None:
            tokens = (record.prompt_tokens or 0) + (record.completion_tokens or 0)
        if isinstance(admission, Admission):
            admission.end(tokens)
        if isinstance(tenant, Tenant) and record is not None:
            self.tenancy.usage.answered(tenant.name, status or 500, record)
