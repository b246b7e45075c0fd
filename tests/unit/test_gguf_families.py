"""GGUF import of each family llama.cpp's converter writes: the imported model answers as
mlx-lm's own class does on the same weights, stays quantized, and carries its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm import load
from mlx_lm.utils import load_model

from hotlora.models.gguf import UnsupportedGGUF, import_gguf

from tests.support.gguf_files import CHAT_TEMPLATE
from tests.support.gguf_models import FAMILIES, write_family_gguf

TOKENS = mx.array([[1, 60, 77, 200, 12, 3, 99, 2, 150, 260, 5, 41]])  # [batch, seq], > window


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
    """(family name, imported directory, values the GGUF holds by mlx-lm name, GGUF types)."""
    root = tmp_path_factory.mktemp(request.param)
    values, kinds = write_family_gguf(root / "m.gguf", request.param)
    return request.param, import_gguf(root / "m.gguf", root / "model"), values, kinds


def reference(name: str, values: dict[str, np.ndarray]) -> nn.Module:
    """mlx-lm's class for the family, built from its own arguments, holding `values`."""
    family = FAMILIES[name]
    model = family.module.Model(family.model_args(values["model.embed_tokens.weight"].shape[0]))
    weights = {k: mx.array(v) for k, v in values.items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    return model


def test_logits_equal_mlx_lm_on_the_same_weights(imported):
    name, model_dir, values, _ = imported
    model, config = load_model(model_dir)
    expected = np.array(reference(name, values)(TOKENS))
    actual = np.array(model(TOKENS).astype(mx.float32))
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, atol=2e-3 * np.abs(expected).max())


def test_config_holds_the_family_arguments(imported):
    name, model_dir, values, _ = imported
    family = FAMILIES[name]
    config = json.loads((model_dir / "config.json").read_text())
    args = family.model_args(values["model.embed_tokens.weight"].shape[0])
    assert config["model_type"] == family.model_type
    for key in family.args:
        value = getattr(args, key)
        assert config[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert config.get("tie_word_embeddings", True) == family.tied


def test_quantized_tensors_stay_quantized(imported):
    _, model_dir, _, kinds = imported
    model, _ = load_model(model_dir)
    modules = dict(model.named_modules())
    paths = {"token_embd": "model.embed_tokens", "output": "lm_head"}
    checked = 0
    for gguf_name, kind in kinds.items():
        bits = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}.get(kind)
        if bits is None or gguf_name.endswith(".bias"):
            continue
        module = modules[paths.get(gguf_name) or _layer_path(model_dir, gguf_name)]
        assert isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)), gguf_name
        assert (module.bits, module.group_size, module.mode) == (bits, 32, "affine"), gguf_name
        checked += 1
    assert checked >= 5


def _layer_path(model_dir: Path, gguf_name: str) -> str:
    """The mlx-lm module of quantized layer tensor `gguf_name`, read from the quantization
    block of config.json by its position in the layer (the importer's names, not the test's)."""
    _, index, kind = gguf_name.split(".")
    suffix = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_down": "mlp.down_proj",
    }.get(kind)
    if kind == "ffn_up":
        config = json.loads((model_dir / "config.json").read_text())
        suffix = "mlp.gate_up_proj" if config["model_type"] == "phi3" else "mlp.up_proj"
    return f"model.layers.{index}.{suffix}"


def test_chat_template_and_tokenizer_come_along(imported):
    _, model_dir, _, _ = imported
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    _, tokenizer = load(str(model_dir))
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode("<|im_start|>the world<|im_end|>", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = "the world, 12 times!"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_gemma_norms_are_stored_with_one_added(tmp_path):
    # The import subtracts llama.cpp's +1: mlx-lm's gemma norm multiplies by 1 + weight itself.
    values, _ = write_family_gguf(tmp_path / "m.gguf", "gemma2")
    model, _ = load_model(import_gguf(tmp_path / "m.gguf", tmp_path / "model"))
    norm = model.model.layers[0].input_layernorm.weight
    expected = values["model.layers.0.input_layernorm.weight"]
    np.testing.assert_allclose(np.array(norm), expected, atol=1e-6)
    assert np.abs(expected).max() < 0.5  # near 0: the stored values were near 1


@pytest.mark.parametrize(
    ("name", "metadata", "words"),
    [
        ("qwen2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "rope scaling 'yarn'"),
        ("gemma2", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, "'linear'"),
        ("phi3_longrope", {"rope.scaling.attn_factor": 1.0}, "rope attention factor 1.0"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "soft-capping"),
        ("qwen3", {"expert_count": 4}, "mixture-of-experts qwen3"),
        ("qwen2", {"attention.key_length": 32}, "head size"),
        ("qwen2", {"attention.key_length": [32, 32]}, "per-layer qwen2.attention.key_length"),
    ],
)
def test_what_mlx_lm_cannot_express_is_refused(tmp_path, name, metadata, words):
    write_family_gguf(tmp_path / "m.gguf", name, metadata=metadata)
    with pytest.raises(UnsupportedGGUF, match=words):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_a_sliding_pattern_of_one_flag_a_layer_becomes_its_period(tmp_path):
    slides = [True, True, False, True, True, False]  # the tiny gemma3's 6 layers, every 3rd global
    pattern = {"attention.sliding_window_pattern": slides}
    write_family_gguf(tmp_path / "m.gguf", "gemma3", metadata=pattern)
    import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert (
        json.loads((tmp_path / "model" / "config.json").read_text())["sliding_window_pattern"] == 3
    )


@pytest.mark.parametrize(("name", "arch"), [("qwen2", "gemma3"), ("gemma2", "qwen3")])
def test_another_family_s_tensors_are_refused(tmp_path, name, arch):
    # A qwen2 file labelled gemma3 lacks the q/k norms; a gemma2 file labelled qwen3 has norms
    # qwen3 does not know.
    write_family_gguf(tmp_path / "m.gguf", name, arch=arch)
    with pytest.raises(UnsupportedGGUF, match="lacks tensor|is not one a"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("arch", ["mamba", "gemma4", "qwen3moe", "bert"])
def test_other_architectures_are_refused_by_name(tmp_path, arch):
    write_family_gguf(tmp_path / "m.gguf", "qwen2", arch=arch)
    with pytest.raises(UnsupportedGGUF, match=f"architecture '{arch}' is not supported"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()
