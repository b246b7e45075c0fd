"""`--persist-mounts` over HTTP: a restarted app is ready with the recorded adapters mounted."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hotlora.adapters import MountFile

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "temperature": 0}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    model = tiny_model(quantize=True)
    for seed, name in enumerate(("a", "a2", "b"), start=1):
        write_mlx_adapter(root / name, random_pairs(model, seed=seed), scale=20.0)
    return root


def text(client: TestClient, adapter: str) -> str:
    body = {**CHAT, "max_tokens": 12, "adapter": adapter}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def listed(client: TestClient) -> dict[str, str]:
    return {card["id"]: card["path"] for card in client.get("/v1/adapters").json()["data"]}


def mounts_counted(client: TestClient) -> float:
    metrics = client.get("/metrics").text
    [family] = [
        f for f in text_string_to_metric_families(metrics) if f.name == "hotlora_adapter_mounts"
    ]
    return sum(sample.value for sample in family.samples)


def stop(client: TestClient) -> None:
    client.__exit__(None, None, None)


def test_a_restarted_server_is_ready_with_the_same_adapters(make_client, root: Path, tmp_path):
    first = make_client(adapter_root=root, persist_mounts=True)
    assert first.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code == 201
    replaced = {"id": "a", "path": "a2", "replace": True}
    assert first.post("/v1/adapters", json=replaced).status_code == 201
    assert first.post("/v1/adapters", json={"id": "b", "path": "b"}).status_code == 201
    answers = {name: text(first, name) for name in ("a", "b")}
    assert first.delete("/v1/adapters/b").status_code == 200
    stop(first)
    assert (tmp_path / "home" / "mounts.json").is_file()

    again = make_client(adapter_root=root, persist_mounts=True)  # returns once /ready is 200
    assert listed(again) == {"a": str(root / "a2")}
    assert text(again, "a") == answers["a"]
    assert again.post("/v1/chat/completions", json={**CHAT, "adapter": "b"}).status_code == 404


def test_mounts_made_again_at_start_are_counted(make_client, root: Path):
    first = make_client(adapter_root=root, persist_mounts=True)
    for name in ("a", "b"):
        assert first.post("/v1/adapters", json={"id": name, "path": name}).status_code == 201
    assert mounts_counted(first) == 2
    stop(first)
    again = make_client(adapter_root=root, persist_mounts=True)
    assert mounts_counted(again) == 2  # made again from the record, before any request


def test_changed_files_are_reported_at_start_and_not_mounted(make_client, root: Path, caplog):
    first = make_client(adapter_root=root, persist_mounts=True)
    for name in ("a", "b"):
        assert first.post("/v1/adapters", json={"id": name, "path": name}).status_code == 201
    stop(first)
    shutil.rmtree(root / "a")
    shutil.copytree(root / "a2", root / "a")  # same path, other weights
    with caplog.at_level(logging.WARNING, logger="hotlora.adapters"):
        again = make_client(adapter_root=root, persist_mounts=True)
    assert listed(again) == {"b": str(root / "b")}
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "recorded adapter a " in warning and "changed since it was recorded" in warning


def test_a_store_given_to_the_app_records_and_restores_its_mounts(make_client, root, tmp_path):
    # As a Ray replica passes its link to the cluster's registry: the app keeps no record of its
    # own, and the one it is given records each change and brings a new app to the set.
    elsewhere = tmp_path / "elsewhere" / "mounts.json"
    first = make_client(adapter_root=root, mount_store=MountFile(elsewhere))
    assert first.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code == 201
    stop(first)
    assert [record.id for record in MountFile(elsewhere).records] == ["a"]
    assert not (tmp_path / "home" / "mounts.json").exists()
    again = make_client(adapter_root=root, mount_store=MountFile(elsewhere))
    assert listed(again) == {"a": str(root / "a")}
    assert mounts_counted(again) == 1


def test_without_the_setting_nothing_is_recorded(make_client, root: Path, tmp_path):
    first = make_client(adapter_root=root)
    assert first.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code == 201
    stop(first)
    assert not (tmp_path / "home" / "mounts.json").exists()
    assert listed(make_client(adapter_root=root, persist_mounts=True)) == {}


def pins(client: TestClient) -> dict[str, bool]:
    return {card["id"]: card["pinned"] for card in client.get("/v1/adapters").json()["data"]}


def test_a_pin_survives_a_restart_as_the_mount_does(make_client, root: Path):
    budget = {"adapter_root": root, "persist_mounts": True, "max_mounted_adapters": 2}
    first = make_client(**budget)
    assert first.post("/v1/adapters", json={"id": "a", "path": "a", "pin": True}).status_code == 201
    assert first.post("/v1/adapters", json={"id": "b", "path": "b"}).status_code == 201
    # Pinning what is mounted already, same files, is recorded too.
    assert first.post("/v1/adapters", json={"id": "a2", "path": "a2"}).status_code == 201
    assert first.post("/v1/adapters", json={"id": "a2", "path": "a2", "pin": True}).status_code in (
        200,
        201,
    )
    assert pins(first) == {"a": True, "a2": True}  # b evicted past the cap of 2
    stop(first)

    again = make_client(**budget)
    assert pins(again) == {"a": True, "a2": True}  # b made again, then evicted past the cap
    assert text(again, "b")  # an evicted hand mount comes back on use; a pin is never evicted
    assert {"a": True, "a2": True}.items() <= pins(again).items()


def test_a_replace_without_pin_unpins_and_the_record_follows(make_client, root: Path):
    first = make_client(adapter_root=root, persist_mounts=True)
    assert first.post("/v1/adapters", json={"id": "a", "path": "a", "pin": True}).status_code == 201
    replaced = {"id": "a", "path": "a2", "replace": True}
    assert first.post("/v1/adapters", json=replaced).status_code == 201
    assert pins(first) == {"a": False}
    # The same files: a mount asking nothing leaves the pin, a replace without one unpins.
    assert first.post("/v1/adapters", json={**replaced, "pin": True}).status_code == 200
    assert first.post("/v1/adapters", json={"id": "a", "path": "a2"}).status_code == 200
    assert pins(first) == {"a": True}
    assert first.post("/v1/adapters", json=replaced).status_code == 200
    assert pins(first) == {"a": False}
    stop(first)
    assert pins(make_client(adapter_root=root, persist_mounts=True)) == {"a": False}


def test_a_mount_on_first_use_is_not_recorded_and_loads_again_after_a_restart(
    make_client, root: Path, tmp_path: Path
):
    lazy = {"adapter_root": root, "persist_mounts": True, "auto_mount": True}
    first = make_client(**lazy)
    answer = text(first, "a")
    assert listed(first) == {"a": str(root / "a")}
    stop(first)
    assert [r.id for r in MountFile(tmp_path / "home" / "mounts.json").records] == []

    again = make_client(**lazy)
    assert listed(again) == {}
    assert text(again, "a") == answer  # mounted again on first use, from the root
    # An admin mounting what a request loaded makes it a recorded mount.
    assert again.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code in (200, 201)
    stop(again)
    assert [r.id for r in MountFile(tmp_path / "home" / "mounts.json").records] == ["a"]
