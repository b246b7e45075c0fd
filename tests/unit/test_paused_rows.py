"""Rows whose client reads nothing are paused: out of the batch with their own KV cache, holding
their slot, computing nothing, and back where they stopped once the client reads."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    Delta,
    Engine,
    Finished,
    GenerationJob,
    GenerationWorker,
    SamplingParams,
    Scheduler,
)

from tests.support.scheduling import Recorder, run

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
ENDLESS = ((0, -100.0), (1, -100.0), (2, -100.0))  # no end of text: rows run to max_tokens


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model_dir(tiny_model_dir), base_id="tiny", prompt_cache_size=0)


def job(prompt: list[int], max_tokens: int) -> GenerationJob:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=ENDLESS)
    return GenerationJob(prompt, params)


def tokens(sink: Recorder) -> int:
    return sum(1 for _, e in sink.events if isinstance(e, Delta))


def solo(engine: Engine, prompt: list[int], max_tokens: int) -> str:
    return run(Scheduler(engine, max_batch=1), [[job(prompt, max_tokens)]])[0].text()


def test_a_paused_row_leaves_the_batch_and_resumes_where_it_stopped(engine: Engine):
    scheduler = Scheduler(engine, max_batch=4)
    jobs = [job(p, 24) for p in PROMPTS]
    sinks = [Recorder() for _ in jobs]
    for j, sink in zip(jobs, sinks, strict=True):
        scheduler.add([j], sink)
    for _ in range(4):
        scheduler.step()
    jobs[1].paused.set()
    scheduler.step()
    assert [row.job for row, _ in scheduler.paused] == [jobs[1]]
    assert len(scheduler.running) == 2
    assert scheduler.load.paused == 1
    made = tokens(sinks[1])
    for _ in range(6):
        assert scheduler.step()
    assert tokens(sinks[1]) == made  # nothing computed for it while paused
    assert tokens(sinks[0]) > made  # the others went on
    jobs[1].paused.clear()
    while not scheduler.idle:
        scheduler.step()
    for prompt, sink in zip(PROMPTS, sinks, strict=True):
        assert sink.finished() == Finished("length", len(prompt), 24, 0)
        assert sink.text() == solo(engine, prompt, 24)


def test_a_paused_row_holds_its_slot_and_nothing_runs_while_all_are_paused(engine: Engine):
    scheduler = Scheduler(engine, max_batch=1)
    first, second = job(PROMPTS[0], 12), job(PROMPTS[1], 4)
    sinks = [Recorder(), Recorder()]
    scheduler.add([first], sinks[0])
    scheduler.add([second], sinks[1])
    scheduler.step()
    first.paused.set()
    assert not scheduler.step()  # paused; the other may not take its slot
    assert not scheduler.step()
    assert sinks[1].starts == 0 and not scheduler.idle
    first.paused.clear()
    while not scheduler.idle:
        scheduler.step()
    assert [s.finished().finish_reason for s in sinks] == ["length", "length"]


def test_a_paused_row_that_is_cancelled_ends(engine: Engine):
    scheduler = Scheduler(engine, max_batch=2)
    j, sink = job(PROMPTS[0], 40), Recorder()
    scheduler.add([j], sink)
    scheduler.step()
    j.paused.set()
    scheduler.step()
    j.cancelled.set()
    scheduler.step()
    finished = sink.finished()
    assert finished is not None and finished.finish_reason == "cancelled"
    assert scheduler.idle and scheduler.load.paused == 0


def test_a_request_whose_reader_takes_nothing_pauses_then_finishes_once_read(engine: Engine):
    async def scenario() -> None:
        worker = GenerationWorker(engine, max_unsent=16)  # pauses at 8 untaken events
        steps = 0
        step = worker.scheduler.step

        def counted() -> bool:
            nonlocal steps
            steps += 1
            return step()

        worker.scheduler.step = counted  # type: ignore[method-assign]
        worker.start()
        try:
            ticket = worker.submit([job(PROMPTS[0], 60)])
            deadline = time.monotonic() + 30
            while not ticket.paused:
                assert time.monotonic() < deadline, "never paused"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            before = steps
            await asyncio.sleep(0.5)  # many steps' time: nothing more is made or run
            assert steps == before, "the worker steps a batch whose rows are all paused"
            held = ticket.events.qsize()
            # At most one step's event beyond the bound, and the step launched before it was read.
            assert 8 <= held <= 10
            assert worker.load_snapshot().paused == 1
            events = [event async for _, event in worker.events(ticket)]
            assert not ticket.overflowed and ticket.pauses >= 1
            assert not ticket.not_read  # read to the end: slow, not gone
            finished = events[-1]
            assert isinstance(finished, Finished) and finished.completion_tokens == 60
            assert "".join(e.text for e in events if isinstance(e, Delta)) == solo(
                engine, PROMPTS[0], 60
            )
        finally:
            await worker.stop()

    asyncio.run(scenario())


def test_a_paused_request_abandoned_by_its_reader_leaves_at_once(engine: Engine):
    async def scenario() -> None:
        worker = GenerationWorker(engine, max_unsent=16)
        worker.start()
        try:
            ticket = worker.submit([job(PROMPTS[0], 200)])
            while not ticket.paused:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the worker waits: no step runs for a paused batch
            assert ticket.not_read
            worker.abandon(ticket)
            deadline = time.monotonic() + 10
            while not worker.scheduler.idle:
                assert time.monotonic() < deadline, "the paused row stayed"
                await asyncio.sleep(0.01)
        finally:
            await worker.stop()

    asyncio.run(scenario())
