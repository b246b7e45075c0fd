"""Batched rows answer as each row alone, or the model is served one row at a time: gemma2's
per-row masks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from mlx_lm import generate
from mlx_lm import load as mlx_lm_load

from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    Engine,
    GenerationJob,
    SamplingParams,
    Scheduler,
)

from tests.support.scheduling import run
from tests.support.tiny import write_tiny_gemma2

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma2(tmp_path_factory.mktemp("tiny-gemma2"), seed=1)


def job(prompt: list[int], max_tokens: int = 8) -> list[GenerationJob]:
    return [GenerationJob(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))]


def texts(engine: Engine, prompts: Sequence[list[int]], max_batch: int) -> list[str]:
    sinks = run(Scheduler(engine, max_batch=max_batch), [job(p) for p in prompts])
    for sink in sinks:
        assert not sink.errors
    return [sink.text() for sink in sinks]


@pytest.mark.parametrize("rows", [2, 5])
def test_gemma2_rows_batched_answer_as_each_row_alone_and_as_mlx_lm(gemma2_dir: Path, rows: int):
    engine = Engine(load_model_dir(gemma2_dir), base_id="gemma2", prompt_cache_size=0)
    prompts = PROMPTS[:rows]
    alone = [texts(engine, [prompt], max_batch=1)[0] for prompt in prompts]
    assert texts(engine, prompts, max_batch=8) == alone
    model, tokenizer = mlx_lm_load(str(gemma2_dir))
    expected = [generate(model, tokenizer, prompt=p, max_tokens=8) for p in prompts]
    assert alone == expected
