"""Benchmark plumbing: the servers to compare, and timed SSE chat requests."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.server_process import ServerProcess, ServerSpec, hotlora_spec

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


# Servers whose usage.completion_tokens counts the eos token: mlx_lm.server's batch path queues
# it as a response, so len(tokens) includes it.
COUNTS_STOP_TOKEN = frozenset({"mlx_lm.server"})


def _mlx_lm_ready(client: httpx.Client, url: str) -> str | None:
    # /v1/models answers before the generation thread has loaded the model; a one-token
    # completion blocks until it has.
    if client.get(f"{url}/v1/models", timeout=5).status_code != 200:
        return None
    body = {"model": "default_model", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    r = client.post(f"{url}/v1/completions", json=body, timeout=STARTUP_TIMEOUT_S)
    return "default_model" if r.status_code == 200 else None


def hotlora_bench_spec(model_dir: Path, *extra: str) -> ServerSpec:
    return hotlora_spec("--model", str(model_dir), "--log-level", "warning", *extra)


def mlx_lm_spec(model_dir: Path) -> ServerSpec:
    def argv(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ]

    return ServerSpec("mlx_lm.server", argv, _mlx_lm_ready)


def launch(specs: list[ServerSpec], env: dict[str, str], log_dir: Path) -> list[ServerProcess]:
    """Start every server at once (they load in parallel); return once all can serve."""
    servers = [
        ServerProcess(spec, env=env, log_dir=log_dir, ready_timeout=STARTUP_TIMEOUT_S)
        for spec in specs
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def stream_chat(
    client: httpx.Client,
    server: ServerProcess,
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
    if finish == "stop" and server.spec.name in COUNTS_STOP_TOKEN:
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


def kernels_isa(chosen: str = "auto") -> str:
    """The vector instructions hotlora's native kernels run with here (`chosen`, or auto: the
    widest this CPU runs), and the CPU's model."""
    from hotlora.models.cpu import extension

    loaded = extension.load(1)
    isa = loaded if isinstance(loaded, str) else loaded.isa()
    if chosen != "auto":
        isa = f"{chosen} (--cpu-kernels-isa; the CPU's widest: {isa})"
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    return f"kernels: {isa} on {model}"
