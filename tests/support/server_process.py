"""A server in a subprocess on a free loopback port, for end-to-end tests and the benchmark.

The one way either starts a server: hotlora itself, or another OpenAI-compatible server that
the benchmark compares it with.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

READY_TIMEOUT_S = 300.0
# The base URL of in-process clients: a loopback name, which a loopback server answers.
LOCALHOST = "http://localhost"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hotlora_ready(client: httpx.Client, url: str) -> str | None:
    """The served base model's id once `GET /ready` says so; None before."""
    response = client.get(f"{url}/ready", timeout=5)
    return response.json().get("model", "") if response.status_code == 200 else None


def hotlora_command(*args: str) -> Callable[[int], list[str]]:
    """`hotlora serve ARGS` on loopback at the given port."""

    def argv(port: int) -> list[str]:
        serve = ["serve", "--host", "127.0.0.1", "--port", str(port), *args]
        return [sys.executable, "-m", "hotlora.server.cli", *serve]

    return argv


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server and tell when it can serve."""

    name: str
    argv: Callable[[int], list[str]]  # port -> command line
    ready: Callable[[httpx.Client, str], str | None] = hotlora_ready  # -> model id, or not yet
    hint: str = ""  # what to try when it exits before it is ready


def hotlora_spec(*args: str) -> ServerSpec:
    return ServerSpec("hotlora", hotlora_command(*args))


class ServerProcess:
    """A server subprocess; `url` and `model_id` once ready. Use as a context manager, or
    `start()` several and `wait_ready()` each, so they load in parallel; `stop()` is safe twice.
    """

    def __init__(
        self,
        spec: ServerSpec,
        *,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
    ):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_id = ""
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"{spec.name}-{self.port}.log"
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> ServerProcess:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            self.spec.argv(self.port), env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        return self

    def wait_ready(self) -> None:
        """Block until the server can serve; stop it and raise with its log if it cannot."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + self.ready_timeout
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    problem = f"exited ({self.proc.returncode})"
                    if self.spec.hint:
                        problem += f" ({self.spec.hint})"
                    break
                try:
                    model = self.spec.ready(client, self.url)
                except httpx.HTTPError:
                    model = None
                if model is not None:
                    self.model_id = model
                    return
                time.sleep(0.2)
            else:
                problem = f"was not ready after {self.ready_timeout:.0f}s"
        self.stop()
        raise RuntimeError(f"{self.spec.name} {problem}:\n{self.log()}")

    def log(self, lines: int = 40) -> str:
        """The last lines the server wrote."""
        if self._log is not None and not self._log.closed:
            self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process (Linux /proc; 0 elsewhere)."""
        assert self.proc is not None
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> ServerProcess:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
