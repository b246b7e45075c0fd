"""Serving without a GPU: which weights, MLX's JIT flags, and the native kernels, chosen at start.

`prepare_cpu` is the one entry point: the server calls it with its settings once the base model
is loaded, and the log says what it chose and why. Its parts, one job each: `weights` (packed
for the native kernels, float32 or as loaded), `vector_jit` (MLX's fused kernels built for this
CPU), `attention` (mlx-lm's attention on the CPU), `extension` (the native kernels' build and
load), `layers` (the model's layers on those kernels) and `features` (what the CPU offers them).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from hotlora.models.cpu.layers import CpuPrecision
    from hotlora.models.cpu.weights import CpuWeights

# The parts are imported where they are used: `python -m hotlora.models.cpu.extension` imports
# this package first, and must find the extension module not imported yet.

log = logging.getLogger("hotlora")

# glibc's mallopt parameter, and the threshold it starts from: buffers of at least this many
# bytes are mapped of their own.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 128 << 10

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
    native kernels (None with a GPU or weights as loaded for MLX's kernels)."""

    float32: bool
    weights: str
    vector_jit: str | None
    batch_kernels: str | None
    packed: bool = False


def default_threads() -> int:
    """The native kernels' threads unless set: every core this process may run on."""
    return len(os.sched_getaffinity(0))


def install_rows_kernels(
    model: nn.Module, threads: int | None = None, isa: str = "auto"
) -> RowsKernels:
    """Route the model's float projections (a tied output layer too) and attention through the
    native kernels for batched decode steps, and its norms and RoPEs for every float32 step.
    Changes the modules' classes in place; their weights are untouched. The reason names what
    stays on MLX's own operations (an architecture's own attention, experts' layers)."""
    from hotlora.models.cpu import extension
    from hotlora.models.cpu.attention import install_rows_attention
    from hotlora.models.cpu.layers import (
        NativeLinear,
        NativeOffsetRMSNorm,
        NativeRMSNorm,
        NativeRoPE,
        swap_layers,
    )

    threads = threads or default_threads()
    loaded = extension.load(threads, isa)
    if isinstance(loaded, str):
        return RowsKernels(False, loaded)
    swapped = swap_layers(model)
    attention = install_rows_attention(model)
    norms = swapped[NativeRMSNorm] + swapped[NativeOffsetRMSNorm]
    return RowsKernels(
        True,
        f"decode steps of {extension.MIN_ROWS}-{extension.max_rows} rows run "
        f"{swapped[NativeLinear]} projections and {' and '.join(attention) or 'no'} attention "
        f"through the rows kernels ({loaded.isa()}, {threads} threads); every float32 step runs "
        f"{norms} norms and {swapped[NativeRoPE]} RoPEs as one operation each; "
        f"MLX's own operations: {_left_to_mlx(model, attention)}",
    )


def _left_to_mlx(model: nn.Module, attention: list[str]) -> str:
    """What the kernels leave to MLX's own operations: an architecture's own attention, layers
    no Rows class serves (an MoE's experts, say); 'none'."""
    from hotlora.models.cpu.layers import mlx_layers

    kept = [f"{count} {name}" for name, count in sorted(mlx_layers(model).items())]
    if not attention:
        kept.insert(0, f"the attention of {type(model).__module__.rsplit('.', 1)[-1]} (its own)")
    return ", ".join(kept) or "none"


def install_packed_kernels(
    model: nn.Module,
    threads: int | None = None,
    precision: CpuPrecision = "exact",
    isa: str = "auto",
) -> RowsKernels:
    """Route every call of the model's quantized layers (packed, 4 or 8 bits), its other float
    layers, norms, RoPEs and attention through the native kernels, whatever the rows and
    tokens: a row's results are then the same bits alone, in any batch, in any chunking of its
    prompt. Changes the modules' classes in place and casts the float parameters that are not
    packed to float32 (`weights.to_packed`). `precision`: the packed layers' products
    (`layers.set_cpu_precision`): int8 activations (fast), in three int8 parts (exact) or float32
    ones (float32)."""
    from hotlora.models.cpu import extension
    from hotlora.models.cpu.attention import install_rows_attention
    from hotlora.models.cpu.fused import install_fused
    from hotlora.models.cpu.layers import (
        PackedEmbedding,
        PackedLinear,
        narrowed,
        set_cpu_precision,
        swap_layers,
    )
    from hotlora.models.cpu.weights import half_float_layers, to_packed, widened

    threads = threads or default_threads()
    loaded = extension.load(threads, isa)
    if isinstance(loaded, str):
        return RowsKernels(False, loaded)
    if count := widened(model):  # seconds on a large model: say what the wait is
        log.info("packing: widening the codes of %d quantized layers to 4 or 8 bits", count)
    if halves := half_float_layers(model):
        log.warning("%s", float32_layers(halves))
    repacked = to_packed(model)
    swapped = swap_layers(model, all_rows=True)
    attention = install_rows_attention(model, all_rows=True)
    fused = install_fused(model)
    quantized = swapped[PackedLinear] + swapped[PackedEmbedding]
    set_cpu_precision(model, precision)
    products = {
        "fast": "int8 activations, integer dot products (--cpu-precision fast)",
        "exact": "activations in three int8 parts, integer dot products (--cpu-precision exact)",
        "float32": "float32 activations (--cpu-precision float32)",
    }[precision]
    return RowsKernels(
        True,
        f"every step runs {quantized} quantized layers from their packed weights ({products}; "
        f"codes widened at load: {repacked.describe()}{narrowed(model)}) and "
        f"{' and '.join(attention) or 'no'} attention through the native kernels "
        f"({loaded.isa()}, {threads} threads), a row's results the same in any batch; "
        f"{fused} llama attention and MLP layers compute their projections together "
        "(and their adapters' residuals, where the gathered kernel reads them); "
        f"MLX's own operations: {_left_to_mlx(model, attention)}",
    )


def packed_unserved(model: nn.Module, batch_kernels: bool) -> str | None:
    """Why the native kernels cannot serve this model's weights packed; None when they can."""
    import importlib.util

    from hotlora.models.cpu import extension
    from hotlora.models.cpu.layers import quantized_unserved
    from hotlora.models.cpu.weights import has_gpu

    if has_gpu():
        return "MLX runs on a GPU here"
    if not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()):
        return "the weights are not quantized"
    if not batch_kernels:
        return "--no-cpu-native-kernels"
    if (why := extension.unavailable()) is not None:
        return why
    if importlib.util.find_spec(f"{extension.__package__}.{extension._MODULE}") is None:
        return "the native kernels are not built; `make setup` builds them"
    return quantized_unserved(model)


def float32_layers(halves: list[tuple[str, int]]) -> str:
    """The warning for half-precision layers of a packed model, served as float32 copies:
    which (the largest first), the RAM they cost, and what keeps them packed."""
    halves = sorted(halves, key=lambda item: -item[1])
    named = ", ".join(f"{path} ({size / 1e6:.0f} MB)" for path, size in halves[:3])
    more = f" and {len(halves) - 3} more" if len(halves) > 3 else ""
    total = sum(size for _, size in halves)
    return (
        f"{len(halves)} unquantized float16/bfloat16 layers served as float32 copies beside the "
        f"packed ones: {named}{more}, {total / 1e6:.0f} MB of RAM in all (half as loaded); to "
        "keep them packed, quantize them: a GGUF's embedding and output head with llama.cpp's "
        "llama-quantize --token-embedding-type q8_0 --output-tensor-type q8_0, a float model "
        "with `hotlora quantize`"
    )


def float32_fallback(model: nn.Module, unpacked: str) -> str:
    """The warning for quantized weights served as a float32 copy: why (`unpacked`, naming the
    layer where one is the cause), the RAM the copy costs, and what keeps them packed."""
    from hotlora.models.cpu.weights import float32_bytes, packed_bytes

    copy, packed = float32_bytes(model), packed_bytes(model)
    if unpacked == "--no-cpu-native-kernels":
        fix = "drop --no-cpu-native-kernels"
    elif "not built" in unpacked:
        fix = "`make setup` builds the native kernels"
    else:
        fix = (
            "quantize the model in MLX's affine mode at 1-6 or 8 bits (`hotlora quantize` from a "
            "float model), or pass --cpu-weights mlx to keep the weights as loaded for MLX's own, "
            "slower kernels"
        )
    return (
        f"quantized weights served as a float32 copy: {unpacked}; the copy takes "
        f"{copy / 1e6:.0f} MB of RAM where the packed weights would take {packed / 1e6:.0f} MB; "
        f"to keep them packed, {fix}"
    )


def prepare_cpu(
    model: nn.Module,
    *,
    weights: CpuWeights,
    float_budget: int | None,
    cache_bytes: int | None = None,
    vector_jit: bool,
    batch_kernels: bool,
    precision: CpuPrecision = "exact",
    model_dir: Path | None = None,
    home: Path,
    converting: Converting | None = None,
    threads: int | None = None,
    isa: str = "auto",
) -> CpuSetup:
    """Without a GPU: quantized weights kept packed for the native kernels, else float32 weights
    when they fit (`weights`, `float_budget`); MLX's fused CPU kernels built for this CPU and the
    attention that uses them (`vector_jit`); the native kernels (`batch_kernels`) on `threads`
    threads (default: every core this process may run on) with the vector instructions `isa`
    (auto: the widest this CPU runs), their packed products at `precision`
    (`install_packed_kernels`), or exact where the fast path's recorded verdict on `model_dir`
    says it breaks its rule there (`fidelity.serving_precision`); at most `cache_bytes` of freed
    buffers kept by MLX for reuse, the rest given back to the system (None: MLX's and malloc's
    own ways). Logs which weights and kernels serve and why."""
    from hotlora.models.cpu import extension
    from hotlora.models.cpu.attention import install_cpu_attention
    from hotlora.models.cpu.fidelity import serving_precision
    from hotlora.models.cpu.vector_jit import enable_vector_jit
    from hotlora.models.cpu.weights import (
        all_float32,
        any_quantized,
        choose_cpu_weights,
        has_gpu,
        to_float32,
    )

    if not has_gpu():  # an ISA the kernels cannot run here: refused before anything is loaded
        extension.check_isa(isa)
    cuda = getattr(mx, "cuda", None)  # absent from older MLX releases
    log.info(
        "MLX device: %s (Metal: %s, CUDA: %s)",
        mx.default_device(),
        mx.metal.is_available(),
        cuda is not None and cuda.is_available(),
    )
    unpacked = None if weights in ("auto", "packed") else f"--cpu-weights {weights}"
    unpacked = unpacked or packed_unserved(model, batch_kernels)
    choice = choose_cpu_weights(model, weights, float_budget, unpacked=unpacked)
    if choice.float32 and weights != "float32" and unpacked is not None and any_quantized(model):
        log.warning("%s", float32_fallback(model, unpacked))
    if choice.float32:
        with (converting or _quietly)(choice.reason):
            to_float32(model)
    served = "packed" if choice.packed else "float32" if choice.float32 else "as-loaded"
    log.info("serving %s weights: %s", served, choice.reason)
    if has_gpu():
        return CpuSetup(choice.float32, choice.reason, None, None)
    if cache_bytes is not None:
        # MLX keeps every freed buffer for reuse up to its memory limit: the batch KV cache's
        # old copies each time it grows or loses rows, held resident long after. By default it
        # keeps none: glibc's heap reuses the small buffers a step allocates and frees again.
        mx.set_cache_limit(cache_bytes)
        _map_large_buffers()
    if vector_jit:
        jit = enable_vector_jit(home)
        if jit.enabled:
            install_cpu_attention(model)
        jit_reason = jit.reason
    else:
        jit_reason = "baseline x86-64 (--no-cpu-vector-jit)"
    log.info("CPU kernels: %s", jit_reason)
    if choice.packed:
        if model_dir is not None:
            precision = serving_precision(precision, home, model_dir)
        rows = install_packed_kernels(model, threads, precision, isa)
        if rows.enabled:
            log.info("native kernels: %s", rows.reason)
            return CpuSetup(False, choice.reason, jit_reason, rows.reason, packed=True)
        log.warning("native kernels: unusable (%s); MLX's own kernels serve as loaded", rows.reason)
        return CpuSetup(False, choice.reason, jit_reason, None)
    if not all_float32(model):  # the batched decode kernels read float32 weights
        return CpuSetup(False, choice.reason, jit_reason, None)
    if batch_kernels:
        rows = install_rows_kernels(model, threads, isa)
        rows_reason = rows.reason if rows.enabled else f"MLX's own (BLAS; {rows.reason})"
    else:
        rows_reason = "MLX's own (BLAS; --no-cpu-native-kernels)"
    log.info("batched decode kernels: %s", rows_reason)
    return CpuSetup(True, choice.reason, jit_reason, rows_reason)


def _quietly(reason: str) -> AbstractContextManager[object]:
    return contextlib.nullcontext()


@functools.cache
def _glibc(name: str) -> Callable[..., int] | None:
    """glibc's malloc function `name`, or None elsewhere than glibc."""
    try:
        return cast("Callable[..., int]", getattr(ctypes.CDLL(None), name))
    except (OSError, AttributeError):
        return None


def _map_large_buffers() -> None:
    """Keep glibc's malloc mapping every buffer of 128 KiB or more of its own, so that freeing
    one gives it back to the system. Unset, glibc raises that threshold to the size of each
    mapped buffer freed (up to 32 MiB), and from then on the KV caches' buffers come from its
    heap, whose freed space stays resident. Elsewhere than glibc, nothing changes."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def give_back_freed_memory() -> None:
    """Return what was just freed to the system: MLX's cached buffers, then the free pages of
    glibc's heaps (`malloc_trim`). An adapter's arrays are hundreds of buffers, nearly all under
    the 128 KiB that glibc maps of their own, so its heap holds them; once they are freed, their
    pages stay resident (a trim aside) wherever a buffer allocated later sits above them, and
    adapters mounted and unmounted over and over would keep the server's memory at its peak.
    Elsewhere than glibc, MLX's cache alone."""
    mx.clear_cache()
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)
