"""Every refused mount says why and leaves the adapter manager and the model as they were."""

from __future__ import annotations

import gc
import hashlib
import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from hotlora.adapters import (
    AdapterConflict,
    AdapterError,
    AdapterManager,
    AdapterPathRefused,
    InvalidAdapter,
    activate,
    adapter_files,
)
from hotlora.adapters.adapter_config import read_adapter_config
from hotlora.adapters.adapter_files import revision
from hotlora.models.cpu import extension

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
MAX_BYTES = 256 << 10  # the tiny model's adapters are about 60 KiB


def good(root: Path, name: str = "bad") -> Path:
    return write_mlx_adapter(root / name, random_pairs(tiny_model(), seed=3))


def edit_config(root: Path, **changes: object) -> str:
    directory = good(root)
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return "bad"


def edit_lora_parameters(root: Path, **changes: object) -> str:
    directory = good(root)
    config = json.loads((directory / "adapter_config.json").read_text())
    config["lora_parameters"].update(changes)
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


def edit_peft_config(root: Path, **changes: object) -> str:
    directory = write_peft_adapter(root / "bad", random_pairs(tiny_model(), seed=3))
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(config))  # NaN, Infinity allowed
    return "bad"


def with_peft_tensors(root: Path, tensors: dict[str, mx.array], **changes: object) -> str:
    """A PEFT adapter whose file also holds `tensors`, its config with `changes`."""
    edit_peft_config(root, **changes)
    weights = root / "bad" / "adapter_model.safetensors"
    mx.save_safetensors(str(weights), {**mx.load(str(weights)), **tensors})
    return "bad"


def config_text(root: Path, text: str) -> str:
    (good(root) / "adapter_config.json").write_text(text)
    return "bad"


def not_utf8(root: Path) -> str:
    (good(root) / "adapter_config.json").write_bytes(b'{"lora_parameters": "\xff"}')
    return "bad"


def nested(depth: int) -> str:
    """A valid mlx-lm config with one more key holding arrays nested `depth` levels deep."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)  # the config object itself is one level
    return f'{{"lora_parameters": {{"rank": 4, "scale": 2.0}}, "extra": {inner}}}'


def poisoned(root: Path, half: str, value: float, peft: bool = False) -> str:
    """The good adapter with one value of the first layer's q_proj `half` set to `value`."""
    pairs = random_pairs(tiny_model(), seed=3)
    a, b = pairs[Q]
    target = mx.array(a if half == "a" else b)
    target[1, 2] = value
    pairs[Q] = (target, b) if half == "a" else (a, target)
    if peft:
        write_peft_adapter(root / "bad", pairs)
    else:
        write_mlx_adapter(root / "bad", pairs)
    return "bad"


def oversized_weights(root: Path) -> str:
    pairs = random_pairs(tiny_model(), seed=3)
    write_mlx_adapter(root / "bad", pairs, extra_tensors={"padding": mx.zeros((MAX_BYTES // 4,))})
    return "bad"


def peft_pattern(key: str) -> Callable[[Path], str]:
    """A PEFT adapter whose config gives `q_proj` a rank or alpha of its own (`key`)."""

    def make(root: Path) -> str:
        directory = write_peft_adapter(root / "bad", random_pairs(tiny_model(), keys=["q_proj"]))
        config = json.loads((directory / "adapter_config.json").read_text())
        config[key] = {"q_proj": 8}
        (directory / "adapter_config.json").write_text(json.dumps(config))
        return "bad"

    return make


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
    ("num-layers-fewer", "sft", lambda r: edit_config(r, num_layers=1), InvalidAdapter,
     "num_layers 1 (layers 1 to 1), but the file holds pairs outside them"),
    ("num-layers-text", "sft", lambda r: edit_config(r, num_layers="2"), InvalidAdapter,
     "num_layers must be an integer"),
    ("keys-fewer", "sft", lambda r: edit_lora_parameters(r, keys=["self_attn.q_proj"]),
     InvalidAdapter, "model.layers.0.mlp.down_proj"),
    ("keys-not-a-list", "sft", lambda r: edit_lora_parameters(r, keys="self_attn.q_proj"),
     InvalidAdapter, "keys must be a list"),
    ("peft-targets-fewer", "sft", lambda r: edit_peft_config(r, target_modules=["q_proj"]),
     InvalidAdapter, "base_model.model.model.layers.0.mlp.down_proj"),
    ("peft-targets-pattern", "sft",
     lambda r: edit_peft_config(r, target_modules=r".*\.(q|k|v|o)_proj"), InvalidAdapter,
     "leave out modules the file holds pairs for"),
    ("peft-targets-excluded", "sft",
     lambda r: edit_peft_config(r, target_modules="all-linear", exclude_modules=["down_proj"]),
     InvalidAdapter, "layers.1.mlp.down_proj"),
    ("peft-targets-layers", "sft",
     lambda r: edit_peft_config(r, layers_to_transform=[1], layers_pattern="layers"),
     InvalidAdapter, "layers.0.mlp.down_proj"),
    ("peft-targets-bad-pattern", "sft", lambda r: edit_peft_config(r, target_modules="(q"),
     InvalidAdapter, "target_modules is not a valid pattern"),
    ("peft-targets-not-names", "sft", lambda r: edit_peft_config(r, target_modules=[1]),
     InvalidAdapter, "target_modules must be a pattern or a list of module names"),
    ("peft-layers-text", "sft", lambda r: edit_peft_config(r, layers_to_transform="0"),
     InvalidAdapter, "layers_to_transform must be a layer index"),
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
    ("rank-pattern", "sft", peft_pattern("rank_pattern"), InvalidAdapter,
     "per-module ranks (rank_pattern)"),
    ("alpha-pattern", "sft", peft_pattern("alpha_pattern"), InvalidAdapter,
     "per-module alphas (alpha_pattern)"),
    # A config that trained more than LoRA pairs, whether or not the file holds those weights.
    ("modules-to-save", "sft", lambda r: edit_peft_config(r, modules_to_save=["lm_head"]),
     InvalidAdapter, "modules_to_save ('lm_head') says the adapter was trained with full copies"),
    ("modules-to-save-with-weights", "sft", lambda r: with_peft_tensors(
        r, {"base_model.model.lm_head.modules_to_save.default.weight": mx.zeros((128, 64))},
        modules_to_save=["lm_head"]),
     InvalidAdapter, "modules_to_save ('lm_head')"),
    ("trained-biases", "sft", lambda r: edit_peft_config(r, bias="lora_only"),
     InvalidAdapter, "bias 'lora_only' says the adapter trained biases"),
    # Numbers that feed the scale: finite, in bounds, and named in the message.
    ("rank-zero", "sft", lambda r: edit_config(r, lora_parameters={"rank": 0, "scale": 1.0}),
     InvalidAdapter, "lora_parameters.rank must be a positive integer, got 0"),
    ("rank-float", "sft", lambda r: edit_config(r, lora_parameters={"rank": 4.0, "scale": 1.0}),
     InvalidAdapter, "lora_parameters.rank must be a positive integer, got 4.0"),
    ("rank-bool", "sft", lambda r: edit_config(r, lora_parameters={"rank": True, "scale": 1.0}),
     InvalidAdapter, "lora_parameters.rank must be a positive integer, got True"),
    ("scale-nan-literal", "sft",
     lambda r: edit_config(r, lora_parameters={"rank": 4, "scale": float("nan")}),
     InvalidAdapter, "lora_parameters.scale must be a finite number, got nan"),
    ("scale-inf-literal", "sft",
     lambda r: edit_config(r, lora_parameters={"rank": 4, "scale": float("-inf")}),
     InvalidAdapter, "lora_parameters.scale must be a finite number, got -inf"),
    ("scale-beyond-bound", "sft",
     lambda r: edit_config(r, lora_parameters={"rank": 4, "scale": 1.5e4}),
     InvalidAdapter, "scale 15000 (lora_parameters.scale) is outside the bound |scale| <= 10000"),
    ("scale-negative-bound", "sft",
     lambda r: edit_config(r, lora_parameters={"rank": 4, "scale": -1e300}),
     InvalidAdapter, "is outside the bound"),
    ("scale-int-past-float", "sft",
     lambda r: edit_config(r, lora_parameters={"rank": 4, "scale": 10**400}),
     InvalidAdapter, "lora_parameters.scale must be a finite number"),
    ("top-level-scale", "sft", lambda r: edit_config(r, lora_parameters={"rank": 4}, scale=2e4),
     InvalidAdapter, "(scale) is outside the bound"),
    ("peft-r-zero", "sft", lambda r: edit_peft_config(r, r=0), InvalidAdapter,
     "r must be a positive integer, got 0"),
    ("peft-r-string", "sft", lambda r: edit_peft_config(r, r="4"), InvalidAdapter,
     "r must be a positive integer, got '4'"),
    ("peft-r-negative", "sft", lambda r: edit_peft_config(r, r=-4), InvalidAdapter,
     "r must be a positive integer, got -4"),
    ("peft-alpha-inf", "sft", lambda r: edit_peft_config(r, lora_alpha=float("inf")),
     InvalidAdapter, "lora_alpha must be a finite number, got inf"),
    ("peft-alpha-missing", "sft", lambda r: edit_peft_config(r, lora_alpha=None),
     InvalidAdapter, "lora_alpha must be a finite number, got None"),
    ("peft-alpha-int-past-float", "sft", lambda r: edit_peft_config(r, lora_alpha=10**400),
     InvalidAdapter, "lora_alpha must be a finite number"),
    ("peft-alpha-beyond-bound", "sft", lambda r: edit_peft_config(r, lora_alpha=1e300),
     InvalidAdapter, "(lora_alpha / r) is outside the bound"),
    ("peft-rslora-beyond-bound", "sft",
     lambda r: edit_peft_config(r, lora_alpha=3e4, use_rslora=True),
     InvalidAdapter, "scale 15000 (lora_alpha / sqrt(r)) is outside the bound"),
    ("peft-scale-nan", "sft", lambda r: edit_peft_config(r, scale=float("nan")), InvalidAdapter,
     "scale must be a finite number, got nan"),
    # The config file itself: size and nesting are checked before it is parsed.
    ("config-too-deep", "sft", lambda r: config_text(r, nested(100_000)), InvalidAdapter,
     "nests deeper than 32 levels"),
    ("config-one-level-too-deep", "sft", lambda r: config_text(r, nested(33)), InvalidAdapter,
     "nests deeper than 32 levels"),
    ("config-too-large", "sft",
     lambda r: config_text(r, json.dumps({"pad": " " * MAX_BYTES, "lora_parameters": {}})),
     InvalidAdapter, f"adapter_config.json is over the limit of {MAX_BYTES} bytes"),
    ("config-long-number", "sft",
     lambda r: config_text(r, '{"lora_parameters": {"rank": 4, "scale": 1' + "0" * 5000 + "}}"),
     InvalidAdapter, "cannot be read as JSON"),
    ("config-not-utf8", "sft", not_utf8, InvalidAdapter, "cannot be read as JSON"),
    # The weights: every value finite, as stored and as mounted; the file within the cap.
    ("nan-in-a", "sft", lambda r: poisoned(r, "a", float("nan")), InvalidAdapter,
     f"NaN or infinite values in the tensor {Q}.lora_a"),
    ("inf-in-b", "sft", lambda r: poisoned(r, "b", float("inf")), InvalidAdapter,
     f"NaN or infinite values in the tensor {Q}.lora_b"),
    ("peft-nan", "sft", lambda r: poisoned(r, "b", float("-inf"), peft=True), InvalidAdapter,
     f"NaN or infinite values in the tensor base_model.model.{Q}.lora_B.weight"),
    ("weights-over-cap", "sft", oversized_weights, InvalidAdapter,
     f"adapters.safetensors is over this server's limit of {MAX_BYTES} bytes per adapter file"),
    # Paths the file system cannot take are refused, not a server error.
    ("name-too-long", "sft", lambda r: "x" * 300, InvalidAdapter, "cannot be read"),
    ("path-too-long", "sft", lambda r: "/".join(["y" * 200] * 30), InvalidAdapter,
     "cannot be read"),
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
    # Every tensor is applied or the mount is refused, naming the first tensors it cannot apply.
    ("expert-weight", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)), **pair("model.layers.0.mlp.experts.0.gate_proj",
                                                  (64, 4), (4, 128))}),
     InvalidAdapter, "model.layers.0.mlp.experts.0.gate_proj.lora_a (MoE expert weights take no "
     "LoRA here)"),
    ("switch-mlp-weight", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)), **pair("model.layers.0.mlp.switch_mlp.up_proj",
                                                  (64, 4), (4, 128))}),
     InvalidAdapter, "switch_mlp.up_proj.lora_a (MoE expert weights"),
    ("embedding", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)), "model.embed_tokens.lora_a": mx.zeros((128, 4))}),
     InvalidAdapter, "model.embed_tokens.lora_a (embeddings take no LoRA here)"),
    ("peft-embedding", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)),
            "base_model.model.model.embed_tokens.lora_embedding_A": mx.zeros((4, 128))}),
     InvalidAdapter, "embed_tokens.lora_embedding_A (embeddings take no LoRA here)"),
    ("lm-head", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)), "lm_head.lora_b": mx.zeros((4, 128))}),
     InvalidAdapter, "lm_head.lora_b (lm_head takes no LoRA here)"),
    ("peft-modules-to-save", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)),
            "base_model.model.lm_head.modules_to_save.default.weight": mx.zeros((128, 64))}),
     InvalidAdapter, "lm_head.modules_to_save.default.weight (lm_head takes no LoRA here)"),
    ("unknown-projection", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)), **pair("model.layers.0.self_attn.dense", (64, 4),
                                                  (4, 64))}),
     InvalidAdapter, "self_attn.dense.lora_a (dense is not a projection that takes LoRA)"),
    ("not-a-lora-tensor", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)), "model.norm.weight": mx.zeros((64,))}),
     InvalidAdapter, "model.norm.weight (not a LoRA A or B matrix"),
    ("fused-projection-the-base-lacks", "sft", lambda r: with_tensors(
        r, {**pair(Q, (64, 4), (4, 64)), **pair("model.layers.0.self_attn.qkv_proj", (64, 4),
                                                  (4, 128))}),
     InvalidAdapter, "modules the base model does not have (model.layers.0.self_attn.qkv_proj)"),
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
    model, manager = make_manager(root, max_rank=MAX_RANK, max_bytes=MAX_BYTES)
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
    assert caught.value.param == ("path" if adapter_id == "sft" else "id")
    if adapter_id == "sft":  # the same files, as a replacement of a mounted adapter
        with pytest.raises(error):
            manager.mount("ok", path, replace=True)

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


def test_nesting_up_to_the_limit_and_brackets_in_strings_mount(tmp_path: Path):
    _, manager = make_manager(tmp_path)
    config_text(tmp_path, nested(32))
    assert manager.mount("deep", "bad").rank == 4
    brackets = '{"lora_parameters": {"rank": 4, "scale": 2.0}, "note": "' + "[{" * 1000 + '\\""}'
    write_mlx_adapter(tmp_path / "strings", random_pairs(tiny_model(), seed=3))
    (tmp_path / "strings" / "adapter_config.json").write_text(brackets)
    assert manager.mount("strings", "strings").rank == 4


def test_an_oversized_weight_file_is_refused_from_its_size_alone(tmp_path: Path, monkeypatch):
    """A 3 GiB sparse file over the default 2 GiB cap: refused without being read or hashed."""
    _, manager = make_manager(tmp_path)
    directory = good(tmp_path)
    with (directory / "adapters.safetensors").open("r+b") as stream:
        stream.truncate(3 << 30)

    def unreachable(*args: object, **kwargs: object) -> None:
        raise AssertionError("the file was opened for reading")

    monkeypatch.setattr(mx, "load", unreachable)
    monkeypatch.setattr(hashlib, "sha256", unreachable)
    with pytest.raises(InvalidAdapter) as caught:
        manager.mount("sft", "bad")
    assert caught.value.param == "path"
    assert str(caught.value) == (
        f"adapters.safetensors is over this server's limit of {2 << 30} bytes per adapter file "
        f"({3 << 30} bytes)"
    )
    assert manager.list() == []


def test_a_file_that_grows_past_the_cap_while_hashed_is_refused(tmp_path: Path):
    directory = good(tmp_path)
    config = read_adapter_config(directory / "adapter_config.json", max_rank=8)
    size = (directory / "adapters.safetensors").stat().st_size
    assert len(revision(config, directory / "adapters.safetensors", max_bytes=size)) == 64
    with pytest.raises(InvalidAdapter, match="grew past this server's limit"):
        revision(config, directory / "adapters.safetensors", max_bytes=size - 1)


def test_a_file_hashed_before_and_unchanged_is_not_hashed_again(tmp_path: Path, monkeypatch):
    """An evicted adapter loaded again from the same, unchanged file keeps its revision without
    reading the file a second time for it; the same bytes rewritten, other bytes of the same
    size, or a file hashed too soon after it was written are hashed again."""
    _, manager = make_manager(tmp_path)
    directory = good(tmp_path, "a")
    weights = directory / "adapters.safetensors"
    hashed: list[str] = []
    real = adapter_files.revision

    def counted(*args: object, **kwargs: object) -> str:
        hashed.append("x")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(adapter_files, "revision", counted)
    # Just written: too close to its times to tell a later write in the same tick, hashed each time.
    first = manager.mount("a", "a").revision
    manager.unmount("a")
    assert manager.mount("a", "a").revision == first and len(hashed) == 2
    manager.unmount("a")
    monkeypatch.setattr(adapter_files, "_UNCHANGED_AFTER_NS", 0)  # as if written long before
    assert manager.mount("a", "a").revision == first and len(hashed) == 3
    manager.unmount("a")
    assert manager.mount("a", "a").revision == first and len(hashed) == 3  # not read again
    manager.unmount("a")
    data = weights.read_bytes()
    weights.write_bytes(data)  # the same bytes written again: new times, hashed again
    assert manager.mount("a", "a").revision == first and len(hashed) == 4
    manager.unmount("a")
    stat = weights.stat()
    other = write_mlx_adapter(tmp_path / "b", random_pairs(tiny_model(), seed=4))
    changed = (other / "adapters.safetensors").read_bytes()
    assert len(changed) == len(data) and changed != data
    weights.write_bytes(changed)  # other bytes, the same size, its times put back
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert manager.mount("a", "a").revision != first and len(hashed) == 5


@pytest.fixture(params=["native", "numpy"])
def finiteness_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which check of the values a mount takes: the native extension's, one call for every
    tensor (where it is loaded, as on a CPU server), or NumPy's and MLX's, a tensor at a time."""
    if request.param == "native":
        if (why := extension.unavailable()) is not None:
            pytest.skip(f"native kernels: {why}")
        native = importlib.import_module("hotlora.models.cpu._rows_matmul")
        monkeypatch.setattr(extension, "native", native)
    else:
        monkeypatch.setattr(extension, "native", None)
    return str(request.param)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("at", ["first", "last"])
def test_a_value_not_finite_anywhere_is_refused_naming_its_tensor(
    tmp_path: Path, finiteness_check: str, dtype: mx.Dtype, value: float, at: str
):
    """Whatever the dtype, and wherever the value sits in the tensor, only that tensor is named;
    the same tensors, finite, mount."""
    _, manager = make_manager(tmp_path)
    pairs = {
        path: (a.astype(dtype), b.astype(dtype))
        for path, (a, b) in random_pairs(tiny_model(), seed=5).items()
    }
    write_mlx_adapter(tmp_path / "good", pairs)
    a, b = pairs[Q]
    poisoned_a = mx.array(a)
    poisoned_a[(0, 0) if at == "first" else (-1, -1)] = value
    write_mlx_adapter(tmp_path / "bad", {**pairs, Q: (poisoned_a, b)})
    with pytest.raises(InvalidAdapter) as caught:
        manager.mount("sft", "bad")
    assert str(caught.value) == f"NaN or infinite values in the tensor {Q}.lora_a"
    assert manager.list() == []
    assert manager.mount("sft", "good").mounted_layers == len(pairs)


@pytest.mark.parametrize("kept_in", ["float16 activations", "--adapter-dtype float16"])
def test_values_past_the_half_precision_range_are_refused(
    tmp_path: Path, finiteness_check: str, kept_in: str
):
    """float32 values that float16 cannot hold would turn into inf once mounted in float16:
    where the activations are float16, or where the server keeps adapters in float16."""
    model = tiny_model()
    if kept_in == "float16 activations":
        model.set_dtype(mx.float16)
        manager = AdapterManager(model, base_id="tiny", adapter_root=tmp_path, max_rank=8)
    else:
        manager = AdapterManager(
            model, base_id="tiny", adapter_root=tmp_path, max_rank=8, adapter_dtype=mx.float16
        )
    poisoned(tmp_path, "b", 1e6)
    with pytest.raises(InvalidAdapter) as caught:
        manager.mount("sft", "bad")
    assert str(caught.value) == (
        f"the tensor {Q}.lora_b has values beyond the range of float16, the dtype this server "
        "keeps adapters in (its activations', or --adapter-dtype; where the activations are "
        "float32, --adapter-dtype float32 keeps the values as stored)"
    )
    assert manager.list() == []
    make_manager(tmp_path)[1].mount("sft", "bad")  # float32 activations hold it


@pytest.mark.parametrize("layout", ["mlx-lm", "peft"])
def test_a_float16_mount_holds_mlx_s_rounding_of_the_pairs(
    tmp_path: Path, finiteness_check: str, layout: str
):
    """`--adapter-dtype float16`: whichever path rounds the file's float32 values (the native
    extension's, or MLX's astype), the mounted pairs are MLX's float16 rounding of them, in
    mlx-lm's layout and row-major, from either file layout."""
    pairs = random_pairs(tiny_model(), seed=7)
    write = write_mlx_adapter if layout == "mlx-lm" else write_peft_adapter
    write(tmp_path / "sft", pairs)
    manager = AdapterManager(
        tiny_model(), base_id="tiny", adapter_root=tmp_path, max_rank=8, adapter_dtype=mx.float16
    )
    manager.mount("sft", "sft")
    (entry,) = adapter_set(manager, "sft").entries
    mounted = entry.mounted.adapter.weights
    assert mounted.keys() == pairs.keys()
    for path, (a, b) in pairs.items():
        for got, want in zip(mounted[path], (a, b), strict=True):
            assert got.dtype == mx.float16 and got.shape == want.shape
            assert mx.array_equal(got.view(mx.uint16), want.astype(mx.float16).view(mx.uint16))


def test_bfloat16_weights_are_checked_as_the_others(tmp_path: Path, finiteness_check: str):
    """bfloat16, which NumPy cannot read, takes the same checks: a NaN is refused naming the
    tensor, finite values mount."""
    _, manager = make_manager(tmp_path)
    pairs = random_pairs(tiny_model(), seed=3)
    halves = {
        path: (a.astype(mx.bfloat16), b.astype(mx.bfloat16)) for path, (a, b) in pairs.items()
    }
    write_mlx_adapter(tmp_path / "good16", halves)
    a, b = halves[Q]
    poisoned_b = mx.array(b)
    poisoned_b[0, 1] = float("nan")
    write_mlx_adapter(tmp_path / "bad16", {**halves, Q: (a, poisoned_b)})
    with pytest.raises(InvalidAdapter) as caught:
        manager.mount("sft", "bad16")
    assert str(caught.value) == f"NaN or infinite values in the tensor {Q}.lora_b"
    assert manager.list() == []
    assert manager.mount("sft", "good16").mounted_layers == len(pairs)


def test_a_refused_mount_leaves_no_memory_behind(tmp_path: Path):
    _, manager = make_manager(tmp_path)
    pairs = random_pairs(tiny_model(), rank=64, seed=3)
    a, b = pairs[Q]
    pairs[Q] = (a, b * float("nan"))
    write_mlx_adapter(tmp_path / "bad", pairs, rank=64)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    with pytest.raises(InvalidAdapter, match="NaN"):
        manager.mount("sft", "bad")
    # The error is still held (by `pytest.raises`), as a server holds it while it answers.
    gc.collect()
    assert mx.get_active_memory() == before
    assert mx.get_cache_memory() == 0


@pytest.mark.parametrize("changes", [{"modules_to_save": None}, {"modules_to_save": []},
                                     {"bias": "none"}])  # fmt: skip
def test_a_peft_config_that_trained_only_pairs_mounts(tmp_path: Path, changes: dict):
    root = tmp_path / "root"
    _, manager = make_manager(root, max_rank=MAX_RANK, max_bytes=MAX_BYTES)
    path = edit_peft_config(root, **changes)
    assert manager.mount("sft", path).rank == 4


@pytest.mark.parametrize(
    "changes",
    [
        {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]},
        {"target_modules": "all-linear"},
        {"target_modules": r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"},
        {"target_modules": None},
        {"target_modules": ["down_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                            "up_proj", "lm_head"], "exclude_modules": ["lm_head"]},
        {"layers_to_transform": [0, 1], "layers_pattern": ["h", "layers"]},
        {"layers_to_transform": [0, 1, 7]},
    ],
)  # fmt: skip
def test_a_peft_config_whose_targets_cover_the_pairs_mounts(tmp_path: Path, changes: dict):
    """Target modules as names, as `all-linear`, as a pattern or not given, and layers that
    take in every pair's: PEFT puts LoRA on every module the file holds pairs for."""
    root = tmp_path / "root"
    _, manager = make_manager(root, max_rank=MAX_RANK, max_bytes=MAX_BYTES)
    path = edit_peft_config(root, **changes)
    assert manager.mount("sft", path).mounted_layers == len(random_pairs(tiny_model()))


@pytest.mark.parametrize("num_layers", [2, 5, 0, -1])
def test_a_config_that_declares_every_layer_the_pairs_are_in_mounts(tmp_path, num_layers):
    """mlx-lm's `num_layers` at or above the base's layer count, or 0 or -1 (all), and `keys`
    naming every projection the pairs are for: the adapter mounts."""
    root = tmp_path / "root"
    root.mkdir()
    _, manager = make_manager(root, max_rank=MAX_RANK, max_bytes=MAX_BYTES)
    edit_config(root, num_layers=num_layers)
    assert manager.mount("declared", "bad").mounted_layers > 0


def test_a_key_naming_a_module_s_whole_path_holds_in_any_layer(tmp_path):
    """mlx-lm applies a key that is a module's whole path whatever `num_layers` says."""
    root = tmp_path / "root"
    root.mkdir()
    _, manager = make_manager(root, max_rank=MAX_RANK, max_bytes=MAX_BYTES)
    directory = good(root)
    config = json.loads((directory / "adapter_config.json").read_text())
    within = config["lora_parameters"]["keys"]
    config["num_layers"] = 1  # the last layer only, but for the whole paths of layer 0's
    config["lora_parameters"]["keys"] = [f"model.layers.0.{key}" for key in within] + within
    (directory / "adapter_config.json").write_text(json.dumps(config))
    assert manager.mount("whole", "bad").mounted_layers > 0
