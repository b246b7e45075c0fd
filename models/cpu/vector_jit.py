"""Faster MLX CPU kernels with the same results: vector instructions for the JIT, and an attention
whose softmax uses them.

`mx.compile` (and mlx.nn's activations, which are compiled) turns chains of elementwise ops into
C++ that MLX builds with the host's `g++` on first use. MLX adds `-mavx2 -mfma -mf16c` to that
command only when MLX itself was built for AVX2, and its Linux wheel is built for baseline x86-64:
a kernel then calls libm for every fused multiply-add of `exp`'s polynomial, ~20 ns a value, and
SiLU and the attention softmax dominate what a batched decode step adds per row. With the flags,
the same code runs 2.5-4x faster and gives the same bits: a fused multiply-add rounds once
whether libm or the CPU does it, and `-std=c++17` keeps the compiler from fusing anything else.

The flags reach MLX through a `g++` wrapper first on PATH; MLX keeps what it builds under
`$TMPDIR/mlx`, so TMPDIR points at a directory of the hotlora home that only kernels built with
the flags go to (one built without them elsewhere is never picked up, nor ours by others).

MLX's CPU attention is a composition of ops whose softmax is one uncompiled kernel; on float32
`cpu_attention` computes the same composition, bit for bit, with the exponentials compiled.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base

# What MLX's own AVX2 builds add to the JIT command, and the CPU features they need.
JIT_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_CPU_FEATURES = ("avx2", "fma", "f16c")
_NO_COMPILER = "no g++ on PATH: MLX runs its fused kernels op by op"


@dataclass(frozen=True)
class VectorJit:
    enabled: bool
    reason: str


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags as Linux lists them; empty where it does not."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def vector_jit_unavailable() -> str | None:
    """Why MLX's JIT cannot use the vector flags on this machine; None when it can."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "not an x86-64 Linux machine: MLX's JIT is left as it is"
    missing = [f for f in _CPU_FEATURES if f not in cpu_features()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}: baseline x86-64 kernels"
    if shutil.which("g++") is None:
        return _NO_COMPILER
    return None


def enable_vector_jit(home: Path) -> VectorJit:
    """Have MLX build its fused CPU kernels with AVX2 and FMA where this x86-64 CPU has them.

    Sets PATH and TMPDIR of this process (Python's own temporary files stay where they were);
    safe to call again."""
    if (reason := vector_jit_unavailable()) is not None:
        return VectorJit(False, reason)
    root = Path(home).expanduser() / "mlx-jit" / "-".join(_CPU_FEATURES)
    bin_dir = root / "bin"
    others = _path_without(bin_dir)  # PATH without the wrapper, which may be there already
    compiler = shutil.which("g++", path=others)
    if compiler is None:
        return VectorJit(False, _NO_COMPILER)
    wrapper = f'#!/bin/sh\nexec {shlex.quote(compiler)} "$@" {" ".join(JIT_FLAGS)}\n'
    try:
        bin_dir.mkdir(parents=True, exist_ok=True)
        (root / "tmp").mkdir(exist_ok=True)
        target = bin_dir / "g++"
        if not target.is_file() or target.read_text() != wrapper:
            staged = bin_dir / f".g++.{os.getpid()}"
            staged.write_text(wrapper)
            staged.chmod(0o755)
            staged.replace(target)
    except OSError as exc:
        return VectorJit(False, f"cannot write {root} ({exc}): baseline x86-64 kernels")
    tempfile.gettempdir()  # fixes Python's choice before TMPDIR changes
    os.environ["PATH"] = os.pathsep.join([str(bin_dir), others])
    os.environ["TMPDIR"] = str(root / "tmp")
    return VectorJit(True, f"fused kernels built with {' '.join(JIT_FLAGS)} in {root}")


def _path_without(directory: Path) -> str:
    entries = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(e for e in entries if e and Path(e) != directory)


MaskedSoftmax = Callable[[mx.array, mx.array], mx.array]


@mx.compile
def _shifted_exp(scores: mx.array, maximum: mx.array) -> mx.array:
    return mx.exp(scores - maximum)


@mx.compile
def _normalized(exps: mx.array, total: mx.array) -> mx.array:
    return exps * (1 / total)


def softmax(scores: mx.array) -> mx.array:
    """`mx.softmax(scores, axis=-1, precise=True)` on float32, bit for bit, exponentials fused."""
    exps = _shifted_exp(scores, mx.max(scores, axis=-1, keepdims=True))
    return _normalized(exps, mx.sum(exps, axis=-1, keepdims=True))


def cpu_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
    *,
    masked_softmax: MaskedSoftmax | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` as MLX computes it on the CPU, with `softmax`.

    The steps are those of `mx.fast.scaled_dot_product_attention`'s CPU path (MLX's
    `mlx/fast.cpp`), with the same results bit for bit. Float32 only, without sinks or a
    quantized KV cache; anything else goes to mlx-lm's own function. `masked_softmax`, when
    given, computes `softmax(where(mask, scores, lowest))` for a bool mask of the scores' shape
    to the same bits in one operation (the native kernels' `masked_softmax`).
    """
    if (
        hasattr(cache, "bits")
        or sinks is not None
        or any(a.dtype != mx.float32 for a in (queries, keys, values))
    ):
        return mlx_lm_base.scaled_dot_product_attention(
            queries,
            keys,
            values,
            cache=cache,
            scale=scale,
            mask=mask,  # type: ignore[arg-type]  # mlx-lm passes "causal" too
            sinks=sinks,
        )
    batch, n_heads, q_len, _ = queries.shape
    n_kv_heads, kv_len = keys.shape[1], keys.shape[2]
    repeats = n_heads // n_kv_heads
    q = queries * mx.array(scale, dtype=queries.dtype)
    if repeats > 1:
        # The query heads sharing a KV head as a broadcast batch of products, as MLX groups
        # them: one product of all their rows would take other BLAS kernels, and other bits.
        q = q.reshape(batch, n_kv_heads, repeats, q_len, -1)  # [B, n_kv_heads, repeats, L, D]
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = q @ mx.swapaxes(keys, -1, -2)  # [B, n_kv_heads, (repeats,) L, S]
    if isinstance(mask, str):  # "causal": query i sees keys up to its own position
        q_idx = mx.arange(kv_len - q_len, kv_len)[:, None]
        mask = q_idx >= mx.arange(kv_len)[None]
    elif mask is not None:  # [B, n_heads, L, S], as MLX broadcasts it
        if mask.dtype != mx.bool_:
            mask = mask.astype(scores.dtype)
        mask = mx.broadcast_to(mask, (batch, n_heads, q_len, kv_len))
    if mask is not None:
        if repeats > 1 and mask.ndim >= 3:
            mask = mask.reshape(*mask.shape[:-3], n_kv_heads, repeats, *mask.shape[-2:])
        if mask.dtype == mx.bool_ and masked_softmax is not None:
            probabilities = masked_softmax(scores, mx.broadcast_to(mask, scores.shape))
            return (probabilities @ values).reshape(batch, n_heads, q_len, -1)
        if mask.dtype == mx.bool_:
            lowest = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
            scores = mx.where(mask, scores, lowest)
        else:
            scores = scores + mask
    return (softmax(scores) @ values).reshape(batch, n_heads, q_len, -1)


def install_cpu_attention(model: nn.Module) -> list[str]:
    """Point the model's architecture modules at `cpu_attention`; returns the modules changed.

    mlx-lm's architecture files call `scaled_dot_product_attention` as a module global; a
    module whose global is anything but mlx-lm's own function is left alone."""
    changed = []
    for module, current in attention_globals(model):
        if current is mlx_lm_base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = cpu_attention  # type: ignore[attr-defined]
            changed.append(module.__name__)
    return changed


def attention_globals(model: nn.Module) -> Iterator[tuple[ModuleType, Any]]:
    """The modules of the model's classes that have a `scaled_dot_product_attention` global
    (mlx-lm's architecture files call it as one), each with its current value."""
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if module is not None and current is not None:
            yield module, current
