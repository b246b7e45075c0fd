"""MLX's fused CPU kernels built with the vector instructions this CPU has, to the same bits.

`mx.compile` (and mlx.nn's activations, which are compiled) turns chains of elementwise ops into
C++ that MLX builds with the host's `g++` on first use. MLX adds `-mavx2 -mfma -mf16c` to that
command only when MLX itself was built for AVX2, and its Linux wheel is built for baseline x86-64:
a kernel then calls libm for every fused multiply-add of `exp`'s polynomial, and SiLU and the
attention softmax dominate what a batched decode step adds per row. With the flags the same code
runs several times faster and gives the same bits: a fused multiply-add rounds once whether libm
or the CPU does it, and `-std=c++17` keeps the compiler from fusing anything else.

The flags reach MLX through a `g++` wrapper first on PATH; MLX keeps what it builds under
`$TMPDIR/mlx`, so TMPDIR points at a directory of the hotlora home that only kernels built with
the flags go to (one built without them elsewhere is never picked up, nor ours by others).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hotlora.models.cpu.features import cpu_features, x86_64_linux

# What MLX's own AVX2 builds add to the JIT command, and the CPU features they need.
JIT_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_CPU_FEATURES = ("avx2", "fma", "f16c")
_NO_COMPILER = "no g++ on PATH: MLX runs its fused kernels op by op"


@dataclass(frozen=True)
class VectorJit:
    """Whether MLX's JIT builds with the vector flags, and why (the log's `CPU kernels:` line)."""

    enabled: bool
    reason: str


def vector_jit_unavailable() -> str | None:
    """Why MLX's JIT cannot use the vector flags on this machine; None when it can."""
    if not x86_64_linux():
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
