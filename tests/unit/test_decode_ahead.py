"""Decode steps launched ahead (`server/engine/decode_step.py`) on a tiny model: the scheduler
builds the next step from a step's tokens before it reads them. Rows that finish, stop, sample,
hold tokens off, get cancelled or fail meanwhile answer as they do with nothing launched ahead,
and a finished row's cache still serves the next turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    Engine,
    Finished,
    GenerationJob,
    Scheduler,
    decode_step,
)
from hotlora.server.engine import scheduler as scheduler_module
from hotlora.server.engine.next_tokens import processed
from hotlora.server.engine.sampling import RowSampler

from tests.support.scheduling import PROMPTS, Recorder, job, run


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model_dir(tiny_model_dir), base_id="tiny", prompt_cache_size=0)


def answers(sink: Recorder) -> tuple[str, Finished | None, list[tuple[int, float]]]:
    return sink.text(), sink.finished(), [(s.token, s.logprob) for s in sink.logprobs()]


class Launches:
    """Counts the steps launched ahead of their tokens being read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.ahead = 0

        def counted(*args, **kwargs):
            self.ahead += kwargs.get("ahead", 0)
            return decode_step.launch(*args, **kwargs)

        monkeypatch.setattr(scheduler_module, "launch", counted)


def mixed() -> list[list[GenerationJob]]:
    """Rows that end at different steps and in different ways, side by side."""
    return [
        [job(PROMPTS[0], max_tokens=1)],
        [job(PROMPTS[1], max_tokens=2)],
        [job(PROMPTS[2], max_tokens=12)],
        [job(PROMPTS[3], max_tokens=9, temperature=1.0, seed=7)],  # a key split every step
        [job(PROMPTS[4], max_tokens=10, min_tokens=6, logprobs=True, top_logprobs=2)],
        [job(PROMPTS[0], max_tokens=12, stop_token_ids=[3, 7, 11])],
        [job(PROMPTS[1], max_tokens=12, ignore_eos=True)],
    ]


def test_a_mixed_batch_answers_as_with_nothing_launched_ahead(engine, monkeypatch):
    launches = Launches(monkeypatch)
    ahead = run(Scheduler(engine, max_batch=8), mixed())
    launched = launches.ahead
    assert launched > 5
    plain = run(Scheduler(engine, max_batch=8, look_ahead=False), mixed())
    assert launches.ahead == launched
    for mine, theirs in zip(ahead, plain, strict=True):
        assert answers(mine) == answers(theirs)
        assert not mine.errors
    # The seeded sampling row and the held-off row are the batch's, alone as well.
    alone = run(Scheduler(engine, max_batch=1), [mixed()[3], mixed()[4]])
    assert [answers(s) for s in alone] == [answers(ahead[3]), answers(ahead[4])]


def test_rows_cancelled_while_their_next_step_runs_leave_and_the_others_carry_on(engine):
    requests = [[job(PROMPTS[i], max_tokens=10)] for i in range(3)]
    scheduler = Scheduler(engine, max_batch=4)
    sinks = [Recorder() for _ in requests]
    for jobs, sink in zip(requests, sinks, strict=True):
        scheduler.add(jobs, sink)
    scheduler.step()
    scheduler.step()
    assert scheduler._ahead is not None and len(scheduler._ahead.rows) == 3
    requests[1][0].cancelled.set()
    scheduler.step()
    cancelled = sinks[1].finished()
    assert cancelled is not None and cancelled.completion_tokens == 2
    while not scheduler.idle:
        scheduler.step()
    plain = run(Scheduler(engine, max_batch=1, look_ahead=False), [requests[0], requests[2]])
    assert [answers(s) for s in (sinks[0], sinks[2])] == [answers(s) for s in plain]


def generated_ids(engine: Engine, request: GenerationJob) -> list[int]:
    """The token ids the request generates, alone."""
    scheduler = Scheduler(engine, max_batch=1)
    scheduler.add([request], Recorder())
    scheduler.step()
    [row] = scheduler.running
    while not scheduler.idle:
        scheduler.step()
    return row.tokens[len(request.prompt) :]


def test_a_row_ended_by_a_stop_token_leaves_its_cache_for_the_next_turn(
    engine, tiny_model_dir: Path
):
    prompt = [60, 61, 62]  # the tiny model answers 62 four times, then 119
    tokens = generated_ids(engine, job(prompt, max_tokens=10, ignore_eos=True))
    # The first new token ends the answer quietly: the step launched ahead took it all the same.
    at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    cached = Engine(load_model_dir(tiny_model_dir), base_id="tiny", prompt_cache_size=4)
    ended = [job(prompt, max_tokens=12, stop_token_ids=[tokens[at]], ignore_eos=True)]
    first = run(Scheduler(cached, max_batch=1), [ended])[0]
    assert at > 1 and first.finished() == Finished("stop", len(prompt), at, 0)
    # The next turn opens with the whole first one: its cache held every token of it.
    turn = prompt + tokens[:at] + [50, 51]
    again = run(Scheduler(cached, max_batch=1), [[job(turn, max_tokens=3)]])[0]
    assert again.finished().cached_tokens == len(prompt) + at
    [fresh] = run(Scheduler(engine, max_batch=1), [[job(turn, max_tokens=3)]])
    assert again.text() == fresh.text()


def failing_at(model: Callable, call: int) -> Callable:
    """The model, raising on its `call`-th call (1-based)."""
    calls = 0

    def model_call(tokens, cache=None):
        nonlocal calls
        calls += 1
        if calls == call:
            raise RuntimeError("boom")
        return model(tokens, cache=cache)

    return model_call


def test_a_failed_step_launched_ahead_fails_its_rows_after_the_tokens_before_it(
    engine, monkeypatch
):
    scheduler = Scheduler(engine, max_batch=4)
    # Calls: the prompt's prefill, the first decode step, then the step launched ahead of it.
    monkeypatch.setattr(scheduler, "model", failing_at(scheduler.model, 3))
    [sink] = run(scheduler, [[job(PROMPTS[1], max_tokens=6, ignore_eos=True)]])
    assert [str(e) for e in sink.errors] == ["boom"]
    assert sink.finished() is None
    monkeypatch.undo()
    after = run(scheduler, [[job(PROMPTS[0], max_tokens=3)]])[0]
    assert after.finished() == Finished("length", 3, 3, 0)


def test_rows_whose_processors_or_grammar_need_each_token_launch_nothing_ahead(engine, monkeypatch):
    launches = Launches(monkeypatch)
    requests: Sequence[list[GenerationJob]] = [
        [job(PROMPTS[0], max_tokens=6, repetition_penalty=1.3)],
        [job(PROMPTS[1], max_tokens=6)],
    ]
    run(Scheduler(engine, max_batch=4), requests)
    assert launches.ahead == 0


def biased_batch() -> list[list[GenerationJob]]:
    """Rows with and without `logit_bias`, one also with a penalty after its bias."""
    return [
        [job(PROMPTS[0], max_tokens=8, logit_bias=((62, 5.0), (119, -100.0)))],
        [job(PROMPTS[1], max_tokens=8)],
        [job(PROMPTS[2], max_tokens=8, logit_bias=((3, 2.5),), logprobs=True, top_logprobs=2)],
        [job(PROMPTS[3], max_tokens=8, logit_bias=((50, 4.0),), repetition_penalty=1.3)],
    ]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_rows_with_a_logit_bias_launch_ahead_and_answer_as_mlx_lm_biases_them(
    engine, monkeypatch, dtype
):
    launches = Launches(monkeypatch)
    ahead = run(Scheduler(engine, max_batch=8), biased_batch()[:3])
    assert launches.ahead > 3
    plain = run(Scheduler(engine, max_batch=8, look_ahead=False), biased_batch()[:3])
    assert [answers(s) for s in ahead] == [answers(s) for s in plain]
    # The bias changes the answer: the favoured token is taken, the banned one never.
    unbiased = run(Scheduler(engine, max_batch=1), [[job(PROMPTS[0], max_tokens=8)]])[0]
    assert ahead[0].text() != unbiased.text()
    # mlx-lm's processors, the bias first, on the same logits give the same bits as the batch's
    # one scatter, beside a row with a penalty after its bias.
    requests = [jobs[0] for jobs in biased_batch()]
    rows = [SimpleNamespace(sampler=RowSampler(r.params), tokens=r.prompt, job=r) for r in requests]
    logits = mx.random.normal((len(rows), 128), key=mx.random.key(3)).astype(dtype)
    got, failed = processed(rows, logits)
    assert not failed
    for i, (row, request) in enumerate(zip(rows, requests, strict=True)):
        params = request.params
        want = logits[i : i + 1]
        for processor in make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty,
        ):
            want = processor(mx.array(row.tokens), want)
        assert got.dtype == want.dtype == dtype
        assert mx.array_equal(got[i : i + 1], want).item()


def test_a_token_biased_twice_keeps_the_last_value_as_a_dict_of_them_does():
    """ "5" and "05" name one token: its last value holds, added once, as mlx-lm's dict does."""
    params = job(PROMPTS[0], logit_bias=((5, 100.0), (9, 1.0), (5, -100.0))).params
    row = SimpleNamespace(sampler=RowSampler(params), tokens=[1])
    got, _ = processed([row], mx.zeros((1, 16)))
    want = make_logits_processors(logit_bias=dict(params.logit_bias))[0](None, mx.zeros((1, 16)))
    assert mx.array_equal(got, want).item()
    assert got[0, 5].item() == -100.0 and got[0, 9].item() == 1.0
