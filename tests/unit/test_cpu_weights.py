"""Float32 weights on the CPU: when they are chosen, and that they generate what mlx-lm does."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import dequantize_model, load

from hotlora.models.cpu import prepare_cpu, weights
from hotlora.models.cpu.weights import choose_cpu_weights, float32_bytes, to_float32
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import Engine, GenerationJob, SamplingParams, Scheduler

from tests.support.tiny import write_tiny_llama

PROMPT = [5, 17, 3, 99, 42, 7, 60, 61]


def dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {value.dtype for _, value in tree_flatten(model.parameters())}


def test_auto_serves_float32_on_a_cpu_when_the_copy_fits(tiny_model_dir: Path):
    model = load_model_dir(tiny_model_dir).model
    size = float32_bytes(model)
    fits = choose_cpu_weights(model, "auto", budget=size)
    assert fits.float32 and "no GPU" in fits.reason
    over = choose_cpu_weights(model, "auto", budget=size - 1)
    assert not over.float32 and "exceeds" in over.reason
    assert not choose_cpu_weights(model, "mlx").float32
    assert choose_cpu_weights(model, "float32", budget=1).float32


def test_auto_keeps_the_weights_on_a_gpu(tiny_model_dir: Path, monkeypatch):
    monkeypatch.setattr(weights, "has_gpu", lambda: True)
    choice = choose_cpu_weights(load_model_dir(tiny_model_dir).model, "auto")
    assert not choice.float32 and "GPU" in choice.reason


def test_float32_size_counts_dequantized_weights(tmp_path: Path):
    float_dir = write_tiny_llama(tmp_path / "float", quantize=False)
    quant_dir = write_tiny_llama(tmp_path / "quant", quantize=True)
    plain = load_model_dir(float_dir).model
    expected = 4 * sum(v.size for _, v in tree_flatten(plain.parameters()))
    assert float32_bytes(load_model_dir(quant_dir).model) == expected
    assert not choose_cpu_weights(plain, "auto").float32  # float32 already: nothing to do


def test_float32_weights_generate_what_mlx_lm_generates_on_the_dequantized_model(
    tiny_model_dir: Path,
):
    reference, tokenizer = load(str(tiny_model_dir))
    dequantize_model(reference)
    reference.set_dtype(mx.float32)
    expected = generate(
        reference, tokenizer, prompt=PROMPT, max_tokens=16, sampler=make_sampler(temp=0.0)
    )

    loaded = load_model_dir(tiny_model_dir)
    assert mx.uint32 in dtypes(loaded.model)
    to_float32(loaded.model)
    assert dtypes(loaded.model) == {mx.float32}
    scheduler = Scheduler(Engine(loaded, base_id="tiny", prompt_cache_size=0), max_batch=1)
    events = []

    class Sink:
        def started(self) -> None: ...

        def event(self, position: int, event) -> None:
            events.append(event)

        def failed(self, position: int, error: BaseException) -> None:
            raise error

    scheduler.add([GenerationJob(PROMPT, SamplingParams(max_tokens=16, temperature=0.0))], Sink())
    while not scheduler.idle:
        scheduler.step()
    text = "".join(getattr(e, "text", "") for e in events)
    assert text == expected
    assert len(expected) > 0


def test_prepare_cpu_converts_in_the_callers_context_and_logs_what_it_chose(
    tiny_model_dir: Path, tmp_path: Path, caplog
):
    model = load_model_dir(tiny_model_dir).model
    seen = []

    @contextlib.contextmanager
    def converting(reason: str) -> Iterator[None]:
        seen.append((reason, mx.uint32 in dtypes(model)))  # before the conversion
        yield
        seen.append(("converted", dtypes(model) == {mx.float32}))

    with caplog.at_level(logging.INFO, logger="hotlora"):
        setup = prepare_cpu(
            model,
            weights="float32",
            float_budget=None,
            vector_jit=False,
            batch_kernels=False,
            home=tmp_path,
            converting=converting,
        )
    assert setup.float32 and seen == [(setup.weights, True), ("converted", True)]
    logged = [r.getMessage() for r in caplog.records]
    assert f"serving float32 weights: {setup.weights}" in logged
    if weights.has_gpu():
        assert setup.vector_jit is setup.batch_kernels is None
        return
    assert "CPU kernels: baseline x86-64 (--no-cpu-vector-jit)" in logged
    assert "batched decode kernels: MLX's own (BLAS; --no-cpu-native-kernels)" in logged


@pytest.mark.parametrize("setting", ["auto", "packed", "float32", "mlx"])
def test_the_setting_is_validated(setting: str, tiny_model_dir: Path):
    from hotlora.config.settings import Settings

    assert Settings(cpu_weights=setting).cpu_weights == setting
    with pytest.raises(ValueError):
        Settings(cpu_weights="fp8")


def test_a_float32_model_directory_takes_the_batched_decode_kernels(tmp_path: Path, caplog):
    from hotlora.models.cpu import extension

    if weights.has_gpu() or extension.unavailable():
        pytest.skip("the native kernels serve x86-64 Linux CPUs without a GPU")
    model = load_model_dir(write_tiny_llama(tmp_path / "tiny")).model
    model.set_dtype(mx.float32)  # as a float32 checkpoint loads
    with caplog.at_level(logging.INFO, logger="hotlora"):
        setup = prepare_cpu(
            model,
            weights="auto",
            float_budget=None,
            vector_jit=False,
            batch_kernels=True,
            home=tmp_path,
        )
    assert setup.weights == "the weights are float32 already"
    assert setup.batch_kernels is not None and "through the rows kernels" in setup.batch_kernels
    assert f"batched decode kernels: {setup.batch_kernels}" in [
        r.getMessage() for r in caplog.records
    ]


@pytest.mark.parametrize("bound", [None, 4 << 20])
def test_freed_buffers_beyond_the_cache_bound_go_back_to_the_system(
    tmp_path: Path, bound: int | None
):
    """MLX otherwise keeps every freed buffer up to its memory limit: the batch KV cache's old
    copies stayed resident. By default (None: the setting's) it keeps none."""
    from hotlora.config.settings import Settings

    if weights.has_gpu():
        pytest.skip("the bound applies without a GPU")
    bound = Settings().cpu_cache_bytes if bound is None else bound
    model = load_model_dir(write_tiny_llama(tmp_path / "tiny")).model
    before = mx.set_cache_limit(1 << 40)  # as large as MLX's own default, whatever it was
    try:
        prepare_cpu(
            model,
            weights="auto",
            float_budget=None,
            cache_bytes=bound,
            vector_jit=False,
            batch_kernels=False,
            home=tmp_path,
        )
        mx.clear_cache()
        small = mx.ones((256,), dtype=mx.float32)  # a step's own small buffers
        large = mx.zeros((max(bound, 1 << 20),), dtype=mx.float32)  # 4 MiB or four times the bound
        mx.eval(small, large)
        del small, large
        assert mx.get_cache_memory() <= bound
    finally:
        mx.set_cache_limit(before)


# Run in a process of its own: a heap that an earlier unmount trimmed (malloc_trim) keeps free
# space whose pages were given back, from which malloc serves large buffers before mapping any,
# and those pages stay resident once such a buffer is freed, until the next trim.
FREED_LARGE_BUFFERS = """
import os, sys
from pathlib import Path
import mlx.core as mx
from hotlora.models.cpu import prepare_cpu
from hotlora.models.loader import load_model_dir
from tests.bench.soak import rss_mb
from tests.support.tiny import write_tiny_llama

home = Path(sys.argv[1])
model = load_model_dir(write_tiny_llama(home / "tiny")).model
mx.set_cache_limit(0)  # what MLX frees goes straight to malloc
prepare_cpu(model, weights="auto", float_budget=None, cache_bytes=0, vector_jit=False,
            batch_kernels=False, home=home)
first = mx.zeros((4 << 20,), dtype=mx.float32)  # 16 MiB, mapped; freed, it sets the bar
mx.eval(first)
del first
large, small = [], []
for _ in range(32):
    large.append(mx.full((1 << 20,), 1.0))  # [4 MiB] each, 128 MiB in all
    small.append(mx.full((16 << 10,), 1.0))  # [64 KiB], from the heap between them
    mx.eval(large[-1], small[-1])
held = rss_mb(os.getpid())
del large
print(held - rss_mb(os.getpid()))
"""


def test_freed_large_buffers_leave_the_resident_set_between_live_small_ones(tmp_path: Path):
    """glibc raises its mmap threshold as mapped buffers are freed; the KV caches' buffers then
    came from its heap, between small live ones, and stayed resident once freed."""
    if weights.has_gpu() or not Path("/proc/self/status").is_file():
        pytest.skip("the resident set is read from /proc, without a GPU")
    probe = subprocess.run(
        [sys.executable, "-c", FREED_LARGE_BUFFERS, str(tmp_path)],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    freed = float(probe.stdout.split()[-1])
    assert freed > 96, f"{freed:.0f} of the 128 MiB freed left the resident set"
