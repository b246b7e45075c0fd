"""Per-tenant limits: requests a minute, tokens a minute, requests in flight (`max_streams`).

Counted per tenant name over a sliding minute, in this process (with Ray: per replica). A
request is admitted when none of its key's limits is reached: the tokens of a minute are those
of the requests that ended in it (prompt and completion), so a request is never cut short for
its own tokens; the next one waits until the minute's tokens fall under the limit. A refusal
is `RateLimited`: 429, with `Retry-After` in whole seconds.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hotlora.config.errors import HotloraError
from hotlora.server.http.tenants import Tenant

WINDOW_S = 60.0


class RateLimited(HotloraError):
    """A tenant's limit is reached: retry after `retry_after` seconds (at least 1)."""

    code = "rate_limit_exceeded"
    limit = "requests_per_minute"  # which limit, as the metrics name it

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class TokensRateLimited(RateLimited):
    limit = "tokens_per_minute"


class StreamsLimited(RateLimited):
    limit = "max_streams"


@dataclass
class _Counts:
    """One tenant's recent requests and tokens, and its requests in flight."""

    requests: deque[float] = field(default_factory=deque)  # arrival times
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (end time, tokens)
    token_sum: int = 0
    streams: int = 0

    def forget(self, before: float) -> None:
        while self.requests and self.requests[0] <= before:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= before:
            self.token_sum -= self.tokens.popleft()[1]


class Admission:
    """A request's place in its tenant's counts: `end(tokens)` once it is answered."""

    def __init__(self, limits: TenantLimits, tenant: Tenant):
        self._limits = limits
        self.tenant = tenant
        self._ended = False

    def end(self, tokens: int) -> None:
        """The request ended having used `tokens` (prompt and completion); idempotent."""
        if not self._ended:
            self._ended = True
            self._limits.ended(self.tenant, tokens)


@dataclass
class TenantLimits:
    """Every tenant's counts, checked as requests arrive and fed as they end."""

    clock: Callable[[], float] = time.monotonic
    _counts: dict[str, _Counts] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def admit(self, tenant: Tenant) -> Admission:
        """Count a request of `tenant` in, or raise `RateLimited` (nothing counted then)."""
        with self._lock:
            now = self.clock()
            counts = self._counts.setdefault(tenant.name, _Counts())
            counts.forget(now - WINDOW_S)
            most = tenant.max_streams
            if most is not None and counts.streams >= most:
                raise StreamsLimited(
                    f"Too many requests in flight for '{tenant.name}': at most {most} at once. "
                    "Retry once one of them ends.",
                    retry_after=1,
                )
            rpm = tenant.requests_per_minute
            if rpm is not None and len(counts.requests) >= rpm:
                wait = counts.requests[len(counts.requests) - rpm] + WINDOW_S - now
                raise RateLimited(
                    f"Rate limit reached for '{tenant.name}' on requests per minute: limit "
                    f"{rpm}. Retry in {math.ceil(wait)}s.",
                    retry_after=wait,
                )
            tpm = tenant.tokens_per_minute
            if tpm is not None and counts.token_sum >= tpm:
                wait = self._tokens_free_in(counts, tpm, now)
                raise TokensRateLimited(
                    f"Rate limit reached for '{tenant.name}' on tokens per minute: limit {tpm}, "
                    f"used {counts.token_sum}. Retry in {math.ceil(wait)}s.",
                    retry_after=wait,
                )
            counts.requests.append(now)
            counts.streams += 1
        return Admission(self, tenant)

    def ended(self, tenant: Tenant, tokens: int) -> None:
        with self._lock:
            counts = self._counts.setdefault(tenant.name, _Counts())
            counts.streams = max(counts.streams - 1, 0)
            if tokens > 0:
                counts.tokens.append((self.clock(), tokens))
                counts.token_sum += tokens

    def in_flight(self, name: str) -> int:
        """The requests of tenant `name` admitted and not yet ended."""
        with self._lock:
            counts = self._counts.get(name)
            return counts.streams if counts is not None else 0

    @staticmethod
    def _tokens_free_in(counts: _Counts, limit: int, now: float) -> float:
        """Seconds until the minute's tokens fall under `limit`."""
        left = counts.token_sum
        for ended, tokens in counts.tokens:
            left -= tokens
            if left < limit:
                return ended + WINDOW_S - now
        return WINDOW_S
