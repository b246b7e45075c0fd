"""Per-tenant limits on a clock the test moves: the sliding minute, Retry-After, streams."""

from __future__ import annotations

import pytest

from hotlora.server.http.tenant_limits import (
    RateLimited,
    StreamsLimited,
    TenantLimits,
    TokensRateLimited,
)
from hotlora.server.http.tenants import DEFAULT_TENANT, Tenant


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_requests_per_minute_slide_with_the_minute(clock: Clock):
    limits = TenantLimits(clock=clock)
    tenant = Tenant("a", role="user", requests_per_minute=3)
    for step in (0.0, 10.0, 20.0):
        clock.now += step
        limits.admit(tenant).end(0)
    clock.now += 5.0  # 35 s after the first
    with pytest.raises(RateLimited) as refused:
        limits.admit(tenant)
    assert refused.value.retry_after == 25  # when the first leaves the minute
    assert refused.value.limit == "requests_per_minute"
    clock.now += 25.0
    limits.admit(tenant)  # the first one's minute is over


def test_tokens_per_minute_count_what_ended(clock: Clock):
    limits = TenantLimits(clock=clock)
    tenant = Tenant("a", role="user", tokens_per_minute=100)
    limits.admit(tenant).end(60)
    clock.now += 10
    running = limits.admit(tenant)  # 60 used: under the limit
    running.end(50)
    running.end(50)  # ending twice counts once
    clock.now += 10
    with pytest.raises(TokensRateLimited) as refused:
        limits.admit(tenant)  # 110 used
    # Under 100 once the first 60 leave the minute: 40 s from now.
    assert refused.value.retry_after == 40
    clock.now += 40
    limits.admit(tenant)


def test_max_streams_and_other_tenants(clock: Clock):
    limits = TenantLimits(clock=clock)
    tenant = Tenant("a", role="user", max_streams=2)
    first, _second = limits.admit(tenant), limits.admit(tenant)
    with pytest.raises(StreamsLimited) as refused:
        limits.admit(tenant)
    assert refused.value.retry_after == 1 and limits.in_flight("a") == 2
    limits.admit(Tenant("b", role="user", max_streams=1))  # its own count
    for _ in range(50):
        limits.admit(DEFAULT_TENANT)  # no limits
    first.end(3)
    limits.admit(tenant)


def test_a_refusal_counts_nothing(clock: Clock):
    limits = TenantLimits(clock=clock)
    tenant = Tenant("a", role="user", requests_per_minute=1, max_streams=5)
    limits.admit(tenant).end(0)
    for _ in range(3):
        with pytest.raises(RateLimited):
            limits.admit(tenant)
    assert limits.in_flight("a") == 0
    clock.now += 60
    limits.admit(tenant)
