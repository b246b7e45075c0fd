"""The batching scheduler on a tiny model: rows join and leave, prefill in chunks, keep their
own sampling, adapters, stops and limits, and stay within the KV budget.

The scheduler is driven step by step here, without the worker's thread, so each test can look
at the batch between steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import mlx.core as mx
import pytest

from hotlora.adapters import AdapterManager, AdapterSet, parse_adapter_spec
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    Engine,
    Finished,
    GenerationJob,
    Scheduler,
)
from hotlora.server.engine.kv_caches import KV_STEP
from hotlora.server.engine.next_tokens import finite_rows
from hotlora.server.engine.scheduler import ALONE_CHUNKS

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.scheduling import PROMPTS, Recorder, job, run


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    loaded = load_model_dir(tiny_model_dir)
    root = tmp_path_factory.mktemp("adapters")
    reference = tiny_model()
    for seed, name in enumerate(("a", "b", "c")):
        rank = 4 + 2 * seed  # different ranks: the side-by-side layout pads nothing
        pairs = random_pairs(reference, seed=10 + seed, rank=rank)
        write_mlx_adapter(root / name, pairs, rank=rank)
    manager = AdapterManager(loaded.model, base_id="tiny", adapter_root=root, max_rank=64)
    for name in ("a", "b", "c"):
        manager.mount(name, name)
    engine = Engine(loaded, base_id="tiny", prompt_cache_size=0)
    return engine, manager


def adapters(manager: AdapterManager, spec: str) -> AdapterSet:
    return manager.resolve(parse_adapter_spec(spec))


def solo(engine: Engine, jobs: Sequence[GenerationJob]) -> Recorder:
    return run(Scheduler(engine, max_batch=1), [jobs])[0]


def test_rows_join_a_running_batch_and_leave_it_when_done(setup):
    engine, _ = setup
    scheduler = Scheduler(engine, max_batch=4, look_ahead=False)
    first, second = Recorder(), Recorder()
    scheduler.add([job(PROMPTS[0], max_tokens=3)], first)
    scheduler.step()
    assert len(scheduler.running) == 1
    scheduler.add([job(PROMPTS[1], max_tokens=6)], second)
    scheduler.step()  # the newcomer is prefilled and decodes in this same step
    assert len(scheduler.running) == 2
    scheduler.step()  # the first row's third token: it leaves at once
    assert first.finished() == Finished("length", 3, 3, 0)
    assert len(scheduler.running) == 1
    while not scheduler.idle:
        scheduler.step()
    assert second.finished() == Finished("length", 5, 6, 0)
    assert first.text() == solo(engine, [job(PROMPTS[0], max_tokens=3)]).text()
    assert second.text() == solo(engine, [job(PROMPTS[1], max_tokens=6)]).text()


def test_a_row_joining_takes_the_step_launched_ahead_first(setup):
    """With the next step launched before its tokens are read, a row joining makes the
    running rows take that step first: the first row's second and third tokens come in the
    step the newcomer joins, which decodes in it too."""
    engine, _ = setup
    scheduler = Scheduler(engine, max_batch=4)
    first, second = Recorder(), Recorder()
    scheduler.add([job(PROMPTS[0], max_tokens=3)], first)
    scheduler.step()
    assert [row.generated for row in scheduler.running] == [1]
    scheduler.add([job(PROMPTS[1], max_tokens=6)], second)
    scheduler.step()
    assert first.finished() == Finished("length", 3, 3, 0)
    assert [row.generated for row in scheduler.running] == [1]  # the newcomer
    while not scheduler.idle:
        scheduler.step()
    assert second.finished() == Finished("length", 5, 6, 0)
    assert first.text() == solo(engine, [job(PROMPTS[0], max_tokens=3)]).text()
    assert second.text() == solo(engine, [job(PROMPTS[1], max_tokens=6)]).text()
    while not scheduler.idle:
        scheduler.step()
    assert second.finished() == Finished("length", 5, 6, 0)
    assert first.text() == solo(engine, [job(PROMPTS[0], max_tokens=3)]).text()
    assert second.text() == solo(engine, [job(PROMPTS[1], max_tokens=6)]).text()


def test_a_cancelled_row_leaves_mid_batch_and_the_others_carry_on(setup):
    engine, _ = setup
    scheduler = Scheduler(engine, max_batch=4)
    jobs = [job(PROMPTS[i], max_tokens=10) for i in range(3)]
    sinks = [Recorder() for _ in jobs]
    for j, sink in zip(jobs, sinks, strict=True):
        scheduler.add([j], sink)
    scheduler.step()
    scheduler.step()
    jobs[1].cancelled.set()
    scheduler.step()
    cancelled = sinks[1].finished()
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert cancelled.completion_tokens == 2
    assert len(scheduler.running) == 2
    while not scheduler.idle:
        scheduler.step()
    for i in (0, 2):
        assert sinks[i].text() == solo(engine, [job(PROMPTS[i], max_tokens=10)]).text()


def test_a_long_prompt_is_prefilled_in_chunks_while_running_rows_keep_decoding(setup):
    engine, _ = setup
    long_prompt = list(range(4, 104))  # 100 tokens: 99 to prefill, the last one decodes
    # Attention priced at nothing: chunks of a fixed token count.
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=16, prefill_context_unit=1 << 30)
    running, waiting = Recorder(), Recorder()
    scheduler.add([job(PROMPTS[0], max_tokens=20)], running)
    scheduler.step()
    scheduler.add([job(long_prompt, max_tokens=4)], waiting)
    for step in range(1, 7):  # ceil(99 / 16) = 7 chunks: the last one joins the batch
        before = len(running.events)
        scheduler.step()
        assert len(running.events) == before + 1, f"the running row stalled at step {step}"
        assert len(scheduler.running) == 1
    scheduler.step()
    assert len(scheduler.running) == 2
    while not scheduler.idle:
        scheduler.step()
    whole = run(Scheduler(engine, max_batch=1, prefill_chunk=512), [[job(long_prompt, 4)]])[0]
    assert waiting.text() == whole.text()


def test_a_short_prompt_behind_long_ones_gets_its_first_token_before_theirs(setup):
    """The groups whose whole rest fits in half a step's budget are prefilled first: a short
    prompt that arrives behind two long ones joins the batch at once, and the long ones go on
    with the rest of each step."""
    engine, _ = setup
    longs = [[4 + (i * 7 + k) % 120 for i in range(200)] for k in range(2)]
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=32, prefill_context_unit=1 << 30)
    endless = tuple((eos, -100.0) for eos in engine.tokenizer.eos_token_ids)
    running, short = Recorder(), Recorder()
    long_sinks = [Recorder(), Recorder()]
    scheduler.add([job(PROMPTS[0], max_tokens=200, logit_bias=endless)], running)
    scheduler.step()
    for prompt, sink in zip(longs, long_sinks, strict=True):
        scheduler.add([job(prompt, max_tokens=4)], sink)
    scheduler.step()
    quick = job(PROMPTS[1], max_tokens=4)
    scheduler.add([quick], short)
    before = len(scheduler.prefilling[0].pending)
    scheduler.step()
    [row] = [row for row in scheduler.running if row.job is quick]  # prefilled, and decoding
    assert row.generated == 1
    assert 0 < len(scheduler.prefilling[0].pending) < before  # the oldest went on beside it
    assert len(scheduler.prefilling) == 2
    while not scheduler.idle:
        if all(sink.finished() for sink in [short, *long_sinks]):
            break
        scheduler.step()
    for prompt, sink in [(PROMPTS[1], short), *zip(longs, long_sinks, strict=True)]:
        assert sink.text() == solo(engine, [job(prompt, max_tokens=4)]).text()


def test_short_prompts_arriving_every_step_leave_a_long_one_every_other_step(setup):
    """Deep in a long prompt, a short prompt's chunk padded beside the long one's costs more
    than the step's budget: a step serves one or the other. Short ones always waiting take
    every other step at most; the long one advances in the others."""
    engine, _ = setup
    long_prompt = [4 + i % 120 for i in range(400)]
    scheduler = Scheduler(engine, max_batch=8, prefill_chunk=32, prefill_context_unit=16)
    endless = tuple((eos, -100.0) for eos in engine.tokenizer.eos_token_ids)
    scheduler.add([job(PROMPTS[0], max_tokens=400, logit_bias=endless)], Recorder())
    scheduler.step()
    scheduler.add([job(long_prompt, max_tokens=2)], Recorder())
    for _ in range(6):  # into the prompt, where each token's attention costs several tokens'
        scheduler.step()
    [group] = scheduler.prefilling
    shorts = [Recorder() for _ in range(16)]
    advanced = []
    for i in range(0, len(shorts), 2):  # two a step: one waits whenever the other is served
        for k in (i, i + 1):
            scheduler.add([job(PROMPTS[1 + k % 4], max_tokens=1)], shorts[k])
        before = len(group.pending)
        scheduler.step()
        advanced.append(len(group.pending) < before)
    assert all(a or b for a, b in pairwise(advanced)), advanced
    for _ in range(2):
        scheduler.step()
    assert all(sink.finished() for sink in shorts)


class CallLog:
    """The scheduler's model, as it is, noting each call: (decode or prefill, tokens, context)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.model = scheduler, scheduler.model
        self.calls: list[tuple[str, int, int]] = []
        scheduler.model = self  # type: ignore[assignment]

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        kind = "decode" if cache is self.scheduler._cache else "prefill"
        self.calls.append((kind, inputs.shape[1], cache[0].offset))
        return self.model(inputs, cache=cache)


def test_a_long_prompt_s_chunks_shrink_as_its_context_grows_and_streams_decode_between(setup):
    engine, _ = setup
    long_prompt = [4 + i % 120 for i in range(400)]  # 399 to prefill, the last one decodes
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=32, prefill_context_unit=16)
    calls = CallLog(scheduler)
    endless = tuple((eos, -100.0) for eos in engine.tokenizer.eos_token_ids)
    running, waiting = Recorder(), Recorder()
    scheduler.add([job(PROMPTS[0], max_tokens=400, logit_bias=endless)], running)
    scheduler.step()
    calls.calls.clear()  # the running row's own prefill
    scheduler.add([job(long_prompt, max_tokens=4)], waiting)
    while not waiting.events:
        before = len(running.events)
        scheduler.step()
        # One token a step; two in the step the waiting row joins in (the step launched ahead
        # is taken first, as a step of its own).
        assert before + 1 <= len(running.events) <= before + 2, "the running row stalled"
    kinds = [kind for kind, _, _ in calls.calls]
    assert "prefill, prefill" not in ", ".join(kinds), "two chunks without a decode between"
    chunks = [(tokens, context) for kind, tokens, context in calls.calls if kind == "prefill"]
    assert sum(tokens for tokens, _ in chunks) == len(long_prompt) - 1
    assert [context for _, context in chunks] == [
        sum(tokens for tokens, _ in chunks[:i]) for i in range(len(chunks))
    ]
    cost = scheduler.prefill
    assert chunks[0][0] == 32  # on an empty cache: prefill_chunk tokens
    assert all(cost.cost(tokens, context) <= cost.budget for tokens, context in chunks)
    assert chunks[-2][0] < 4  # deep in the prompt a chunk holds a few tokens
    while not scheduler.idle:
        scheduler.step()
    whole = Scheduler(engine, max_batch=1, prefill_chunk=512, prefill_context_unit=1 << 30)
    whole_calls = CallLog(whole)
    assert run(whole, [[job(long_prompt, 4)]])[0].text() == waiting.text()
    assert whole_calls.calls[0] == ("prefill", len(long_prompt) - 1, 0)


def test_with_no_row_decoding_a_prefill_step_takes_more_and_the_prompt_grows_its_cache_once(
    setup,
):
    """Beside a decoding row a step takes one chunk's cost (the test above); with none, only a
    request yet to come waits on the step, and it takes ALONE_CHUNKS chunks' worth."""
    engine, _ = setup
    long_prompt = [4 + i % 120 for i in range(400)]  # 399 to prefill, the last one decodes
    # Attention priced at nothing: chunks of a fixed token count.
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=32, prefill_context_unit=1 << 30)
    calls = CallLog(scheduler)
    waiting = Recorder()
    scheduler.add([job(long_prompt, max_tokens=4)], waiting)
    scheduler.step()
    (group,) = scheduler.prefilling
    # One growth holds the whole prompt: 399 positions in whole steps of KV_STEP.
    assert group.cache[0].keys.shape[2] == -(-399 // KV_STEP) * KV_STEP
    while not scheduler.idle:
        scheduler.step()
    chunks = [tokens for kind, tokens, _ in calls.calls if kind == "prefill"]
    assert chunks[0] == 32 * ALONE_CHUNKS and sum(chunks) == 399
    assert len(chunks) == 4  # 128 a step (less a token where attention's cost rounds it down)
    whole = run(Scheduler(engine, max_batch=1, prefill_chunk=512), [[job(long_prompt, 4)]])[0]
    assert waiting.text() == whole.text()


def test_each_row_keeps_its_own_stops_and_max_tokens(setup):
    engine, _ = setup
    free = solo(engine, [job(PROMPTS[3], max_tokens=12)]).text()
    stop = free[3:5]  # text the row will produce: it must stop right before it
    assert len(stop) == 2
    requests = [
        [job(PROMPTS[0], max_tokens=2)],
        [job(PROMPTS[3], max_tokens=12, stop=(stop,))],
        [job(PROMPTS[2], max_tokens=7)],
    ]
    sinks = run(Scheduler(engine, max_batch=4), requests)
    assert sinks[0].finished() is not None and sinks[0].finished().completion_tokens == 2
    assert sinks[1].finished().finish_reason == "stop"
    assert sinks[1].text() == free[: free.index(stop)]
    assert sinks[2].finished() == Finished("length", 2, 7, 0)


def test_a_seeded_request_samples_the_same_alone_or_batched(setup):
    engine, _ = setup
    seeded = dict(temperature=1.0, seed=1234, max_tokens=12)
    alone = solo(engine, [job(PROMPTS[3], **seeded)]).text()
    mx.random.seed(99)  # MLX's global generator plays no part
    crowd = [
        [job(PROMPTS[0], temperature=1.0, max_tokens=12)],  # unseeded neighbours
        [job(PROMPTS[3], **seeded)],
        [job(PROMPTS[1], temperature=0.7, seed=7, max_tokens=12)],
        [job(PROMPTS[2], max_tokens=12)],
    ]
    sinks = run(Scheduler(engine, max_batch=8), crowd)
    assert sinks[1].text() == alone
    other_seed = solo(engine, [job(PROMPTS[3], **{**seeded, "seed": 4321})]).text()
    assert other_seed != alone


def test_logprobs_are_the_same_alone_or_beside_greedy_and_sampled_rows(setup):
    engine, _ = setup
    reported = dict(logprobs=True, top_logprobs=3, max_tokens=6)
    alone = solo(engine, [job(PROMPTS[1], **reported)]).logprobs()
    crowd = [
        [job(PROMPTS[0], max_tokens=6)],  # greedy: no log-probabilities computed for it
        [job(PROMPTS[1], **reported)],
        [job(PROMPTS[2], temperature=0.8, seed=3, max_tokens=6)],
    ]
    batched = run(Scheduler(engine, max_batch=8), crowd)[1].logprobs()
    assert len(alone) == 6
    assert [s.token for s in batched] == [s.token for s in alone]
    for mine, theirs in zip(batched, alone, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [p for p, _ in mine.top] == [p for p, _ in theirs.top]
        # Normalized: the chosen token's probability and its alternatives' stay within 1.
        assert mine.logprob <= 0 and sum(math.exp(v) for _, v in mine.top) <= 1 + 1e-5


def test_finite_rows_flags_nan_and_infinities_and_sums_half_precision_in_float32():
    inf = float("inf")
    rows = mx.array(
        [
            [1.0, 2.0, 3.0],
            [1.0, float("nan"), 3.0],
            [inf, 0.0, 1.0],
            [-inf, 0.0, 1.0],
            [inf, -inf, 0],
        ]
    )
    assert finite_rows(rows).tolist() == [True, False, False, False, False]
    # 49,152 logits of 30 sum to ~1.5e6, far past float16's 65,504: still finite.
    assert finite_rows(mx.full((2, 49152), 30.0, dtype=mx.float16)).tolist() == [True, True]


def test_n_choices_share_one_prefill(setup, monkeypatch):
    engine, _ = setup
    scheduler = Scheduler(engine, max_batch=8)
    calls: list[tuple[int, ...]] = []
    model = scheduler.model

    def counting(tokens, cache=None):
        calls.append(tuple(tokens.shape))
        return model(tokens, cache=cache)

    monkeypatch.setattr(scheduler, "model", counting)
    prompt = PROMPTS[4]
    choices = [
        job(prompt, temperature=1.0, seed=s, max_tokens=4) for s in range(3)
    ]  # one prompt object, as a request's n choices share it
    sink = run(scheduler, [choices])[0]
    prefills = [shape for shape in calls if shape[1] > 1]
    assert prefills == [(1, len(prompt) - 1)]
    assert all(sink.finished(i) is not None for i in range(3))
    assert len({sink.text(i) for i in range(3)}) > 1  # their own seeds


def test_the_kv_budget_holds_new_rows_back_until_memory_frees(setup):
    engine, _ = setup
    one_row = (len(PROMPTS[0]) + 6 + KV_STEP) * engine.kv_bytes_per_token
    scheduler = Scheduler(engine, max_batch=8, kv_cache_bytes=one_row)
    sinks = [Recorder() for _ in range(3)]
    for sink in sinks:
        scheduler.add([job(PROMPTS[0], max_tokens=6)], sink)
    while not scheduler.idle:
        scheduler.step()
        assert len(scheduler.running) <= 1
        assert scheduler.kv_reserved() <= one_row
        assert sum(s.starts for s in sinks) <= 1 + sum(s.finished() is not None for s in sinks)
    assert [s.finished().finish_reason for s in sinks] == ["length"] * 3


def test_kv_caches_hold_at_most_one_step_of_positions_beyond_their_rows(setup):
    """mlx-lm grows a cache 256 positions at a time, the batch's rows all at once: short
    answers would hold several times the positions they use."""
    engine, _ = setup
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=16)
    long_prompt = list(range(50, 90))  # prefilled in chunks, a single-row cache between them
    prompts = [*PROMPTS[:3], long_prompt]
    sinks = [Recorder() for _ in prompts]
    for prompt, sink in zip(prompts, sinks, strict=True):
        scheduler.add([job(prompt, max_tokens=10)], sink)
    held = []  # positions each cache has room for, after every step
    while not scheduler.idle:
        scheduler.step()
        prefilling = [c for group in scheduler.prefilling for c in group.cache or []]
        for cache in [*prefilling, *(scheduler._cache or [])]:
            if cache.keys is not None:
                held.append(cache.keys.shape[2])
    for sink, prompt in zip(sinks, prompts, strict=True):
        assert sink.finished() == Finished("length", len(prompt), 10, 0)
    assert held and max(held) <= len(long_prompt) + 10 + KV_STEP


def test_a_batchs_caches_grow_no_further_than_its_rows_can_still_write(setup):
    """Decoding past a full step grows the caches by what the rows can still write, where that
    is less than a step: here 36 positions (133 to 169), not 64 a row."""
    engine, _ = setup
    scheduler = Scheduler(engine, max_batch=4)
    prompts = [list(range(50, 120)), list(range(60, 120))]  # 70 and 60 tokens
    sinks = [Recorder() for _ in prompts]
    for prompt, sink in zip(prompts, sinks, strict=True):
        scheduler.add([job(prompt, max_tokens=100)], sink)
    held = []
    while not scheduler.idle:
        scheduler.step()
        held += [cache.keys.shape[2] for cache in scheduler._cache or [] if cache.keys is not None]
    for sink, prompt in zip(sinks, prompts, strict=True):
        assert sink.finished() == Finished("length", len(prompt), 100, 0)
    # The longer prompt's 69 positions (its last token is the first step's input), then one a
    # decode step, 100 (the last token generated is never written): 169, where whole steps
    # (69 + 64 + 64) made it 197.
    assert max(held) == len(prompts[0]) - 1 + 100 < len(prompts[0]) - 1 + 2 * KV_STEP


def test_max_batch_bounds_the_rows_decoding_together(setup):
    engine, _ = setup
    scheduler = Scheduler(engine, max_batch=2)
    sinks = [Recorder() for _ in range(3)]
    for i, sink in enumerate(sinks):
        scheduler.add([job(PROMPTS[i], max_tokens=3)], sink)
    scheduler.step()
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1
    assert sinks[2].starts == 0
    while not scheduler.idle:
        scheduler.step()
    assert all(s.finished() is not None for s in sinks)


@pytest.mark.parametrize("seed", [0, 1])
def test_rows_with_different_adapter_sets_match_their_solo_answers(setup, seed):
    engine, manager = setup
    specs = ["", "a", "b", "a+b", "c", "b@0.5+c", "", "a"]
    if seed:
        specs = specs[::-1]
    requests = [
        [job(PROMPTS[i % len(PROMPTS)], max_tokens=10, adapter=adapters(manager, spec))]
        for i, spec in enumerate(specs)
    ]
    batched = run(Scheduler(engine, max_batch=8), requests)
    for request, sink in zip(requests, batched, strict=True):
        fresh = [job(request[0].prompt, max_tokens=10, adapter=request[0].adapters)]
        assert sink.text() == solo(engine, fresh).text()
    # The adapters matter: each set gives another answer than the base on the same prompt.
    base = solo(engine, [job(PROMPTS[1], max_tokens=10)]).text()
    assert solo(engine, [job(PROMPTS[1], 10, adapters(manager, "a"))]).text() != base


def test_a_finished_row_leaves_its_cache_for_the_next_turn(setup, tiny_model_dir: Path):
    engine = Engine(load_model_dir(tiny_model_dir), base_id="tiny", prompt_cache_size=4)
    first = solo(engine, [job(PROMPTS[4], max_tokens=4)])
    again = solo(engine, [job(PROMPTS[4], max_tokens=4)])
    assert again.text() == first.text()
    assert first.finished().cached_tokens == 0
    assert again.finished().cached_tokens == len(PROMPTS[4]) - 1


def test_a_new_turn_of_a_cached_conversation_counts_as_short(tiny_model_dir: Path):
    """What the prompt cache holds of a prompt is not prefilled again: a long conversation's
    next turn, a few tokens past its cache, goes before a long prompt that came first."""
    engine = Engine(load_model_dir(tiny_model_dir), base_id="tiny", prompt_cache_size=4)
    conversation = [4 + (i * 5) % 120 for i in range(300)]
    first = solo(engine, [job(conversation, max_tokens=4)])
    assert first.finished().completion_tokens == 4
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=32, prefill_context_unit=1 << 30)
    endless = tuple((eos, -100.0) for eos in engine.tokenizer.eos_token_ids)
    scheduler.add([job(PROMPTS[0], max_tokens=100, logit_bias=endless)], Recorder())
    scheduler.step()
    scheduler.add([job([4 + (i * 3) % 120 for i in range(300)], max_tokens=2)], Recorder())
    scheduler.step()
    next_turn = job([*conversation, 7, 8, 9], max_tokens=2)  # three tokens past the cache
    scheduler.add([next_turn], Recorder())
    scheduler.step()
    [row] = [row for row in scheduler.running if row.job is next_turn]  # prefilled, decoding
    assert row.cached >= len(conversation) - 1


def test_a_failed_model_call_fails_its_rows_and_the_scheduler_serves_on(setup, monkeypatch):
    engine, _ = setup
    scheduler = Scheduler(engine, max_batch=4)
    model = scheduler.model

    def broken(tokens, cache=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(scheduler, "model", broken)
    failed = run(scheduler, [[job(PROMPTS[0])], [job(PROMPTS[1])]])
    assert all(len(s.errors) == 1 for s in failed)
    monkeypatch.setattr(scheduler, "model", model)
    after = run(scheduler, [[job(PROMPTS[0], max_tokens=3)]])[0]
    assert after.finished() == Finished("length", 3, 3, 0)


def test_a_long_prompt_in_cost_sized_chunks_on_the_cpu_kernels_answers_as_mlx_lm(
    tmp_path: Path, monkeypatch
):
    # Float32 weights with the CPU kernels installed, as served without a GPU: the chunks'
    # attention takes the masked softmax, and the answer is mlx-lm's, whose prefill is whole.
    from mlx_lm import generate
    from mlx_lm.models import llama

    from hotlora.models.cpu import install_rows_kernels
    from hotlora.models.cpu.attention import install_cpu_attention
    from hotlora.models.cpu.extension import unavailable

    from tests.support.tiny import write_tiny_llama

    if (why := unavailable()) is not None:
        pytest.skip(f"CPU kernels: {why}")
    monkeypatch.setattr(llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention)
    path = write_tiny_llama(tmp_path / "tiny", seed=3)
    reference = load_model_dir(path)
    reference.model.set_dtype(mx.float32)
    prompt = [4 + (7 * i) % 120 for i in range(300)]
    expected = generate(reference.model, reference.tokenizer, prompt=prompt, max_tokens=12)
    loaded = load_model_dir(path)
    loaded.model.set_dtype(mx.float32)
    install_cpu_attention(loaded.model)
    assert install_rows_kernels(loaded.model, threads=2).enabled
    engine = Engine(loaded, base_id="tiny", prompt_cache_size=0)
    scheduler = Scheduler(engine, max_batch=2, prefill_chunk=24, prefill_context_unit=16)
    calls = CallLog(scheduler)
    answer = run(scheduler, [[job(prompt, max_tokens=12)]])[0]
    chunks = [tokens for kind, tokens, _ in calls.calls if kind == "prefill"]
    # No row decodes beside it: ALONE_CHUNKS times the chunk on an empty cache, fewer deeper.
    assert len(chunks) > 5 and chunks[0] == 24 * ALONE_CHUNKS and chunks[-2] < chunks[1] < 96
    assert answer.finished().completion_tokens == 12  # no end token cut it short
    assert answer.text() == expected
