"""Batched rows answer as each row alone, or the model is served one row at a time: gemma2's
per-row masks, the start-up batching check, and the runtime that acts on it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
from mlx_lm import generate
from mlx_lm import load as mlx_lm_load
from mlx_lm.models import gemma2

from hotlora.config.settings import Settings
from hotlora.models import loader
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    Delta,
    Engine,
    GenerationJob,
    SamplingParams,
    Scheduler,
    Ticket,
    check_batching,
)
from hotlora.server.runtime import Runtime

from tests.support.scheduling import run
from tests.support.tiny import tiny_gemma2_args, write_tiny_gemma2

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


def test_the_check_passes_llama_and_gemma2_as_loaded(tiny_model_dir: Path, gemma2_dir: Path):
    assert check_batching(load_model_dir(tiny_model_dir).model) is None
    assert check_batching(load_model_dir(gemma2_dir).model) is None


@pytest.mark.parametrize(
    ("kv_heads", "why"),
    [(2, "a batched step failed"), (3, "differs from the row alone")],  # as many as its rows
)
def test_the_check_fails_gemma2_without_its_row_masks(kv_heads: int, why: str):
    # mlx-lm's own gemma2: its grouped scores meet the per-row mask unexpanded, which fails to
    # broadcast, or with as many KV heads as rows broadcasts and masks rows with others' masks.
    args = tiny_gemma2_args()
    args.num_attention_heads, args.num_key_value_heads = 2 * kv_heads, kv_heads
    failed = check_batching(gemma2.Model(args))
    assert failed is not None and why in failed


def test_a_model_that_fails_the_check_is_served_one_row_at_a_time(
    gemma2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
):
    monkeypatch.setattr(loader, "install_row_masks", lambda model: 0)  # mlx-lm's gemma2 as is
    settings = Settings(home=tmp_path / "home", model=gemma2_dir, cpu_vector_jit=False)

    async def start_and_answer() -> list[str]:
        runtime = Runtime(settings)
        await runtime.start()
        assert runtime.ready and runtime.worker is not None
        worker = runtime.worker
        try:
            assert worker.scheduler.max_batch == 1
            tickets = [worker.submit(job(p)) for p in PROMPTS[:3]]  # all waiting at once

            async def answer(ticket: Ticket) -> str:
                events = [e async for _, e in worker.events(ticket)]
                return "".join(e.text for e in events if isinstance(e, Delta))

            return list(await asyncio.gather(*(answer(t) for t in tickets)))
        finally:
            await runtime.stop()

    with caplog.at_level(logging.WARNING, logger="hotlora"):
        answers = asyncio.run(start_and_answer())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("batching off for gemma2: a batched step failed") for m in warnings)
    model, tokenizer = mlx_lm_load(str(gemma2_dir))
    assert answers == [generate(model, tokenizer, prompt=p, max_tokens=8) for p in PROMPTS[:3]]


def test_a_model_that_passes_the_check_keeps_max_batch(gemma2_dir: Path, tmp_path: Path):
    settings = Settings(
        home=tmp_path / "home", model=gemma2_dir, cpu_vector_jit=False, warmup=False
    )

    async def started_max_batch() -> int:
        runtime = Runtime(settings)
        await runtime.start()
        try:
            assert runtime.ready and runtime.worker is not None
            assert "batching check" in runtime.phases
            return runtime.worker.scheduler.max_batch
        finally:
            await runtime.stop()

    assert asyncio.run(started_max_batch()) == settings.max_batch
