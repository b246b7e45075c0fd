"""The default CPU path's fidelity: int8 activations (`--cpu-precision fast`) no further from
mlx-lm's float32 run of the same weights than mlx-lm's own bfloat16 run, with no lower top-1
agreement, on teacher-forced prompts of the embedded model and of tiny models of three
families; and a row's logits the same bits alone, in a batch and in any prefill chunking."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from hotlora.models.batch_masks import install_row_masks
from hotlora.models.cpu import extension, install_packed_kernels
from hotlora.models.cpu.fidelity import CONVERSATIONS, POSITIONS, forward
from hotlora.models.loader import load_model_dir

from tests.support.families import FAMILIES
from tests.support.fidelity import Distance, dequantized_reference, distance
from tests.support.tiny import VOCAB_SIZE

if (_why := extension.unavailable()) is not None:
    pytest.skip(f"packed kernels: {_why}", allow_module_level=True)


@pytest.fixture(autouse=True)
def mlx_lm_attention():
    """mlx-lm's own attention function for every run here, as it was afterwards."""
    original = llama.scaled_dot_product_attention
    llama.scaled_dot_product_attention = mlx_lm_base.scaled_dot_product_attention
    yield
    llama.scaled_dot_product_attention = original


def runs(build: callable, tokens: mx.array) -> tuple[Distance, Distance, mx.array]:  # type: ignore[valid-type]
    """The int8 path's distance from the float32 reference, the bfloat16 run's, and the int8
    path's logits. `build()` gives a fresh copy of the quantized model."""
    reference = forward(dequantized_reference(build()), tokens)
    bfloat16 = build()
    bfloat16.set_dtype(mx.bfloat16)
    fast = build()
    state = install_packed_kernels(fast, threads=2, precision="fast")
    assert state.enabled and "int8 activations" in state.reason, state.reason
    logits = forward(fast, tokens)
    return distance(logits, reference), distance(forward(bfloat16, tokens), reference), logits


def report(name: str, fast: Distance, bfloat16: Distance) -> None:
    print(f"\n{name}: int8 activations: {fast}\n{name}: mlx-lm bfloat16:   {bfloat16}")


def test_the_embedded_model_on_int8_activations_is_no_further_than_bfloat16(
    embedded_model_dir: Path,
):
    tokenizer = load_model_dir(embedded_model_dir).tokenizer
    rows = [list(tokenizer.apply_chat_template(c))[:POSITIONS] for c in CONVERSATIONS]
    assert all(len(row) == POSITIONS for row in rows)
    tokens = mx.array(rows)
    fast, bfloat16, logits = runs(lambda: load_model_dir(embedded_model_dir).model, tokens)
    report("embedded", fast, bfloat16)
    assert fast.within(bfloat16), (fast, bfloat16)
    # Not the float path under another name: int8 activations move the logits.
    assert fast.largest > 1e-4

    # The same bits for a row alone, beside the other row, and in another prefill chunking.
    model = load_model_dir(embedded_model_dir).model
    install_packed_kernels(model, threads=2, precision="fast")
    alone = forward(model, tokens[:1])
    assert mx.array_equal(alone[0], logits[0]).item()
    cache = make_prompt_cache(model)
    chunks = [model(tokens[:1, at : at + 7], cache=cache) for at in range(0, POSITIONS, 7)]
    assert mx.array_equal(mx.concatenate(chunks, axis=1)[0], logits[0]).item()
    # A decode step beside another row, left-padded, is the row's own step.
    cache = [BatchKVCache([0, 3]) for _ in model.layers]
    padded = mx.concatenate([tokens[:1, :12], mx.pad(tokens[1:, :9], [(0, 0), (3, 0)])])
    model(padded, cache=cache)
    step = model(mx.array([[tokens[0, 12].item()], [tokens[1, 9].item()]]), cache=cache)[0, -1]
    single = make_prompt_cache(model)
    model(tokens[:1, :12], cache=single)
    own = model(tokens[:1, 12:13], cache=single)[0, -1]
    assert mx.array_equal(step, own).item()


FAMILY_TOKENS = mx.array(
    [[(7 * i + 5 * r + 3) % (VOCAB_SIZE - 4) + 4 for i in range(48)] for r in range(4)]
)


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3"])
def test_a_tiny_model_on_int8_activations_is_no_further_than_bfloat16(name: str):
    def build() -> nn.Module:
        model = FAMILIES[name].build(name)
        nn.quantize(model, group_size=32, bits=4)
        install_row_masks(model)
        mx.eval(model.parameters())
        return model

    fast, bfloat16, _ = runs(build, FAMILY_TOKENS)
    report(name, fast, bfloat16)
    assert fast.within(bfloat16), (fast, bfloat16)


def test_the_integer_paths_interleave_the_rows_and_the_float32_path_takes_mlxs_packing_back(
    embedded_model_dir: Path,
):
    """Every packed layer of the embedded model (4 and 8 bits, rows in eights) takes the
    interleaved layout on int8 activations, fast and exact alike, the same bytes reordered; the
    float32 path gets MLX's packing back to the bit, and its logits with it. The exact path's
    three int8 parts a value are float32's products within its rounding; the fast path's one
    code is not."""
    from hotlora.models.cpu.layers import PackedEmbedding, PackedLinear, set_cpu_precision

    model = load_model_dir(embedded_model_dir).model
    install_packed_kernels(model, threads=2, precision="float32")
    layers = [m for _, m in model.named_modules() if isinstance(m, PackedLinear | PackedEmbedding)]
    original = [(m.weight, m.scales, m.biases) for m in layers]
    tokens = FAMILY_TOKENS[:1, :16]
    float32 = forward(model, tokens)
    largest = mx.abs(float32).max(axis=-1)
    runs = {}
    for precision in ("fast", "exact"):
        set_cpu_precision(model, precision)
        assert {m.bits for m in layers} == {4, 8}  # Q4_1's layers, Q8_0's embedding and head
        assert all(m.interleaved for m in layers)
        for m in layers:  # 4-bit codes unsigned; Q8_0's, of every value, signed
            assert m.weight.dtype == (mx.uint8 if m.bits == 4 else mx.int8)
        for m, (weight, _, _) in zip(layers, original, strict=True):
            assert m.weight.nbytes == weight.nbytes  # reordered, not copied
        runs[precision] = forward(model, tokens)
    exact_distance = (mx.abs(runs["exact"] - float32).max(axis=-1) / largest).max().item()
    fast_distance = (mx.abs(runs["fast"] - float32).max(axis=-1) / largest).max().item()
    print(
        f"largest |logit - float32's| / largest logit: exact {exact_distance:.2e}, "
        f"fast {fast_distance:.2e}"
    )
    assert exact_distance < 5e-5 and fast_distance > 1e-3
    set_cpu_precision(model, "float32")
    for m, arrays in zip(layers, original, strict=True):
        assert not m.interleaved
        for got, want in zip((m.weight, m.scales, m.biases), arrays, strict=True):
            assert got.dtype == want.dtype and mx.array_equal(got, want).item()
    assert mx.array_equal(forward(model, tokens), float32).item()
