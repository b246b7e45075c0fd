"""The native kernels on every ISA, without MLX: tests/native/kernels_check.cpp built with the
kernels' sources (models/cpu/native/kernels) and the extension's flags, for this machine and for
arm64 (run under qemu), checks each float and quantized product and the attention against a
scalar reference, and each row's bits alone and in a batch. The whole extension compiles without
a warning, here and for arm64. Which machines take the kernels, and what the others log."""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from hotlora.models.cpu import extension, prepare_cpu, weights
from hotlora.models.cpu.extension import (
    NATIVE,
    compile_cleanly,
    include_flags,
    kernel_flags,
    kernel_sources,
    kernels_program,
    sources,
)
from hotlora.models.loader import load_model_dir

from tests.bench import lora_reads
from tests.support.tiny import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "native" / "kernels_check.cpp"
ARM64_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
ARM64_ROOT = Path("/usr/aarch64-linux-gnu")  # Debian's arm64 libraries, for qemu's loader


def build(cxx: str, machine: str, out: Path, objects: list[Path] | None = None) -> Path:
    """The check compiled by `cxx` for `machine` with the kernels' sources (or their `objects`,
    compiled for it), at `out`; the kernels and the check build without a warning."""
    return kernels_program(CHECK, out, cxx=cxx, machine=machine, objects=objects)


@pytest.fixture(scope="module")
def kernel_objects(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The kernels' sources compiled for this machine once, on both cores, for the programs
    that link them (the check, tests/bench/lora_reads.py's): the tests that take it are
    skipped where the kernels serve nothing."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("the native kernels serve x86-64 and arm64 Linux")
    if shutil.which("g++") is None:
        pytest.fail("g++ is missing: `make setup` installs it")
    folder = tmp_path_factory.mktemp("kernel-objects")

    def compile_one(source: Path) -> Path:
        out = folder / f"{source.parent.name}-{source.stem}.o"
        command = ["g++", *kernel_flags(), f"-I{NATIVE}", "-c", str(source), "-o", str(out)]
        compile_cleanly(command, source.name)
        return out

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(compile_one, kernel_sources()))


def syntax_errors(cxx: str, machine: str, *extra: str) -> list[str]:
    """Each of the extension's sources checked by `cxx` for `machine` against MLX's and
    nanobind's headers, warnings as errors: the compiler's complaints, none when clean."""

    def check(source: Path) -> str:
        command = [
            *(cxx, *kernel_flags(machine), "-fsyntax-only", "-Werror", *extra),
            *(*include_flags(), str(source)),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        return "" if result.returncode == 0 else f"{source}:\n{result.stderr[-4000:]}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        return [error for error in pool.map(check, sources()) if error]


def passed(result: subprocess.CompletedProcess[str], isa: str) -> bool:
    # The x86 ISAs also check their interleaved products on 5- and 6-bit layouts (108 more).
    checks = 1092 if isa == "neon" else 1200
    return (
        result.returncode == 0
        and f"{isa}: {checks} products (integer ones included), low-rank activations and "
        "attentions right, each row's product the same bits alone and in its batch"
        in result.stdout
    )


def test_the_kernels_of_this_machine_pass_the_check(tmp_path: Path, kernel_objects: list[Path]):
    machine = platform.machine()
    check = build("g++", machine, tmp_path / "kernels_check", kernel_objects)
    result = subprocess.run([check], capture_output=True, text=True, timeout=300)
    # AVX2 or NEON: every server these kernels serve runs one of them.
    assert passed(result, "avx2" if machine == "x86_64" else "neon"), result.stdout
    for isa in ("avx512", "avx512vbmi", "avx512vnni") if machine == "x86_64" else ():
        if f"{isa}: not run" not in result.stdout:
            assert passed(result, isa), result.stdout


def test_the_lora_reads_benchmark_builds_and_times_the_kernels_of_this_machine(
    tmp_path: Path, kernel_objects: list[Path]
):
    # Raises on an error or a warning.
    program = lora_reads.build(tmp_path / "lora_reads", kernel_objects)
    widest = "avx2" if platform.machine() == "x86_64" else "neon"
    for half in (True, False):  # a pair of 96 x 16 and 16 x 40, a footprint of 64 KiB
        isa, lora, read = lora_reads.measure(program, 96, 40, 16, half, 1 / 16, 1, 0.05, True)
        assert isa == widest or isa.startswith("avx512")
        assert lora > 0 and read is not None and read > 0
    assert lora_reads.measure(program, 96, 40, 16, True, 1 / 16, 1, 0.05, False)[1] > 0  # no read


def test_the_neon_kernels_pass_the_check_under_qemu(tmp_path: Path):
    if platform.machine() == "aarch64":
        pytest.skip("an arm64 machine: the check above runs NEON natively")
    missing = [tool for tool in (ARM64_CXX, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} missing: `make setup` installs the arm64 cross "
            "compiler and qemu (g++-aarch64-linux-gnu, qemu-user)"
        )
    check = build(ARM64_CXX, "aarch64", tmp_path / "kernels_check")
    result = subprocess.run(
        [QEMU, "-L", str(ARM64_ROOT), check], capture_output=True, text=True, timeout=600
    )
    assert passed(result, "neon"), result.stdout


def test_the_whole_extension_compiles_without_a_warning():
    """Every source of the extension, -Wall -Wextra -Werror: the primitives, plans, checks and
    bindings beside the kernels that the check above builds."""
    machine = platform.machine()
    if sys.platform != "linux" or machine not in ("x86_64", "aarch64"):
        pytest.skip("the native kernels serve x86-64 and arm64 Linux")
    assert syntax_errors("g++", machine) == []


def test_the_whole_extension_compiles_for_arm64():
    """The primitives and threads beside the kernels too: code the check above leaves out, which
    must keep to no x86 intrinsic, warnings as errors. Compiled against MLX's and nanobind's
    headers, not linked (MLX's arm64 library is not at hand)."""
    if platform.machine() == "aarch64":
        pytest.skip("an arm64 machine: the test above compiles it natively")
    if shutil.which(ARM64_CXX) is None:
        pytest.skip(f"{ARM64_CXX} missing: `make setup` installs it (g++-aarch64-linux-gnu)")
    include = Path(sysconfig.get_paths()["include"])
    if "x86_64-linux-gnu" in (include / "pyconfig.h").read_text():
        pytest.skip("this Python's headers describe x86-64 alone (a multiarch pyconfig.h)")
    assert syntax_errors(ARM64_CXX, "aarch64", "-Wno-psabi") == []


def test_an_arm64_linux_machine_takes_the_kernels_whatever_its_flags(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(extension, "cpu_features", lambda: set())  # arm64 lists no x86 flags
    assert extension.unavailable() is None
    assert "-march=armv8-a" in kernel_flags()
    assert not any(flag.startswith("-m") for flag in kernel_flags("x86_64"))


@pytest.mark.parametrize("machine", ["riscv64", "armv7l"])  # 32-bit arm: no AArch64 NEON
def test_another_machine_keeps_mlxs_operations_and_the_log_says_why(
    machine: str, monkeypatch, tmp_path: Path, caplog
):
    if weights.has_gpu():
        pytest.skip("MLX runs on a GPU here: the CPU kernels are not considered")
    model = load_model_dir(write_tiny_llama(tmp_path / "tiny")).model
    model.set_dtype(mx.float32)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    with caplog.at_level(logging.INFO, logger="hotlora"):
        setup = prepare_cpu(
            model,
            weights="auto",
            float_budget=None,
            vector_jit=False,
            batch_kernels=True,
            home=tmp_path,
        )
    reason = "not an x86-64 or arm64 Linux machine"
    assert setup.batch_kernels == f"MLX's own (BLAS; {reason})"
    assert f"batched decode kernels: MLX's own (BLAS; {reason})" in [
        r.getMessage() for r in caplog.records
    ]
    assert all(type(m) is nn.Linear for _, m in model.named_modules() if isinstance(m, nn.Linear))
