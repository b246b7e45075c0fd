"""The soak test's remount race: adapter `x` unmounted and mounted again, or replaced by other
files and back, while a long `x` request and a long base request share the batch; after each
remount a greedy `x` request must answer exactly what `x` answered alone at the start."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from tests.bench.soak_traffic import Spec, Traffic

REMOUNTED = "x"
PROMPT = "Name three colours."
GREEDY_TOKENS = 16
LONG_TOKENS = 160
ATTEMPTS = 20  # tries of one request while the queue is full


def remount_loop(traffic: Traffic, own_dir: str, other_dir: str) -> None:
    """Remount `x` (from `own_dir`) until the deadline, checking its greedy answer each time."""
    spec = Spec(REMOUNTED, {"adapter": REMOUNTED}, False)
    with httpx.Client(base_url=traffic.url, timeout=traffic.timeout_s) as client:
        if not _admin(traffic, client, "mount", {"id": REMOUNTED, "path": own_dir}):
            return
        reference = _greedy(traffic, client, spec)
        if reference is None:
            return
        rounds = 0
        while not traffic.stop.is_set():
            side = [
                threading.Thread(target=_long, args=(traffic, client, extra), daemon=True)
                for extra in ({"adapter": REMOUNTED}, {})
            ]
            for thread in side:
                thread.start()
            traffic.stop.wait(0.5)  # both are in the batch
            if rounds % 2 == 0:
                done = _admin(traffic, client, "unmount", None) and _admin(
                    traffic, client, "mount", {"id": REMOUNTED, "path": own_dir}
                )
            else:
                done = all(
                    _admin(traffic, client, "replace", body)
                    for body in (
                        {"id": REMOUNTED, "path": other_dir, "replace": True},
                        {"id": REMOUNTED, "path": own_dir, "replace": True},
                    )
                )
            answer = _greedy(traffic, client, spec) if done else None
            if answer is not None and answer != reference:
                traffic.tally.fail(
                    "remounted adapter answers differently",
                    f"after {'an unmount' if rounds % 2 == 0 else 'a replace'}: "
                    f"{answer!r}, alone at the start {reference!r}",
                )
            elif answer is not None:
                traffic.tally.count(traffic.tally.served, "remount check")
            for thread in side:
                thread.join(timeout=traffic.timeout_s)
            rounds += 1


def _admin(traffic: Traffic, client: httpx.Client, op: str, body: dict[str, Any] | None) -> bool:
    try:
        if op == "unmount":
            response = client.delete(f"/v1/adapters/{REMOUNTED}")
        else:
            response = client.post("/v1/adapters", json=body)
    except httpx.HTTPError as exc:
        traffic.tally.fail(f"remount {op} {type(exc).__name__}", repr(exc))
        return False
    if response.status_code != (200 if op == "unmount" else 201):
        traffic.tally.fail(f"remount {op} HTTP {response.status_code}", response.text[:300])
        return False
    traffic.tally.count(traffic.tally.admin, op)
    return True


def _greedy(traffic: Traffic, client: httpx.Client, spec: Spec) -> str | None:
    """`x`'s greedy answer to PROMPT; None (after filing why) when it could not be had."""
    body = {
        "model": traffic.base_id,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": GREEDY_TOKENS,
        "temperature": 0.0,
        **spec.extra,
    }
    for _ in range(ATTEMPTS):
        try:
            response = client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            traffic.tally.fail(type(exc).__name__, f"remount check: {exc!r}")
            return None
        if response.status_code == 200:
            return str(response.json()["choices"][0]["message"]["content"])
        wait = traffic.tally.refusal(response, spec)
        if not wait or traffic.stop.wait(wait):
            return None
    return None


def _long(traffic: Traffic, client: httpx.Client, extra: dict[str, Any]) -> None:
    """A long streamed request (with `extra` adapter fields), read to its end."""
    body = {
        "model": traffic.base_id,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": LONG_TOKENS,
        "stream": True,
        **extra,
    }
    spec = Spec("remount side", extra, True)  # may arrive while `x` is unmounted
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                traffic.tally.refusal(response, spec)
                return
            lines = list(response.iter_lines())
    except httpx.HTTPError as exc:
        traffic.tally.fail(type(exc).__name__, f"remount side request: {exc!r}")
        return
    if "data: [DONE]" not in lines or any('"error"' in line for line in lines):
        traffic.tally.fail("remount side stream broken", str(lines[-3:])[:300])
