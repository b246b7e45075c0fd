"""Many adapters over HTTP, in-process on the tiny model: mounts on first use, the budget, pins,
what the root holds, and the metrics of loads and evictions."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hotlora.adapters import AdapterRef

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "temperature": 0}
IDS = ("a", "b", "c")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    model = tiny_model(quantize=True)
    for seed, adapter_id in enumerate(IDS, start=1):
        write_mlx_adapter(root / adapter_id, random_pairs(model, seed=seed), scale=20.0)
    broken = write_mlx_adapter(root / "broken", random_pairs(model, seed=9))
    (broken / "adapter_config.json").write_text("{not json")
    return root


def chat(client: TestClient, **fields: object):
    return client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6, **fields})


def resident(client: TestClient) -> list[str]:
    return [card["id"] for card in client.get("/v1/adapters").json()["data"]]


def states(client: TestClient) -> dict[str, str]:
    listing = client.get("/v1/adapter_root")
    assert listing.status_code == 200, listing.text
    return {entry["id"]: entry["state"] for entry in listing.json()["data"]}


def metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_request_mounts_an_adapter_under_the_root_on_first_use(make_client, root: Path):
    client = make_client(adapter_root=root, auto_mount=True)
    assert resident(client) == []
    assert states(client) == {"a": "on disk", "b": "on disk", "broken": "on disk", "c": "on disk"}
    lazily = chat(client, adapter="a")
    assert lazily.status_code == 200, lazily.text
    by_model = chat(client, model="b")
    assert by_model.status_code == 200 and by_model.json()["model"] == "b"
    assert resident(client) == ["a", "b"]
    cards = client.get("/v1/adapters").json()["data"]
    assert all(card["on_demand"] and not card["pinned"] for card in cards)
    # The same adapter mounted by hand answers the same.
    hand = make_client(adapter_root=root)
    assert hand.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code == 201
    assert chat(hand, adapter="a").json()["choices"] == lazily.json()["choices"]
    assert metric(client, "hotlora_adapter_loads_total") == 2
    assert metric(client, "hotlora_adapter_load_seconds_count") == 2
    assert metric(client, 'hotlora_adapter_resident_bytes{adapter="a"}') == cards[0]["ram_bytes"]


def test_without_auto_mount_an_adapter_under_the_root_is_not_found(make_client, root: Path):
    client = make_client(adapter_root=root)
    response = chat(client, adapter="a")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "adapter_not_found"
    assert resident(client) == []


def test_a_failed_first_load_is_a_400_naming_the_problem(make_client, root: Path):
    client = make_client(adapter_root=root, auto_mount=True)
    response = chat(client, adapter="broken")
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "adapter"
    assert "'broken' could not be loaded" in error["message"]
    assert "adapter_config.json" in error["message"]
    assert resident(client) == [] and states(client)["broken"] == "on disk"
    # Named in `model`, the same error names that field.
    as_model = chat(client, model="tiny:broken").json()["error"]
    assert as_model == {**error, "param": "model"}


def test_tokenize_names_an_adapter_on_disk_without_mounting_it(make_client, root: Path):
    client = make_client(adapter_root=root, auto_mount=True, max_mounted_adapters=1)
    assert chat(client, adapter="a").status_code == 200
    for model in ("b", "tiny:b"):
        tokens = client.post("/tokenize", json={"model": model, "prompt": "the cat"})
        assert tokens.status_code == 200, tokens.text
        ids = tokens.json()["tokens"]
        back = client.post("/detokenize", json={"model": model, "tokens": ids})
        assert back.status_code == 200 and back.json()["prompt"] == "the cat"
    # Nothing loaded for it, and nothing evicted to make room.
    assert resident(client) == ["a"] and states(client)["b"] == "on disk"
    assert metric(client, "hotlora_adapter_loads_total") == 1
    unknown = client.post("/tokenize", json={"model": "nope", "prompt": "the cat"})
    assert unknown.status_code == 404


def test_eviction_past_the_budget_and_back_on_next_use(make_client, root: Path):
    client = make_client(adapter_root=root, auto_mount=True, max_mounted_adapters=2)
    first = {adapter_id: chat(client, adapter=adapter_id).json()["choices"] for adapter_id in IDS}
    assert resident(client) == ["b", "c"]
    assert states(client)["a"] == "evicted"
    assert metric(client, "hotlora_adapter_evictions_total") == 1
    again = chat(client, adapter="a")  # evicted: mounted again, the same answer
    assert again.status_code == 200 and again.json()["choices"] == first["a"]
    assert resident(client) == ["c", "a"]
    assert metric(client, "hotlora_adapter_loads_total") == 4


def test_a_pinned_mount_stays_and_pins_past_the_budget_are_refused(make_client, root: Path):
    client = make_client(adapter_root=root, auto_mount=True, max_mounted_adapters=1)
    pinned = client.post("/v1/adapters", json={"id": "kept", "path": "a", "pin": True})
    assert pinned.status_code == 201 and pinned.json()["pinned"]
    for adapter_id in ("b", "c", "b"):
        assert chat(client, adapter=adapter_id).status_code == 200
    assert "kept" in resident(client)
    refused = client.post("/v1/adapters", json={"id": "more", "path": "b", "pin": True})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "adapter_over_budget" and error["param"] == "pin"
    assert "more" not in resident(client)


def test_an_adapter_larger_than_the_memory_budget_is_refused(make_client, root: Path):
    probe = make_client(adapter_root=root)
    size = probe.post("/v1/adapters", json={"id": "a", "path": "a"}).json()["ram_bytes"]
    client = make_client(adapter_root=root, auto_mount=True, adapter_memory_bytes=size - 1)
    refused = client.post("/v1/adapters", json={"id": "a", "path": "a"})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "adapter_over_budget"
    assert str(size) in refused.json()["error"]["message"]
    lazily = chat(client, adapter="b")
    assert lazily.status_code == 400 and "could not be loaded" in lazily.json()["error"]["message"]
    assert resident(client) == []
    assert client.get("/v1/adapter_root").json()["resident_bytes"] == 0


def mounted_bytes(client: TestClient, adapter_id: str) -> int:
    response = client.post("/v1/adapters", json={"id": adapter_id, "path": adapter_id})
    assert response.status_code == 201, response.text
    return int(response.json()["ram_bytes"])


def test_adapters_kept_in_float16_hold_half_the_memory_where_packed_kernels_serve(
    make_client, root: Path, caplog: pytest.LogCaptureFixture
):
    """By default (`auto`) the packed kernels' adapters are kept in float16, half the bytes of
    `--adapter-dtype float32`; on float32 weights `auto` keeps float32 and says nothing, and
    an explicit `float16` is logged and left aside."""
    single = mounted_bytes(make_client(adapter_root=root, adapter_dtype="float32"), "a")
    for asked in ({}, {"adapter_dtype": "float16"}):
        half = make_client(adapter_root=root, **asked)
        assert mounted_bytes(half, "a") * 2 == single
        answer = chat(half, adapter="a")
        assert answer.status_code == 200, answer.text
    caplog.clear()
    unpacked = make_client(adapter_root=root, cpu_weights="float32")
    assert mounted_bytes(unpacked, "a") == single
    assert "--adapter-dtype" not in caplog.text
    # On float32 weights float16 is logged and left aside: MLX's layers read float32.
    unpacked = make_client(adapter_root=root, adapter_dtype="float16", cpu_weights="float32")
    assert mounted_bytes(unpacked, "a") == single
    assert "--adapter-dtype float16 applies to packed 4-bit weights" in caplog.text


def test_a_request_the_queue_refuses_mounts_nothing(make_client, root: Path):
    client = make_client(adapter_root=root, max_mounted_adapters=2, max_batch=1, queue_size=1)
    for adapter_id in IDS:
        assert client.post("/v1/adapters", json={"id": adapter_id, "path": adapter_id}).is_success
    assert resident(client) == ["b", "c"]  # a evicted, mounted again on its next use
    worker = client.app.state.runtime.worker
    release = threading.Event()
    held = client.portal.start_task_soon(worker.call, release.wait)  # the generation thread
    waiting = threading.Thread(target=chat, args=(client,), kwargs={"adapter": "b"})
    waiting.start()
    try:
        deadline = time.monotonic() + 30
        while worker.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.waiting == 1  # the queue is full
        refused = chat(client, adapter="a")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        assert resident(client) == ["b", "c"]  # a not mounted again, nothing evicted
        # Embeddings wait in no queue: a full one refuses them nothing.
        service = client.app.state.runtime.inference
        unqueued = functools.partial(service.lease, "tiny", (AdapterRef("a"),), queued=False)
        client.portal.call(unqueued).release()
        assert "a" in resident(client)
    finally:
        release.set()
        held.result(timeout=30)
        waiting.join(timeout=30)
    assert chat(client, adapter="a").status_code == 200


def test_an_evicted_id_is_bound_to_its_files_until_unmounted_or_replaced(make_client, root: Path):
    client = make_client(adapter_root=root, max_mounted_adapters=2)
    for adapter_id in IDS:
        assert client.post("/v1/adapters", json={"id": adapter_id, "path": adapter_id}).is_success
    assert resident(client) == ["b", "c"] and states(client)["a"] == "evicted"
    other = client.post("/v1/adapters", json={"id": "a", "path": "b"})
    assert other.status_code == 409 and other.json()["error"]["code"] == "adapter_conflict"
    assert "evicted" in other.json()["error"]["message"]
    assert resident(client) == ["b", "c"] and states(client)["a"] == "evicted"
    swapped = client.post("/v1/adapters", json={"id": "a", "path": "b", "replace": True})
    assert swapped.status_code in (200, 201), swapped.text
    assert (
        chat(client, adapter="a").json()["choices"] == chat(client, adapter="b").json()["choices"]
    )


def test_the_root_lists_no_link_out_of_it_that_no_mount_reads(make_client, root: Path, tmp_path):
    outside = write_mlx_adapter(
        tmp_path / "elsewhere" / "shared", random_pairs(tiny_model(quantize=True), seed=7)
    )
    (root / "shared-link").symlink_to(outside, target_is_directory=True)
    (root / "inner-link").symlink_to(root / "a", target_is_directory=True)
    client = make_client(adapter_root=root, auto_mount=True)
    assert "shared-link" not in states(client)
    assert states(client)["inner-link"] == "on disk"  # a link within the root reads as its target
    assert chat(client, adapter="inner-link").status_code == 200
    refused = chat(client, adapter="shared-link")
    assert refused.status_code in (400, 404) and "shared-link" not in resident(client)
