"""A real `hotlora serve` process on a free loopback port, for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hotlora.config.settings import Settings
from hotlora.models.embedded import ensure_embedded_model


def home() -> Path:
    """The cache shared with `make run`, so the embedded model is imported once per machine."""
    return Settings().home


def embedded_model_dir() -> Path:
    return ensure_embedded_model(home())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """`hotlora serve` in a subprocess; `url` once ready. Use as a context manager."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RemoteServer:
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"hotlora-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hotlora.server.cli", *self.args],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server not ready after {self.ready_timeout}s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
