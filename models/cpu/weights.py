"""Which weights the CPU serves: quantized weights kept packed for the native kernels, a
float32 copy through BLAS, or the weights as loaded for MLX's own kernels.

MLX's CPU kernels for quantized and half-precision matmuls do not use BLAS: they are slow on
prompts and gain nothing from batching. The native kernels (`layers.PackedLinear`) read
the packed weights themselves, a fraction of a float32 copy's bytes, for every row count. So on
a machine without a GPU, `auto` keeps quantized weights packed when those kernels serve them
(`packed`); otherwise (half-precision weights, other quantizations, a CPU without AVX2) it
serves a float32 copy through BLAS (OpenBLAS where preloaded) when it fits a memory budget (half
the RAM unless set). With a GPU (Metal, CUDA) the weights stay as loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model

CpuWeights = Literal["auto", "packed", "float32", "mlx"]
_HALF = (mx.float16, mx.bfloat16)


@dataclass(frozen=True)
class WeightsChoice:
    """Whether the CPU serves a float32 copy of the weights, or keeps quantized ones packed for
    the native kernels (`packed`), and why; neither: the weights as loaded."""

    float32: bool
    reason: str
    packed: bool = False


def has_gpu() -> bool:
    """Whether MLX runs on a GPU here (Metal or CUDA)."""
    cuda = getattr(mx, "cuda", None)
    return bool(mx.metal.is_available() or (cuda is not None and cuda.is_available()))


def default_float_budget() -> int:
    """Half the machine's physical memory, in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def float32_bytes(model: nn.Module) -> int:
    """What the model's parameters take once dequantized to float32."""
    total = 0
    modules = cast(
        list[tuple[str, Any]], tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    )
    for _, module in modules:
        params = cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            rows, packed = module.weight.shape
            total += 4 * rows * (packed * 32 // module.bits)
            params = [(k, v) for k, v in params if k not in ("weight", "scales", "biases")]
        total += 4 * sum(v.size for _, v in params)
    return total


def _low_precision(model: nn.Module) -> str | None:
    """What makes the weights slow on the CPU: 'quantized', 'float16', ... or None."""
    for _, value in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())):
        if value.dtype == mx.uint32:
            return "quantized"
        if value.dtype in _HALF:
            return str(value.dtype).rsplit(".", 1)[-1]
    return None


def all_float32(model: nn.Module) -> bool:
    """Whether every parameter is float32 already (a float32 model directory, or after
    `to_float32`)."""
    return _low_precision(model) is None


def choose_cpu_weights(
    model: nn.Module,
    setting: CpuWeights,
    budget: int | None = None,
    *,
    unpacked: str | None = "the native kernels were not asked",
) -> WeightsChoice:
    """What `setting` means for this model on this machine; `unpacked`: why the native kernels
    cannot serve its quantized weights packed (None: they can)."""
    kind = _low_precision(model)
    if kind is None:
        return WeightsChoice(False, "the weights are float32 already")
    if setting == "mlx":
        return WeightsChoice(False, f"{kind} weights kept for MLX's kernels (--cpu-weights mlx)")
    size = float32_bytes(model)
    if setting == "float32":
        return WeightsChoice(True, f"--cpu-weights float32, {size / 1e6:.0f} MB")
    if has_gpu():
        return WeightsChoice(False, f"{kind} weights kept: MLX runs on a GPU here")
    if unpacked is None:
        return WeightsChoice(
            False,
            f"no GPU; {kind} weights kept packed ({packed_bytes(model) / 1e6:.0f} MB) for the "
            "native kernels",
            packed=True,
        )
    why = f"not packed: {unpacked}; " if setting == "packed" or kind == "quantized" else ""
    budget = default_float_budget() if budget is None else budget
    if size > budget:
        return WeightsChoice(
            False,
            f"{why}{kind} weights kept: a float32 copy ({size / 1e6:.0f} MB) exceeds the "
            f"{budget / 1e6:.0f} MB budget",
        )
    return WeightsChoice(
        True,
        f"{why}no GPU; {kind} weights as float32 take {size / 1e6:.0f} MB of the "
        f"{budget / 1e6:.0f} MB budget",
    )


def packed_bytes(model: nn.Module) -> int:
    """What the model's parameters take served packed: quantized arrays as they are, the other
    float parameters as float32."""
    total = 0
    modules = cast(
        list[tuple[str, Any]], tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    )
    for _, module in modules:
        quantized = isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
        for key, value in cast(list[tuple[str, mx.array]], tree_flatten(module.parameters())):
            kept = quantized and key in ("weight", "scales", "biases")
            total += value.nbytes if kept else 4 * value.size
    return total


def to_packed(model: nn.Module) -> None:
    """Cast every float parameter but the quantized layers' packed weights, scales and biases to
    float32, in place; the packed arrays made row-contiguous, as the native kernels read them."""
    packed = ("weight", "scales", "biases")
    for _, module in model.named_modules():
        quantized = isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
        for key, value in list(module.items()):
            if not isinstance(value, mx.array):
                continue
            if quantized and key in packed:
                module[key] = mx.contiguous(value)
            elif mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32:
                module[key] = value.astype(mx.float32)
    mx.eval(model.parameters())


def to_float32(model: nn.Module) -> None:
    """Dequantize every quantized layer and cast every float parameter to float32, in place."""
    dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
