"""Prompt heads on a tiny model: the opening a prompt shares with recent prompts is kept per
adapter set when the prompt cache lacks it, serves the next request of that set (the same
answer as with nothing cached), never another set's, and stays within its bounds."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from hotlora.adapters import AdapterManager, AdapterSet, parse_adapter_spec
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import Engine, GenerationJob, SamplingParams, Scheduler
from hotlora.server.engine.prompt_heads import MIN_HEAD, PromptHeads, shared_prefix

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.scheduling import Recorder, run

OPENING = [4 + (5 * i) % 90 for i in range(20)]  # a system prompt every request starts with


def prompt(*tail: int) -> list[int]:
    return OPENING + list(tail)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path):
    return load_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def manager(loaded, tmp_path_factory: pytest.TempPathFactory) -> AdapterManager:
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("a", "b")):
        write_mlx_adapter(root / name, random_pairs(tiny_model(), seed=30 + seed, rank=4), rank=4)
    manager = AdapterManager(loaded.model, base_id="tiny", adapter_root=root, max_rank=64)
    for name in ("a", "b"):
        manager.mount(name, name)
    return manager


def job(tokens: list[int], adapters: AdapterSet | None) -> GenerationJob:
    sampling = SamplingParams(max_tokens=6, temperature=0.0)
    if adapters is None:
        return GenerationJob(tokens, sampling)
    return GenerationJob(tokens, sampling, adapters)


def answer(engine: Engine, tokens: list[int], adapters: AdapterSet | None) -> Recorder:
    return run(Scheduler(engine, max_batch=1), [[job(tokens, adapters)]])[0]


def test_a_request_finds_its_adapter_sets_head_where_the_prompt_cache_kept_another_set(
    loaded, manager: AdapterManager
):
    a, b = (manager.resolve(parse_adapter_spec(name)) for name in ("a", "b"))
    engine = Engine(loaded, base_id="tiny", prompt_cache_size=1)  # one conversation kept
    uncached = Engine(loaded, base_id="tiny", prompt_cache_size=0)

    for tail in (90, 91):  # seen twice: the opening is now known as shared
        answer(engine, prompt(tail, 92), None)
    first_a = answer(engine, prompt(93, 94, 95), a)
    first_b = answer(engine, prompt(96), b)  # the prompt cache now holds b's conversation only
    assert first_a.finished().cached_tokens == 0  # nothing of a's was kept yet
    assert len(engine.prompt_heads) == 2  # a's and b's openings

    again_a = answer(engine, prompt(97, 98), a)
    assert again_a.finished().cached_tokens == len(OPENING)
    assert again_a.text() == answer(uncached, prompt(97, 98), a).text()
    assert first_b.finished().cached_tokens == 0
    # Nothing new was kept: the head served.
    assert len(engine.prompt_heads) == 2


def test_a_head_serves_only_its_own_adapter_set(loaded, manager: AdapterManager):
    a, b = (manager.resolve(parse_adapter_spec(name)) for name in ("a", "b"))
    engine = Engine(loaded, base_id="tiny", prompt_cache_size=1)
    uncached = Engine(loaded, base_id="tiny", prompt_cache_size=0)
    answer(engine, prompt(90), None)
    answer(engine, prompt(91), None)
    answer(engine, prompt(92, 93), a)  # a's head kept
    answer(engine, prompt(94), None)  # the prompt cache now holds a base conversation
    on_b = answer(engine, prompt(95, 96), b)
    assert on_b.finished().cached_tokens == 0
    assert on_b.text() == answer(uncached, prompt(95, 96), b).text()
    # The adapters matter here: a's KV would have given b another answer.
    assert answer(uncached, prompt(95, 96), a).text() != on_b.text()


def test_rows_started_from_heads_batch_with_others_and_answer_as_uncached(
    loaded, manager: AdapterManager
):
    a, b = (manager.resolve(parse_adapter_spec(name)) for name in ("a", "b"))
    engine = Engine(loaded, base_id="tiny", prompt_cache_size=1)
    uncached = Engine(loaded, base_id="tiny", prompt_cache_size=0)
    answer(engine, prompt(90), None)
    answer(engine, prompt(91), None)
    answer(engine, prompt(92, 93), a)
    answer(engine, prompt(94), b)  # a's and b's heads kept
    jobs = [job(prompt(95, 96), a), job(prompt(97), b), job(prompt(98, 99, 100), None)]
    together = run(Scheduler(engine, max_batch=3), [[j] for j in jobs])
    assert [sink.finished().cached_tokens for sink in together[:2]] == [len(OPENING)] * 2
    for j, sink in zip(jobs, together, strict=True):
        assert sink.text() == answer(uncached, j.prompt, j.adapters).text()


def test_no_prompt_cache_keeps_no_heads(loaded, manager: AdapterManager):
    a = manager.resolve(parse_adapter_spec("a"))
    engine = Engine(loaded, base_id="tiny", prompt_cache_size=0)
    for tail in (91, 92, 93):
        assert answer(engine, prompt(tail), a).finished().cached_tokens == 0
    assert len(engine.prompt_heads) == 0


def test_the_opening_is_what_would_have_saved_recent_prompts_the_most():
    heads = PromptHeads(max_size=4, max_bytes=1 << 20)
    assert heads.opening(prompt(1, 2)) == 0  # nothing seen yet
    assert heads.opening(prompt(1, 3)) == 0  # shared with one prompt: the prompt cache's
    assert heads.opening(prompt(1, 4)) == len(OPENING) + 1
    assert heads.opening(prompt(7)) == len(OPENING)
    # The same prompt again shares all of it with one, the system prompt with every other.
    assert heads.opening(prompt(7)) == len(OPENING)
    assert heads.opening(prompt(7, 8, 9)) == len(OPENING)  # a next turn, as well
    # A template's preamble before two system prompts: the one most recent prompts share wins
    # over the preamble all of them share, which wins over a system prompt few share.
    preamble = list(range(60, 70))
    system_a, system_b = preamble + list(range(70, 85)), preamble + list(range(85, 100))
    mixed = PromptHeads(max_size=4, max_bytes=1 << 20)
    for question in (1, 2, 3):
        mixed.opening([*system_a, question, 0])
    mixed.opening([*system_b, 4, 0])
    assert mixed.opening([*system_a, 5, 0]) == len(system_a)
    assert mixed.opening([*system_b, 6, 0]) == len(preamble)
    assert 4 < MIN_HEAD <= 9
    assert heads.opening(OPENING[:4] + [99, 98, 97, 96, 95]) == 0  # 4 shared: too short
    assert heads.opening(OPENING[:4] + [99, 98, 97, 96, 95, 94]) == 0  # 9, with one prompt
    assert heads.opening(OPENING[:4] + [99, 98, 97, 96, 95, 93]) == 9  # 9, with two
    assert heads.opening(OPENING[:4] + [99, 98, 97, 96, 95]) == 8  # all but the last token
    # Only prompts of the same cache scope count: another tenant's say nothing of this one's.
    scoped = PromptHeads(max_size=4, max_bytes=1 << 20)
    acme, globex = ("tenant:acme",), ("tenant:globex",)
    assert [scoped.opening(prompt(1, n), acme) for n in (2, 3)] == [0, 0]
    assert scoped.opening(prompt(1, 4), globex) == 0
    assert scoped.opening(prompt(1, 5), acme) == len(OPENING) + 1
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix((1, 2), (1, 2)) == 2


def caches(length: int, layers: int = 2, value: float = 1.0) -> list[KVCache]:
    out = []
    for _ in range(layers):
        cache = KVCache()
        cache.update_and_fetch(
            mx.full((1, 2, length, 4), value), mx.full((1, 2, length, 4), -value)
        )
        out.append(cache)
    return out


def test_heads_keep_their_positions_alone_and_stay_within_count_and_bytes():
    per_head = 2 * 2 * (2 * 10 * 4) * 4  # layers x (keys, values) x [2, 10, 4] float32
    heads = PromptHeads(max_size=2, max_bytes=3 * per_head)
    key_a, key_b, key_c = ("m", "a"), ("m", "b"), ("m", "c")
    head = list(range(10))
    heads.keep(key_a, head, caches(30, value=1.0))
    assert heads.nbytes == per_head  # ten positions copied, not the row's thirty
    found = heads.fetch(key_a, head + [50, 51])
    assert found is not None
    fetched, length = found
    assert length == 10 and all(c.offset == 10 for c in fetched)
    assert mx.array_equal(fetched[0].keys, mx.full((1, 2, 10, 4), 1.0)).item()
    # Writing past the head leaves the kept head as it was.
    fetched[0].update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    again = heads.fetch(key_a, head + [50])
    assert again is not None and again[0][0].offset == 10
    assert mx.array_equal(again[0][0].keys, mx.full((1, 2, 10, 4), 1.0)).item()
    assert heads.fetch(key_a, head) is None  # a head is never the whole prompt
    assert heads.fetch(key_a, [0, 1, 2, 3, 4, 5, 6, 7, 8, 99, 50]) is None  # another opening
    assert heads.fetch(key_b, head + [50]) is None
    heads.keep(key_b, head, caches(12))
    heads.fetch(key_a, head + [1])  # a used last: b is the least recently used
    heads.keep(key_c, head, caches(12))
    assert len(heads) == 2 and heads.nbytes == 2 * per_head
    assert heads.fetch(key_b, head + [1]) is None
    assert heads.fetch(key_a, head + [1]) is not None
    # Too big for the budget alone: not kept, nothing dropped for it.
    small = PromptHeads(max_size=4, max_bytes=per_head - 1)
    small.keep(key_a, head, caches(12))
    assert len(small) == 0 and small.nbytes == 0


def test_of_two_heads_opening_a_prompt_the_longer_serves():
    heads = PromptHeads(max_size=4, max_bytes=1 << 20)
    key, head = ("m", "a"), list(range(10))
    heads.keep(key, head[:8], caches(12, value=2.0))
    heads.keep(key, [*head[:8], 77, 78], caches(12, value=3.0))
    heads.keep(key, [*head[:8], 77, 78], caches(12, value=4.0))  # kept already: nothing changes
    assert len(heads) == 2
    longer = heads.fetch(key, [*head[:8], 77, 78, 50])
    shorter = heads.fetch(key, [*head[:8], 50])
    assert longer is not None and longer[1] == 10
    assert mx.array_equal(longer[0][0].keys, mx.full((1, 2, 10, 4), 3.0)).item()
    assert shorter is not None and shorter[1] == 8


PER_POSITION = 2 * 2 * (2 * 4) * 4  # layers x (keys, values) x [2, 4] float32


def test_heads_of_one_set_hold_their_common_positions_once():
    key, head = ("m", "a"), list(range(10))
    # The longer first: the shorter reads its positions there.
    heads = PromptHeads(max_size=4, max_bytes=1 << 20)
    heads.keep(key, head, caches(12, value=3.0))
    heads.keep(key, head[:8], caches(12, value=2.0))
    assert len(heads) == 2 and heads.nbytes == 10 * PER_POSITION
    shorter = heads.fetch(key, [*head[:8], 50])
    assert shorter is not None and shorter[1] == 8
    assert mx.array_equal(shorter[0][1].values, mx.full((1, 2, 8, 4), -3.0)).item()
    # The shorter first: once the longer comes, the shorter reads it and its own buffer goes.
    heads = PromptHeads(max_size=4, max_bytes=1 << 20)
    heads.keep(key, head[:8], caches(12, value=2.0))
    assert heads.nbytes == 8 * PER_POSITION
    heads.keep(key, head, caches(12, value=3.0))
    assert len(heads) == 2 and heads.nbytes == 10 * PER_POSITION
    shorter = heads.fetch(key, [*head[:8], 50])
    assert shorter is not None
    assert mx.array_equal(shorter[0][0].keys, mx.full((1, 2, 8, 4), 3.0)).item()
    # Another set's head of the same tokens holds its own (an adapter changes every position).
    heads.keep(("m", "b"), head[:8], caches(12, value=4.0))
    assert heads.nbytes == 18 * PER_POSITION
    other = heads.fetch(("m", "b"), [*head[:8], 50])
    assert other is not None
    assert mx.array_equal(other[0][0].keys, mx.full((1, 2, 8, 4), 4.0)).item()
    # A head the shorter opens, beside the longer: its own buffer; the longer keeps its own.
    heads.keep(key, [*head[:8], 77, 78], caches(12, value=5.0))
    assert len(heads) == 4 and heads.nbytes == 28 * PER_POSITION
    longer = heads.fetch(key, [*head, 50])
    assert longer is not None and longer[1] == 10
    assert mx.array_equal(longer[0][0].keys, mx.full((1, 2, 10, 4), 3.0)).item()


def test_a_buffer_counts_until_no_head_reads_it():
    key, head = ("m", "a"), list(range(10))
    heads = PromptHeads(max_size=2, max_bytes=1 << 20)
    heads.keep(key, head, caches(12, value=3.0))
    heads.keep(key, head[:8], caches(12, value=2.0))  # reads the longer's buffer
    heads.keep(("m", "b"), head, caches(12, value=4.0))  # two heads at most: the longer goes
    assert len(heads) == 2
    found = heads.fetch(key, [*head, 50])
    assert found is not None and found[1] == 8  # the shorter serves, the longer gone
    assert mx.array_equal(found[0][0].keys, mx.full((1, 2, 8, 4), 3.0)).item()
    # The shorter still reads the longer's ten positions: they count until it goes too.
    assert heads.nbytes == 20 * PER_POSITION
    heads.keep(("m", "c"), head, caches(12, value=5.0))
    assert len(heads) == 2 and heads.nbytes == 20 * PER_POSITION
    heads.keep(("m", "d"), head[:8], caches(12, value=6.0))
    assert len(heads) == 2 and heads.nbytes == 18 * PER_POSITION


def test_caches_other_than_plain_kv_caches_are_not_cut():
    heads = PromptHeads(max_size=4, max_bytes=1 << 20)
    window = RotatingKVCache(max_size=8)
    window.update_and_fetch(mx.ones((1, 2, 12, 4)), mx.ones((1, 2, 12, 4)))
    heads.keep(("m",), list(range(10)), [*caches(12, layers=1), window])
    assert len(heads) == 0
    heads.keep(("m",), list(range(10)), caches(6))  # shorter than the head
    assert len(heads) == 0
