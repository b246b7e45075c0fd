"""The generation worker: one thread owns all MLX work and runs the batching scheduler.

The event loop never runs MLX code. A request is admitted (or refused with `QueueFull`: its
tenant already has `max_queue` requests waiting) before any response starts, as one ticket
holding all of its jobs and its tenant's share; the thread moves tickets into the
scheduler, steps it, and each ticket's events come back through its own asyncio queue. A reader
that stops taking events (a client that reads nothing, its socket's buffers full) has its rows
paused once `PAUSE_AT` wait (up to half `max_unsent`; the step under way and the one launched
ahead of it add theirs before the rows leave): they leave the batch holding only their KV cache,
and come back once it has taken half of them. The queue is bounded too (`max_unsent`): events
that pile up beyond it end the request with `ClientNotReading`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hotlora.config.errors import HotloraError
from hotlora.server.engine.fair_share import DEFAULT_SHARE, Share
from hotlora.server.engine.generate import Engine, Event, Finished, GenerationJob
from hotlora.server.engine.scheduler import Scheduler

log = logging.getLogger("hotlora")

_DONE = object()
PAUSE_AT = 64  # events a request's reader leaves untaken before its rows pause
T = TypeVar("T")


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    CANCELLED = "cancelled"


class QueueFull(HotloraError):
    """The wait list is full; the request was not admitted and holds nothing."""

    code = "queue_full"


class ClientNotReading(HotloraError):
    """A request's reader left `max_unsent` of its tokens untaken: its generation was stopped."""

    code = "client_not_reading"


class WorkerStopped(HotloraError):
    """The worker stopped before the request finished (the server is shutting down)."""

    code = "shutting_down"


class Ticket:
    """One admitted request: its jobs and the events they produce, in order per job."""

    def __init__(
        self,
        worker: GenerationWorker,
        jobs: Sequence[GenerationJob],
        max_unsent: int,
        share: Share = DEFAULT_SHARE,
    ):
        self.jobs = list(jobs)
        self.share = share  # whose request it is: its place in the fair share of the batch
        self.events: asyncio.Queue[object] = asyncio.Queue()
        self.state = _State.WAITING
        self.max_unsent = max_unsent  # events the queue may hold before the request is ended
        self.overflowed = False  # ended with `ClientNotReading`
        self.pause_at = max(1, min(PAUSE_AT, max_unsent // 2))
        self.paused = False  # its rows wait out of the batch for its reader
        self.pauses = 0  # how many times they did
        self.read_through = False  # its reader took its last event
        self.started_at: float | None = None  # perf_counter when its first row was admitted
        self._worker = worker
        self._loop = asyncio.get_running_loop()
        self._closed: set[int] = set()  # jobs whose last event was sent
        self._failed = False

    def cancel(self) -> None:
        """Stop every job: a running one within one step, the rest before they start."""
        for job in self.jobs:
            job.cancelled.set()
        self._worker._wake()  # a paused row leaves at the next step

    @property
    def not_read(self) -> bool:
        """Its client stopped taking its answer: it overflowed, or it paused and its reader
        left before the end."""
        return self.overflowed or (self.pauses > 0 and not self.read_through)

    # The scheduler's side (the worker thread).

    def started(self) -> None:
        if self.started_at is None:
            self.started_at = time.perf_counter()
        self._worker._started(self)

    def event(self, position: int, event: Event) -> None:
        if position in self._closed:
            return
        self._put((position, event))
        if isinstance(event, Finished):
            self._close(position)

    def failed(self, position: int, error: BaseException) -> None:
        if position in self._closed:
            return
        if not self._failed:
            self._failed = True
            self.cancel()  # the request failed: its other choices stop too
            self._put(error)
        self._close(position)

    def fail_all(self, error: BaseException) -> None:
        """Fail every job that has not ended (the ticket never reached the scheduler)."""
        for position in range(len(self.jobs)):
            self.failed(position, error)

    def _close(self, position: int) -> None:
        self._closed.add(position)
        if len(self._closed) == len(self.jobs):
            self._put(_DONE)

    def _put(self, item: object) -> None:
        # A closed loop (the server has stopped) has nobody left to read the event.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, item)

    # The event loop's side.

    def _deliver(self, item: object) -> None:
        if self.overflowed:
            return
        if isinstance(item, tuple) and self.events.qsize() >= self.max_unsent:
            # Nobody takes the events: stop the jobs (they leave the batch within one step),
            # drop what they made, and leave the reader the error alone.
            self.overflowed = True
            self.cancel()
            while not self.events.empty():
                self.events.get_nowait()
            self.events.put_nowait(
                ClientNotReading(
                    f"The client took none of the last {self.max_unsent} generated tokens; "
                    "generation was stopped."
                )
            )
            return
        self.events.put_nowait(item)
        if not self.paused and self.events.qsize() >= self.pause_at:
            self._pause()

    def _pause(self) -> None:
        self.paused = True
        self.pauses += 1
        if self.pauses == 1:
            log.info(
                "a client has taken none of its request's last %d events (its socket's buffers "
                "are full): the request's %d rows are paused, holding only their KV cache, "
                "until it reads; --send-timeout cuts it if it never does",
                self.pause_at,
                len(self.jobs),
            )
        for job in self.jobs:
            job.paused.set()

    def taken(self) -> None:
        """The reader took an event: once it has taken half of those waiting, the rows resume."""
        if self.paused and self.events.qsize() <= self.pause_at // 2:
            self.paused = False
            for job in self.jobs:
                job.paused.clear()
            self._worker._wake()


@dataclass(frozen=True)
class LoadSnapshot:
    """What the worker holds at one moment, read whole by other threads (the metrics)."""

    running: int = 0  # requests with a row prefilling or decoding
    waiting: int = 0  # admitted requests none of whose rows has started
    paused: int = 0  # running requests with rows paused for a client that reads nothing
    kv_usage: float = 0.0  # KV cache the batch reserves over its budget (1: all of it)
    running_adapters: frozenset[str] = frozenset()  # adapter ids of the running requests
    waiting_adapters: frozenset[str] = frozenset()  # adapter ids of rows not admitted yet
    prompt_cache_entries: int = 0  # prompt KV caches kept for reuse, prompt heads included
    prompt_cache_bytes: int = 0  # the memory they hold
    prompt_cache_usage: float = 0.0  # that memory over its budget (1: all of it)


class GenerationWorker:
    """Feeds admitted tickets to the scheduler on one dedicated thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int = 64,
        max_unsent: int = 1024,
        max_batch: int = 8,
        prefill_chunk: int = 192,
        prefill_context_unit: int = 1024,
        kv_cache_bytes: int = 2 << 30,
        before_step: Callable[[], None] | None = None,
        look_ahead: bool = True,
    ):
        self.engine = engine
        # Run before each step: the adapter manager's `yield_to_loads`, so that a request's
        # adapter loads without the decoding threads beside it.
        self.before_step = before_step
        self.max_queue = max_queue
        self.max_unsent = max_unsent
        self.scheduler = Scheduler(
            engine,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            prefill_context_unit=prefill_context_unit,
            kv_cache_bytes=kv_cache_bytes,
            look_ahead=look_ahead,
        )
        self._lock = threading.Condition()
        self._inbox: deque[Ticket] = deque()
        # Other model work (embeddings), run between steps: (work, its future).
        self._errands: deque[tuple[Callable[[], Any], asyncio.Future[Any]]] = deque()
        self._waiting = 0
        self._waiting_by_tenant: dict[str, int] = {}
        self._stopping = False
        self._stalled = False  # the last step had nothing to run: wait for news
        self._news = 0  # wake-ups so far (a step that ran none stalls only if none came)
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        """Admitted tickets none of whose jobs has started (cancelled ones excluded)."""
        with self._lock:
            return self._waiting

    def load_snapshot(self) -> LoadSnapshot:
        """The batch as the last step left it, the wait list and the prompt cache now."""
        load, cache, heads = self.scheduler.load, self.engine.prompt_cache, self.engine.prompt_heads
        cache_bytes = cache.nbytes + heads.nbytes
        budget = cache.max_bytes + (heads.max_bytes if heads.max_size else 0)
        return LoadSnapshot(
            running=load.running,
            waiting=self.waiting,
            paused=load.paused,
            kv_usage=load.kv_reserved / self.scheduler.kv_cache_bytes,
            running_adapters=load.running_adapters,
            waiting_adapters=load.waiting_adapters,
            prompt_cache_entries=len(cache) + len(heads),
            prompt_cache_bytes=cache_bytes,
            prompt_cache_usage=cache_bytes / budget if budget else 0.0,
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hotlora-gen", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def submit(self, jobs: Sequence[GenerationJob], share: Share = DEFAULT_SHARE) -> Ticket:
        """Admit a request's jobs now, or raise `QueueFull`; nothing is queued on refusal.

        The wait list is bounded per tenant: one tenant's flood fills its own, not another's.
        """
        with self._lock:
            self._check_room(share.tenant)
            ticket = Ticket(self, jobs, self.max_unsent, share)
            self._count_waiting(ticket, 1)
            self._inbox.append(ticket)
            self._lock.notify()
        return ticket

    def check_room(self, tenant: str) -> None:
        """Raise what `submit` would raise for `tenant` now (`QueueFull`, `WorkerStopped`): for
        a request to be refused before work that changes what is served, such as mounting its
        adapter, rather than after it."""
        with self._lock:
            self._check_room(tenant)

    def _check_room(self, tenant: str) -> None:
        if self._stopping:
            raise WorkerStopped("The server is shutting down; retry on another replica.")
        waiting = self._waiting_by_tenant.get(tenant, 0)
        if waiting >= self.max_queue:
            raise QueueFull(
                f"The server is busy: {waiting} requests are already waiting. Retry shortly."
            )

    async def call(self, work: Callable[[], T]) -> T:
        """Run `work` on the generation thread between two steps (MLX work the event loop must
        not do, and that must not race the batch) and return what it returns."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._stopping:
                raise WorkerStopped("The server is shutting down; retry on another replica.")
            self._errands.append((work, future))
            self._lock.notify()
        return await future

    def _run_errands(self) -> None:
        with self._lock:
            errands, self._errands = list(self._errands), deque()
        for work, future in errands:
            loop = future.get_loop()
            try:
                result = work()
            except Exception as exc:  # noqa: BLE001 - the caller gets its own failure
                _settle(loop, future, None, exc)
            else:
                _settle(loop, future, result, None)

    async def events(self, ticket: Ticket) -> AsyncIterator[tuple[int, Event]]:
        """(job position, event) for each event; leaving early cancels the ticket."""
        try:
            while True:
                item = await ticket.events.get()
                ticket.taken()
                if item is _DONE:
                    ticket.read_through = True
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, tuple)
                yield item
        finally:
            self.abandon(ticket)

    def abandon(self, ticket: Ticket) -> None:
        """Nobody will read `ticket`: drop it from the wait list, or stop it if it runs."""
        ticket.cancel()
        with self._lock:
            if ticket.state is _State.WAITING:
                ticket.state = _State.CANCELLED
                self._count_waiting(ticket, -1)

    def _wake(self) -> None:
        """Something may have changed for rows that wait on their readers: step again."""
        with self._lock:
            self._news += 1
            self._stalled = False
            self._lock.notify()

    def _started(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.state is _State.WAITING:
                ticket.state = _State.RUNNING
                self._count_waiting(ticket, -1)

    def _count_waiting(self, ticket: Ticket, change: int) -> None:
        """Add `change` to the waiting counts, the total and the ticket's tenant's (lock held)."""
        self._waiting += change
        tenant = ticket.share.tenant
        left = self._waiting_by_tenant.get(tenant, 0) + change
        if left:
            self._waiting_by_tenant[tenant] = left
        else:
            self._waiting_by_tenant.pop(tenant, None)

    def _run(self) -> None:
        scheduler = self.scheduler
        try:
            while True:
                with self._lock:
                    while (
                        not self._stopping
                        and not self._inbox
                        and not self._errands
                        and (scheduler.idle or self._stalled)
                    ):
                        self._lock.wait()
                    self._stalled = False
                    if self._stopping:
                        break
                    arrived = list(self._inbox)
                    self._inbox.clear()
                self._run_errands()
                for ticket in arrived:
                    try:
                        scheduler.add(ticket.jobs, ticket, ticket.share)
                    except Exception as exc:  # noqa: BLE001 - this request fails, others go on
                        log.exception("could not admit a request")
                        ticket.fail_all(exc)
                if self.before_step is not None and not scheduler.idle:
                    try:
                        self.before_step()
                    except Exception:  # noqa: BLE001 - a step must not wait on it
                        log.exception("the hook before a step failed")
                try:
                    with self._lock:
                        news = self._news
                    ran = scheduler.step()
                    with self._lock:
                        # Only a step that says it ran nothing waits (not one wrapped in tests).
                        self._stalled = ran is False and self._news == news
                except Exception as exc:  # noqa: BLE001 - what ran fails, the worker serves on
                    log.exception("generation step failed")
                    scheduler.fail_admitted(exc)
        finally:
            stopped = WorkerStopped("The server is shutting down.")
            with self._lock:
                self._stopping = True
                left, self._inbox = list(self._inbox), deque()
                errands, self._errands = list(self._errands), deque()
            for ticket in left:
                ticket.fail_all(stopped)
            for _, future in errands:
                _settle(future.get_loop(), future, None, stopped)
            scheduler.cancel_all(stopped)


def _settle(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    """Resolve `future` on its own loop (from the generation thread), unless it was cancelled."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # A closed loop (the server has stopped) has nobody left to read the result.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)
