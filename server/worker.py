"""The generation worker: one thread owns all MLX work; requests reach it through an asyncio queue.

The event loop never runs MLX code: each job is handed to the worker thread, and its events
come back through a per-job asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hotlora.server.engine import Delta, Engine, Event, Finished, GenerationJob
from hotlora.server.errors import QueueFull

log = logging.getLogger("hotlora")

_DONE = object()


@dataclass
class _Ticket:
    job: GenerationJob
    events: asyncio.Queue[object] = field(default_factory=asyncio.Queue)


class GenerationWorker:
    """Serves queued jobs one at a time on a dedicated thread."""

    def __init__(self, engine: Engine, *, max_queue: int = 64):
        self.engine = engine
        self._queue: asyncio.Queue[_Ticket] = asyncio.Queue(maxsize=max_queue)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotlora-gen")
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="generation")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def stream(self, job: GenerationJob) -> AsyncIterator[Event]:
        """Queue a job and yield its events; leaving early cancels it within one decode step."""
        ticket = _Ticket(job)
        try:
            self._queue.put_nowait(ticket)
        except asyncio.QueueFull:
            raise QueueFull(
                f"The server is busy: {self._queue.maxsize} requests are already waiting."
            ) from None
        finished = False
        try:
            while True:
                item = await ticket.events.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, Delta | Finished)
                finished = finished or isinstance(item, Finished)
                yield item
        finally:
            if not finished:
                job.cancelled.set()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ticket = await self._queue.get()
            if ticket.job.cancelled.is_set():
                continue
            await loop.run_in_executor(self._executor, self._run, ticket, loop)

    def _run(self, ticket: _Ticket, loop: asyncio.AbstractEventLoop) -> None:
        def put(item: object) -> None:
            loop.call_soon_threadsafe(ticket.events.put_nowait, item)

        try:
            for event in self.engine.generate(ticket.job):
                put(event)
        except Exception as exc:  # surfaced to the request, the worker keeps serving
            log.exception("generation failed")
            put(exc)
        finally:
            put(_DONE)
