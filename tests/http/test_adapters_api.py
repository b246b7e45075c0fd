"""Adapters over HTTP, in-process on the tiny model: admin routes, keys, selection, refusals."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from fastapi.testclient import TestClient

from hotlora.adapters import parse_adapter_spec

from tests.support.adapter_builders import (
    random_pairs,
    tiny_model,
    write_mlx_adapter,
    write_peft_adapter,
)
from tests.support.sse import sse_events

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "temperature": 0}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An adapter root holding two adapters whose residuals visibly change the tiny model."""
    root = tmp_path / "adapters"
    model = tiny_model(quantize=True)
    write_mlx_adapter(root / "a", random_pairs(model, seed=1), scale=20.0)
    write_peft_adapter(root / "b", random_pairs(model, seed=2), alpha=80.0)
    write_mlx_adapter(root / "a2", random_pairs(model, seed=3), scale=20.0)
    return root


@pytest.fixture
def api(make_client, root: Path) -> TestClient:
    return make_client(adapter_root=root)


def text(client: TestClient, **fields: object) -> str:
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def mount(client: TestClient, adapter_id: str, path: str, **extra: object):
    return client.post("/v1/adapters", json={"id": adapter_id, "path": path, **extra})


def test_mount_list_get_and_unmount(api: TestClient, root: Path):
    created = mount(api, "a", "a")
    assert created.status_code == 201, created.text
    card = created.json()
    assert card["id"] == "a" and card["path"] == str(root / "a")
    assert card["rank"] == 4 and card["scale"] == 20.0 and not card["rslora"]
    assert card["mounted_layers"] == 14  # 7 projections x 2 layers
    assert card["ram_bytes"] > 0 and card["size_bytes"] > 0 and len(card["revision"]) == 64
    assert mount(api, "a", "a").status_code == 200  # same revision: unchanged
    assert [c["id"] for c in api.get("/v1/adapters").json()["data"]] == ["a"]
    assert api.get("/v1/adapters/a").json()["revision"] == card["revision"]
    models = api.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a", "tiny")]
    assert api.delete("/v1/adapters/a").json() == {"id": "a", "object": "adapter", "deleted": True}
    assert api.get("/v1/adapters").json()["data"] == []
    gone = api.get("/v1/adapters/a")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"
    long = api.get(f"/v1/adapters/{'z' * 60_000}").json()["error"]
    assert long["code"] == "adapter_not_found" and "'zzzzzzzzzzzzzzzz...'" in long["message"]
    assert len(long["message"]) < 200


def test_adapter_selection_changes_output_and_the_base_stays(api: TestClient):
    base = text(api)
    mount(api, "a", "a")
    mount(api, "b", "b")
    with_a = text(api, adapter="a")
    with_b = text(api, adapter="b")
    assert len({base, with_a, with_b}) == 3
    assert text(api) == base
    assert text(api, adapter="none") == base
    assert text(api, adapter="a@0") == base  # weight 0 contributes nothing
    assert text(api, adapter=[{"id": "a", "scale": 1.0}]) == with_a
    assert text(api, model="a") == with_a
    assert text(api, model="tiny:a") == with_a
    stacked = api.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12, "adapter": "a+b"})
    assert stacked.json()["model"] == "tiny:a+b"
    assert api.post("/v1/chat/completions", json={**CHAT, "model": "a"}).json()["model"] == "a"
    assert text(api) == base
    # The model an answer names can be looked up, as any model it may name.
    card = api.get("/v1/models/tiny:a+b").json()
    assert (card["id"], card["parent"], card["object"]) == ("tiny:a+b", "tiny", "model")
    assert card["max_model_len"] == api.get("/v1/models/tiny").json()["max_model_len"]
    for unknown in ("tiny:a+c", "tiny:a@x", "a+b", "other:a"):
        missing = api.get(f"/v1/models/{unknown}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_stream_with_adapter_equals_whole(api: TestClient):
    mount(api, "a", "a")
    whole = text(api, adapter="a")
    streamed = api.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 12, "adapter": "a", "stream": True}
    )
    chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole
    assert chunks[0]["model"] == "tiny:a"


def test_replace_swaps_and_conflict_refuses(api: TestClient):
    mount(api, "a", "a")
    with_a = text(api, adapter="a")
    conflict = mount(api, "a", "a2")
    assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "id"
    assert text(api, adapter="a") == with_a
    replaced = mount(api, "a", "a2", replace=True)
    assert replaced.status_code == 201
    assert text(api, adapter="a") != with_a
    mount(api, "a2", "a2")
    assert text(api, adapter="a") == text(api, adapter="a2")


def test_vllm_aliases(api: TestClient):
    loaded = api.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "b"})
    # vLLM's answer: 200 and a line of text, not a card.
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'b' added successfully.",
    )
    assert api.get("/v1/adapters/b").json()["scale"] == 20.0  # PEFT alpha 80 / r 4
    unloaded = api.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert (unloaded.status_code, unloaded.text) == (
        200,
        "Success: LoRA adapter 'b' removed successfully.",
    )
    missing = api.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "adapter_not_found"
    # Refusals name vLLM's fields, as the request sent them.
    assert missing.json()["error"]["param"] == "lora_name"
    outside = api.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "/etc"})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "lora_path"
    assert mount(api, "z", "/etc").json()["error"]["param"] == "path"  # the admin API's own
    assert api.get("/v1/adapters").json()["data"] == []


def test_vllm_load_of_a_path_with_nothing_there_is_a_404(api: TestClient):
    nothing = api.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "missing"})
    assert nothing.status_code == 404, nothing.text
    error = nothing.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "not_found_error",
        "adapter_path_not_found",
        "lora_path",
    )
    assert "does not exist" in error["message"]
    # The admin API's own mount keeps its answer: a 400 naming the path.
    refused = mount(api, "x", "missing")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "path"
    assert api.get("/v1/adapters").json()["data"] == []


def test_concurrent_vllm_loads_of_one_name_one_200_the_rest_400(api: TestClient):
    body = {"lora_name": "a", "lora_path": "a"}
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: api.post("/v1/load_lora_adapter", json=body), range(3)))
    assert sorted(r.status_code for r in answers) == [200, 400, 400], [r.text for r in answers]


def test_vllm_load_inplace_replaces(api: TestClient):
    def load(path: str, **extra: object) -> httpx.Response:
        return api.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path, **extra}
        )

    assert load("a").status_code == 200
    with_a = text(api, adapter="a")
    # vLLM's answer to a name already loaded, from the same files or others.
    for path in ("a", "a2"):
        again = load(path)
        assert again.status_code == 400, again.text
        error = again.json()["error"]
        assert error["message"] == (
            "The lora adapter 'a' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True."
        )
        assert (error["param"], error["code"]) == ("lora_name", "adapter_already_loaded")
    assert text(api, adapter="a") == with_a
    assert load("a", load_inplace=True).status_code == 200  # the same files, in place
    replaced = load("a2", load_inplace=True)
    assert replaced.status_code == 200, replaced.text
    assert api.get("/v1/adapters/a").json()["path"].endswith("a2")
    assert text(api, adapter="a") != with_a


MOUNT_REFUSALS = [
    # (body, status, param, words in the message)
    ({"id": "x", "path": "../outside"}, 400, "path", "outside the adapter root"),
    ({"id": "x", "path": "/etc"}, 400, "path", "outside the adapter root"),
    ({"id": "x", "path": "missing"}, 400, "path", "does not exist"),
    ({"id": "a+b", "path": "a"}, 400, "id", "may only contain"),
    ({"id": "none", "path": "a"}, 400, "id", "reserved"),
    ({"id": "", "path": "a"}, 400, "id", "empty"),
    # Ids that URLs normalise away: mounted, no DELETE could name them.
    ({"id": ".", "path": "a"}, 400, "id", "path segment"),
    ({"id": "..", "path": "a"}, 400, "id", "path segment"),
    ({"path": "a"}, 400, "id", ""),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), MOUNT_REFUSALS)
def test_refused_mount_changes_nothing(api: TestClient, body, status, param, words):
    mount(api, "b", "b")
    before = api.get("/v1/adapters").json()
    response = api.post("/v1/adapters", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert api.get("/v1/adapters").json() == before


# Ids at the edges of the id rules; each must be one a URL can name as it is.
EDGE_IDS = [".a", "a.", "...", "a..b", "-", "_", ".-_", "A" * 64, "0"]


def test_every_mountable_id_can_be_read_and_unmounted_by_its_url(api: TestClient):
    for adapter_id in EDGE_IDS:
        assert mount(api, adapter_id, "a").status_code == 201, adapter_id
    for adapter_id in EDGE_IDS:
        url = f"/v1/adapters/{adapter_id}"
        assert api.get(url).json()["id"] == adapter_id
        assert api.delete(url).json() == {"id": adapter_id, "object": "adapter", "deleted": True}
    assert api.get("/v1/adapters").json()["data"] == []


REQUEST_REFUSALS = [
    # (fields, status, param, code)
    ({"adapter": "zzz"}, 404, "adapter", "adapter_not_found"),
    ({"adapter": "b+zzz"}, 404, "adapter", "adapter_not_found"),
    ({"adapter": "b b"}, 400, "adapter", None),
    ({"adapter": "b@nan"}, 400, "adapter", None),
    ({"adapter": [{"scale": 2}]}, 400, "adapter", None),
    ({"model": "zzz"}, 404, "model", "model_not_found"),
    ({"model": "b", "adapter": "b"}, 400, "adapter", None),
    ({"model": "tiny:b@x"}, 400, "model", None),
    ({"model": "tiny:b+zzz"}, 404, "model", "adapter_not_found"),
]


@pytest.mark.parametrize(("fields", "status", "param", "code"), REQUEST_REFUSALS)
def test_refused_request_leaves_state_alone(api: TestClient, fields, status, param, code):
    mount(api, "b", "b")
    response = api.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, **fields})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if code:
        assert error["code"] == code
    if status == 404 and param == "adapter":
        assert "b" in error["message"]  # lists what is mounted
    [card] = api.get("/v1/adapters").json()["data"]
    assert card["in_use"] == 0  # no lease left behind
    assert api.app.state.runtime.worker.waiting == 0


def test_keys_guard_inference_and_admin_separately(make_client, root: Path):
    client = make_client(adapter_root=root, api_key="user-key", admin_api_key="admin-key")
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    assert client.get("/health").status_code == 200
    denied = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    wrong = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert client.get("/v1/models", headers=user).status_code == 200
    ok = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}, headers=user)
    assert ok.status_code == 200
    body = {"id": "a", "path": "a"}
    forbidden = client.post("/v1/adapters", json=body, headers=user)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
    assert client.post("/v1/adapters", json=body, headers=admin).status_code == 201
    assert client.get("/v1/adapters", headers=user).status_code == 403


def test_startup_adapters_are_mounted(make_client, root: Path):
    client = make_client(adapter_root=root, startup_adapters={"a": "a", "b": str(root / "b")})
    assert [c["id"] for c in client.get("/v1/adapters").json()["data"]] == ["a", "b"]


def test_a_bad_startup_adapter_stops_the_start(make_client, root: Path):
    failures: list[BaseException] = []
    client = make_client(
        ready=False,
        on_fatal=failures.append,
        adapter_root=root,
        startup_adapters={"x": "../nope"},
    )
    for _ in range(200):
        if failures:
            break
        time.sleep(0.05)
    assert failures and "outside the adapter root" in str(failures[0])
    ready = client.get("/ready")
    assert ready.status_code == 503 and "failed" in ready.json()["error"]["message"]


def cached(client: TestClient, **fields: object) -> int:
    body = {**CHAT, "messages": [{"role": "user", "content": "cache key"}], "max_tokens": 2}
    response = client.post("/v1/chat/completions", json={**body, **fields})
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prompt_cache_is_keyed_by_adapter_revision(api: TestClient):
    mount(api, "a", "a")
    cached(api)
    warm = cached(api)
    assert warm > 0  # the base's own repeat hits the cache
    assert cached(api, adapter="a") == 0  # never the base's KV under an adapter
    assert cached(api, adapter="a") == warm
    assert cached(api, adapter="a@0.5") == 0  # another weight is another residual
    mount(api, "a", "a2", replace=True)
    assert cached(api, adapter="a") == 0  # same name, new revision: nothing reused
    assert cached(api, adapter="a") == warm


Q = "model.layers.0.self_attn.q_proj"


def nan_weights(root: Path) -> str:
    pairs = random_pairs(tiny_model(quantize=True), seed=4)
    a, b = pairs[Q]
    pairs[Q] = (a * float("nan"), b)
    write_mlx_adapter(root / "bad", pairs)
    return "bad"


def bad_config(root: Path, text: str) -> str:
    write_mlx_adapter(root / "bad", random_pairs(tiny_model(quantize=True), seed=4))
    (root / "bad" / "adapter_config.json").write_text(text)
    return "bad"


def with_lm_head(root: Path) -> str:
    """A good adapter that also trains lm_head, which takes no LoRA here."""
    pairs = random_pairs(tiny_model(quantize=True), seed=4)
    extra = {"lm_head.lora_a": mx.zeros((64, 4)), "lm_head.lora_b": mx.zeros((4, 128))}
    write_mlx_adapter(root / "bad", pairs, extra_tensors=extra)
    return "bad"


BAD_FILES = [
    # (case id, path maker, words in the message); all 400 with param "path"
    ("nan-tensor", nan_weights, f"NaN or infinite values in the tensor {Q}.lora_a"),
    ("scale-bound", lambda r: bad_config(r, '{"lora_parameters": {"rank": 4, "scale": 1e9}}'),
     "(lora_parameters.scale) is outside the bound |scale| <= 10000"),
    ("scale-infinity", lambda r: bad_config(r, '{"r": 4, "lora_alpha": Infinity}'),
     "lora_alpha must be a finite number, got inf"),
    ("rank-zero", lambda r: bad_config(r, '{"lora_parameters": {"rank": 0, "scale": 1}}'),
     "lora_parameters.rank must be a positive integer"),
    ("config-deep", lambda r: bad_config(r, "[" * 50_000 + "]" * 50_000),
     "nests deeper than 32 levels"),
    ("config-large", lambda r: bad_config(r, " " * (1 << 20) + "{}"),
     f"adapter_config.json is over the limit of {1 << 20} bytes"),
    ("lm-head-tensor", with_lm_head, "lm_head.lora_a (lm_head takes no LoRA here)"),
    ("name-too-long", lambda r: "x" * 300, "cannot be read"),
    ("path-too-long", lambda r: "/".join(["y" * 200] * 30), "cannot be read"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make_path", "words"), [case[1:] for case in BAD_FILES], ids=[case[0] for case in BAD_FILES]
)
def test_bad_adapter_files_are_refused_with_a_400(api: TestClient, root: Path, make_path, words):
    mount(api, "b", "b")
    before = api.get("/v1/adapters").json()
    path = make_path(root)
    for body in ({"id": "x", "path": path}, {"id": "b", "path": path, "replace": True}):
        response = api.post("/v1/adapters", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("path", "invalid_adapter")
        assert words in error["message"]
    assert api.get("/v1/adapters").json() == before


def test_the_adapter_size_cap_is_a_setting(make_client, root: Path):
    size = (root / "a" / "adapters.safetensors").stat().st_size
    client = make_client(adapter_root=root, max_adapter_bytes=size - 1)
    refused = mount(client, "a", "a")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "path"
    assert error["message"] == (
        f"adapters.safetensors is over this server's limit of {size - 1} bytes per adapter file "
        f"({size} bytes)"
    )
    assert client.get("/v1/adapters").json()["data"] == []
    exact = make_client(adapter_root=root, max_adapter_bytes=size)
    assert mount(exact, "a", "a").status_code == 201


def test_in_use_after_replace_counts_the_old_revision(api: TestClient):
    mount(api, "a", "a")
    manager = api.app.state.runtime.adapters
    running = manager.select("tiny", parse_adapter_spec("a"))  # a request still on the old files
    assert mount(api, "a", "a2", replace=True).json()["in_use"] == 1
    assert api.get("/v1/adapters/a").json()["in_use"] == 1
    running.release()
    assert api.get("/v1/adapters/a").json()["in_use"] == 0


@pytest.mark.parametrize("mounts", [2, 4])
def test_concurrent_mounts_of_the_same_files_one_201_the_rest_200(api: TestClient, mounts: int):
    """However the calls interleave, one mounted the files and the others found them mounted."""
    with ThreadPoolExecutor(mounts) as pool:
        answers = list(pool.map(lambda _: mount(api, "a", "a"), range(mounts)))
    assert sorted(r.status_code for r in answers) == [200] * (mounts - 1) + [201], [
        r.text for r in answers
    ]
    assert len({r.json()["revision"] for r in answers}) == 1
    assert [card["id"] for card in api.get("/v1/adapters").json()["data"]] == ["a"]
