"""The packed quantized weights' kernels: the float kernel's products on the dequantized weights
to the bit, every row count; a row's results the same bits alone, in any batch, with any other
adapter sets and in any chunking of its prompt; mlx-lm's float32 results within a tolerance."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from hotlora.adapters import AdapterSet, RowAdapterCache, activate
from hotlora.adapters.manager import AdapterManager
from hotlora.models.cpu import extension, install_packed_kernels, prepare_cpu
from hotlora.models.cpu.layers import RowsQuantizedEmbedding, RowsQuantizedLinear

from tests.support.adapter_builders import (
    BASE_ID,
    adapter_set,
    random_pairs,
    tiny_model,
    write_mlx_adapter,
)
from tests.support.fidelity import (
    LOGIT_TOLERANCE,
    dequantized_reference,
    prompt_logits,
    relative_difference,
)

if (_why := extension.unavailable()) is not None:
    pytest.skip(f"packed kernels: {_why}", allow_module_level=True)
try:
    from hotlora.models.cpu import _rows_matmul as native
except ImportError:
    pytest.fail("the native kernels are not built: run `make setup`")

ROW_COUNTS = (1, 2, 7, 16, 33, 200)


@pytest.fixture(autouse=True)
def mlx_lm_attention(monkeypatch):
    """Installing the kernels points the architecture's attention global elsewhere: each test
    starts from mlx-lm's own and leaves it as it was."""
    monkeypatch.setattr(
        llama, "scaled_dot_product_attention", mlx_lm_base.scaled_dot_product_attention
    )


@pytest.fixture(params=["avx512vbmi", "avx512", "avx2"])
def isa(request):
    """Each kernel this CPU runs; the widest one again afterwards."""
    widest = native.isa()
    if not native.use_isa(request.param):
        pytest.skip(f"the CPU lacks {request.param}")
    yield request.param
    native.use_isa(widest)


def quantized(n: int, k: int, bits: int, group: int, dtype: mx.Dtype, seed: int):
    """Weights [n, k] quantized as MLX does, and their exact float32 values."""
    w = (mx.random.normal((n, k), key=mx.random.key(seed)) * 0.5).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    exact = mx.dequantize(
        packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits
    )
    return packed, scales, biases, exact


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
def test_the_kernel_multiplies_by_the_dequantized_weights(
    isa: str, bits: int, group: int, dtype: mx.Dtype
):
    # 74 weight rows: a tile's last two, fewer than its blocks take, go one at a time.
    packed, scales, biases, exact = quantized(74, 384, bits, group, dtype, seed=bits + group)
    for rows in ROW_COUNTS:
        x = mx.random.normal((rows, 384), key=mx.random.key(rows))
        got = native.quant_matmul(x, packed, scales, biases, group, bits)
        assert got.shape == (rows, 74)
        # The float kernel's sums on the weights dequantized as mx.dequantize does: the same bits.
        assert mx.array_equal(got, native.rows_matmul(x, exact)).item(), rows
        assert mx.allclose(got, x @ exact.T, rtol=1e-4, atol=1e-4 * 384**0.5).item(), rows


def test_a_rows_result_is_the_same_whatever_the_other_rows_and_their_shape(isa: str):
    packed, scales, biases, _ = quantized(1536, 576, 4, 32, mx.float16, seed=3)
    x = mx.random.normal((200, 576), key=mx.random.key(4))
    whole = native.quant_matmul(x, packed, scales, biases, 32, 4)
    for size in (1, 2, 3, 4, 5, 7, 8, 16, 33):  # in registers up to 8 rows, a tile beyond
        parts = [
            native.quant_matmul(x[i : i + size], packed, scales, biases, 32, 4)
            for i in range(0, 200, size)
        ]
        assert mx.array_equal(mx.concatenate(parts), whole).item(), size
    prompt = native.quant_matmul(x.reshape(4, 50, 576), packed, scales, biases, 32, 4)
    assert mx.array_equal(prompt.reshape(200, 1536), whole).item()


def lora_operands(rows: int, k: int, n: int, rank: int, seed: int):
    keys = mx.random.split(mx.random.key(seed), 4)
    x = mx.random.normal((rows, k), key=keys[0])
    a_t = mx.random.normal((rank, k), key=keys[1]) * 0.1
    b_t = mx.random.normal((n, rank), key=keys[2]) * 0.1
    mask = mx.where(mx.random.normal((rows, rank), key=keys[3]) > 0, 2.0, 0.0)
    return x, a_t, b_t, mask


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_the_lora_kernel_adds_each_rows_own_residual(isa: str, rows: int):
    packed, scales, biases, exact = quantized(200, 256, 4, 32, mx.float16, seed=5)
    x, a_t, b_t, mask = lora_operands(rows, 256, 200, 24, seed=rows)
    b = mx.contiguous(b_t.T)  # [R, N], as the kernel reads it
    got = native.quant_matmul_lora(x, packed, scales, biases, 32, 4, a_t, b, mask)
    expected = x @ exact.T + ((x @ a_t.T) * mask) @ b_t.T
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-3).item()
    # No column kept: the base product, to the bit.
    bare = native.quant_matmul_lora(x, packed, scales, biases, 32, 4, a_t, b, mx.zeros_like(mask))
    assert mx.array_equal(bare, native.quant_matmul(x, packed, scales, biases, 32, 4)).item()


def test_a_lora_rows_result_ignores_the_other_rows_columns(isa: str):
    """Row 0 keeps columns 8-15; the others keep anything. Alone, with only its own columns in
    the pair, it gets the same bits: other adapters' columns add nothing, not even a rounding."""
    packed, scales, biases, _ = quantized(300, 576, 4, 32, mx.float16, seed=6)
    x, a_t, b_t, mask = lora_operands(9, 576, 300, 32, seed=7)
    own = (mx.arange(32) >= 8) & (mx.arange(32) < 16)
    mask[0] = mx.where(own, 1.5, 0.0)
    b = mx.contiguous(b_t.T)  # [R, N]
    whole = native.quant_matmul_lora(x, packed, scales, biases, 32, 4, a_t, b, mask)
    alone = native.quant_matmul_lora(
        x[:1], packed, scales, biases, 32, 4, a_t[8:16], mx.contiguous(b[8:16]), mask[:1, 8:16]
    )
    assert mx.array_equal(alone[0], whole[0]).item()


@pytest.mark.parametrize(
    ("bits", "group", "told", "message"),
    [
        (3, 32, 32, "4 or 8 bits"),
        (6, 64, 64, "4 or 8 bits"),
        (4, 32, 64, "scales and biases"),  # the weights' groups are not those told
    ],
)
def test_other_quantizations_are_refused(bits: int, group: int, told: int, message: str):
    w = mx.random.normal((8, 128), key=mx.random.key(0))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    with pytest.raises(ValueError, match=message):
        native.quant_matmul(mx.ones((1, 128)), packed, scales, biases, told, bits)


class OtherQuantizedLinear(nn.QuantizedLinear):
    """A quantized layer of a class the kernels do not know (as experts' layers are)."""


@pytest.mark.parametrize(
    ("quantize", "why"),
    [
        (lambda m: nn.quantize(m, group_size=64, bits=3), "3 bits"),
        (
            lambda m: (
                nn.quantize(m, group_size=32, bits=4),
                setattr(m.layers[0].mlp.up_proj, "__class__", OtherQuantizedLinear),
            ),
            "OtherQuantizedLinear",
        ),
    ],
)
def test_a_model_quantized_otherwise_is_served_by_mlx(tmp_path: Path, quantize, why: str):
    model = tiny_model()
    quantize(model)
    setup = prepare_cpu(
        model,
        weights="auto",
        float_budget=None,
        vector_jit=False,
        batch_kernels=True,
        home=tmp_path,
    )
    assert not setup.packed and why in setup.weights
    assert not any(isinstance(m, RowsQuantizedLinear) for _, m in model.named_modules())


# The model: the tiny llama quantized as mlx-lm's converter does (tied embeddings, 4 bits),
# served packed, with adapters `a` and `b` mounted on it.

PROMPTS = [[5, 17, 3, 99, 42, 7, 60, 61, 9], [8, 8, 31], [100, 2, 77, 4, 5, 6]]
SPECS = ["", "a", "b", "a+b", "b@-0.5+a"]


@pytest.fixture
def packed(tmp_path: Path):
    """(model, manager): the tiny quantized llama with the kernels installed, `a` and `b`."""
    model = tiny_model(quantize=True)
    state = install_packed_kernels(model, threads=2)
    assert state.enabled, state.reason
    kinds = {type(m) for _, m in model.named_modules()}
    assert {RowsQuantizedLinear, RowsQuantizedEmbedding} <= kinds
    manager = AdapterManager(model, base_id=BASE_ID, adapter_root=tmp_path, max_rank=64)
    for seed, adapter_id in enumerate(("a", "b"), start=1):
        write_mlx_adapter(tmp_path / adapter_id, random_pairs(tiny_model(), seed=seed))
        manager.mount(adapter_id, adapter_id)
    return model, manager


def alone(
    model: nn.Module, adapters: AdapterSet, prompt: list[int], chunks: list[int], steps: list[int]
) -> list[mx.array]:
    """A request alone: its prompt in chunks of these sizes, then one decode step a token."""
    cache = make_prompt_cache(model)
    out, at = [], 0
    with activate(adapters):
        for size in chunks:
            out.append(model(mx.array([prompt[at : at + size]]), cache=cache)[0])
            at += size
        for token in steps:
            out.append(model(mx.array([[token]]), cache=cache)[0])
    mx.eval(out)
    return out


def test_a_prompts_logits_are_the_same_bits_however_it_is_chunked(packed):
    model, manager = packed
    prompt = PROMPTS[0]
    for spec in SPECS:
        adapters = adapter_set(manager, spec)
        whole = mx.concatenate(alone(model, adapters, prompt, [9], []))
        for chunks in ([1] * 9, [4, 5], [2, 6, 1]):
            parts = mx.concatenate(alone(model, adapters, prompt, chunks, []))
            assert mx.array_equal(parts, whole).item(), (spec, chunks)


def test_a_rows_decode_is_the_same_bits_alone_and_beside_other_sets(packed):
    """Rows of different prompt lengths (left-padded) and adapter sets, a stack among them,
    decoded together: each row's logits are its logits alone, bit for bit."""
    model, manager = packed
    steps = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    for specs in (["a+b", "b", ""], ["b", "a+b", "a"], ["", "", "b@-0.5+a"]):
        sets = [adapter_set(manager, spec) for spec in specs]
        longest = max(map(len, PROMPTS))
        pads = [longest - len(p) for p in PROMPTS]
        cache = [BatchKVCache(pads) for _ in model.layers]
        prompts = mx.array([[0] * pad + p for pad, p in zip(pads, PROMPTS, strict=True)])
        batch = RowAdapterCache().for_rows(sets)
        with activate(batch):
            model(prompts, cache=cache)
            together = [
                model(mx.array(column)[:, None], cache=cache)[:, 0]
                for column in zip(*steps, strict=True)
            ]
        mx.eval(together)
        for row, (spec, adapters) in enumerate(zip(specs, sets, strict=True)):
            own = alone(model, adapters, PROMPTS[row], [len(PROMPTS[row])], steps[row])[1:]
            for step, logits in enumerate(own):
                assert mx.array_equal(together[step][row], logits[0]).item(), (specs, spec, step)


def test_a_set_alone_and_beside_others_differ_from_the_base(packed):
    model, manager = packed
    base = alone(model, adapter_set(manager, ""), PROMPTS[0], [9], [])[0]
    for spec in SPECS[1:]:
        assert (
            relative_difference(
                alone(model, adapter_set(manager, spec), PROMPTS[0], [9], [])[0], base
            )
            > 1e-3
        )


def test_logits_are_mlx_lms_on_the_dequantized_weights_within_the_tolerance(packed):
    model, _ = packed
    reference = dequantized_reference(tiny_model(quantize=True))
    for prompt in PROMPTS:
        difference = relative_difference(
            prompt_logits(model, prompt), prompt_logits(reference, prompt)
        )
        assert difference < LOGIT_TOLERANCE, difference


def test_auto_serves_a_quantized_model_packed_on_the_threads_asked(tmp_path: Path, caplog):
    model = tiny_model(quantize=True)
    with caplog.at_level("INFO", logger="hotlora"):
        setup = prepare_cpu(
            model,
            weights="auto",
            float_budget=None,
            vector_jit=False,
            batch_kernels=True,
            home=tmp_path,
            threads=1,
        )
    assert setup.packed and not setup.float32
    assert setup.batch_kernels is not None and f"({native.isa()}, 1 threads)" in setup.batch_kernels
    logged = [r.getMessage() for r in caplog.records]
    assert f"serving packed weights: {setup.weights}" in logged
    assert f"native kernels: {setup.batch_kernels}" in logged
    # The packed arrays stay as loaded; everything else is float32.
    embedding = model.model.embed_tokens
    assert isinstance(embedding, RowsQuantizedEmbedding) and embedding.weight.dtype == mx.uint32
    assert embedding(mx.array([[3, 4]])).dtype == mx.float32
    assert model.model.norm.weight.dtype == mx.float32
    native.set_threads(2)
