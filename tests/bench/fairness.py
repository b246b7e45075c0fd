"""`make bench`, section `fairness`: one tenant floods, another's first token does not wait on it.

hotlora serves two keys (`--keys`, tenants `tenant-a` and `tenant-b`, weight 1 each) with its
default `--max-batch` (8). Tenant B sends `--fairness-rounds` (5) streaming requests one at a
time, first with the server idle, then while tenant A keeps `--fairness-flood` (64) streams in
flight (a new one as each ends; 32 to 64 new tokens each), so that most of A's requests wait
for a batch slot. Reported: B's median time to first token idle and beside A's flood, and the
median first token of A's requests that queued (those sent once the batch was full). Then the
same flood with B's requests sent under A's key, one tenant as every request was before the
fair share (first come, first served): B's request waits behind A's queue.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.bench.servers import REQUEST_TIMEOUT_S, launch
from tests.support.server_process import ServerProcess, hotlora_spec

MAX_BATCH = 8  # hotlora's default --max-batch
# New tokens per request of the flood: 32 to 64, spread so that slots free one at a time rather
# than all eight at once.
A_TOKENS = range(32, 65)
B_TOKENS = 16  # new tokens per request of tenant B
B_QUESTION = "Name three rivers of Europe."
A_QUESTIONS = [
    "Write a long story about a dragon who learns to bake bread.",
    "Explain in detail how a steam engine works.",
    "Describe a walk through a busy market in a foreign city.",
    "Write a letter from a sailor to his family.",
]
NO_END = {"0": -100, "1": -100, "2": -100}  # the flood's rows run to their max_tokens


@dataclass(frozen=True)
class FairnessSection:
    title: str
    lines: list[str]


@dataclass
class Flood:
    """Tenant A's streams: `streams` in flight, each started again as it ends, until stopped."""

    server: ServerProcess
    key: str
    streams: int
    stop: threading.Event = field(default_factory=threading.Event)
    first_tokens: list[tuple[int, float]] = field(default_factory=list)  # (order sent, ttft)
    errors: list[str] = field(default_factory=list)
    _sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(self.streams)]
        for thread in threads:
            thread.start()
        return threads

    def _loop(self, i: int) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.is_set():
                with self._lock:
                    order, self._sent = self._sent, self._sent + 1
                body = {
                    "messages": [{"role": "user", "content": A_QUESTIONS[i % len(A_QUESTIONS)]}],
                    "max_tokens": A_TOKENS[order * 17 % len(A_TOKENS)],
                    "logit_bias": NO_END,
                }
                try:
                    ttft = first_token(client, self.server, self.key, body)
                except (httpx.HTTPError, RuntimeError) as exc:
                    self.errors.append(str(exc))
                    time.sleep(0.5)
                    continue
                with self._lock:
                    self.first_tokens.append((order, ttft))

    def queued_ttfts(self) -> list[float]:
        """First tokens of the requests sent once the batch was full (all but the first ones)."""
        return [ttft for order, ttft in self.first_tokens if order >= MAX_BATCH]


def first_token(client: httpx.Client, server: ServerProcess, key: str, body: dict) -> float:
    """Stream one greedy chat request to its end; seconds to its first content chunk."""
    request = {
        "model": server.model_id,
        "stream": True,
        "temperature": 0,
        **body,
    }
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{server.url}/v1/chat/completions"
    began, ttft = time.perf_counter(), None
    with client.stream("POST", url, json=request, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or []:
                if ttft is None and (choice.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - began
    if ttft is None:
        raise RuntimeError("no content streamed")
    return ttft


def b_requests(server: ServerProcess, key: str, rounds: int) -> list[float]:
    """Tenant B's requests one at a time: each one's first token."""
    body = {"messages": [{"role": "user", "content": B_QUESTION}], "max_tokens": B_TOKENS}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        return [first_token(client, server, key, body) for _ in range(rounds)]


def beside_flood(
    server: ServerProcess, a_key: str, b_key: str, flood: int, rounds: int
) -> tuple[list[float], list[float]]:
    """B's first tokens while A floods, and A's queued requests' first tokens meanwhile."""
    streams = Flood(server, a_key, flood)
    threads = streams.start()
    try:
        wait_full(server, flood)
        b = b_requests(server, b_key, rounds)
    finally:
        streams.stop.set()
        for thread in threads:
            thread.join()
    if streams.errors:
        raise RuntimeError(f"the flood's requests failed: {streams.errors[:3]}")
    return b, streams.queued_ttfts()


def wait_full(server: ServerProcess, flood: int) -> None:
    """Until the flood's requests beyond the batch wait (vllm:num_requests_waiting)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        waiting = next(
            (
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:num_requests_waiting")
            ),
            0.0,
        )
        if waiting >= (flood - MAX_BATCH) * 0.75:
            return
        time.sleep(0.2)
    raise RuntimeError("the flood never filled the wait list")


def keys_file(folder: Path) -> tuple[Path, str, str]:
    """A keys file of two user keys, tenants `tenant-a` and `tenant-b`; the keys."""
    keys = {name: f"hl-{secrets.token_urlsafe(24)}" for name in ("tenant-a", "tenant-b")}
    entries = [
        f'[[key]]\nname = "{name}"\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
        'role = "user"\n'
        for name, key in keys.items()
    ]
    path = folder / "keys.toml"
    path.write_text("\n".join(entries))
    return path, keys["tenant-a"], keys["tenant-b"]


def run_fairness(model_dir: Path, env: dict[str, str], flood: int, rounds: int) -> FairnessSection:
    with tempfile.TemporaryDirectory(prefix="hotlora-bench-") as folder:
        keys, a_key, b_key = keys_file(Path(folder))
        spec = hotlora_spec(
            "--model", str(model_dir), "--log-level", "warning", "--keys", str(keys)
        )
        (server,) = launch([spec], env, Path(folder))
        try:
            b_requests(server, b_key, 1)  # warm-up
            idle = b_requests(server, b_key, rounds)
            print(f"fairness: B idle, first tokens {fmt(idle)}", flush=True)
            fair, a_fair = beside_flood(server, a_key, b_key, flood, rounds)
            print(f"fairness: B beside A's flood, first tokens {fmt(fair)}", flush=True)
            fifo, a_fifo = beside_flood(server, a_key, a_key, flood, rounds)
            print(f"fairness: B under A's key, first tokens {fmt(fifo)}", flush=True)
        finally:
            server.stop()
    med = statistics.median
    lines = [
        f"{'':<44}{'B first token p50_s':>20}{'A queued p50_s':>16}{'A queued n':>12}",
        f"{'B alone (idle server)':<44}{med(idle):>20.3f}{'':>16}{'':>12}",
        f"{'B beside A flooding (two tenants)':<44}{med(fair):>20.3f}"
        f"{med(a_fair):>16.3f}{len(a_fair):>12}",
        f"{'B beside A flooding (one tenant: FIFO)':<44}{med(fifo):>20.3f}"
        f"{med(a_fifo):>16.3f}{len(a_fifo):>12}",
        f"B's first token beside the flood: {med(fair) / med(a_fair):.2f}x A's queued requests' "
        f"with two tenants, {med(fifo) / med(a_fifo):.2f}x as one tenant",
    ]
    return FairnessSection(
        f"fairness: tenant A keeps {flood} streams in flight ({A_TOKENS[0]}-{A_TOKENS[-1]} "
        f"tokens each, "
        f"--max-batch {MAX_BATCH}), tenant B sends one request at a time ({B_TOKENS} tokens; "
        f"medians of {rounds})",
        lines,
    )


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}s" for v in values)
