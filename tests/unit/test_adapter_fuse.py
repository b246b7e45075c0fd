"""Fusing an adapter into a model directory gives a base that computes the adapted logits."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from hotlora.adapters import AdapterManager, InvalidAdapter, activate, fuse_adapter
from hotlora.adapters.projections import find_targets
from hotlora.models.loader import load_model_dir

from tests.support.adapter_builders import (
    BASE_ID,
    adapter_set,
    logits,
    random_pairs,
    tiny_model,
    tiny_phi3,
    write_mlx_adapter,
    write_peft_adapter,
)
from tests.support.tiny import write_tiny_llama


def adapted_and_fused(tmp_path: Path, quantize: bool) -> tuple[mx.array, mx.array, mx.array]:
    base_dir = write_tiny_llama(tmp_path / "base", quantize=quantize)
    # Outside any adapter root on purpose: fusing is an operator's command on their own files.
    adapter = write_peft_adapter(tmp_path / "adapter", random_pairs(tiny_model()), alpha=8.0)
    out = fuse_adapter(base_dir, adapter, tmp_path / "fused")
    assert out == tmp_path / "fused"

    base = load_model_dir(base_dir).model
    base_logits = logits(base)
    manager = AdapterManager(base, base_id=BASE_ID, adapter_root=tmp_path, max_rank=8)
    manager.mount("sft", "adapter")
    with activate(adapter_set(manager, "sft")):
        adapted = logits(base)
    fused = load_model_dir(out).model
    return base_logits, adapted, logits(fused)


def test_fused_float_model_equals_the_mounted_adapter(tmp_path: Path):
    base, adapted, fused = adapted_and_fused(tmp_path, quantize=False)
    assert mx.allclose(fused, adapted, rtol=1e-4, atol=1e-4)
    assert not mx.allclose(base, adapted, rtol=1e-4, atol=1e-4)
    assert (tmp_path / "fused" / "tokenizer.json").is_file()


def test_fused_quantized_model_keeps_its_quantization(tmp_path: Path):
    base, adapted, fused = adapted_and_fused(tmp_path, quantize=True)
    assert mx.abs(fused - adapted).max() < mx.abs(adapted - base).max()
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32

    # Each merged weight is the quantized base plus the delta, to within one quantization step
    # (MLX's affine rounding does not always pick the nearest level); the delta is about three
    # steps large, so a wrong or missing merge fails here.
    pairs = random_pairs(tiny_model())
    before = find_targets(load_model_dir(tmp_path / "base").model)
    after = find_targets(load_model_dir(tmp_path / "fused").model)
    for path, (a, b) in pairs.items():
        old, new = before[path], after[path]
        assert isinstance(new, nn.QuantizedLinear) and (new.bits, new.group_size) == (4, 32)
        expected = dequantized(old) + 2.0 * (a @ b).T  # [out, in]
        error = mx.abs(dequantized(new) - expected).reshape(*new.scales.shape, 32)
        assert mx.all(error <= mx.abs(new.scales)[..., None] + 1e-5), path


def dequantized(linear: nn.QuantizedLinear) -> mx.array:
    return mx.dequantize(
        linear.weight, linear.scales, linear.biases, group_size=linear.group_size, bits=linear.bits
    )


def test_a_bad_adapter_writes_nothing(tmp_path: Path):
    base_dir = write_tiny_llama(tmp_path / "base")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(InvalidAdapter):
        fuse_adapter(base_dir, adapter, tmp_path / "fused")
    assert not (tmp_path / "fused").exists()


def test_a_phi3_adapter_on_its_fused_projections_fuses(tmp_path: Path):
    base_dir = write_tiny_llama(tmp_path / "base")  # its tokenizer; the weights become phi3's
    config = json.loads((base_dir / "config.json").read_text())
    config.update(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False)
    (base_dir / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(tiny_phi3().parameters()))
    mx.save_safetensors(str(base_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    pairs = random_pairs(tiny_phi3(), keys=["qkv_proj", "gate_up_proj"])
    adapter = write_mlx_adapter(tmp_path / "adapter", pairs)
    out = fuse_adapter(base_dir, adapter, tmp_path / "fused")

    base = load_model_dir(base_dir).model
    base_logits = logits(base)
    manager = AdapterManager(base, base_id=BASE_ID, adapter_root=tmp_path, max_rank=8)
    assert manager.mount("sft", "adapter").mounted_layers == 4
    with activate(adapter_set(manager, "sft")):
        adapted = logits(base)
    assert mx.allclose(logits(load_model_dir(out).model), adapted, rtol=1e-4, atol=1e-4)
    assert not mx.allclose(base_logits, adapted, rtol=1e-4, atol=1e-4)
