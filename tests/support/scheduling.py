"""Driving the batching scheduler step by step in unit tests: prompts of the tiny model, greedy
jobs, a recording sink and a runner."""

from __future__ import annotations

from collections.abc import Sequence

from hotlora.adapters import AdapterSet
from hotlora.server.engine import (
    Delta,
    Event,
    Finished,
    GenerationJob,
    SampledToken,
    SamplingParams,
    Scheduler,
)

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33], [40, 41, 42, 43, 44, 45]]


def job(
    prompt: list[int], max_tokens: int = 8, adapter: AdapterSet | None = None, **params
) -> GenerationJob:
    """A greedy job (unless `params` say otherwise) for `prompt`, under `adapter` if given."""
    sampling = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **params})
    if adapter is None:
        return GenerationJob(prompt, sampling)
    return GenerationJob(prompt, sampling, adapter)


class Recorder:
    """A request's sink: what the scheduler reported, per choice."""

    def __init__(self) -> None:
        self.events: list[tuple[int, Event]] = []
        self.errors: list[BaseException] = []
        self.starts = 0

    def started(self) -> None:
        self.starts += 1

    def event(self, position: int, event: Event) -> None:
        self.events.append((position, event))

    def failed(self, position: int, error: BaseException) -> None:
        self.errors.append(error)

    def text(self, position: int = 0) -> str:
        return "".join(e.text for p, e in self.events if p == position and isinstance(e, Delta))

    def finished(self, position: int = 0) -> Finished | None:
        """The choice's `Finished`; None while it runs. A choice finishes once."""
        done = [e for p, e in self.events if p == position and isinstance(e, Finished)]
        assert len(done) <= 1, f"choice {position} finished {len(done)} times"
        return done[0] if done else None

    def logprobs(self, position: int = 0) -> list[SampledToken]:
        deltas = [e for p, e in self.events if p == position and isinstance(e, Delta)]
        return [sampled for delta in deltas for sampled in delta.logprobs]


def run(
    scheduler: Scheduler, requests: Sequence[Sequence[GenerationJob]], max_steps: int = 500
) -> list[Recorder]:
    """Add every request at once, then step until all are done (at most `max_steps`)."""
    sinks = [Recorder() for _ in requests]
    for jobs, sink in zip(requests, sinks, strict=True):
        scheduler.add(jobs, sink)
    for _ in range(max_steps):
        if scheduler.idle:
            return sinks
        scheduler.step()
    raise AssertionError("the scheduler did not finish")
