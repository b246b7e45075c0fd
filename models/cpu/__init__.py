"""Serving without a GPU: which weights, MLX's JIT flags, and the native kernels, chosen at start.

`prepare_cpu` is the one entry point: the server calls it with its settings once the base model
is loaded, and the log says what it chose and why. Its parts, one job each: `weights` (float32
or as loaded), `vector_jit` (MLX's fused kernels built for this CPU), `attention` (mlx-lm's
attention on the CPU), `extension` (the native kernels' build and load), `layers` (the model's
layers on those kernels) and `features` (what the CPU offers them).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    import mlx.nn as nn

    from hotlora.models.cpu.weights import CpuWeights

# The parts are imported where they are used: `python -m hotlora.models.cpu.extension` imports
# this package first, and must find the extension module not imported yet.

log = logging.getLogger("hotlora")

# Wraps the float32 conversion: given why the weights convert, the context it runs in (the
# server reports its progress and times it as a start-up phase).
Converting = Callable[[str], AbstractContextManager[object]]


@dataclass(frozen=True)
class RowsKernels:
    """Whether the native kernels serve the model's batched decode steps, and why."""

    enabled: bool
    reason: str


@dataclass(frozen=True)
class CpuSetup:
    """What `prepare_cpu` chose, each with why: the weights, MLX's JIT (None with a GPU), the
    batched decode kernels (None with a GPU or weights as loaded)."""

    float32: bool
    weights: str
    vector_jit: str | None
    batch_kernels: str | None


def install_rows_kernels(model: nn.Module, threads: int | None = None) -> RowsKernels:
    """Route the model's float projections (a tied output layer too) and attention through the
    native kernels for batched decode steps, and its norms and RoPEs for every float32 step.
    Changes the modules' classes in place; their weights are untouched. The reason names what
    stays on MLX's own operations (an architecture's own attention, experts' layers)."""
    from hotlora.models.cpu import extension
    from hotlora.models.cpu.attention import install_rows_attention
    from hotlora.models.cpu.layers import (
        RowsLinear,
        RowsOffsetRMSNorm,
        RowsRMSNorm,
        RowsRoPE,
        mlx_layers,
        swap_layers,
    )

    threads = threads or min(len(os.sched_getaffinity(0)), 8)
    loaded = extension.load(threads)
    if isinstance(loaded, str):
        return RowsKernels(False, loaded)
    swapped = swap_layers(model)
    attention = install_rows_attention(model)
    kept = [f"{count} {name}" for name, count in sorted(mlx_layers(model).items())]
    if not attention:
        kept.insert(0, f"the attention of {type(model).__module__.rsplit('.', 1)[-1]} (its own)")
    norms = swapped[RowsRMSNorm] + swapped[RowsOffsetRMSNorm]
    return RowsKernels(
        True,
        f"decode steps of {extension.MIN_ROWS}-{extension.max_rows} rows run "
        f"{swapped[RowsLinear]} projections and {' and '.join(attention) or 'no'} attention "
        f"through the rows kernels ({loaded.isa()}, {threads} threads); every float32 step runs "
        f"{norms} norms and {swapped[RowsRoPE]} RoPEs as one operation each; "
        f"MLX's own operations: {', '.join(kept) or 'none'}",
    )


def prepare_cpu(
    model: nn.Module,
    *,
    weights: CpuWeights,
    float_budget: int | None,
    vector_jit: bool,
    batch_kernels: bool,
    home: Path,
    converting: Converting | None = None,
) -> CpuSetup:
    """Float32 weights on a CPU-only machine when they fit (`weights`, `float_budget`); without
    a GPU, MLX's fused CPU kernels built for this CPU and the attention that uses them
    (`vector_jit`), and the batched decode kernels of float32 weights (`batch_kernels`). Logs
    which weights and kernels serve and why."""
    from hotlora.models.cpu.attention import install_cpu_attention
    from hotlora.models.cpu.vector_jit import enable_vector_jit
    from hotlora.models.cpu.weights import all_float32, choose_cpu_weights, has_gpu, to_float32

    cuda = getattr(mx, "cuda", None)  # absent from older MLX releases
    log.info(
        "MLX device: %s (Metal: %s, CUDA: %s)",
        mx.default_device(),
        mx.metal.is_available(),
        cuda is not None and cuda.is_available(),
    )
    choice = choose_cpu_weights(model, weights, float_budget)
    if choice.float32:
        with (converting or _quietly)(choice.reason):
            to_float32(model)
    log.info("serving %s weights: %s", "float32" if choice.float32 else "as-loaded", choice.reason)
    if has_gpu():
        return CpuSetup(choice.float32, choice.reason, None, None)
    if vector_jit:
        jit = enable_vector_jit(home)
        if jit.enabled:
            install_cpu_attention(model)
        jit_reason = jit.reason
    else:
        jit_reason = "baseline x86-64 (--no-cpu-vector-jit)"
    log.info("CPU kernels: %s", jit_reason)
    if not all_float32(model):  # the batched decode kernels read float32 weights
        return CpuSetup(False, choice.reason, jit_reason, None)
    if batch_kernels:
        rows = install_rows_kernels(model)
        rows_reason = rows.reason if rows.enabled else f"MLX's own (BLAS; {rows.reason})"
    else:
        rows_reason = "MLX's own (BLAS; --no-cpu-batch-matmul)"
    log.info("batched decode kernels: %s", rows_reason)
    return CpuSetup(True, choice.reason, jit_reason, rows_reason)


def _quietly(reason: str) -> AbstractContextManager[object]:
    return contextlib.nullcontext()
