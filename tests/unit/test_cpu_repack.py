"""Quantized layers of every affine width served packed: 1-3-bit codes widened to 4 bits and
5-6-bit ones to 8 at load, every weight's value kept to the bit; a layer no kernel takes turns
the model into a float32 copy with a WARNING naming the layer, its RAM and what to do."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from hotlora.models.cpu import extension, prepare_cpu
from hotlora.models.cpu.layers import PackedEmbedding, PackedLinear
from hotlora.models.cpu.weights import (
    pack_codes,
    packed_bytes,
    repack,
    served_bits,
    unpack_codes,
    widened,
)

from tests.support.families import FAMILIES
from tests.support.fidelity import LOGIT_TOLERANCE, dequantized_reference, relative_difference
from tests.support.tiny import VOCAB_SIZE

TOKENS = mx.array(
    [[(7 * i + 5 * r + 3) % (VOCAB_SIZE - 4) + 4 for i in range(24)] for r in range(3)]
)
# Bits by layer, in turn: every width MLX quantizes to, the kernels' own among them.
WIDTHS = (5, 6, 3, 2, 4, 8, 1)


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 6])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_widened_codes_dequantize_to_the_same_bits(bits: int, group: int, dtype: mx.Dtype):
    w = mx.random.normal((40, 384), key=mx.random.key(bits * group)).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    codes = unpack_codes(packed, bits)
    assert codes.shape == (40, 384) and codes.dtype == mx.uint8
    assert int(codes.max().item()) == 2**bits - 1  # every code read whole
    wider = served_bits(bits)
    assert wider == (4 if bits < 4 else 8)
    widened = pack_codes(codes, wider)
    assert widened.shape == (40, 384 * wider // 32)
    before = mx.dequantize(packed, scales, biases, group_size=group, bits=bits)
    after = mx.dequantize(widened, scales, biases, group_size=group, bits=wider)
    assert mx.array_equal(before, after).item()


def mixed_llama(embedding_bits: int = 6) -> nn.Module:
    """A tiny llama whose layers take every width in turn, its embedding (and tied head) at
    `embedding_bits`, float16 scales as GGUF's Q4_0-Q8_0 blocks have them."""
    model = FAMILIES["llama"].build("llama", seed=3, tie_word_embeddings=True)
    model.set_dtype(mx.float16)
    order = iter(range(1000))

    def bits(path: str, module: nn.Module) -> dict | bool:
        if not hasattr(module, "to_quantized"):
            return False
        b = embedding_bits if isinstance(module, nn.Embedding) else WIDTHS[next(order) % 7]
        return {"group_size": 32, "bits": b, "mode": "affine"}

    nn.quantize(model, class_predicate=bits)
    mx.eval(model.parameters())
    return model


def forward(model: nn.Module, tokens: mx.array) -> mx.array:
    out = model(tokens, cache=make_prompt_cache(model)).astype(mx.float32)
    mx.eval(out)
    return out


@pytest.fixture(autouse=True)
def mlx_lm_attention():
    original = llama.scaled_dot_product_attention
    llama.scaled_dot_product_attention = mlx_lm_base.scaled_dot_product_attention
    yield
    llama.scaled_dot_product_attention = original


def serve(model: nn.Module, tmp_path: Path, precision: str = "exact"):
    return prepare_cpu(
        model,
        weights="auto",
        float_budget=None,
        vector_jit=False,
        batch_kernels=True,
        precision=precision,  # type: ignore[arg-type]
        home=tmp_path,
        threads=2,
    )


@pytest.mark.skipif(extension.unavailable() is not None, reason=f"{extension.unavailable()}")
def test_a_model_of_every_width_is_served_packed_with_every_value_kept(tmp_path: Path, caplog):
    reference = forward(dequantized_reference(mixed_llama()), TOKENS)
    model = mixed_llama()
    expected_bytes = packed_bytes(model)
    widths = {m.bits for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert widths == set(WIDTHS)
    with caplog.at_level(logging.INFO, logger="hotlora"):
        setup = serve(model, tmp_path)
    assert setup.packed and not setup.float32, setup.weights
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    layers = [m for _, m in model.named_modules() if isinstance(m, PackedLinear | PackedEmbedding)]
    assert len(layers) == 15  # 7 projections a layer, and the embedding (the tied head)
    # 4 and 8 bits; the widened 5- and 6-bit codes laid out at their own width again where the
    # integer products interleave them.
    assert {m.bits for m in layers} == {4, 5, 6, 8}
    assert all(m.interleaved for m in layers)
    # The reported size is what the widened layers take, less what their interleaving saves.
    narrow = [m for m in layers if m.bits in (5, 6)]
    saved = sum(m.weight.size * (8 - m.bits) // m.bits for m in narrow)
    assert saved > 0 and packed_bytes(model) == expected_bytes - saved
    fives, sixes = (sum(m.bits == b for m in narrow) for b in (5, 6))
    laid_out = f"laid out again for the integer products: {fives} at 5 bits, {sixes} at 6 bits"
    assert f"{laid_out}, codes -{saved / 1e6:.0f} MB" in setup.batch_kernels
    # Their 5 and 6 bits are the interleaved layout's: nothing there to widen again.
    codes = [m.weight for m in narrow]
    assert widened(model) == 0 and not repack(model).layers
    assert all(m.weight is c for m, c in zip(narrow, codes, strict=True))
    assert setup.batch_kernels is not None and "from 5 to 8 bits" in setup.batch_kernels
    assert "from 1 to 4 bits" in setup.batch_kernels
    logged = [r.getMessage() for r in caplog.records]
    assert "packing: widening the codes of 11 quantized layers to 4 or 8 bits" in logged
    got = forward(model, TOKENS)
    assert relative_difference(got, reference) <= LOGIT_TOLERANCE


@pytest.mark.skipif(extension.unavailable() is not None, reason=f"{extension.unavailable()}")
def test_widened_layers_on_int8_activations_keep_a_rows_bits_alone_and_in_a_batch(
    tmp_path: Path,
):
    model = mixed_llama(embedding_bits=5)
    setup = serve(model, tmp_path, precision="fast")
    assert setup.packed and setup.batch_kernels and "int8 activations" in setup.batch_kernels
    batch = forward(model, TOKENS)
    for row in range(TOKENS.shape[0]):
        assert mx.array_equal(forward(model, TOKENS[row : row + 1])[0], batch[row]).item()
    reference = forward(dequantized_reference(mixed_llama(embedding_bits=5)), TOKENS)
    # The int8 rounding of the activations, not a change of weights: the float path's rule is
    # far tighter (above); this only says the widened codes are read as the values they were.
    assert relative_difference(batch, reference) < 0.05


def test_a_layer_no_kernel_takes_costs_a_float32_copy_with_a_warning(tmp_path: Path, caplog):
    if extension.unavailable() is not None:
        pytest.skip(f"packed kernels: {extension.unavailable()}")
    model = FAMILIES["llama"].build("llama", seed=3)
    nn.quantize(
        model,
        class_predicate=lambda path, m: (
            hasattr(m, "to_quantized")
            and (
                {"group_size": 32, "bits": 4, "mode": "mxfp4"}
                if path == "model.layers.1.mlp.up_proj"
                else {"group_size": 32, "bits": 4, "mode": "affine"}
            )
        ),
    )
    with caplog.at_level(logging.INFO, logger="hotlora"):
        setup = serve(model, tmp_path)
    assert setup.float32 and not setup.packed
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "model.layers.1.mlp.up_proj is quantized as mxfp4" in warning
    assert "MB of RAM where the packed weights would take" in warning
    assert "--cpu-weights mlx" in warning and "hotlora quantize" in warning


@pytest.mark.skipif(extension.unavailable() is not None, reason=f"{extension.unavailable()}")
def test_half_precision_layers_beside_packed_ones_are_named_with_their_ram(tmp_path: Path, caplog):
    """A quantized file with a float16 layer (a GGUF's F16 embedding, say) is served packed,
    that layer as a float32 copy: the WARNING names it and its bytes."""
    model = FAMILIES["llama"].build("llama", seed=3, tie_word_embeddings=True)
    model.set_dtype(mx.float16)
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda path, m: (
            isinstance(m, nn.Linear) and path != "model.layers.0.mlp.down_proj"
        ),
    )
    with caplog.at_level(logging.INFO, logger="hotlora"):
        setup = serve(model, tmp_path)
    assert setup.packed
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("2 unquantized float16/bfloat16 layers served as float32 copies")
    embedding = 4 * VOCAB_SIZE * 64 / 1e6
    assert f"model.embed_tokens ({embedding:.0f} MB)" in warning
    assert "model.layers.0.mlp.down_proj" in warning and "--token-embedding-type q8_0" in warning
    assert model.model.embed_tokens.weight.dtype == mx.float32
