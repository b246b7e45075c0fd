"""What outlives a request (a finished row's cache, a prompt head) is kept in one buffer: its
layers' keys and values side by side, each a view, equal to what the row held."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from hotlora.adapters import BASE_ONLY
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import Engine, GenerationJob, SamplingParams, Scheduler
from hotlora.server.engine.generate import prompt_cache_key
from hotlora.server.engine.kv_caches import in_one_buffer

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
    first = run(Scheduler(engine, max_batch=1), [[GenerationJob(prompt, sampling)]])[0]
    kept, _ = engine.prompt_cache.fetch_nearest_cache(prompt_cache_key("tiny", BASE_ONLY), prompt)
    assert kept is not None
    assert side_by_side([c.keys for c in kept] + [c.values for c in kept])
    again = run(Scheduler(engine, max_batch=1), [[GenerationJob(prompt, sampling)]])[0]
    assert again.text() == first.text()
    assert again.finished().cached_tokens == len(prompt) - 1
