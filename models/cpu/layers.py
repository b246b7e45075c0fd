"""The projections of a batched decode step on the CPU: `x @ w.T` for 2-16 rows of x.

OpenBLAS packs the whole weight matrix into blocks on every call, whatever the row count, so
at 8 rows a projection costs about three times its 1-row product (~8 GB/s of weights against
~30 GB/s for one row, measured here). `native/rows_matmul.cpp` reads each weight row from memory
once, straight into registers, and multiplies every row of x by it while it is there: the
8-row step's projections run about twice as fast.

Each output is one dot product summed in a fixed order, so a row's result does not depend on
the rest of the batch. It differs from BLAS in the last bits, so it serves only batched calls
of one token per row (`[B, 1, K]` inputs, 2 <= B <= 16; 8 with AVX2): decode steps, and a
batched prefill whose chunks are all one token long. A request alone, and every longer prefill,
keep BLAS and mlx-lm's results to the bit. Beyond 16 rows BLAS is faster again.

The model's RMSNorms and RoPEs take one primitive each (`RowsRMSNorm`, `RowsRoPE`): MLX's CPU
backend composes them from ten to thirty small operations, each of which costs more to schedule
(~7 us) than to compute at a few rows; per step that was about 2,000 of the graph's 3,700
operations. Each computes MLX's composition operation for operation, with MLX's own exp, sin and
cos, so its results are MLX's to the bit: every float32 call takes it, a request decoding alone
and prefill included. A batched decode step's attention (`rows_attention`) is one primitive too:
about twenty operations a layer, two of them BLAS products of a few rows, become one that reads
each row's cached keys and values once; like the projections, it is within rounding of MLX.
A prefill chunk's attention keeps MLX's BLAS products, but the softmax between them, five
single-threaded passes over a chunk's scores (which deep in a long prompt are tens of megabytes
a layer), is one threaded primitive (`masked_softmax`) with MLX's results to the bit.

The kernels are MLX primitives in a small C++ extension, built by `make setup` (or
`python -m hotlora.models.cpu.layers`) with g++ against MLX's headers and nanobind: it needs
x86-64 with AVX-512, or AVX2 and FMA.
"""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
import sys
import sysconfig
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base

from hotlora.models.cpu.vector_jit import attention_globals, cpu_attention, cpu_features

MIN_ROWS = 2
# Up to these many rows the kernel beats OpenBLAS here; by the vector instructions it uses.
MAX_ROWS = {"avx512": 16, "avx2": 8}
_SOURCE = Path(__file__).with_name("native") / "rows_matmul.cpp"
_MODULE = "_rows_matmul"
_BUILD_HINT = "`make setup` builds it"


@dataclass(frozen=True)
class BatchMatmul:
    enabled: bool
    reason: str


def library_path() -> Path:
    return Path(__file__).with_name(_MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def unavailable() -> str | None:
    """Why the kernel cannot run on this machine; None when it can."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "not an x86-64 Linux machine"
    features = cpu_features()
    if "avx512f" not in features and not {"avx2", "fma"} <= features:
        return "the CPU lacks AVX-512 and AVX2 with FMA"
    return None


def build() -> Path:
    """Compile the extension next to this module; returns its path. Raises on failure."""
    import nanobind

    nb = Path(nanobind.__file__).parent
    mlx_root = Path(mx.__file__).parent
    target = library_path()
    staged = target.with_name(f".{target.name}.{os.getpid()}")
    command = [
        os.environ.get("CXX", "g++"),
        *("-O3", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG"),
        # Lets the compiler vectorize loops of selects (the softmax's exp); every operation
        # still rounds as IEEE says, so the results are the same bits.
        "-fno-trapping-math",
        "-DNB_DOMAIN=mlx",  # MLX's own nanobind domain, so that `mx.array` crosses over
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{nb / 'include'}",
        f"-I{nb / 'ext' / 'robin_map' / 'include'}",
        f"-I{mlx_root / 'include'}",
        str(_SOURCE),
        str(nb / "src" / "nb_combined.cpp"),
        f"-L{mlx_root / 'lib'}",
        "-lmlx",
        f"-Wl,-rpath,{mlx_root / 'lib'}",
        "-o",
        str(staged),
    ]
    try:
        subprocess.run(command, check=True)
        staged.replace(target)
    finally:
        staged.unlink(missing_ok=True)
    return target


def _load(threads: int) -> ModuleType | str:
    """The extension on `threads` threads, checked on a small product; else why it cannot
    serve."""
    try:
        native = importlib.import_module(f"hotlora.models.cpu.{_MODULE}")
    except ImportError as exc:
        return f"not built ({exc}); {_BUILD_HINT}"
    native.set_threads(threads)
    x = mx.random.normal((3, 40), key=mx.random.key(0))
    w = mx.random.normal((5, 40), key=mx.random.key(1))
    try:
        ok = mx.allclose(native.rows_matmul(x, w), x @ w.T, rtol=1e-5, atol=1e-5).item()
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. built against another MLX
        return f"unusable ({exc}); {_BUILD_HINT} again"
    return native if ok else f"gave wrong products on a check; {_BUILD_HINT} again"


_native: ModuleType | None = None
_max_rows = 0


def _one_token_rows(x: mx.array, ndim: int) -> bool:
    """Whether x is float32 of `ndim` axes with one token a row (axis -2) and 2 to the
    kernels' most rows (axis 0): a batched decode step's, with the kernels loaded."""
    shape = x.shape
    return (
        _native is not None
        and len(shape) == ndim
        and shape[-2] == 1
        and MIN_ROWS <= shape[0] <= _max_rows
        and x.dtype == mx.float32
    )


def serves_rows(x: mx.array) -> bool:
    """Whether x is a batched decode step's input ([B, 1, in], float32) the kernel takes."""
    return _one_token_rows(x, 3)


def _decode_rows(x: mx.array, weight: mx.array) -> mx.array | None:
    """`x @ weight.T` through the kernel when x is a batched decode step's input, else None."""
    if weight.dtype != mx.float32 or not serves_rows(x):
        return None
    assert _native is not None
    return _native.rows_matmul(x, weight)  # [B, 1, out]


def serves_lora(linear: nn.Module) -> bool:
    """Whether `lora_rows` takes this projection, for inputs `serves_rows` takes."""
    return (
        _native is not None
        and type(linear) is RowsLinear
        and "bias" not in linear
        and linear.weight.dtype == mx.float32
    )


def lora_rows(
    x: mx.array, linear: nn.Module, a_t: mx.array, b_t: mx.array, mask: mx.array
) -> mx.array:
    """`linear(x) + ((x @ a_t.T) * mask) @ b_t.T` for a batched decode step, in one kernel call
    (`serves_lora` and `serves_rows` say when): x [B, 1, in], a_t [R, in], b_t [out, R],
    mask [B, R] or [B, 1, R], each row's scale on each low-rank column. Where the base
    projection's weights are read, so are the low-rank pair's: about a quarter of the cost of
    three separate products."""
    assert _native is not None
    return _native.rows_matmul_lora(x, linear.weight, a_t, b_t, mask)  # [B, 1, out]


class RowsLinear(nn.Linear):
    """`nn.Linear` whose batched decode steps go through the kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _decode_rows(x, self.weight)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


class RowsEmbedding(nn.Embedding):
    """`nn.Embedding` whose use as the output layer (tied weights) does the same."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _decode_rows(x, self.weight)
        return super().as_linear(x) if y is None else y


class RowsRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` as one primitive, not MLX's ten, on float32: MLX's results to the bit, so
    every call takes it (a request alone and prefill too)."""

    def __call__(self, x: mx.array) -> mx.array:
        if _native is not None and x.dtype == self.weight.dtype == mx.float32 and x.size:
            return _native.rms_norm_rows(x, self.weight, self.eps)
        return super().__call__(x)


class RowsRoPE(nn.RoPE):
    """`nn.RoPE` as one primitive, not MLX's thirty, on float32 [B, heads, L, D] with one
    position for all rows or one per row: MLX's results to the bit, so every call takes it."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if isinstance(offset, int) and -(2**31) <= offset < 2**31:
            offset = mx.array([offset], dtype=mx.int32)
        if (
            _native is not None
            and x.ndim == 4
            and x.size
            and x.dtype == mx.float32
            and isinstance(offset, mx.array)
            and offset.dtype == mx.int32
            and offset.shape in ((1,), (x.shape[0],))
        ):
            return _native.rope_rows(x, offset, self.dims, self.traditional, self.base, self.scale)
        return super().__call__(x, offset)  # type: ignore[arg-type]  # mlx-lm passes arrays


# Set while a model with the kernels installed runs, on the thread that runs it: the attention
# function is a module global of mlx-lm's architecture files, shared by every model of the
# process, and only those models' steps may take the kernel.
_running = threading.local()


class _RowsModel(nn.Module):
    """Mixed into an installed model's own class: its calls let `rows_attention` serve."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_running, "rows", False)
        _running.rows = True
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _running.rows = outer


_ROWS_MODELS: dict[type[nn.Module], type[nn.Module]] = {}


def _rows_model_class(cls: type[nn.Module]) -> type[nn.Module]:
    if issubclass(cls, _RowsModel):
        return cls
    if cls not in _ROWS_MODELS:
        _ROWS_MODELS[cls] = type(cls.__name__, (_RowsModel, cls), {"__module__": cls.__module__})
    return _ROWS_MODELS[cls]


Attention = Callable[..., mx.array]


def _serves_attention(queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> bool:
    """Whether an installed model's batched decode step calls attention with these: float32
    queries [B, H, 1, D], keys and values [B, Hkv, S, *], a bool mask [B, 1, 1, S]."""
    if not (getattr(_running, "rows", False) and _one_token_rows(queries, 4)):
        return False
    batch, heads, _, width = queries.shape
    return (
        keys.ndim == 4
        and values.ndim == 4
        and keys.dtype == values.dtype == mx.float32
        and keys.shape[0] == values.shape[0] == batch
        and keys.shape[1] == values.shape[1]
        and heads % keys.shape[1] == 0
        and keys.shape[2] == values.shape[2]
        and keys.shape[3] == width
        and isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.shape == (batch, 1, 1, keys.shape[2])
    )


def rows_attention(fallback: Attention) -> Attention:
    """mlx-lm's `scaled_dot_product_attention` for an architecture module: a batched decode
    step of an installed model through the attention kernel; its other calls (prefill chunks,
    a request decoding alone) to `fallback`, whose masked softmax, when it is `cpu_attention`,
    takes the `masked_softmax` primitive (the same bits)."""

    def attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if (
            sinks is None
            and not hasattr(cache, "bits")
            and _serves_attention(queries, keys, values, mask)
        ):
            assert _native is not None
            return _native.attention_rows(queries, keys, values, mask, scale)
        if fallback is cpu_attention and _native is not None and getattr(_running, "rows", False):
            # Prefill chunks: the masked softmax as one primitive, to cpu_attention's bits.
            return cpu_attention(
                queries,
                keys,
                values,
                cache=cache,
                scale=scale,
                mask=mask,
                sinks=sinks,
                masked_softmax=_native.masked_softmax,
            )
        return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    attention.rows_fallback = fallback  # type: ignore[attr-defined]
    return attention


def _install_attention(model: nn.Module) -> list[str]:
    """Point the model's architecture modules at `rows_attention`, over the function they had
    (mlx-lm's, or `cpu_attention`); returns the modules that take it."""
    served = []
    for module, current in attention_globals(model):
        if current in (mlx_lm_base.scaled_dot_product_attention, cpu_attention):
            module.scaled_dot_product_attention = rows_attention(current)
        if hasattr(module.scaled_dot_product_attention, "rows_fallback"):
            served.append(module.__name__.rsplit(".", 1)[-1])
    return served


_ROWS_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: RowsLinear,
    nn.Embedding: RowsEmbedding,
    nn.RMSNorm: RowsRMSNorm,
    nn.RoPE: RowsRoPE,
}


def install_batch_matmul(model: nn.Module, threads: int | None = None) -> BatchMatmul:
    """Route the model's float projections (a tied output layer too) and attention through the
    kernels for batched decode steps, and its norms and RoPEs for every float32 step. Changes
    the modules' classes in place; their weights are untouched."""
    global _native, _max_rows
    if (reason := unavailable()) is not None:
        return BatchMatmul(False, reason)
    threads = threads or min(len(os.sched_getaffinity(0)), 8)
    loaded = _load(threads)
    if isinstance(loaded, str):
        return BatchMatmul(False, loaded)
    _native, _max_rows = loaded, MAX_ROWS[loaded.isa()]
    swapped: Counter[type[nn.Module]] = Counter()
    for _, module in model.named_modules():
        rows_class = _ROWS_CLASSES.get(type(module))
        if rows_class is not None:
            module.__class__ = rows_class
            swapped[rows_class] += 1
    attention = _install_attention(model)
    if attention:
        model.__class__ = _rows_model_class(type(model))
    return BatchMatmul(
        True,
        f"decode steps of {MIN_ROWS}-{_max_rows} rows run {swapped[RowsLinear]} projections "
        f"and {' and '.join(attention) or 'no'} attention through the rows kernels "
        f"({loaded.isa()}, {threads} threads); every float32 step runs {swapped[RowsRMSNorm]} "
        f"norms and {swapped[RowsRoPE]} RoPEs as one operation each",
    )


if __name__ == "__main__":
    if (why := unavailable()) is not None:
        print(f"batch matmul kernel not built: {why}")
    else:
        print(f"built {build()}")
