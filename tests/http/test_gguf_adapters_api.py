"""llama.cpp's LoRA files over HTTP, in-process on the tiny model: mounted by the admin routes,
vLLM's route and `--adapter`, selected per request, refused with OpenAI's error shape."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.support.adapter_builders import random_pairs, tiny_model, write_peft_adapter
from tests.support.gguf_adapters import write_gguf_adapter
from tests.support.gguf_files import MALFORMED_HEADERS, write_raw_gguf, write_tiny_gguf

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "temperature": 0}
ALPHA, RANK = 80.0, 4  # scale 20: the tiny model's greedy answer visibly changes
HEADS = (4, 2)  # the tiny llama's query and key-value heads


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The same adapter as llama.cpp's file (alone, and in a directory) and as PEFT's."""
    root = tmp_path / "adapters"
    pairs = random_pairs(tiny_model(quantize=True), seed=2)
    write_gguf_adapter(root / "sft-F32-LoRA.gguf", pairs, alpha=ALPHA, heads=HEADS)
    write_gguf_adapter(root / "in-dir" / "sft.gguf", pairs, alpha=ALPHA, heads=HEADS)
    write_peft_adapter(root / "peft", pairs, rank=RANK, alpha=ALPHA)
    write_tiny_gguf(root / "base-model.gguf")
    return root


def text(client: TestClient, **fields: object) -> str:
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12, **fields})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_a_gguf_adapter_mounts_and_answers_as_its_peft_twin(make_client, root: Path):
    api = make_client(adapter_root=root)
    created = api.post("/v1/adapters", json={"id": "g", "path": "sft-F32-LoRA.gguf"})
    assert created.status_code == 201, created.text
    card = created.json()
    assert (card["rank"], card["scale"], card["mounted_layers"]) == (RANK, 20.0, 14)
    assert card["path"] == str(root / "sft-F32-LoRA.gguf")
    assert api.post("/v1/adapters", json={"id": "p", "path": "peft"}).status_code == 201
    vllm = api.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "in-dir"})
    assert vllm.status_code == 200, vllm.text
    base = text(api)
    assert text(api, adapter="g") == text(api, adapter="p") == text(api, model="d") != base
    assert text(api, adapter="g@0.5+p@0.5") != base  # bit-exact sums: tests/unit


def test_a_base_model_gguf_is_refused_with_the_openai_error(make_client, root: Path):
    api = make_client(adapter_root=root)
    api.post("/v1/adapters", json={"id": "g", "path": "sft-F32-LoRA.gguf"})
    before = api.get("/v1/adapters").json()
    refused = api.post("/v1/adapters", json={"id": "m", "path": "base-model.gguf"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == ("path", "invalid_adapter")
    assert "base-model.gguf is not a LoRA adapter: its general.type is none" in error["message"]
    assert api.get("/v1/adapters").json() == before
    replaced = api.post(
        "/v1/adapters", json={"id": "g", "path": "base-model.gguf", "replace": True}
    )
    assert replaced.status_code == 400 and api.get("/v1/adapters").json() == before


@pytest.mark.parametrize("case", ["alignment-0", "arrays-nested-deep"])
def test_a_malformed_header_is_a_400_naming_the_file(make_client, root: Path, case: str):
    values, words = MALFORMED_HEADERS[case]
    write_raw_gguf(root / "crafted" / "bad.gguf", values)
    api = make_client(adapter_root=root, auto_mount=True)
    refused = api.post("/v1/adapters", json={"id": "c", "path": "crafted/bad.gguf"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("path", "invalid_adapter")
    assert "bad.gguf cannot be read as a GGUF adapter" in error["message"]
    assert words in error["message"]
    first_use = api.post("/v1/chat/completions", json={**CHAT, "adapter": "crafted"})
    assert first_use.status_code == 400, first_use.text
    assert words in first_use.json()["error"]["message"]
    assert api.get("/v1/adapters").json()["data"] == []


def test_startup_mounts_take_gguf_files(make_client, root: Path):
    client = make_client(
        adapter_root=root, startup_adapters={"g": "sft-F32-LoRA.gguf", "d": "in-dir"}
    )
    cards = {card["id"]: card for card in client.get("/v1/adapters").json()["data"]}
    assert cards.keys() == {"g", "d"} and cards["g"]["revision"] == cards["d"]["revision"]


def test_first_use_mounts_a_directory_holding_a_gguf_file(make_client, root: Path):
    client = make_client(adapter_root=root, auto_mount=True)
    assert text(client, adapter="in-dir") != text(client)
    assert [card["id"] for card in client.get("/v1/adapters").json()["data"]] == ["in-dir"]


def test_the_root_listing_shows_a_directory_holding_a_gguf_file(make_client, root: Path):
    client = make_client(adapter_root=root)
    listing = client.get("/v1/adapter_root")
    assert listing.status_code == 200, listing.text
    entries = {entry["id"]: entry for entry in listing.json()["data"]}
    assert entries.keys() == {"in-dir", "peft"}  # loose files mount by path, not on first use
    assert entries["in-dir"]["state"] == "on disk"
    assert entries["in-dir"]["size_bytes"] == (root / "in-dir" / "sft.gguf").stat().st_size


def test_a_recorded_gguf_mount_comes_back_after_a_restart(make_client, root: Path):
    first = make_client(adapter_root=root, persist_mounts=True)
    created = first.post("/v1/adapters", json={"id": "g", "path": "sft-F32-LoRA.gguf"})
    assert created.status_code == 201, created.text
    answer = text(first, adapter="g")
    first.__exit__(None, None, None)
    again = make_client(adapter_root=root, persist_mounts=True)
    [card] = again.get("/v1/adapters").json()["data"]
    assert (card["id"], card["revision"]) == ("g", created.json()["revision"])
    assert text(again, adapter="g") == answer
