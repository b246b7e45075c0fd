"""The generation worker's admission: a bounded wait list, counted without abandoned tickets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    Delta,
    Engine,
    Finished,
    GenerationJob,
    GenerationWorker,
    QueueFull,
    SamplingParams,
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model_dir(tiny_model_dir), base_id="tiny")


def job(max_tokens: int) -> GenerationJob:
    return GenerationJob([5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_admission_is_bounded_and_abandoned_tickets_free_their_place(engine: Engine):
    async def scenario() -> list[str]:
        worker = GenerationWorker(engine, max_queue=1)
        worker.start()
        seen = []
        try:
            running = worker.submit([job(200)])
            first = worker.events(running)
            await anext(first)  # the worker has taken it: nothing is waiting now
            waiting = worker.submit([job(2)])
            assert worker.waiting == 1
            with pytest.raises(QueueFull):
                worker.submit([job(2)])
            # A client that gives up before its turn leaves the wait list at once.
            worker.abandon(waiting)
            assert worker.waiting == 0
            admitted = worker.submit([job(2), job(3)])
            await first.aclose()  # cancels the long job within one decode step
            async for position, event in worker.events(admitted):
                seen.append(f"{position}:{type(event).__name__}")
        finally:
            await worker.stop()
        return seen

    seen = asyncio.run(scenario())
    assert seen[-1] == "1:Finished" and "0:Finished" in seen
    assert all(s.split(":")[1] in ("Delta", "Finished") for s in seen)


def test_a_ticket_serves_its_jobs_back_to_back(engine: Engine):
    async def scenario() -> list[tuple[int, object]]:
        worker = GenerationWorker(engine, max_queue=4)
        worker.start()
        try:
            ticket = worker.submit([job(2), job(2), job(2)])
            return [item async for item in worker.events(ticket)]
        finally:
            await worker.stop()

    events = asyncio.run(scenario())
    finished = [(position, e) for position, e in events if isinstance(e, Finished)]
    assert [position for position, _ in finished] == [0, 1, 2]
    assert all(e.completion_tokens <= 2 for _, e in finished)
    assert all(isinstance(e, Delta | Finished) for _, e in events)
