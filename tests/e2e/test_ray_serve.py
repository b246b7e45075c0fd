"""hotlora on Ray Serve: two replicas on a local Ray instance behind one proxy port, on the tiny
model, checked against one in-process server's answers."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from hotlora.config.settings import Settings
from hotlora.server.app import create_app

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.server_process import LOCALHOST, free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
ray_app = pytest.importorskip("hotlora.server.ray.serve_app")

pytestmark = pytest.mark.e2e

REPLICA = "x-hotlora-replica"
REPLICA_PROCESS = "ServeReplica:hotlora:HotloraReplica"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "temperature": 0}
SPECS = ["", "a", "b", "a@0.5+b"]
LONG = 160  # tokens: long enough to be running on both replicas while an adapter is replaced


class Cluster:
    """The proxy's address, and one server's answers to compare with."""

    def __init__(self, url: str, reference: dict[str, object]):
        self.http = httpx.Client(base_url=url, timeout=120)
        self.url = url
        self.reference = reference


def chat(client: httpx.Client | TestClient, spec: str, **fields: object) -> httpx.Response:
    body = {**CHAT, "max_tokens": 12, "adapter": spec, **fields}
    return client.post("/v1/chat/completions", json=body)


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def streamed(client: httpx.Client, spec: str, max_tokens: int) -> tuple[str, str]:
    """The text of a streamed chat completion, and the replica that answered it."""
    body = {**CHAT, "adapter": spec, "max_tokens": max_tokens, "stream": True}
    parts = []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                parts.append(delta.get("content") or "")
        return "".join(parts), response.headers[REPLICA]


def mount(client: httpx.Client | TestClient, adapter_id: str, path: str) -> httpx.Response:
    return client.post("/v1/adapters", json={"id": adapter_id, "path": path, "replace": True})


def replicas_listing(cluster: Cluster, within: float = 30.0) -> dict[str, dict[str, str]]:
    """Each replica's adapters (id -> revision), once both replicas have answered."""
    seen: dict[str, dict[str, str]] = {}
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        response = cluster.http.get("/v1/adapters")
        assert response.status_code == 200, response.text
        cards = response.json()["data"]
        seen[response.headers[REPLICA]] = {card["id"]: card["revision"] for card in cards}
        if len(seen) == 2:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"only replicas {list(seen)} answered")


def replica_pids() -> list[int]:
    """The replica processes of this test's own Ray instance (started under this process)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if REPLICA_PROCESS.encode() in cmdline and started_here(int(entry.name)):
                pids.append(int(entry.name))
    return pids


def started_here(pid: int) -> bool:
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid
    return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("ray")
    root = work / "adapters"
    model = tiny_model(quantize=True)
    for seed, name in enumerate(("a", "b", "a2"), start=1):
        write_mlx_adapter(root / name, random_pairs(model, seed=seed), scale=20.0)
    # max_batch 2: a replica takes at most 4 requests, so a burst spills onto the other one.
    # Batched decode steps keep BLAS, as a request alone does: the rows kernel differs from it
    # in the last bits, and 160 greedy tokens of a random tiny model part at a near-tie, while
    # these tests compare texts to tell revisions apart.
    fields = {
        "model": tiny_model_dir,
        "served_model_name": "tiny",
        "adapter_root": root,
        "max_batch": 2,
        "cpu_native_kernels": False,
    }
    # The reference app runs in this process and leaves its PATH and TMPDIR alone: it computes
    # with MLX's baseline CPU kernels, the replicas with the vector ones, to the same answers.
    reference = one_server_answers(Settings(home=work / "one", cpu_vector_jit=False, **fields))
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200_000_000)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = Settings(home=work / "cluster", replicas=2, **fields)
        serve.run(ray_app.build_app(settings), name=ray_app.APP_NAME, route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{port}", reference)
    finally:
        serve.shutdown()
        ray.shutdown()


def one_server_answers(settings: Settings) -> dict[str, object]:
    """One server's answers: each spec's text, a's and a2's long ones, an unknown adapter's 404."""
    with TestClient(create_app(settings), base_url=LOCALHOST) as one:
        deadline = time.monotonic() + 60
        while one.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, one.get("/ready").json()
            time.sleep(0.05)
        for name in ("a", "b"):
            assert mount(one, name, name).status_code == 201
        answers: dict[str, object] = {spec: content(chat(one, spec)) for spec in SPECS}
        answers["long:a"] = content(chat(one, "a", max_tokens=LONG))
        answers["404"] = chat(one, "zzz").json()
        assert mount(one, "a", "a2").status_code == 201
        answers["long:a2"] = content(chat(one, "a", max_tokens=LONG))
        answers["a2"] = content(chat(one, "a"))
    return answers


def test_a_mount_through_the_proxy_reaches_both_replicas(cluster: Cluster):
    assert cluster.http.get("/ready").status_code == 200
    created = mount(cluster.http, "a", "a")
    assert created.status_code == 201, created.text
    revision = created.json()["revision"]
    listings = replicas_listing(cluster)
    assert all(listing == {"a": revision} for listing in listings.values()), listings


def test_requests_with_different_adapters_are_answered_as_by_one_server(cluster: Cluster):
    for name in ("a", "b"):
        assert mount(cluster.http, name, name).status_code in (200, 201)
    for spec in SPECS:
        assert content(chat(cluster.http, spec)) == cluster.reference[spec], spec
        assert streamed(cluster.http, spec, 12)[0] == cluster.reference[spec], spec
    unknown = chat(cluster.http, "zzz")
    assert unknown.status_code == 404
    assert unknown.json() == cluster.reference["404"]
    # The same adapter set goes back to the replica that has it hot. A set no request has named
    # yet: `b`'s two requests above may both have been routed before Serve's router heard
    # which replica took the first, and then both hold it.
    assert mount(cluster.http, "hot", "b").status_code == 201
    first = chat(cluster.http, "hot", max_tokens=1).headers[REPLICA]
    time.sleep(1.0)  # the replica tells Serve's router what it holds
    served = {chat(cluster.http, "hot", max_tokens=1).headers[REPLICA] for _ in range(5)}
    assert served == {first}


def test_an_adapter_replaced_while_requests_run_on_both_replicas(cluster: Cluster):
    assert mount(cluster.http, "a", "a").status_code in (200, 201)
    old, new = cluster.reference["long:a"], cluster.reference["long:a2"]
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(streamed, cluster.http, "a", LONG) for _ in range(8)]
        time.sleep(0.3)  # admitted and decoding
        replaced = mount(cluster.http, "a", "a2")
        assert replaced.status_code == 201, replaced.text
        after = [pool.submit(streamed, cluster.http, "a", LONG) for _ in range(4)]
        before = [future.result() for future in running]
        later = [future.result() for future in after]
    # Every request ran on one revision throughout: the one the registry held at admission.
    assert {text for text, _ in before} <= {old, new}
    assert {replica for _, replica in before} == set(replicas_listing(cluster)), "one replica"
    assert [text for text, _ in later] == [new] * len(later)
    listings = replicas_listing(cluster)
    assert {listing["a"] for listing in listings.values()} == {replaced.json()["revision"]}
    assert all(content(chat(cluster.http, "a")) == cluster.reference["a2"] for _ in range(4))


def test_a_client_that_leaves_stops_its_generation_on_the_replica(cluster: Cluster):
    assert mount(cluster.http, "a", "a2").status_code in (200, 201)
    began = time.monotonic()
    content(chat(cluster.http, "a", max_tokens=480))
    whole = time.monotonic() - began
    body = {**CHAT, "adapter": "a", "max_tokens": 480, "stream": True}
    with cluster.http.stream("POST", "/v1/chat/completions", json=body) as response:
        next(response.iter_lines())
    left = time.monotonic()
    # The replica's request ends when the client leaves, long before its 480 tokens would.
    while any(listing["a"] for listing in in_use(cluster).values()):
        assert time.monotonic() - left < whole / 2, f"still generating ({whole:.1f}s for all)"
        time.sleep(0.02)


def in_use(cluster: Cluster) -> dict[str, dict[str, int]]:
    """Each replica's requests in flight per adapter."""
    seen: dict[str, dict[str, int]] = {}
    while len(seen) < 2:
        response = cluster.http.get("/v1/adapters")
        cards = response.json()["data"]
        seen[response.headers[REPLICA]] = {card["id"]: card["in_use"] for card in cards}
    return seen


def test_a_killed_replica_is_replaced_with_the_same_adapters(cluster: Cluster):
    assert mount(cluster.http, "b", "b").status_code in (200, 201)
    before = replicas_listing(cluster)
    [mounted] = {json.dumps(listing, sort_keys=True) for listing in before.values()}
    pids = replica_pids()
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    # The other replica goes on serving while Serve starts a new one.
    for _ in range(6):
        assert content(chat(cluster.http, "b")) == cluster.reference["b"]
    deadline = time.monotonic() + 120
    while running_replicas() != 2 or pids[0] in replica_pids():
        assert time.monotonic() < deadline, "no replica came back"
        time.sleep(1)
    after = replicas_listing(cluster)
    assert len(set(after) - set(before)) == 1, (after, before)
    assert {json.dumps(listing, sort_keys=True) for listing in after.values()} == {mounted}
    for spec, reference in (("b", "b"), ("a", "a2")):
        answers = {content(chat(cluster.http, spec)) for _ in range(4)}
        assert answers == {cluster.reference[reference]}


def running_replicas() -> int:
    application = serve.status().applications[ray_app.APP_NAME]
    states = application.deployments["HotloraReplica"].replica_states
    return states.get("RUNNING", 0)
