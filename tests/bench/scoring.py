"""Prompt scoring as lm-evaluation-harness sends it: `python -m tests.bench --sections scoring`.

An evaluation is `--scoring-docs` (16) questions, each a context and 4 choices, sent as
lm-eval's `local-completions` model sends a multiple-choice task: one request per choice,
`{"prompt": context + choice, "echo": true, "logprobs": 1, "max_tokens": 1}`, from
`--scoring-clients` (8) concurrent clients (its `num_concurrent`). One hotlora server with 4
random rank-8 adapters mounted (and `--max-batch` 4 x the clients) runs it for one adapter
alone, then 4 evaluations (one adapter each) one after another, then 4 at once. Reported:
requests per second of each, and the time of
4 at once against 4 one after another (the ratio; under 1 is faster). Every evaluation has
questions of its own, so none finds another's scored openings kept.

A measurement, not a test.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.bench.adapters_at_scale import write_adapters
from tests.support.server_process import ServerProcess, hotlora_spec

ADAPTERS = [f"eval-{i}" for i in range(4)]
RANK = 8
FACTS = [
    "The river that runs through the old town floods every spring, so the bakery on its bank "
    "keeps its ovens on the upper floor.",
    "A lighthouse keeper counts the ships that pass each night and writes the number in a "
    "book that has been kept since the harbour was built.",
    "The orchard behind the school grows apples, pears and plums, and the children pick them "
    "in the autumn before the first frost.",
    "Every train that leaves the mountain station stops twice in the valley, once at the mill "
    "and once at the market square.",
]
CHOICES = [" the bakery", " the lighthouse", " the orchard", " the station"]


@dataclass(frozen=True)
class Evaluation:
    """One adapter's multiple-choice evaluation: its requests, and how long they took."""

    adapter: str
    requests: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds


def prompts(tag: str, docs: int) -> list[str]:
    """`docs` questions of their own (`tag` makes them so), each with its 4 choices."""
    out = []
    for i in range(docs):
        fact = FACTS[i % len(FACTS)]
        name = f"passage {tag}-{i}"
        context = f"The {name}: {fact}\nQuestion: Which place does the {name} tell of?\nAnswer:"
        out += [context + choice for choice in CHOICES]
    return out


def evaluate(url: str, model: str, adapter: str, texts: Sequence[str], clients: int) -> Evaluation:
    """Score every prompt as lm-eval does, from `clients` threads; raises on a failed request."""
    queue = list(reversed(texts))
    lock = threading.Lock()
    errors: list[str] = []

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop()
                body = {
                    "model": model,
                    "adapter": adapter,
                    "prompt": prompt,
                    "echo": True,
                    "logprobs": 1,
                    "max_tokens": 1,
                    "temperature": 0,
                    "seed": 1234,
                }
                response = http.post(f"{url}/v1/completions", json=body)
                if response.status_code != 200:
                    with lock:
                        errors.append(response.text[:200])

    began = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{len(errors)} scoring requests failed: {errors[0]}")
    return Evaluation(adapter, len(texts), time.perf_counter() - began)


def run_scoring(
    model_dir: Path, home: Path, env: dict[str, str], docs: int, clients: int, rounds: int
) -> tuple[str, list[str]]:
    """The section's title and lines."""
    root = home / "bench-scoring-adapters"
    write_adapters(model_dir, root, ADAPTERS, [RANK] * len(ADAPTERS))
    mounts = [arg for name in ADAPTERS for arg in ("--adapter", f"{name}={name}")]
    # Room in the batch for every client of 4 evaluations at once (the default, 8, queues them:
    # 4 at once then take longer than one after another).
    batch = ("--max-batch", str(len(ADAPTERS) * clients))
    spec = hotlora_spec(
        "--model", str(model_dir), "--log-level", "warning", "--adapter-root", str(root), *mounts,
        *batch,
    )  # fmt: skip
    alone: list[float] = []
    serial: list[float] = []
    together: list[float] = []
    with ServerProcess(spec, env=env) as server:
        url, model = server.url, server.model_id
        evaluate(url, model, ADAPTERS[0], prompts("warm", 2), clients)
        for r in range(rounds):
            one = evaluate(url, model, ADAPTERS[0], prompts(f"alone{r}", docs), clients)
            alone.append(one.per_second)
            began = time.perf_counter()
            for name in ADAPTERS:
                evaluate(url, model, name, prompts(f"serial{r}-{name}", docs), clients)
            serial.append(time.perf_counter() - began)
            began = time.perf_counter()
            with ThreadPoolExecutor(len(ADAPTERS)) as pool:
                runs = [
                    pool.submit(
                        evaluate, url, model, name, prompts(f"at-once{r}-{name}", docs), clients
                    )
                    for name in ADAPTERS
                ]
                for run in runs:
                    run.result()
            together.append(time.perf_counter() - began)
    requests = docs * len(CHOICES) * len(ADAPTERS)
    serial_s, together_s = statistics.median(serial), statistics.median(together)
    title = (
        f"scoring: lm-eval-shaped multiple choice ({docs} questions x 4 choices, echo + "
        f"logprobs 1 + max_tokens 1, {clients} clients an evaluation, --max-batch {batch[1]}), "
        f"median of {rounds}"
    )
    lines = [
        f"{'evaluation':<34}{'requests/s':>12}{'seconds':>10}",
        f"{'1 adapter alone':<34}{statistics.median(alone):>12.1f}"
        f"{docs * len(CHOICES) / statistics.median(alone):>10.1f}",
        f"{'4 adapters one after another':<34}{requests / serial_s:>12.1f}{serial_s:>10.1f}",
        f"{'4 adapters at once':<34}{requests / together_s:>12.1f}{together_s:>10.1f}",
        f"4 at once / 4 one after another (time): {together_s / serial_s:.2f}x",
    ]
    return title, lines
