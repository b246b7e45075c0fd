"""Every refused mount says why and leaves the registry and the model exactly as they were."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from hotlora.adapters import (
    AdapterConflict,
    AdapterError,
    AdapterPathRefused,
    InvalidAdapter,
    activate,
)

from tests.support.adapter_builders import (
    adapter_set,
    logits,
    make_manager,
    parameter_ids,
    random_pairs,
    slots,
    tiny_model,
    write_mlx_adapter,
    write_peft_adapter,
)

MAX_RANK = 8


def good(root: Path, name: str = "bad") -> Path:
    return write_mlx_adapter(root / name, random_pairs(tiny_model(), seed=3))


def edit_config(root: Path, **changes: object) -> str:
    directory = good(root)
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return "bad"


def with_tensors(root: Path, tensors: dict[str, mx.array], rank: int = 4) -> str:
    directory = root / "bad"
    write_mlx_adapter(directory, {}, extra_tensors=tensors, rank=rank)
    return "bad"


def pair(path: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> dict[str, mx.array]:
    return {f"{path}.lora_a": mx.zeros(a_shape), f"{path}.lora_b": mx.zeros(b_shape)}


Q = "model.layers.0.self_attn.q_proj"


def outside_dir(root: Path) -> Path:
    return good(root.parent / "elsewhere", "adapter")


def symlink_dir(root: Path) -> str:
    os.symlink(outside_dir(root), root / "link")
    return "link"


def symlink_file(root: Path) -> str:
    directory = good(root)
    target = outside_dir(root) / "adapters.safetensors"
    (directory / "adapters.safetensors").unlink()
    os.symlink(target, directory / "adapters.safetensors")
    return "bad"


def remove(root: Path, name: str) -> str:
    (good(root) / name).unlink()
    return "bad"


def garbage_weights(root: Path) -> str:
    (good(root) / "adapters.safetensors").write_bytes(b"\x00not a safetensors file")
    return "bad"


def bad_json(root: Path) -> str:
    (good(root) / "adapter_config.json").write_text("{rank: 4,")
    return "bad"


def peft_rank_pattern(root: Path) -> str:
    directory = write_peft_adapter(root / "bad", random_pairs(tiny_model(), keys=["q_proj"]))
    config = json.loads((directory / "adapter_config.json").read_text())
    config["rank_pattern"] = {"q_proj": 8}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return "bad"


# (case id, adapter id, path maker -> path argument, exception, words in the message)
CASES: list[tuple[str, str, Callable[[Path], str], type[AdapterError], str]] = [
    ("id-plus", "a+b", good, InvalidAdapter, "may only contain"),
    ("id-comma", "a,b", good, InvalidAdapter, "may only contain"),
    ("id-at", "a@b", good, InvalidAdapter, "may only contain"),
    ("id-space", "a b", good, InvalidAdapter, "may only contain"),
    ("id-empty", "", good, InvalidAdapter, "empty"),
    ("id-long", "x" * 65, good, InvalidAdapter, "longer than 64"),
    ("id-none", "none", good, InvalidAdapter, "reserved"),
    ("id-None", "None", good, InvalidAdapter, "reserved"),
    ("dotdot", "sft", lambda r: (outside_dir(r), "../elsewhere/adapter")[1], AdapterPathRefused,
     "outside the adapter root"),
    ("absolute", "sft", lambda r: str(outside_dir(r)), AdapterPathRefused, "outside"),
    ("symlink-dir", "sft", symlink_dir, AdapterPathRefused, "outside"),
    ("symlink-file", "sft", symlink_file, AdapterPathRefused, "links outside"),
    ("nul-byte", "sft", lambda r: "a\x00b", InvalidAdapter, "cannot be resolved"),
    ("no-dir", "sft", lambda r: "missing", InvalidAdapter, "does not exist"),
    ("no-weights", "sft", lambda r: remove(r, "adapters.safetensors"), InvalidAdapter, "neither"),
    ("no-config", "sft", lambda r: remove(r, "adapter_config.json"), InvalidAdapter,
     "no adapter_config.json"),
    ("bad-json", "sft", bad_json, InvalidAdapter, "cannot be read as JSON"),
    ("garbage-weights", "sft", garbage_weights, InvalidAdapter, "cannot read adapters.safetensors"),
    ("dora", "sft", lambda r: edit_config(r, fine_tune_type="dora"), InvalidAdapter, "'dora'"),
    ("full", "sft", lambda r: edit_config(r, fine_tune_type="full"), InvalidAdapter, "'full'"),
    ("peft-dora", "sft", lambda r: edit_config(r, use_dora=True), InvalidAdapter, "DoRA"),
    ("rank-too-high", "sft", lambda r: edit_config(r, lora_parameters={"rank": 16, "scale": 1.0}),
     InvalidAdapter, "above this server's limit"),
    ("rank-missing", "sft", lambda r: edit_config(r, lora_parameters={"scale": 1.0}),
     InvalidAdapter, "no valid rank"),
    ("scale-missing", "sft", lambda r: edit_config(r, lora_parameters={"rank": 4}),
     InvalidAdapter, "no valid scale"),
    ("scale-nan", "sft", lambda r: edit_config(r, lora_parameters={"rank": 4, "scale": "x"}),
     InvalidAdapter, "no valid scale"),
    ("rank-mismatch", "sft", lambda r: edit_config(r, lora_parameters={"rank": 8, "scale": 1.0}),
     InvalidAdapter, "adapter_config.json says 8"),
    ("rank-pattern", "sft", peft_rank_pattern, InvalidAdapter, "rank_pattern"),
    ("missing-half", "sft", lambda r: with_tensors(r, {f"{Q}.lora_a": mx.zeros((64, 4))}),
     InvalidAdapter, "its lora_b is missing"),
    ("wrong-dims", "sft", lambda r: with_tensors(r, pair(Q, (64, 4), (4, 32))),
     InvalidAdapter, "do not fit"),
    ("not-a-matrix", "sft", lambda r: with_tensors(r, pair(Q, (64, 4, 1), (4, 64))),
     InvalidAdapter, "must be a matrix"),
    ("int-tensor", "sft", lambda r: with_tensors(
        r, {f"{Q}.lora_a": mx.zeros((64, 4), mx.int32), f"{Q}.lora_b": mx.zeros((4, 64))}),
     InvalidAdapter, "non-float"),
    ("no-matching-tensors", "sft", lambda r: with_tensors(
        r, pair("model.layers.0.attention.wq", (64, 4), (4, 64))),
     InvalidAdapter, "probably trained for another base model"),
    ("layer-the-base-lacks", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)), **pair("model.layers.9.self_attn.q_proj", (64, 4),
                                                  (4, 64))}),
     InvalidAdapter, "does not have"),
]  # fmt: skip


def snapshot(model, manager) -> tuple:
    return (
        [(i.id, i.revision, i.ram_bytes, i.mounted_at) for i in manager.list()],
        {path: (id(slot), id(slot.base)) for path, slot in slots(model).items()},
        parameter_ids(model),
    )


@pytest.mark.parametrize(
    ("adapter_id", "make_path", "error", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_refused_mount_changes_nothing(tmp_path, adapter_id, make_path, error, words):
    root = tmp_path / "root"
    root.mkdir()
    model, manager = make_manager(root, max_rank=MAX_RANK)
    write_mlx_adapter(root / "ok", random_pairs(tiny_model()))
    manager.mount("ok", "ok")
    before = snapshot(model, manager)
    base, adapted = logits(model), None
    with activate(adapter_set(manager, "ok")):
        adapted = logits(model)

    path = make_path(root)
    with pytest.raises(error) as caught:
        manager.mount(adapter_id, path)
    assert words in str(caught.value)

    assert snapshot(model, manager) == before
    assert mx.array_equal(logits(model), base)
    with activate(adapter_set(manager, "ok")):
        assert mx.array_equal(logits(model), adapted)


def test_path_errors_carry_the_path_param(tmp_path: Path):
    _, manager = make_manager(tmp_path / "root")
    with pytest.raises(AdapterPathRefused) as caught:
        manager.mount("sft", "../x")
    assert (caught.value.param, caught.value.code) == ("path", "adapter_path_refused")


def test_same_files_return_the_mounted_info_other_files_conflict(tmp_path: Path):
    model, manager = make_manager(tmp_path)
    write_mlx_adapter(tmp_path / "v1", random_pairs(tiny_model(), seed=1))
    write_mlx_adapter(tmp_path / "copy", random_pairs(tiny_model(), seed=1))
    write_mlx_adapter(tmp_path / "v2", random_pairs(tiny_model(), seed=2))
    first = manager.mount("sft", "v1")
    assert manager.mount("sft", "v1") == first
    assert manager.mount("sft", "copy") == first  # same content, same revision

    before = snapshot(model, manager)
    with pytest.raises(AdapterConflict) as caught:
        manager.mount("sft", "v2")
    assert caught.value.code == "adapter_conflict"
    assert snapshot(model, manager) == before

    replaced = manager.mount("sft", "v2", replace=True)
    assert replaced.revision != first.revision
    assert [info.revision for info in manager.list()] == [replaced.revision]


def test_a_changed_scale_is_a_new_revision(tmp_path: Path):
    _, manager = make_manager(tmp_path)
    pairs = random_pairs(tiny_model())
    write_mlx_adapter(tmp_path / "a", pairs, scale=1.0)
    write_mlx_adapter(tmp_path / "b", pairs, scale=2.0)
    assert manager.mount("a", "a").revision != manager.mount("b", "b").revision
