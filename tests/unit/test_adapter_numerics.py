"""Numbers, not behaviour: mounted adapters compute what mlx-lm and plain algebra say."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.tuner.utils import load_adapters

from hotlora.adapters import AdapterManager, AdapterNotFound, AdapterRef, activate
from hotlora.adapters.slots import LoRASlot

from tests.support.adapter_builders import (
    BASE_ID,
    RANK,
    SCALE,
    TOKENS,
    adapter_set,
    layer_keys,
    logits,
    make_manager,
    manager_with_a_and_b,
    merged_model,
    random_pairs,
    slots,
    tiny_model,
    write_mlx_adapter,
    write_peft_adapter,
)

CLOSE = {"rtol": 1e-4, "atol": 1e-4}


def run(model: nn.Module, active) -> mx.array:
    with activate(active):
        return logits(model)


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "4bit"])
def test_single_adapter_equals_mlx_lm_load_adapters(tmp_path: Path, quantize: bool):
    model, manager = make_manager(tmp_path, quantize=quantize)
    pairs = random_pairs(tiny_model())
    write_mlx_adapter(tmp_path / "sft", pairs)
    manager.mount("sft", "sft")

    reference = load_adapters(tiny_model(quantize=quantize), str(tmp_path / "sft"))
    expected = logits(reference)
    got = run(model, adapter_set(manager, "sft"))
    assert mx.array_equal(got, expected)
    assert not mx.allclose(got, logits(model), **CLOSE)  # the residual is not negligible


def test_peft_layout_and_rslora_match_mlx_layout(tmp_path: Path):
    model, manager = make_manager(tmp_path)
    pairs = random_pairs(tiny_model(), keys=["q_proj", "v_proj", "down_proj"])
    write_mlx_adapter(tmp_path / "mlx", pairs)
    write_peft_adapter(tmp_path / "peft", pairs, alpha=SCALE * RANK)
    write_peft_adapter(tmp_path / "rs", pairs, alpha=SCALE * RANK**0.5, rslora=True)
    infos = [manager.mount(name, name) for name in ("mlx", "peft", "rs")]

    assert [info.scale for info in infos] == pytest.approx([SCALE] * 3)
    assert [info.rslora for info in infos] == [False, False, True]
    expected = run(model, adapter_set(manager, "mlx"))
    assert mx.allclose(run(model, adapter_set(manager, "peft")), expected, **CLOSE)
    assert mx.allclose(run(model, adapter_set(manager, "rs")), expected, **CLOSE)


def test_stack_is_base_plus_both_residuals(tmp_path: Path):
    model, manager = make_manager(tmp_path)
    first, second = random_pairs(tiny_model(), seed=1), random_pairs(tiny_model(), seed=2)
    write_mlx_adapter(tmp_path / "sft", first)
    write_mlx_adapter(tmp_path / "dpo", second, scale=0.5)
    manager.mount("sft", "sft")
    manager.mount("dpo", "dpo")

    both = adapter_set(manager, "sft+dpo")
    expected = logits(merged_model([(first, SCALE), (second, 0.5)]))
    assert mx.allclose(run(model, both), expected, **CLOSE)
    assert both.key[0].startswith("sft@") and both.key[1].startswith("dpo@")
    assert mx.allclose(run(model, adapter_set(manager, "dpo,sft")), expected, **CLOSE)


def test_request_weight_scales_the_residual(tmp_path: Path):
    model, manager = make_manager(tmp_path)
    pairs = random_pairs(tiny_model())
    write_mlx_adapter(tmp_path / "sft", pairs)
    info = manager.mount("sft", "sft")

    half = adapter_set(manager, "sft@0.5")
    assert half.key == (f"sft@{info.revision[:12]}*0.5",)
    assert mx.allclose(run(model, half), logits(merged_model([(pairs, SCALE * 0.5)])), **CLOSE)
    zero = manager.resolve((AdapterRef("sft", 0.0),))
    assert mx.array_equal(run(model, zero), logits(tiny_model()))


def test_no_active_set_is_the_pristine_base_bit_for_bit(tmp_path: Path):
    model, manager = make_manager(tmp_path)
    pristine = logits(tiny_model())
    assert mx.array_equal(logits(model), pristine)
    write_mlx_adapter(tmp_path / "sft", random_pairs(tiny_model()))
    manager.mount("sft", "sft")
    assert mx.array_equal(logits(model), pristine)
    assert mx.array_equal(run(model, adapter_set(manager, "none")), pristine)
    manager.unmount("sft")
    assert mx.array_equal(logits(model), pristine)
    assert slots(model) and all(isinstance(s, LoRASlot) for s in slots(model).values())


def test_square_full_rank_pair_layout_follows_the_spelling(tmp_path: Path):
    # q_proj is 64 -> 64, so a rank-64 pair fits both layouts; lora_A/lora_B means PEFT's.
    model, manager = make_manager(tmp_path, max_rank=64)
    pairs = random_pairs(tiny_model(), rank=64, keys=["q_proj"])
    write_mlx_adapter(tmp_path / "mlx", pairs, rank=64)
    write_peft_adapter(tmp_path / "peft", pairs, rank=64, alpha=SCALE * 64)
    manager.mount("mlx", "mlx")
    manager.mount("peft", "peft")
    expected = logits(merged_model([(pairs, SCALE)]))
    assert mx.allclose(run(model, adapter_set(manager, "mlx")), expected, **CLOSE)
    assert mx.allclose(run(model, adapter_set(manager, "peft")), expected, **CLOSE)


def test_wrapped_and_plain_module_paths_match(tmp_path: Path):
    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.language_model = inner

        def __call__(self, tokens: mx.array) -> mx.array:
            return self.language_model(tokens)

    pairs = random_pairs(tiny_model())
    write_mlx_adapter(tmp_path / "plain", pairs)
    write_peft_adapter(tmp_path / "wrapped", pairs, alpha=SCALE * RANK, prefix="language_model.")
    expected = logits(merged_model([(pairs, SCALE)]))

    model = Wrapped(tiny_model())
    manager = AdapterManager(model, base_id=BASE_ID, adapter_root=tmp_path, max_rank=8)
    assert next(iter(slots(model))).startswith("language_model.model.layers.")
    for name in ("plain", "wrapped"):
        assert manager.mount(name, name).mounted_layers == 14
        assert mx.allclose(run(model, adapter_set(manager, name)), expected, **CLOSE)


def test_info_counts_bytes_and_layers(tmp_path: Path):
    _, manager = make_manager(tmp_path)
    pairs = random_pairs(tiny_model(), keys=["q_proj", "v_proj"])
    write_mlx_adapter(tmp_path / "sft", pairs)
    info = manager.mount("sft", "sft")
    assert info.mounted_layers == len(pairs) == 4
    assert info.ram_bytes == sum(a.nbytes + b.nbytes for a, b in pairs.values())
    assert info.size_bytes == (tmp_path / "sft" / "adapters.safetensors").stat().st_size
    assert info.rank == RANK and info.scale == SCALE and len(info.revision) == 64
    assert info.to_dict()["id"] == "sft"
    assert layer_keys(pairs) == ["self_attn.q_proj", "self_attn.v_proj"]


def test_interleaved_requests_each_get_their_own_logits(tmp_path: Path):
    from mlx_lm.models.cache import make_prompt_cache

    model, manager = manager_with_a_and_b(tmp_path)
    sets = {
        "a": adapter_set(manager, "a"),
        "b": adapter_set(manager, "b"),
        "": adapter_set(manager, ""),
    }

    def decode(active, steps: int) -> list[mx.array]:
        cache = make_prompt_cache(model)
        out = []
        for i in range(steps):
            with activate(active):
                out.append(model(TOKENS[:, i : i + 1], cache=cache))
            mx.eval(out[-1])
        return out

    alone = {name: decode(active, 4) for name, active in sets.items()}
    caches = {name: make_prompt_cache(model) for name in sets}
    for i in range(4):  # one decode step per request in turn, as a worker would
        for name, active in sets.items():
            with activate(active):
                step = model(TOKENS[:, i : i + 1], cache=caches[name])
            assert mx.array_equal(step, alone[name][i]), (name, i)
    assert not mx.allclose(alone["a"][-1], alone["b"][-1], **CLOSE)


def test_a_held_set_keeps_its_weights_after_unmount_and_replace(tmp_path: Path):
    model, manager = make_manager(tmp_path)
    first, second = random_pairs(tiny_model(), seed=1), random_pairs(tiny_model(), seed=2)
    write_mlx_adapter(tmp_path / "v1", first)
    write_mlx_adapter(tmp_path / "v2", second)
    manager.mount("sft", "v1")
    held = adapter_set(manager, "sft")
    before = run(model, held)

    manager.mount("sft", "v2", replace=True)
    assert mx.array_equal(run(model, held), before)
    replaced = adapter_set(manager, "sft")
    assert replaced.key != held.key
    assert mx.allclose(run(model, replaced), logits(merged_model([(second, SCALE)])), **CLOSE)

    manager.unmount("sft")
    assert mx.array_equal(run(model, held), before)
    with pytest.raises(AdapterNotFound):
        adapter_set(manager, "sft")
