"""K-quant GGUFs: Q4_K and Q5_K (and Q5_0/Q5_1, llama.cpp's fallback for rows K-quants cannot
split) become MLX affine groups holding llama.cpp's values bit for bit, Q6_K/Q3_K/Q2_K 8-bit
groups within half a step; mixed files get per-layer bits."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from mlx_lm.utils import load_model

from hotlora.models import gguf_tensors
from hotlora.models.gguf import UnsupportedGGUF, import_gguf, read_header, read_tensors
from hotlora.models.gguf_tensors import read_tensor

from tests.support.gguf_files import write_tiny_gguf
from tests.support.gguf_models import FAMILIES, write_family_gguf

# K-quant blocks span 256 values, so every row a K-quant tensor has must be a multiple of 256.
K_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
BITS = {
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q5_0: 5,
    Q.Q5_1: 5,
    Q.Q8_0: 8,
    Q.Q4_K: 4,
    Q.Q5_K: 5,
    Q.Q6_K: 8,
    Q.Q3_K: 8,
    Q.Q2_K: 8,
}
EXACT = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K)
# Requantized 8-bit groups: each value within half a step of its 32-value group's range.
HALF_STEP = 0.5 / 255
TOKENS = mx.array([[1, 60, 77, 200, 12, 3, 99, 2, 150, 260, 5, 41]])  # [batch, seq]


def random_blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `kind`'s block layout, every code and scale bit pattern possible, with
    small float16 super-block scales (d, dmin) so that values are finite and O(1)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    # Byte offsets of the float16 scales in each block (ggml's block_q* structs).
    halves = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82)}
    halves |= {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,)}
    for at in halves[kind]:
        scale = rng.uniform(-0.01, 0.01, len(raw)).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def within_half_a_step(actual: np.ndarray, expected: np.ndarray) -> bool:
    """Each value of `actual` within half an 8-bit step of its 32-value group in `expected`,
    plus float32 rounding of the group's largest magnitude."""
    groups = expected.reshape(expected.shape[0], -1, 32)  # [rows, groups, 32]
    span = groups.max(-1, keepdims=True) - groups.min(-1, keepdims=True)
    rounding = 2 * np.finfo(np.float32).eps * np.abs(groups).max(-1, keepdims=True)
    return bool(
        (np.abs(actual.reshape(groups.shape) - groups) <= span * HALF_STEP + rounding).all()
    )


def dequantized(triplet: tuple[mx.array, ...], bits: int) -> np.ndarray:
    """The triplet's values computed in float32 (MLX computes in the scales' dtype)."""
    weight, scales, biases = triplet
    f32 = mx.float32
    return np.array(mx.dequantize(weight, scales.astype(f32), biases.astype(f32), 32, bits))


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda k: k.name)
def test_32_value_types_keep_llama_cpp_s_codes_and_float16_scales(kind):
    raw = random_blocks(kind, 16, 512)
    weight, scales, biases = read_tensor(raw, kind, (16, 512))
    assert (scales.dtype, biases.dtype) == (mx.float16, mx.float16)
    assert weight.shape == (16, 512 * BITS[kind] // 32)
    expected = dequantize(raw.reshape(16, -1), kind)
    np.testing.assert_array_equal(dequantized((weight, scales, biases), BITS[kind]), expected)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K], ids=lambda k: k.name)
def test_affine_k_quants_keep_llama_cpp_s_values_bit_for_bit(kind):
    raw = random_blocks(kind, 48, 768)
    triplet = read_tensor(raw, kind, (48, 768))
    weight, scales, biases = triplet
    assert (weight.dtype, scales.dtype, biases.dtype) == (mx.uint32, mx.float32, mx.float32)
    assert weight.shape == (48, 768 * BITS[kind] // 32) and scales.shape == (48, 768 // 32)
    expected = dequantize(raw.reshape(48, -1), kind)
    np.testing.assert_array_equal(dequantized(triplet, BITS[kind]), expected)


@pytest.mark.parametrize("kind", [Q.Q6_K, Q.Q3_K, Q.Q2_K], ids=lambda k: k.name)
def test_16_value_k_quants_are_8_bit_within_half_a_step(kind):
    raw = random_blocks(kind, 48, 768)
    actual = dequantized(read_tensor(raw, kind, (48, 768)), 8)
    expected = dequantize(raw.reshape(48, -1), kind)
    assert within_half_a_step(actual, expected)
    assert not np.array_equal(actual, expected)  # 16-value sub-blocks do not fit one 8-bit grid


def test_a_tensor_converted_in_slices_equals_it_converted_whole(monkeypatch):
    raw = {kind: random_blocks(kind, 24, 512, seed=3) for kind in (Q.Q5_K, Q.Q6_K)}
    whole = {kind: read_tensor(r, kind, (24, 512)) for kind, r in raw.items()}
    monkeypatch.setattr(gguf_tensors, "SLICE_VALUES", 3 * 512)  # 3 rows at a time
    for kind, r in raw.items():
        for a, b in zip(read_tensor(r, kind, (24, 512)), whole[kind], strict=True):
            assert mx.array_equal(a, b).item(), kind.name


def test_legacy_types_read_as_mx_load_reads_them(tmp_path):
    # mx.load no longer reads the file; Q4_0, Q4_1, Q8_0, F16 and F32 come out as it gave them.
    write_tiny_gguf(tmp_path / "m.gguf")
    header = read_header(tmp_path / "m.gguf")
    ours = read_tensors(tmp_path / "m.gguf", header)
    theirs = mx.load(str(tmp_path / "m.gguf"))
    kinds = {header.tensors[name].type for name in header.tensors}
    assert {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32} <= kinds
    bf16 = {n.rpartition(".")[0] for n, i in header.tensors.items() if i.type == Q.BF16}
    assert ours.keys() == theirs.keys()
    for name, array in theirs.items():
        if name.rpartition(".")[0] in bf16:
            continue  # mx.load narrows BF16 to float16
        assert ours[name].dtype == array.dtype, name
        assert mx.array_equal(ours[name], array).item(), name


def q4_k_m(layers: int, tied: bool) -> dict[str, Q]:
    """Types as llama.cpp's Q4_K_M recipe mixes them (Q6_K output, Q6_K attn_v and ffn_down on
    some layers), with a Q5_K, a Q4_0 and a Q8_0 tensor beside them, and Q5_0 and Q5_1 (what
    llama.cpp falls back to for rows that are not a multiple of 256)."""
    # A tied model's embedding is its output head: llama.cpp gives it the head's Q6_K.
    types = {"token_embd": Q.Q6_K} if tied else {"token_embd": Q.Q4_K, "output": Q.Q6_K}
    for i in range(layers):
        types |= {f"blk.{i}.{t}": Q.Q4_K for t in LAYER_TENSORS}
        if i % 3 == 0:
            types[f"blk.{i}.attn_v"] = types[f"blk.{i}.ffn_down"] = Q.Q6_K
    types |= {"blk.1.attn_q": Q.Q5_K, "blk.1.ffn_gate": Q.Q4_0, "blk.1.attn_k": Q.Q8_0}
    types |= {"blk.1.ffn_up": Q.Q5_0, "blk.1.attn_output": Q.Q5_1}
    return types


def exact_k(layers: int, tied: bool) -> dict[str, Q]:
    """Q4_K and Q5_K alone: every quantized value is carried over exactly."""
    types = {"token_embd": Q.Q4_K} | ({} if tied else {"output": Q.Q5_K})
    for i in range(layers):
        types |= {f"blk.{i}.{t}": Q.Q5_K if t == "ffn_down" else Q.Q4_K for t in LAYER_TENSORS}
    return types


def reference(name: str, values: dict[str, np.ndarray]) -> nn.Module:
    """mlx-lm's class for the family holding `values` (the GGUF's, dequantized) as float32."""
    family = FAMILIES[name]
    vocab = values["model.embed_tokens.weight"].shape[0]
    model = family.module.Model(family.model_args(vocab, K_SHAPE))
    weights = {k: mx.array(v) for k, v in values.items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    return model


def write_and_import(root: Path, name: str, recipe) -> tuple[Path, dict, dict[str, Q]]:
    family = FAMILIES[name]
    layers = family.model_args(1, K_SHAPE).num_hidden_layers
    types = recipe(layers, family.tied)
    values, kinds = write_family_gguf(root / "m.gguf", name, shape=K_SHAPE, tensor_types=types)
    assert {kinds[n] for n in types} == set(types.values())
    return import_gguf(root / "m.gguf", root / "model"), values, kinds


def module_path(model: nn.Module, gguf_base: str) -> str:
    """The mlx-lm module of GGUF tensor `gguf_base`, found by the module's position."""
    if gguf_base in ("token_embd", "output"):
        return {"token_embd": "model.embed_tokens", "output": "lm_head"}[gguf_base]
    _, index, kind = gguf_base.split(".")
    names = [n for n, _ in model.model.layers[int(index)].named_modules()]
    suffix = {"attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj"}.get(kind)
    suffix = suffix or {"ffn_down": "down_proj"}.get(kind) or f"{kind[5]}_proj"
    (found,) = [n for n in names if n.endswith(suffix) and "norm" not in n]
    return f"model.layers.{index}.{found}"


@pytest.fixture(scope="module", params=["mistral", "qwen3", "gemma3"])
def mixed(request, tmp_path_factory):
    """(family, imported Q4_K_M-like directory, GGUF values by mlx-lm name, GGUF types)."""
    root = tmp_path_factory.mktemp(f"{request.param}-q4_k_m")
    return request.param, *write_and_import(root, request.param, q4_k_m)


def test_mixed_file_gets_per_layer_bits(mixed):
    _, model_dir, _, kinds = mixed
    model, config = load_model(model_dir)
    modules = dict(model.named_modules())
    assert config["quantization"]["bits"] == 4
    for base, kind in kinds.items():
        if kind == Q.F32:
            continue
        path = module_path(model, base)
        module = modules[path]
        assert (module.bits, module.group_size, module.mode) == (BITS[kind], 32, "affine"), base
        own = {"group_size": 32, "bits": BITS[kind], "mode": "affine"}
        assert config["quantization"].get(path) == (None if BITS[kind] == 4 else own), path


def test_mixed_file_holds_the_gguf_values(mixed):
    _, model_dir, values, kinds = mixed
    model, _ = load_model(model_dir)
    modules = dict(model.named_modules())
    for base, kind in kinds.items():
        if kind not in BITS:
            continue
        m = modules[module_path(model, base)]
        actual = dequantized((m.weight, m.scales, m.biases), m.bits)
        expected = values[f"{module_path(model, base)}.weight"]
        if kind in EXACT:
            np.testing.assert_array_equal(actual, expected, err_msg=base)
        elif kind == Q.Q6_K:
            assert within_half_a_step(actual, expected), base


def test_mixed_file_answers_as_mlx_lm_on_the_gguf_values(mixed):
    name, model_dir, values, _ = mixed
    model, _ = load_model(model_dir)
    expected = np.array(reference(name, values)(TOKENS))
    actual = np.array(model(TOKENS).astype(mx.float32))
    # The 8-bit requantization of the Q6_K tensors is all that differs (lm_head's among them).
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error < 1.5e-2, error
    assert (actual.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_q4_k_and_q5_k_file_answers_as_mlx_lm_within_float_rounding(tmp_path, name):
    model_dir, values, _ = write_and_import(tmp_path, name, exact_k)
    model, config = load_model(model_dir)
    assert config["quantization"]["bits"] == 4
    assert {v["bits"] for k, v in config["quantization"].items() if isinstance(v, dict)} == {5}
    expected = np.array(reference(name, values)(TOKENS))
    actual = np.array(model(TOKENS).astype(mx.float32))
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error < 1e-5, error  # the weights are equal; only the order of summation may differ


@pytest.mark.parametrize("kind", [Q.IQ2_XXS, Q.IQ3_S, Q.IQ4_XS, Q.IQ1_M], ids=lambda k: k.name)
def test_iq_types_are_refused_naming_the_type(tmp_path, kind):
    tensor = {"blk.0.ffn_wide.weight": (np.zeros((8, 256), np.float32), kind)}
    write_tiny_gguf(tmp_path / "m.gguf", extra_tensors=tensor)
    with pytest.raises(UnsupportedGGUF, match=rf"{kind.name} \(blk.0.ffn_wide.weight\).*codebook"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
