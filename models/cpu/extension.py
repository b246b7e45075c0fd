"""The native CPU kernels' extension: built with g++ against MLX's headers, loaded, self-checked.

`native/` holds MLX primitives for the few rows of a batched decode step (the projections, with
or without each row's LoRA residual, and the attention), for every step of packed quantized
weights (their products, several projections of one input as one primitive) and for every
float32 step (RMSNorm, RoPE, a prefill chunk's masked softmax); `native/README.md` maps its
files. It is a small C++ extension built by `make setup` (or `python -m
hotlora.models.cpu.extension`) with g++ against MLX's headers and nanobind, next to this module:
it needs Linux on x86-64 with AVX-512, or AVX2 and FMA, and F16C, or on arm64 (AArch64, whose
NEON every CPU has). Elsewhere the layers keep MLX's own operations.

Once `load` has checked it, `native` is the extension and `max_rows` the most rows of a batched
step its products take; until then `native` is None and every layer keeps MLX's own operations.
"""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from hotlora.models.cpu.features import cpu_features, x86_64_linux

MIN_ROWS = 2
# Up to these many rows the kernel beats OpenBLAS; by the vector instructions it uses. Beyond
# them BLAS, whose packing of the weights then pays off, is faster again. NEON's bound is AVX2's
# until it is measured on an arm64 server.
MAX_ROWS = {"avx512vnni": 16, "avx512vbmi": 16, "avx512": 16, "avx2": 8, "neon": 8}
NATIVE = Path(__file__).with_name("native")
_MODULE = "_rows_matmul"
_BUILD_HINT = "`make setup` builds it"

ISAS = tuple(MAX_ROWS)  # the kernels' instruction sets, widest first

native: ModuleType | None = None  # the extension, once loaded and checked
max_rows = 0  # the most rows of a batched decode step the kernels take, once loaded


def library_path() -> Path:
    return Path(__file__).with_name(_MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def unavailable() -> str | None:
    """Why the kernels cannot run on this machine; None when they can."""
    if sys.platform == "linux" and platform.machine() == "aarch64":
        return None  # NEON and the half-to-float conversion are in every ARMv8-A CPU
    if not x86_64_linux():
        return "not an x86-64 or arm64 Linux machine"
    features = cpu_features()
    if "f16c" not in features or ("avx512f" not in features and not {"avx2", "fma"} <= features):
        return "the CPU lacks AVX-512 and AVX2 with FMA, or F16C"
    return None


def sources() -> list[Path]:
    """The extension's C++ translation units: every .cpp under native/, subfolders included."""
    return sorted(NATIVE.rglob("*.cpp"))


def kernel_sources() -> list[Path]:
    """The vector kernels' own translation units (native/kernels): no MLX, no nanobind, so that
    tests/native's check builds them alone."""
    return sorted((NATIVE / "kernels").rglob("*.cpp"))


def include_flags() -> list[str]:
    """g++'s flags for the headers the extension's sources include: native/ itself, and Python's,
    nanobind's and MLX's as system headers (their own warnings are not the extension's)."""
    import nanobind

    nb = Path(nanobind.__file__).parent
    return [
        "-DNB_DOMAIN=mlx",  # MLX's own nanobind domain, so that `mx.array` crosses over
        f"-I{NATIVE}",
        *("-isystem", sysconfig.get_paths()["include"]),
        *("-isystem", str(nb / "include")),
        *("-isystem", str(nb / "ext" / "robin_map" / "include")),
        *("-isystem", str(Path(mx.__file__).parent / "include")),
    ]


def kernel_flags(machine: str | None = None) -> list[str]:
    """g++'s flags for the kernels' code on `machine` (x86_64 or aarch64; default: this one),
    the extension's and tests/native's check's alike. x86-64 needs none for its vector
    instructions: each ISA's code asks for its own target and runs where the CPU has it."""
    machine = machine or platform.machine()
    return [
        *("-O3", "-std=c++20", "-DNDEBUG", "-Wall", "-Wextra"),
        # Lets the compiler vectorize loops of selects (the softmax's exp); every operation
        # still rounds as IEEE says, so the results are the same bits.
        "-fno-trapping-math",
        # A product and a sum stay two roundings unless the code fuses them itself: the
        # quantized kernels dequantize as MLX does, scale * value, then + bias.
        "-ffp-contract=off",
        # The baseline every arm64 server runs: NEON, nothing newer.
        *(["-march=armv8-a"] if machine == "aarch64" else []),
    ]


def kernels_program(
    source: Path,
    out: Path,
    *,
    cxx: str = "g++",
    machine: str | None = None,
    objects: Sequence[Path] | None = None,
) -> Path:
    """A program of tests/native (`source`) built by `cxx` for `machine` with the kernels'
    sources, or their `objects` compiled for it, and the kernels' flags, at `out`. Raises
    RuntimeError with the compiler's complaints where it fails or warns (the flags hold -Wall
    -Wextra): tests/native's programs build as cleanly as the extension."""
    command = [
        *(cxx, *kernel_flags(machine), f"-I{NATIVE}", str(source)),
        *map(str, objects or kernel_sources()),
        *("-pthread", "-o", str(out)),
    ]
    compile_cleanly(command, source.name)
    return out


def compile_cleanly(command: Sequence[str], what: str) -> None:
    """Runs a compiler's `command` building `what`. Raises RuntimeError with the compiler's
    complaints where it fails or warns (the kernels' flags hold -Wall -Wextra)."""
    result = subprocess.run(list(command), capture_output=True, text=True)
    if result.returncode != 0 or "warning" in result.stderr:
        raise RuntimeError(f"building {what} failed:\n{result.stderr[-4000:]}")


def build() -> Path:
    """Compile the extension next to this module; returns its path. Raises on failure. Each
    source is compiled on its own core, then all are linked."""
    import nanobind

    cxx = os.environ.get("CXX", "g++")
    mlx_lib = Path(mx.__file__).parent / "lib"
    flags = [*kernel_flags(), "-fPIC", "-fvisibility=hidden", *include_flags()]
    # nanobind's own source, built with the extension: its warnings are not the extension's.
    nb_source = Path(nanobind.__file__).parent / "src" / "nb_combined.cpp"
    units = [(source, flags) for source in sources()] + [(nb_source, [*flags, "-w"])]
    target = library_path()
    staged = target.with_name(f".{target.name}.{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="hotlora-native-") as scratch:
        objects = [Path(scratch) / f"{i}-{source.stem}.o" for i, (source, _) in enumerate(units)]

        def compile_unit(i: int) -> None:
            source, unit_flags = units[i]
            command = [cxx, *unit_flags, "-c", str(source), "-o", str(objects[i])]
            subprocess.run(command, check=True)

        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        with ThreadPoolExecutor(max_workers=min(len(units), jobs or 1)) as pool:
            list(pool.map(compile_unit, range(len(units))))
        link = [cxx, "-shared", *map(str, objects), f"-L{mlx_lib}", "-lmlx"]
        try:
            subprocess.run([*link, f"-Wl,-rpath,{mlx_lib}", "-o", str(staged)], check=True)
            staged.replace(target)
        finally:
            staged.unlink(missing_ok=True)
    return target


def check_isa(isa: str) -> None:
    """Raises ValueError where `isa` (one of `ISAS`; auto passes) names kernels this machine
    cannot run: an operator's choice is refused at start, not swapped for another."""
    if isa == "auto":
        return
    if isa not in ISAS:
        raise ValueError(f"unknown kernels' ISA {isa!r}: expected auto or one of {', '.join(ISAS)}")
    if (reason := unavailable()) is not None:
        raise ValueError(f"--cpu-kernels-isa {isa}: the native kernels do not run here ({reason})")
    try:
        module = importlib.import_module(f"{__package__}.{_MODULE}")
    except ImportError as exc:
        raise ValueError(f"--cpu-kernels-isa {isa}: not built ({exc}); {_BUILD_HINT}") from exc
    active = module.isa()
    if not module.use_isa(isa):
        widest = next(name for name in ISAS if module.use_isa(name))  # the one active, at least
        module.use_isa(active)
        raise ValueError(
            f"--cpu-kernels-isa {isa}: this CPU lacks its instructions (the widest it runs is "
            f"{widest})"
        )
    module.use_isa(active)


def load(threads: int, isa: str = "auto") -> ModuleType | str:
    """The extension on `threads` threads, its kernels of `isa` (one of `ISAS`; auto: as they
    are, the widest this CPU runs unless a load chose another), checked on a small product, as
    `native`; else why it cannot serve (and `native` stays as it was). Raises ValueError where
    `isa` is named and this CPU lacks it: an operator's choice is not swapped for another."""
    global native, max_rows
    check_isa(isa)
    if (reason := unavailable()) is not None:
        return reason
    try:
        loaded = importlib.import_module(f"{__package__}.{_MODULE}")
    except ImportError as exc:
        return f"not built ({exc}); {_BUILD_HINT}"
    active = loaded.isa()
    if isa != "auto":
        loaded.use_isa(isa)  # check_isa found it runs here
    loaded.set_threads(threads)
    x = mx.random.normal((3, 40), key=mx.random.key(0))
    w = mx.random.normal((5, 40), key=mx.random.key(1))
    try:
        ok = mx.allclose(loaded.rows_matmul(x, w), x @ w.T, rtol=1e-5, atol=1e-5).item()
        ok = ok and mx.array_equal(loaded.rows_argmax(x)[:, 0], mx.argmax(x, axis=-1)).item()
        padded = loaded.step_key_mask(2, 3, mx.array([1, 0], dtype=mx.int32)).reshape(2, 3)
        ok = ok and padded.tolist() == [[False, True, True], [True, True, True]]
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:  # another MLX's build,
        # or one older than these sources
        loaded.use_isa(active)
        return f"unusable ({exc}); {_BUILD_HINT} again"
    if not ok:
        loaded.use_isa(active)
        return f"gave wrong products on a check; {_BUILD_HINT} again"
    native, max_rows = loaded, MAX_ROWS[loaded.isa()]
    return loaded


def one_token_rows(x: mx.array, ndim: int) -> bool:
    """Whether x is float32 of `ndim` axes with one token a row (axis -2) and 2 to the
    kernels' most rows (axis 0): a batched decode step's, with the kernels loaded."""
    shape = x.shape
    return (
        native is not None
        and len(shape) == ndim
        and shape[-2] == 1
        and MIN_ROWS <= shape[0] <= max_rows
        and x.dtype == mx.float32
    )


def greedy_rows(logits: mx.array) -> tuple[mx.array, mx.array] | None:
    """Each row's greedy token ([B] uint32, the first index of its largest logit: mx.argmax's
    choice wherever the row holds no NaN) and whether every one of its logits is finite ([B]
    bool), in one pass of the kernels (`rows_argmax`) where MLX's argmax and a sum read the
    logits a value at a time; None where the kernels do not take them: not loaded, not float32
    [B, V], or another device than the CPU."""
    if native is None or logits.dtype != mx.float32 or logits.ndim != 2:
        return None
    if mx.default_device() != mx.cpu:
        return None
    both = native.rows_argmax(logits)
    return both[:, 0], both[:, 1].astype(mx.bool_)


if __name__ == "__main__":
    if (why := unavailable()) is not None:
        print(f"batch matmul kernel not built: {why}")
    else:
        print(f"built {build()}")
