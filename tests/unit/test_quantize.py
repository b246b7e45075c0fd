"""Quantizing a float model directory; copying auxiliary files; writing directories atomically."""

import json
import logging
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.utils import load_model, save_config, save_model

from hotlora.models.model_files import atomic_model_dir, copy_aux_files
from hotlora.models.quantize import AlreadyQuantized, quantize_model_dir

from tests.support.tiny import tiny_args

AUX = {
    "tokenizer.json": b'{"version": "1.0"}\n',
    "README.md": "# tiny\n\nnot a real model \u2014 bytes kept as they are\r\n".encode(),
    "foo.model": bytes(range(256)),
    "generation_config.json": b'{"eos_token_id": 2}',
}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    """A random float32 llama directory with auxiliary files beside the weights."""
    path = tmp_path_factory.mktemp("float") / "llama"
    args = tiny_args()
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(vars(args)), path / "config.json")
    for name, content in AUX.items():
        (path / name).write_bytes(content)
    return path


@pytest.mark.parametrize(("bits", "group_size"), [(4, 64), (8, 32)])
def test_quantized_copy_loads_with_the_requested_settings(float_dir, tmp_path, bits, group_size):
    dest = quantize_model_dir(float_dir, tmp_path / "q", bits=bits, group_size=group_size)
    model, config = load_model(dest)
    assert config["quantization"] == {"group_size": group_size, "bits": bits, "mode": "affine"}
    layers = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    assert len(layers) == 2 * 7 and all(isinstance(m, nn.QuantizedLinear) for m in layers)
    assert {(m.bits, m.group_size) for m in layers} == {(bits, group_size)}
    for name, content in AUX.items():
        assert (dest / name).read_bytes() == content, name
    original, _ = load_model(float_dir)
    tokens = mx.array([[1, 2, 3, 4, 5]])  # [batch, seq]
    expected, actual = original(tokens), model(tokens)
    # Random weights are the worst case for a 4-bit grid: ~15-25% error, 8 bits ~1%.
    error = (mx.linalg.norm(actual - expected) / mx.linalg.norm(expected)).item()
    assert error < {4: 0.3, 8: 0.03}[bits]


def test_quantized_source_is_refused(float_dir, tmp_path):
    quantized = quantize_model_dir(float_dir, tmp_path / "q")
    with pytest.raises(AlreadyQuantized, match="already quantized"):
        quantize_model_dir(quantized, tmp_path / "qq")
    assert not (tmp_path / "qq").exists()


@pytest.mark.parametrize(("bits", "group_size"), [(7, 64), (4, 48)])
def test_unsupported_settings_are_refused(float_dir, tmp_path, bits, group_size):
    with pytest.raises(ValueError, match="must be one of"):
        quantize_model_dir(float_dir, tmp_path / "q", bits=bits, group_size=group_size)
    assert not (tmp_path / "q").exists()


def test_a_group_size_that_leaves_layers_in_float_is_refused(float_dir, tmp_path):
    # The tiny model's rows are 64 wide (128 for down_proj): group 128 would quantize only
    # down_proj and leave the rest, embedding included, in float.
    words = r"group_size 128 does not divide the input width of 13 of 15 layers \(model\."
    with pytest.raises(ValueError, match=words + r".*use --group-size 64"):
        quantize_model_dir(float_dir, tmp_path / "q", group_size=128)
    assert not (tmp_path / "q").exists()


def test_layers_no_group_size_divides_stay_float_with_a_warning(
    tmp_path, caplog: pytest.LogCaptureFixture
):
    src = tmp_path / "narrow"
    args = replace(tiny_args(), hidden_size=48)  # rows 48 wide: no group size divides them
    model = llama.Model(args)
    mx.eval(model.parameters())
    save_model(src, model)
    save_config(dict(vars(args)), src / "config.json")
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        dest = quantize_model_dir(src, tmp_path / "q", group_size=32)
    assert "13 of 15 layers stay in float: no group size divides their input width" in caplog.text
    quantized, _ = load_model(dest)
    downs = [m for p, m in quantized.named_modules() if p.endswith("down_proj")]
    assert downs and all(isinstance(m, nn.QuantizedLinear) for m in downs)


def test_copy_aux_files_copies_only_what_is_there(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "dest").mkdir()
    for name in ("tokenizer_config.json", "spiece.model", "other.model", "model.safetensors"):
        (tmp_path / "src" / name).write_bytes(name.encode())
    copied = copy_aux_files(tmp_path / "src", tmp_path / "dest")
    assert copied == ["other.model", "spiece.model", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == copied


def test_atomic_model_dir_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError), atomic_model_dir(tmp_path / "m") as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_model_dir(tmp_path / "m") as tmp:
        (tmp / "config.json").write_text("{}")
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == {}
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    with pytest.raises(FileExistsError), atomic_model_dir(tmp_path / "m"):
        pass


def test_weights_are_really_quantized(float_dir, tmp_path):
    dest = quantize_model_dir(float_dir, tmp_path / "q", bits=4, group_size=64)
    weights = mx.load(str(dest / "model.safetensors"))
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj.dtype == mx.uint32 and q_proj.shape == (64, 64 * 4 // 32)
    assert {"model.layers.0.self_attn.q_proj.scales", "model.embed_tokens.scales"} <= weights.keys()
    float_matrices = [k for k, v in weights.items() if v.ndim == 2 and v.dtype == mx.float32]
    assert all(k.endswith((".scales", ".biases")) for k in float_matrices)
