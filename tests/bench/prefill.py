"""`make bench`, section `prefill`: one long prompt, alone and beside a running stream.

Each system prefills a `--prefill-tokens` (8,000) token prompt through `/v1/completions`
(`max_tokens` 1, so the request's time is its prefill), first alone, then while a streaming
chat request decodes beside it (end-of-text tokens biased away, so it outlasts the prefill).
Reported: the prefill's time alone and beside the stream, and the longest gap between two of
the stream's tokens while the long prompt prefilled, with how many tokens it got meanwhile.
Every prompt opens with a line of its own, so no prompt cache helps. Systems: hotlora, and
llama.cpp's `llama-server` on the same GGUF when `LLAMA_SERVER` names its binary, side by side.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from tests.bench.servers import REQUEST_TIMEOUT_S, hotlora_bench_spec, kernels_isa, launch
from tests.support.server_process import ServerProcess, ServerSpec

STREAM_QUESTION = "Write a very long story about a lighthouse keeper and a storm."
STREAM_LEAD_TOKENS = 8  # the stream's tokens before the long prompt is sent
_WORDS = " ".join(
    (
        "river mountain lantern harbor orchard meadow violin compass glacier canyon ember falcon",
        "thistle marble quarry beacon saddle willow cobalt prairie summit anchor bramble cedar",
        "delta fable garnet hollow island jasper kettle ledger mosaic nectar oyster pepper quill",
        "raven spindle tundra umber velvet wander yonder zephyr",
    )
).split(" ")


@dataclass
class Round:
    """One round on one system: the long prompt alone, then beside a stream."""

    alone_s: float
    beside_s: float
    longest_gap_s: float
    stream_tokens: int  # the stream's tokens while the long prompt prefilled


@dataclass
class System:
    name: str
    prompt_tokens: int = 0
    rounds: list[Round] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.rounds)


@dataclass(frozen=True)
class PrefillSection:
    title: str
    lines: list[str]


def long_prompt(tokenizer: Tokenizer, tokens: int, seed: int) -> str:
    """Text of about `tokens` tokens: a line naming the seed, then sentences of common words."""
    rng = random.Random(seed)
    lines = [f"Document {seed}: notes taken on day {rng.randint(1, 10_000)}."]
    while len(tokenizer.encode("\n".join(lines)).ids) < tokens:
        for _ in range(50):
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + ".")
    ids = tokenizer.encode("\n".join(lines)).ids[:tokens]
    return tokenizer.decode(ids)


def complete(client: httpx.Client, server: ServerProcess, prompt: str) -> tuple[float, int]:
    """One greedy one-token completion of `prompt`: (seconds, prompt tokens)."""
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    began = time.perf_counter()
    r = client.post(f"{server.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    took = time.perf_counter() - began
    if r.status_code != 200:
        raise RuntimeError(f"{server.spec.name}: HTTP {r.status_code}: {r.text}")
    return took, int(r.json()["usage"]["prompt_tokens"])


class Stream(threading.Thread):
    """A streaming chat request that runs until stopped, noting when each token arrived."""

    def __init__(self, server: ServerProcess, end_ids: list[int]):
        super().__init__(daemon=True)
        self.server, self.end_ids = server, end_ids
        self.times: list[float] = []
        self.started_tokens = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": self.server.model_id,
            "messages": [{"role": "user", "content": STREAM_QUESTION}],
            "stream": True,
            "temperature": 0,
            "max_tokens": 4000,
            "logit_bias": {str(i): -100 for i in self.end_ids},
        }
        url = f"{self.server.url}/v1/chat/completions"
        try:
            with (
                httpx.Client() as client,
                client.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as response,
            ):
                for line in response.iter_lines():
                    if self.stop.is_set():
                        return  # closing the connection cancels the request
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    for choice in json.loads(line[5:]).get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            self.times.append(time.perf_counter())
                    if len(self.times) >= STREAM_LEAD_TOKENS:
                        self.started_tokens.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc
        finally:
            self.started_tokens.set()


def beside_stream(
    client: httpx.Client, server: ServerProcess, prompt: str, end_ids: list[int]
) -> tuple[float, float, int]:
    """The long prompt's prefill while a stream decodes: (seconds, the stream's longest gap
    between tokens meanwhile, its tokens meanwhile)."""
    stream = Stream(server, end_ids)
    stream.start()
    stream.started_tokens.wait(REQUEST_TIMEOUT_S)
    if stream.error is not None or len(stream.times) < STREAM_LEAD_TOKENS:
        raise RuntimeError(f"{server.spec.name}: the stream did not start: {stream.error}")
    sent = time.perf_counter()
    took, _ = complete(client, server, prompt)
    done = sent + took
    deadline = time.perf_counter() + 60
    while stream.is_alive() and not any(t > done for t in stream.times):
        if time.perf_counter() > deadline:
            break
        time.sleep(0.01)  # the stream's first token after the prefill ends its last gap
    stream.stop.set()
    stream.join(REQUEST_TIMEOUT_S)
    times = stream.times
    # Gaps that overlap the prefill, from the last token before it to the first after it.
    before = [t for t in times if t <= sent][-1:]
    during = [t for t in times if sent < t <= done]
    after = [t for t in times if t > done][:1]
    marks = [*before, *during, *after]
    if not after:
        marks.append(done)  # the stream had not yet caught up when it was stopped
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return took, max(gaps), len(during)


def llama_server_spec(binary: Path, gguf: Path, context: int) -> ServerSpec:
    """llama.cpp's server on the GGUF itself, two slots of `context` tokens each."""

    def argv(port: int) -> list[str]:
        return [
            str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", "2", "-c", str(2 * context), "-t", str(os.cpu_count() or 2),
        ]  # fmt: skip

    def ready(client: httpx.Client, url: str) -> str | None:
        return "default" if client.get(f"{url}/health", timeout=5).status_code == 200 else None

    return ServerSpec("llama-server", argv, ready)


def end_ids(model_dir: Path) -> list[int]:
    """The model's end-of-text ids, which the stream is biased against."""
    config = json.loads((model_dir / "config.json").read_text())
    generation = model_dir / "generation_config.json"
    ids = config.get("eos_token_id")
    if generation.is_file():
        ids = json.loads(generation.read_text()).get("eos_token_id", ids)
    ids = ids if isinstance(ids, list) else [ids]
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for name in ("eos_token", "pad_token"):
        token = tokenizer_config.get(name)
        if isinstance(token, str) and (found := tokenizer.token_to_id(token)) is not None:
            ids.append(found)
    return sorted({int(i) for i in ids if i is not None})


def run_prefill(
    model_dir: Path, env: dict[str, str], prompt_tokens: int, rounds: int, isa: str = "auto"
) -> PrefillSection:
    """hotlora (on `isa`'s kernels, `--cpu-kernels-isa`), then llama-server when `LLAMA_SERVER`
    names it, one at a time."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    biased = end_ids(model_dir)
    specs = [hotlora_bench_spec(model_dir, "--cpu-kernels-isa", isa)]
    llama = os.environ.get("LLAMA_SERVER")
    if llama:
        from hotlora.models.embedded import embedded_gguf_path

        specs.append(llama_server_spec(Path(llama), embedded_gguf_path(), prompt_tokens + 192))
    systems: list[System] = []
    with tempfile.TemporaryDirectory(prefix="hotlora-bench-") as logs, httpx.Client() as client:
        for spec in specs:
            (server,) = launch([spec], env, Path(logs))
            system = System(spec.name)
            try:
                complete(client, server, long_prompt(tokenizer, 600, seed=-1))  # warm-up
                for round_ in range(rounds):
                    alone, system.prompt_tokens = complete(
                        client, server, long_prompt(tokenizer, prompt_tokens, 2 * round_)
                    )
                    prompt = long_prompt(tokenizer, prompt_tokens, 2 * round_ + 1)
                    beside, gap, during = beside_stream(client, server, prompt, biased)
                    system.rounds.append(Round(alone, beside, gap, during))
                    print(
                        f"{spec.name}, round {round_ + 1}: {system.prompt_tokens}-token prefill "
                        f"{alone:.1f}s alone, {beside:.1f}s beside a stream (longest gap "
                        f"{gap:.2f}s, {during} tokens meanwhile)",
                        flush=True,
                    )
            finally:
                server.stop()
            systems.append(system)
    return PrefillSection(
        f"prefill: a {prompt_tokens}-token prompt alone and beside a running stream "
        f"(medians of {rounds} round{'s' * (rounds > 1)}); {kernels_isa(isa)}",
        table(systems) + ratios(systems),
    )


def table(systems: list[System]) -> list[str]:
    head = (
        f"{'system':<14}{'prompt':>8}{'alone_s':>9}{'tok/s':>8}{'beside_s':>10}"
        f"{'longest gap_s':>15}{'stream tokens':>15}"
    )
    lines = [head]
    for s in systems:
        alone = s.median("alone_s")
        lines.append(
            f"{s.name:<14}{s.prompt_tokens:>8}{alone:>9.1f}{s.prompt_tokens / alone:>8.0f}"
            f"{s.median('beside_s'):>10.1f}{s.median('longest_gap_s'):>15.2f}"
            f"{s.median('stream_tokens'):>15.0f}"
        )
    return lines


def ratios(systems: list[System]) -> list[str]:
    named = {s.name: s for s in systems}
    hot, llama = named.get("hotlora"), named.get("llama-server")
    if hot is None or llama is None:
        return []
    alone = hot.median("alone_s") / llama.median("alone_s")
    gap = hot.median("longest_gap_s") / llama.median("longest_gap_s")
    return [f"hotlora/llama-server: prefill alone {alone:.2f}x the time, longest gap {gap:.2f}x"]


if __name__ == "__main__":
    sys.exit("run through `python -m tests.bench --sections prefill`")
