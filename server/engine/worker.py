"""The generation worker: one thread owns all MLX work; requests reach it through an asyncio queue.

The event loop never runs MLX code. A request is admitted (or refused with `QueueFull`) before any
response starts, as one ticket holding all of its jobs; the worker thread serves a ticket's jobs
back to back, and their events come back through the ticket's own asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

from hotlora.config.errors import HotloraError
from hotlora.server.engine.generate import Engine, Event, GenerationJob

log = logging.getLogger("hotlora")

_DONE = object()


class QueueFull(HotloraError):
    """The wait list is full; the request was not admitted and holds nothing."""

    code = "queue_full"


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    CANCELLED = "cancelled"


class Ticket:
    """One admitted request: its jobs, in serving order, and the events they produce."""

    def __init__(self, jobs: Sequence[GenerationJob]):
        self.jobs = list(jobs)
        self.events: asyncio.Queue[object] = asyncio.Queue()
        self.state = _State.WAITING

    def cancel(self) -> None:
        """Stop every job: a running one within one decode step, the rest before they start."""
        for job in self.jobs:
            job.cancelled.set()


class GenerationWorker:
    """Serves admitted tickets one at a time on a dedicated thread."""

    def __init__(self, engine: Engine, *, max_queue: int = 64):
        self.engine = engine
        self.max_queue = max_queue
        # Unbounded: admission is counted in `_waiting`, which cancelled tickets leave at once.
        self._queue: asyncio.Queue[Ticket] = asyncio.Queue()
        self._waiting = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotlora-gen")
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """Admitted tickets not yet started (cancelled ones excluded)."""
        return self._waiting

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="generation")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True, cancel_futures=True)

    def submit(self, jobs: Sequence[GenerationJob]) -> Ticket:
        """Admit a request's jobs now, or raise `QueueFull`; nothing is queued on refusal."""
        if self._waiting >= self.max_queue:
            raise QueueFull(
                f"The server is busy: {self._waiting} requests are already waiting. Retry shortly."
            )
        ticket = Ticket(jobs)
        self._waiting += 1
        self._queue.put_nowait(ticket)
        return ticket

    async def events(self, ticket: Ticket) -> AsyncIterator[tuple[int, Event]]:
        """(job position, event) for each event; leaving early cancels the ticket."""
        try:
            while True:
                item = await ticket.events.get()
                if item is _DONE:
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
        if ticket.state is _State.WAITING:
            ticket.state = _State.CANCELLED
            self._waiting -= 1

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ticket = await self._queue.get()
            if ticket.state is _State.CANCELLED:
                continue
            ticket.state = _State.RUNNING
            self._waiting -= 1
            await loop.run_in_executor(self._executor, self._run, ticket, loop)

    def _run(self, ticket: Ticket, loop: asyncio.AbstractEventLoop) -> None:
        def put(item: object) -> None:
            loop.call_soon_threadsafe(ticket.events.put_nowait, item)

        try:
            for position, job in enumerate(ticket.jobs):
                if job.cancelled.is_set():
                    break
                for event in self.engine.generate(job):
                    put((position, event))
        except Exception as exc:  # surfaced to the request, the worker keeps serving
            log.exception("generation failed")
            # A failure inside a compiled sampler can leave MLX's global RNG state unusable for
            # every later request; start it afresh.
            mx.random.seed(int.from_bytes(os.urandom(8), "little"))
            put(exc)
        finally:
            put(_DONE)
