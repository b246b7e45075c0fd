"""Benchmark plumbing: servers as subprocesses on loopback ports, and timed SSE chat requests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Sample:
    """One timed generation. Times in seconds; `tokens` excludes a final stop token."""

    system: str
    round: int
    ttft_s: float
    decode_tok_s: float
    tokens: int
    prompt_tokens: int
    finish_reason: str
    text: str
    chunks: int = 0  # SSE chunks with content; one per token unless text was held back
    cached_tokens: int | None = None  # prompt tokens served from the prompt cache, if reported
    other_cpu_s: float = 0.0  # CPU time the idle server(s) used meanwhile

    def as_json(self) -> dict:
        return self.__dict__.copy()


def decode_rate(tokens: int, t_first: float, t_last: float) -> float:
    """Tokens after the first, per second of the span between the first and the last."""
    span = t_last - t_first
    return (tokens - 1) / span if tokens > 1 and span > 0 else float("nan")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class ServerSpec:
    """How to start one OpenAI-compatible server and tell when it can serve."""

    name: str
    argv: Callable[[int], list[str]]  # port -> command line
    ready: Callable[[httpx.Client, str], str | None]  # -> the model id to send, None if not yet
    usage_counts_stop_token: bool  # whether usage.completion_tokens includes the eos token


class Server:
    """A running server subprocess; stop() is safe to call twice."""

    def __init__(self, spec: ServerSpec, env: dict[str, str], log_dir: Path):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{spec.name}.log"
        self.model_id = ""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.spec.argv(self.port), env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, client: httpx.Client, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"{self.spec.name} exited ({code}):\n{self.log()}")
            try:
                model = self.spec.ready(client, self.url)
            except httpx.HTTPError:
                model = None
            if model is not None:
                self.model_id = model
                return
            time.sleep(0.25)
        raise TimeoutError(f"{self.spec.name} not ready after {timeout:.0f}s:\n{self.log()}")

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def log(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def _hotlora_ready(client: httpx.Client, url: str) -> str | None:
    r = client.get(f"{url}/ready", timeout=5)
    return r.json().get("model", "") if r.status_code == 200 else None


def _mlx_lm_ready(client: httpx.Client, url: str) -> str | None:
    # /v1/models answers before the generation thread has loaded the model; a one-token
    # completion blocks until it has.
    if client.get(f"{url}/v1/models", timeout=5).status_code != 200:
        return None
    body = {"model": "default_model", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    r = client.post(f"{url}/v1/completions", json=body, timeout=STARTUP_TIMEOUT_S)
    return "default_model" if r.status_code == 200 else None


def _argv(command: list[str], model_dir: Path, log_level: str) -> Callable[[int], list[str]]:
    """`python -m <command> --model DIR` on loopback at the given port, quiet."""

    def argv(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            *command,
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            log_level,
        ]

    return argv


def hotlora_spec(model_dir: Path) -> ServerSpec:
    argv = _argv(["hotlora.server.cli", "serve"], model_dir, "warning")
    return ServerSpec("hotlora", argv, _hotlora_ready, usage_counts_stop_token=False)


def mlx_lm_spec(model_dir: Path) -> ServerSpec:
    argv = _argv(["mlx_lm", "server"], model_dir, "WARNING")
    # Its batch path queues the eos token as a response, so len(tokens) counts it.
    return ServerSpec("mlx_lm.server", argv, _mlx_lm_ready, usage_counts_stop_token=True)


def stream_chat(
    client: httpx.Client,
    server: Server,
    question: str,
    max_tokens: int,
    round_: int,
    extra: dict[str, Any] | None = None,
) -> Sample:
    """One greedy streaming chat request, timed at the client as each SSE chunk arrives.

    The first token is the first chunk with non-empty content (hotlora sends a role-only
    chunk before any token exists). Token counts come from the usage chunk. `extra` is merged
    into the request body (e.g. an `adapter` field).
    """
    body: dict[str, Any] = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        **(extra or {}),
    }
    text, chunks, usage, finish = [], 0, None, ""
    t_first = t_last = None
    t0 = time.perf_counter()
    url = f"{server.url}/v1/chat/completions"
    with client.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{server.spec.name}: HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                    chunks += 1
                    text.append(content)
                finish = choice.get("finish_reason") or finish
    if t_first is None or t_last is None:
        raise RuntimeError(f"{server.spec.name}: no content streamed for {question!r}")
    if usage is None:
        raise RuntimeError(f"{server.spec.name}: no usage chunk for {question!r}")
    tokens = int(usage["completion_tokens"])
    if finish == "stop" and server.spec.usage_counts_stop_token:
        tokens -= 1
    return Sample(
        system=server.spec.name,
        round=round_,
        ttft_s=t_first - t0,
        decode_tok_s=decode_rate(tokens, t_first, t_last),
        tokens=tokens,
        prompt_tokens=int(usage["prompt_tokens"]),
        finish_reason=finish,
        text="".join(text),
        chunks=chunks,
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    )
