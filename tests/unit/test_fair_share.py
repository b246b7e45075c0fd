"""The fair share of the batch between tenants, on a tiny model: one tenant's flood does not hold
another's first token, weights give proportional shares, one tenant alone is served in order,
and each tenant's wait list is bounded apart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    Engine,
    Finished,
    GenerationJob,
    GenerationWorker,
    QueueFull,
    SamplingParams,
    Scheduler,
    Share,
)
from hotlora.server.engine.fair_share import FairQueue

from tests.support.scheduling import Recorder

A, B = Share("a"), Share("b")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model_dir(tiny_model_dir), base_id="tiny", prompt_cache_size=0)


def job(max_tokens: int, prompt: tuple[int, ...] = (5, 6, 7)) -> GenerationJob:
    return GenerationJob(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


class Starts(Recorder):
    """A sink that files its name in a shared list when its request is admitted (once, however
    many choices it has)."""

    def __init__(self, name: str, log: list[str]):
        super().__init__()
        self.name, self.log = name, log

    def started(self) -> None:
        super().started()
        if self.starts == 1:
            self.log.append(self.name)


def drain(scheduler: Scheduler, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if scheduler.idle:
            return
        scheduler.step()
    raise AssertionError("the scheduler did not finish")


def test_a_second_tenant_takes_the_next_free_slot_ahead_of_a_flood(engine: Engine):
    order: list[str] = []
    scheduler = Scheduler(engine, max_batch=4)
    flood = [Starts(f"a{i}", order) for i in range(20)]
    for i, sink in enumerate(flood):
        # Staggered lengths: one slot frees at a time.
        scheduler.add([job(6 + 3 * i)], sink, A)
    scheduler.step()
    assert order == ["a0", "a1", "a2", "a3"]
    alone = Starts("b0", order)
    scheduler.add([job(4)], alone, B)
    while alone.starts == 0:
        scheduler.step()
    # The first slot that freed went to b, though 16 of a's requests arrived before it.
    assert order == ["a0", "a1", "a2", "a3", "b0"]
    assert sum(s.finished() is not None for s in flood) == 1
    drain(scheduler)
    assert all(s.finished() is not None for s in [*flood, alone])
    # Admission order changed nothing in what each request generated.
    assert alone.finished() == Finished("length", 3, 4, 0)


def test_a_tenant_sending_one_request_at_a_time_never_waits_behind_the_flood(engine: Engine):
    order: list[str] = []
    scheduler = Scheduler(engine, max_batch=2)
    for i in range(30):
        scheduler.add([job(5)], Starts(f"a{i}", order), A)
    scheduler.step()
    waits = []
    for turn in range(4):
        mine = Starts(f"b{turn}", order)
        scheduler.add([job(3)], mine, B)
        admitted_before = len(order)
        steps = 0
        while mine.starts == 0:
            before_step = len(order)
            scheduler.step()
            steps += 1
        # Admitted in the first step that admitted anyone after it arrived, with 20-odd of a's
        # waiting (beside one of a's when both slots freed in the same step).
        assert before_step == admitted_before
        assert f"b{turn}" in order[admitted_before : admitted_before + 2]
        waits.append(steps)
        while mine.finished() is None:
            scheduler.step()
    assert max(waits) <= 5  # a's rows run 5 tokens: one of them frees a slot within that
    assert len(scheduler.waiting) > 10
    drain(scheduler)


def test_weights_give_proportional_shares_of_the_slots(engine: Engine):
    order: list[str] = []
    scheduler = Scheduler(engine, max_batch=1)
    for i in range(16):
        scheduler.add([job(1)], Starts(f"a{i}", order), Share("a", 3.0))
        scheduler.add([job(1)], Starts(f"b{i}", order), Share("b", 1.0))
    drain(scheduler)
    first = [name[0] for name in order[:16]]
    assert first.count("a") == 12 and first.count("b") == 4
    # Spread out, not in bursts: every window of four holds one of b's.
    assert all("b" in first[i : i + 4] for i in range(0, 16, 4))


def test_tenants_that_both_flood_hold_the_batch_in_proportion_to_their_weights(engine: Engine):
    order: list[str] = []
    scheduler = Scheduler(engine, max_batch=8)
    for i in range(20):
        scheduler.add([job(4 + i % 5)], Starts(f"a{i}", order), Share("a", 3.0))
        scheduler.add([job(4 + i % 5)], Starts(f"b{i}", order), Share("b", 1.0))
    held = []
    while len(order) < 30:
        scheduler.step()
        rows = [row.tenant for row in scheduler.running]
        if len(rows) == 8:
            held.append((rows.count("a"), rows.count("b")))
    assert held and all(a == 6 and b == 2 for a, b in held), held
    drain(scheduler)


def test_one_tenant_alone_is_served_first_come_first_served(engine: Engine):
    order: list[str] = []
    scheduler = Scheduler(engine, max_batch=2)
    names = [f"r{i}" for i in range(8)]
    for i, name in enumerate(names):
        scheduler.add([job(2 + i % 3)], Starts(name, order))  # the default share
    drain(scheduler)
    assert order == names


def test_a_request_s_choices_count_as_that_many_slots(engine: Engine):
    """`n` choices hold n slots: beside a request of a's with n=4, b gets four slots too."""
    order: list[str] = []
    scheduler = Scheduler(engine, max_batch=8)
    prompt = [5, 6, 7]
    for i in range(4):
        # Greedy, as b's: a choice sampled at random may end at its first token, which would
        # leave a slot free whatever the fairness (the sampling depends on MLX's global seed).
        choices = [
            GenerationJob(prompt, SamplingParams(max_tokens=3, temperature=0.0)) for _ in range(4)
        ]
        scheduler.add(choices, Starts(f"a{i}", order), A)
        scheduler.add([job(3)], Starts(f"b{i}", order), B)
    scheduler.step()
    assert order == ["a0", "b0", "b1", "b2", "b3"]
    assert sorted(row.tenant for row in scheduler.running) == ["a"] * 4 + ["b"] * 4
    drain(scheduler)


def test_a_tenant_back_from_idle_gets_no_credit_for_the_time_it_was_away():
    queue = FairQueue()
    rows = iter(range(1000))

    def add(share: Share, count: int) -> None:
        queue.extend([next(rows) for _ in range(count)], share)  # type: ignore[misc]

    add(A, 40)
    for _ in range(20):  # a alone for a while
        picked = queue.pick()
        assert picked is not None and picked.share == A
        queue.admit(picked, 1)
    add(B, 10)
    turns = []
    for _ in range(10):
        picked = queue.pick()
        assert picked is not None
        queue.admit(picked, 1)
        turns.append(picked.share.tenant)
    # b does not take ten turns in a row for the twenty a had alone: they alternate.
    assert turns == ["b", "a"] * 5
    assert queue.waiting_tenants() == {"a": 15, "b": 5}
    assert len(queue) == 20


def test_a_zero_weight_is_refused():
    with pytest.raises(ValueError, match="above 0"):
        Share("a", 0.0)


def test_each_tenant_s_wait_list_is_bounded_apart(engine: Engine):
    async def scenario() -> None:
        worker = GenerationWorker(engine, max_queue=2, max_batch=1)
        worker.start()
        try:
            running = worker.submit([job(200)], A)
            first = worker.events(running)
            await anext(first)  # running: nothing waits
            waiting = [worker.submit([job(2)], A) for _ in range(2)]
            with pytest.raises(QueueFull, match="2 requests are already waiting"):
                worker.submit([job(2)], A)
            # a's full wait list leaves b's own.
            mine = worker.submit([job(2)], B)
            assert worker.waiting == 3
            await first.aclose()
            events = [event async for _, event in worker.events(mine)]
            assert isinstance(events[-1], Finished)
            for ticket in waiting:
                worker.abandon(ticket)
            assert worker.waiting == 0
        finally:
            await worker.stop()

    asyncio.run(scenario())
