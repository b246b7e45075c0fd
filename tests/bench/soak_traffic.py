"""The soak test's traffic: chat clients, clients that hang up early, and an adapter churn loop.

Every outcome lands in one `Tally`. Two refusals are legitimate and counted apart: 404 for an
adapter the churn loop has unmounted at that moment, and 503 with Retry-After when the queue is
full. Anything else that is not a good answer (another status, a connection error, a timeout,
a stream without `[DONE]` or with an error event) is a failure.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

QUESTIONS = [
    "Name a fruit.",
    "What colour is the sky?",
    "Say hello in French.",
    "Give me a word that rhymes with cat.",
    "How many days are in a week?",
    "Name a planet.",
    "What do bees make?",
    "Tell me a very short joke.",
    "What is two plus three?",
    "Name an animal that swims.",
]
CHURNED = ("b", "c")  # mounted, replaced and unmounted by the churn loop
STEADY = "a"  # only ever replaced, so a request naming it alone must never get 404


@dataclass(frozen=True)
class Spec:
    """One way a request selects adapters: extra body fields, and whether a 404 may happen."""

    label: str
    extra: dict[str, Any]
    may_vanish: bool


def request_specs(base_id: str) -> list[Spec]:
    """The mix the clients draw from: base, single adapters, stacks, the `model` field forms."""
    return [
        Spec("base", {}, False),
        Spec("a", {"adapter": "a"}, False),
        Spec("b", {"adapter": "b"}, True),
        Spec("c", {"adapter": "c"}, True),
        Spec("a+b@0.5", {"adapter": "a+b@0.5"}, True),
        Spec("a@0.7+c", {"adapter": "a@0.7+c"}, True),
        Spec("model=a", {"model": "a"}, False),
        Spec(f"model={base_id}:b+c", {"model": f"{base_id}:b+c"}, True),
    ]


@dataclass
class Tally:
    """Thread-safe counters of everything the soak did and saw."""

    served: Counter[str] = field(default_factory=Counter)  # by request kind
    served_by_spec: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)  # every non-200 answer
    unmounted_404: int = 0
    queue_full_503: int = 0
    disconnects: Counter[str] = field(default_factory=Counter)
    admin: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    closes: dict[str, list[float]] = field(default_factory=dict)  # stuck client -> seconds
    examples: list[str] = field(default_factory=list)  # the first few failures, in full
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, counter: Counter[Any], key: object) -> None:
        with self.lock:
            counter[key] += 1

    def closed(self, kind: str, seconds: float) -> None:
        """The server closed a stuck client's connection `seconds` after it began."""
        with self.lock:
            self.closes.setdefault(kind, []).append(seconds)

    def fail(self, kind: str, detail: str) -> None:
        with self.lock:
            self.failures[kind] += 1
            if len(self.examples) < 8:
                self.examples.append(f"{kind}: {detail}")

    def refusal(self, response: httpx.Response, spec: Spec) -> float:
        """File a non-200 answer as a legitimate refusal or as a failure.

        Returns the seconds a client should wait before its next request (Retry-After), or 0.
        """
        status = response.status_code
        self.count(self.statuses, status)
        try:
            error = response.json().get("error", {})
        except ValueError:
            error = {}
        code = error.get("code")
        if status == 404 and spec.may_vanish and code in ("adapter_not_found", "model_not_found"):
            with self.lock:
                self.unmounted_404 += 1
        elif status == 503 and response.headers.get("retry-after") and "busy" in str(error):
            with self.lock:
                self.queue_full_503 += 1
            return float(response.headers["retry-after"])
        else:
            self.fail(f"HTTP {status}", f"{spec.label}: {response.text[:300]}")
        return 0.0


@dataclass
class Traffic:
    """What every worker shares: the server, the deadline, the tally."""

    url: str
    base_id: str
    stop: threading.Event
    tally: Tally
    timeout_s: float


def chat_body(traffic: Traffic, rng: random.Random, spec: Spec, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": traffic.base_id,
        "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
        "max_tokens": rng.randint(8, 24),
        "temperature": rng.choice([0.0, 0.7]),
        "stream": stream,
    }
    body.update(spec.extra)
    return body


def chat(traffic: Traffic, client: httpx.Client, rng: random.Random, spec: Spec) -> float:
    """One whole non-streaming chat completion; the seconds to wait before the next."""
    body = chat_body(traffic, rng, spec, stream=False)
    return answered(
        traffic, spec, body, client.post(f"{traffic.url}/v1/chat/completions", json=body)
    )


def answered(traffic: Traffic, spec: Spec, body: dict[str, Any], response: httpx.Response) -> float:
    """File a non-streaming answer: served when well-formed, else a refusal or a failure."""
    if response.status_code != 200:
        return traffic.tally.refusal(response, spec)
    answer = response.json()
    tokens = answer.get("usage", {}).get("completion_tokens", -1)
    content = answer["choices"][0]["message"].get("content")
    if not isinstance(content, str) or not 0 <= tokens <= body["max_tokens"]:
        traffic.tally.fail("bad answer", f"{spec.label}: {json.dumps(answer)[:300]}")
        return 0.0
    traffic.tally.count(traffic.tally.served, "chat")
    traffic.tally.count(traffic.tally.served_by_spec, spec.label)
    return 0.0


def stream(
    traffic: Traffic, client: httpx.Client, rng: random.Random, spec: Spec, hang_up: bool
) -> float:
    """One streaming chat completion, read to `[DONE]`, or dropped after its first token."""
    body = chat_body(traffic, rng, spec, stream=True)
    url = f"{traffic.url}/v1/chat/completions"
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            response.read()
            return traffic.tally.refusal(response, spec)
        finish = None
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                traffic.tally.fail("stream error event", f"{spec.label}: {data[:300]}")
                return 0.0
            choices = chunk.get("choices") or [{}]
            if hang_up and choices[0].get("delta", {}).get("content"):
                traffic.tally.count(traffic.tally.disconnects, "stream, after the first token")
                return 0.0  # leaving the block closes the connection mid-stream
            finish = choices[0].get("finish_reason") or finish
        else:
            traffic.tally.fail("stream cut short", f"{spec.label}: no [DONE]")
            return 0.0
    if finish is None:
        traffic.tally.fail("stream cut short", f"{spec.label}: no finish_reason")
    else:
        traffic.tally.count(traffic.tally.served, "stream")
        traffic.tally.count(traffic.tally.served_by_spec, spec.label)
    return 0.0


def abandon(traffic: Traffic, client: httpx.Client, rng: random.Random, spec: Spec) -> float:
    """A non-streaming request whose client gives up after a fraction of a second."""
    body = chat_body(traffic, rng, spec, stream=False)
    patience = httpx.Timeout(traffic.timeout_s, read=rng.uniform(0.1, 0.8))
    try:
        response = client.post(f"{traffic.url}/v1/chat/completions", json=body, timeout=patience)
    except httpx.ReadTimeout:
        traffic.tally.count(traffic.tally.disconnects, "non-streaming, before the answer")
        return 0.0
    return answered(traffic, spec, body, response)  # it came before the patience ran out


def client_loop(traffic: Traffic, seed: int) -> None:
    """Requests back to back until the deadline: 40% whole, 45% streamed, 15% hung up on.

    After a 503 the client waits as long as its Retry-After says.
    """
    rng = random.Random(seed)
    specs = request_specs(traffic.base_id)
    with httpx.Client(timeout=traffic.timeout_s) as client:
        while not traffic.stop.is_set():
            spec = rng.choice(specs)
            roll = rng.random()
            retry_after = 0.0
            try:
                if roll < 0.40:
                    retry_after = chat(traffic, client, rng, spec)
                elif roll < 0.85:
                    retry_after = stream(traffic, client, rng, spec, hang_up=False)
                elif roll < 0.95:
                    retry_after = stream(traffic, client, rng, spec, hang_up=True)
                else:
                    retry_after = abandon(traffic, client, rng, spec)
            except httpx.HTTPError as exc:
                traffic.tally.fail(type(exc).__name__, f"{spec.label}: {exc!r}")
            if retry_after:
                traffic.stop.wait(retry_after)


def churn_step(
    client: httpx.Client, rng: random.Random, adapter_id: str, current: str | None, dirs: list[str]
) -> tuple[str, int, str | None, httpx.Response]:
    """One admin call on `adapter_id` (mounted from `current`, or not mounted).

    Returns the operation, the status it should get, the directory mounted after it (None when
    unmounted) and the response. Mounts and unmounts alternate between the native routes and
    vLLM's aliases.
    """
    native = rng.random() < 0.5
    if current is None:
        path = rng.choice(dirs)
        if native:
            response = client.post("/v1/adapters", json={"id": adapter_id, "path": path})
        else:
            alias = {"lora_name": adapter_id, "lora_path": path}
            # vLLM's alias answers as vLLM does: 200 and a line of text.
            return "mount", 200, path, client.post("/v1/load_lora_adapter", json=alias)
        return "mount", 201, path, response
    if adapter_id == STEADY or rng.random() < 0.5:
        path = rng.choice([d for d in dirs if d != current])
        body = {"id": adapter_id, "path": path, "replace": True}
        return "replace", 201, path, client.post("/v1/adapters", json=body)
    if native:
        response = client.delete(f"/v1/adapters/{adapter_id}")
    else:
        response = client.post("/v1/unload_lora_adapter", json={"lora_name": adapter_id})
    return "unmount", 200, None, response


def churn_loop(traffic: Traffic, dirs: list[str], mounted: dict[str, str], seed: int) -> None:
    """Mount, replace and unmount adapters every 0.2-0.8 s until the deadline.

    `a` is only ever replaced; `b` and `c` come and go. `mounted` (id -> directory) is the
    state at start.
    """
    rng = random.Random(seed)
    with httpx.Client(base_url=traffic.url, timeout=traffic.timeout_s) as client:
        while not traffic.stop.wait(rng.uniform(0.2, 0.8)):
            adapter_id = rng.choice((STEADY, *CHURNED))
            try:
                op, expected, after, response = churn_step(
                    client, rng, adapter_id, mounted.get(adapter_id), dirs
                )
            except httpx.HTTPError as exc:
                traffic.tally.fail(f"admin {type(exc).__name__}", repr(exc))
                continue
            if response.status_code != expected:
                traffic.tally.fail(
                    f"admin {op} HTTP {response.status_code}",
                    f"{adapter_id}: {response.text[:300]}",
                )
                continue
            traffic.tally.count(traffic.tally.admin, op)
            if after is None:
                mounted.pop(adapter_id, None)
            else:
                mounted[adapter_id] = after
