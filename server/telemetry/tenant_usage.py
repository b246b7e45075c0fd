"""What each tenant used: requests, tokens, errors and limits hit, per adapter, since start.

Fed once per request, when it is answered (`TenantUsage.answered`, from the access record),
and once per refusal for a limit (`limited`). Counted twice over: as Prometheus counters with
a `tenant` label on the app's registry, and as totals for `GET /v1/usage`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from hotlora.server.telemetry.access_log import CLIENT_CLOSED_REQUEST, RequestRecord
from hotlora.server.telemetry.prometheus import Metrics


@dataclass
class _Tally:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, prompt: int, completion: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def to_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


@dataclass
class _TenantTotals:
    total: _Tally = field(default_factory=_Tally)
    errors: int = 0
    limited: dict[str, int] = field(default_factory=dict)  # limit -> refusals
    adapters: dict[str, _Tally] = field(default_factory=dict)  # adapter (or base) id -> tally


class TenantUsage:
    """Per-tenant counters: on `metrics`' registry and for `GET /v1/usage`."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._totals: dict[str, _TenantTotals] = {}
        self._lock = threading.Lock()
        r = metrics.registry
        per_adapter = ["tenant", "adapter"]
        self.requests = Counter(
            "hotlora_tenant_requests",
            "Requests answered, per tenant and per adapter in their set (the base model's id: "
            "no adapter; empty: a request that ran no model, such as a listing or a refusal).",
            per_adapter,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "hotlora_tenant_prompt_tokens",
            "Prompt tokens of answered requests, per tenant and adapter.",
            per_adapter,
            registry=r,
        )
        self.generation_tokens = Counter(
            "hotlora_tenant_generation_tokens",
            "Generated tokens of answered requests, per tenant and adapter.",
            per_adapter,
            registry=r,
        )
        self.errors = Counter(
            "hotlora_tenant_errors",
            "Requests answered with an error, per tenant and error code.",
            ["tenant", "code"],
            registry=r,
        )
        self.limited = Counter(
            "hotlora_tenant_limited",
            "Requests refused with 429 for a tenant's limit, per limit (requests_per_minute, "
            "tokens_per_minute, max_streams).",
            ["tenant", "limit"],
            registry=r,
        )

    def answered(self, tenant: str, status: int | None, record: RequestRecord) -> None:
        """One request of `tenant` was answered with `status`, as its access record says."""
        prompt = record.prompt_tokens or 0
        completion = record.completion_tokens or 0
        if record.adapters is None:
            adapters: tuple[str, ...] = ("",)
        else:
            adapters = record.adapters or (self.metrics.model_name,)
        # A client that left was not failed: its request counts as answered, streamed or not.
        left = status == CLIENT_CLOSED_REQUEST
        failed = not left and (record.error is not None or status is None or status >= 400)
        with self._lock:
            totals = self._totals.setdefault(tenant, _TenantTotals())
            totals.total.add(prompt, completion)
            totals.errors += failed
            for adapter in adapters:
                if adapter:
                    totals.adapters.setdefault(adapter, _Tally()).add(prompt, completion)
        for adapter in adapters:
            self.requests.labels(tenant, adapter).inc()
            self.prompt_tokens.labels(tenant, adapter).inc(prompt)
            self.generation_tokens.labels(tenant, adapter).inc(completion)
        if failed:
            self.errors.labels(tenant, record.error or str(status or "error")).inc()

    def limit_hit(self, tenant: str, limit: str) -> None:
        """A request of `tenant` was refused for `limit`."""
        with self._lock:
            limited = self._totals.setdefault(tenant, _TenantTotals()).limited
            limited[limit] = limited.get(limit, 0) + 1
        self.limited.labels(tenant, limit).inc()

    def report(self, tenants: list[str] | None = None) -> list[dict[str, Any]]:
        """Each tenant's totals (only `tenants`' when given), by name."""
        with self._lock:
            names = sorted(self._totals if tenants is None else set(tenants) & set(self._totals))
            return [self._row(name, self._totals[name]) for name in names]

    @staticmethod
    def _row(name: str, totals: _TenantTotals) -> dict[str, Any]:
        return {
            "tenant": name,
            **totals.total.to_dict(),
            "errors": totals.errors,
            "limits_hit": sum(totals.limited.values()),
            "limited": dict(sorted(totals.limited.items())),
            "adapters": {k: v.to_dict() for k, v in sorted(totals.adapters.items())},
        }
