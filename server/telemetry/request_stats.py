"""One request's generation as its events pass: usage, timings and finish reasons, told to the
metrics and to the access log when the request ends."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hotlora.adapters import AdapterSet
from hotlora.server.engine import Delta, Finished, Ticket
from hotlora.server.telemetry.access_log import current_record
from hotlora.server.telemetry.prometheus import Metrics


@dataclass
class UsageTally:
    """Token counts over a request's jobs; each prompt counts once, however many choices."""

    n: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, index: int, finished: Finished) -> None:
        self.completion_tokens += finished.completion_tokens
        if index % self.n == 0:
            self.prompt_tokens += finished.prompt_tokens
            self.cached_tokens += finished.cached_tokens


class RequestStats:
    """Watches one request's events (`saw`) until it ends (`done`, exactly once).

    Times count from the request's arrival at the server when it came over HTTP (its access
    record), else from when this was made. A choice that never finished counts as `error` when
    the request failed, else as `cancelled` (its client left).
    """

    def __init__(
        self,
        metrics: Metrics,
        model: str,
        adapters: AdapterSet,
        choices: int,
        n: int,
        ticket: Ticket | None = None,
    ):
        self.metrics = metrics
        self.ticket = ticket  # its admission time splits the wait from the prefill
        self.model = model
        self.adapters = adapters.ids
        self.choices = choices
        self.usage = UsageTally(n)
        self.record = current_record()
        self.began = self.record.began if self.record is not None else time.perf_counter()
        self.failed = False
        self._first: dict[int, float] = {}  # choice index -> its first event
        self._last: dict[int, float] = {}
        self._reasons: dict[int, str] = {}
        self._generated: dict[int, int] = {}  # choice index -> its completion tokens

    def saw(self, index: int, event: Delta | Finished) -> None:
        now = time.perf_counter()
        if index not in self._first:
            self._first[index] = now
            self.metrics.first_token(now - self.began)
        elif isinstance(event, Delta):
            self.metrics.between_tokens(now - self._last[index])
        self._last[index] = now
        if isinstance(event, Finished):
            self.usage.add(index, event)
            self._reasons[index] = event.finish_reason
            self._generated[index] = event.completion_tokens
            if event.completion_tokens > 1:
                decoding = now - self._first[index]
                self.metrics.per_output_token(decoding / (event.completion_tokens - 1))

    def done(self) -> None:
        unfinished = "error" if self.failed else "cancelled"
        reasons = [self._reasons.get(i, unfinished) for i in range(self.choices)]
        for reason in reasons:
            self.metrics.finished(reason)
        usage = self.usage
        ended = time.perf_counter()
        self.metrics.request(
            self.adapters,
            prompt_tokens=usage.prompt_tokens,
            generation_tokens=usage.completion_tokens,
            most_generated=max(self._generated.values(), default=0),
            cached_tokens=usage.cached_tokens,
            seconds=ended - self.began,
        )
        admitted = self.ticket.started_at if self.ticket is not None else None
        if admitted is not None:
            first = min(self._first.values(), default=None)
            self.metrics.phases(
                queue=max(admitted - self.began, 0.0),
                prefill=None if first is None else max(first - admitted, 0.0),
                decode=None if first is None else max(max(self._last.values()) - first, 0.0),
            )
        record = self.record
        if record is None:
            return
        record.model, record.adapters = self.model, self.adapters
        record.prompt_tokens = usage.prompt_tokens
        record.completion_tokens = usage.completion_tokens
        record.cached_tokens = usage.cached_tokens
        if self._first:
            record.ttft = min(self._first.values()) - self.began
        record.finish_reason = ",".join(reasons)
