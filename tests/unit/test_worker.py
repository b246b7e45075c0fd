"""The generation worker's admission: a bounded wait list, counted without abandoned tickets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    ClientNotReading,
    Delta,
    Engine,
    Finished,
    GenerationJob,
    GenerationWorker,
    QueueFull,
    SamplingParams,
    Ticket,
    WorkerStopped,
)
from hotlora.server.engine.sequences import Row


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model_dir(tiny_model_dir), base_id="tiny")


def job(max_tokens: int) -> GenerationJob:
    return GenerationJob([5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_admission_is_bounded_and_abandoned_tickets_free_their_place(engine: Engine):
    async def scenario() -> list[str]:
        worker = GenerationWorker(engine, max_queue=1, max_batch=1)  # one request at a time
        worker.start()
        seen = []
        try:
            running = worker.submit([job(200)])
            first = worker.events(running)
            await anext(first)  # the worker has taken it: nothing is waiting now
            waiting = worker.submit([job(2)])
            assert worker.waiting == 1
            assert worker.load_snapshot().waiting == 1  # what the metrics read
            with pytest.raises(QueueFull):
                worker.submit([job(2)])
            # A client that gives up before its turn leaves the wait list at once.
            worker.abandon(waiting)
            assert worker.waiting == 0
            assert worker.load_snapshot().waiting == 0
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


def test_a_tickets_jobs_run_together_and_each_ends_once(engine: Engine):
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


def test_a_failing_step_fails_what_ran_and_the_worker_serves_on(engine: Engine, monkeypatch):
    def broken(self, token, sampled):
        raise RuntimeError("bookkeeping failed")

    async def scenario() -> tuple[BaseException | None, list[object]]:
        worker = GenerationWorker(engine)
        worker.start()
        try:
            with monkeypatch.context() as patch:
                patch.setattr(Row, "advance", broken)
                error = None
                try:
                    [item async for item in worker.events(worker.submit([job(4), job(4)]))]
                except RuntimeError as exc:
                    error = exc
            after = [item async for item in worker.events(worker.submit([job(3)]))]
        finally:
            await worker.stop()
        return error, after

    error, after = asyncio.run(scenario())
    assert isinstance(error, RuntimeError) and "bookkeeping" in str(error)
    assert isinstance(after[-1][1], Finished) and after[-1][1].completion_tokens == 3


def test_stopping_fails_requests_in_flight_and_refuses_new_ones(engine: Engine):
    async def scenario() -> BaseException | None:
        worker = GenerationWorker(engine)
        worker.start()
        events = worker.events(worker.submit([job(400)]))
        await anext(events)  # running
        stopping = asyncio.create_task(worker.stop())
        error = None
        try:
            async for _ in events:
                pass
        except WorkerStopped as exc:
            error = exc
        await stopping
        with pytest.raises(WorkerStopped):
            worker.submit([job(2)])
        return error

    assert isinstance(asyncio.run(scenario()), WorkerStopped)


def test_a_reader_that_takes_nothing_has_its_rows_paused_short_of_the_bound(engine: Engine):
    async def scenario() -> tuple[Ticket, int, int, bool]:
        worker = GenerationWorker(engine, max_unsent=8)
        worker.start()
        try:
            ticket = worker.submit([job(500), job(500)])
            # Nobody reads: the rows pause at 4 untaken events, long before 1000 are made.
            while not ticket.paused:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            paused = len(worker.scheduler.paused)
            unsent = ticket.events.qsize()  # before stopping adds its own end events
            return ticket, paused, unsent, any(j.cancelled.is_set() for j in ticket.jobs)
        finally:
            await worker.stop()

    ticket, paused, unsent, cancelled = asyncio.run(scenario())
    assert paused == 2 and not cancelled
    # One step's beyond, and the step launched before those tokens were read.
    assert not ticket.overflowed and unsent <= 4 + 2 + 2
    assert ticket.not_read


def test_events_beyond_the_bound_in_one_step_end_the_request(engine: Engine):
    """Rows pause once a step's events reach the pause mark; should that one step's events
    (a request of many choices) reach the bound itself, the request ends."""

    async def scenario() -> tuple[list[object], bool]:
        worker = GenerationWorker(engine, max_unsent=4)  # pauses at 2; 8 choices make 8
        worker.start()
        try:
            ticket = worker.submit([job(500) for _ in range(8)])
            while not ticket.overflowed:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # what the cancelled jobs still send is dropped
            queued = []
            while not ticket.events.empty():
                queued.append(ticket.events.get_nowait())
            deadline = asyncio.get_running_loop().time() + 30
            while not worker.scheduler.idle:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
            return queued, all(j.cancelled.is_set() for j in ticket.jobs)
        finally:
            await worker.stop()

    queued, cancelled = asyncio.run(scenario())
    assert len(queued) == 1 and isinstance(queued[0], ClientNotReading)
    assert queued[0].code == "client_not_reading"
    assert cancelled


def test_each_step_first_runs_the_before_step_hook(engine: Engine):
    """The hook the adapter manager's `yield_to_loads` is given to: called before every step,
    never while the worker has nothing to do; a hook that raises holds no step back."""
    order: list[str] = []

    def before_step() -> None:
        order.append("hook")
        if len(order) == 1:
            raise RuntimeError("a broken hook")

    async def scenario() -> list[tuple[int, object]]:
        worker = GenerationWorker(engine, before_step=before_step)
        step = worker.scheduler.step

        def counted_step() -> None:
            order.append("step")
            step()

        worker.scheduler.step = counted_step  # type: ignore[method-assign]
        worker.start()
        try:
            await asyncio.sleep(0.2)  # idle: no step, no call
            assert order == []
            return [item async for item in worker.events(worker.submit([job(3)]))]
        finally:
            await worker.stop()

    events = asyncio.run(scenario())
    finished = [e for _, e in events if isinstance(e, Finished)]
    assert finished and finished[0].completion_tokens == 3
    steps = order.count("step")
    assert steps >= 3  # a prefill step, then a decode step a token
    assert order == ["hook", "step"] * steps
