"""What outlives a request (a finished row's cache, a prompt head) is kept in one buffer: its
layers' keys and values side by side, each a view, equal to what the row held."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from hotlora.adapters import BASE_ONLY
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import Engine, GenerationJob, SamplingParams, Scheduler
from hotlora.server.engine.generate import prompt_cache_key
from hotlora.server.engine.kv_caches import in_one_buffer, kept_caches, row_caches

from tests.support.scheduling import run


def address(array: mx.array) -> int:
    return np.frombuffer(memoryview(array), dtype=np.uint8).__array_interface__["data"][0]


def side_by_side(arrays: list[mx.array]) -> bool:
    """Whether each array starts where the one before it ends."""
    return all(
        address(after) == address(before) + before.nbytes
        for before, after in zip(arrays, arrays[1:], strict=False)
    )


def test_arrays_of_one_shape_are_copied_side_by_side_others_each_alone():
    arrays = [mx.full((1, 2, 3, 4), float(i)) for i in range(5)]
    copies = in_one_buffer(arrays)
    assert side_by_side(copies) and not side_by_side(arrays)
    assert all(mx.array_equal(a, c).item() for a, c in zip(arrays, copies, strict=True))
    strided = [mx.arange(48.0).reshape(1, 4, 3, 4)[:, :, :2, :] for _ in range(3)]  # views
    assert all(
        mx.array_equal(a, c).item() for a, c in zip(strided, in_one_buffer(strided), strict=True)
    )
    mixed = [mx.ones((1, 2, 3, 4)), mx.zeros((1, 2, 5, 4))]
    copies = in_one_buffer(mixed)
    assert [c.shape for c in copies] == [(1, 2, 3, 4), (1, 2, 5, 4)]
    assert all(mx.array_equal(a, c).item() for a, c in zip(mixed, copies, strict=True))


def test_a_finished_rows_cache_is_kept_in_one_buffer(tiny_model_dir: Path):
    engine = Engine(load_model_dir(tiny_model_dir), base_id="tiny", prompt_cache_size=4)
    prompt = [40, 41, 42, 43, 44, 45]
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    job = GenerationJob(prompt, sampling, BASE_ONLY)
    first = run(Scheduler(engine, max_batch=1), [[job]])[0]
    kept, _ = engine.prompt_cache.fetch_nearest_cache(prompt_cache_key("tiny", job), prompt)
    assert kept is not None
    assert side_by_side([c.keys for c in kept] + [c.values for c in kept])
    again = run(Scheduler(engine, max_batch=1), [[GenerationJob(prompt, sampling)]])[0]
    assert again.text() == first.text()
    assert again.finished().cached_tokens == len(prompt) - 1


def test_a_kept_row_of_a_batch_is_copied_once_from_the_batchs_buffers():
    """A finished row of a running batch is kept from views of the batch's buffers: one copy,
    into the kept buffer, not a copy a layer first and then the kept buffer (mlx-lm's
    `extract`), which took twice the row's bytes beside the batch for a moment."""
    batch = [BatchKVCache(left_padding=[3, 0]) for _ in range(4)]
    for cache in batch:
        cache.update_and_fetch(mx.random.normal((2, 4, 200, 64)), mx.random.normal((2, 4, 200, 64)))
    mx.eval([c.state for c in batch])
    row_bytes = len(batch) * 2 * 4 * 197 * 64 * 4  # row 0: 197 positions after its padding

    def peak_of(rows) -> tuple[list, float]:
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        kept = kept_caches(rows())
        return kept, (mx.get_peak_memory() - before) / row_bytes

    kept, peak = peak_of(lambda: row_caches(batch, 0))
    _, copied_twice = peak_of(lambda: [c.extract(0) for c in batch])
    assert peak <= 1.1 < 1.9 <= copied_twice
    assert side_by_side([c.keys for c in kept] + [c.values for c in kept])
    for one, cache in zip(kept, batch, strict=True):
        assert one.offset == 197
        assert mx.array_equal(one.keys, cache.keys[0:1, :, 3:200]).item()
        assert mx.array_equal(one.values, cache.values[0:1, :, 3:200]).item()
    row = row_caches(batch, 1)  # no padding: every position
    assert [c.offset for c in row] == [200] * 4
    assert all(
        mx.array_equal(c.keys, b.keys[1:2, :, :200]).item() for c, b in zip(row, batch, strict=True)
    )
