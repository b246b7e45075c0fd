"""The packed quantized weights' kernels: the float kernel's products on the dequantized weights
to the bit, every row count; a row's results the same bits alone, in any batch, with any other
adapter sets and in any chunking of its prompt; mlx-lm's float32 results within a tolerance."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any, get_args

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache, make_prompt_cache

from hotlora.adapters import BASE_ONLY, AdapterSet, RowAdapterCache, RowAdapters, activate
from hotlora.adapters.backends import gathered
from hotlora.adapters.manager import AdapterManager
from hotlora.adapters.projections import find_targets, replace_module
from hotlora.adapters.slots import LoRASlot
from hotlora.config.settings import KernelsIsa
from hotlora.models.cpu import extension, fused, install_packed_kernels, prepare_cpu
from hotlora.models.cpu import weights as cpu_weights
from hotlora.models.cpu.attention import _rows_call, cache_step_mask, step_mask
from hotlora.models.cpu.fused import (
    FusedAttention,
    FusedBlock,
    FusedMLP,
    install_fused,
    uninstall_fused,
)
from hotlora.models.cpu.layers import PackedEmbedding, PackedLinear, set_cpu_precision
from hotlora.models.cpu.weights import (
    deinterleave_rows8,
    interleave_rows8,
    pack_codes,
)

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
from tests.support.tiny import tiny_args

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


@pytest.fixture(params=["avx512vnni", "avx512vbmi", "avx512", "avx2"])
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


@pytest.mark.parametrize("bits", [4, 8])
def test_float16_scales_at_their_extremes_dequantize_as_mlx_does(isa: str, bits: int):
    """Float16 scales from the largest to subnormal ones, with the largest values: each weight
    is still scale * value + bias rounded as mx.dequantize rounds it, to the bit."""
    n, k, group = 40, 128, 32
    words = mx.random.randint(0, 2**31, (n, k * bits // 32), key=mx.random.key(1))
    packed = (words.astype(mx.uint32) * 2 + 1).astype(mx.uint32)  # top bits set too
    extremes = mx.array([65504.0, 1.0e-7, 6.0e-5, 3.14159, -0.0078125], dtype=mx.float16)
    scales = extremes[mx.arange(n * k // group) % 5].reshape(n, k // group)
    biases = (-scales / 3).astype(mx.float16)
    exact = mx.dequantize(
        packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits
    )
    for rows in (1, 3, 16):
        x = mx.random.normal((rows, k), key=mx.random.key(rows)) * 1e-3
        got = native.quant_matmul(x, packed, scales, biases, group, bits)
        assert mx.array_equal(got, native.rows_matmul(x, exact)).item(), rows


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


# The integer products on 4-bit rows interleaved by eight (`interleave_rows8`).


# The widths of the interleaved layouts, each (bits of MLX's packing, the codes' levels, bits of
# the interleaved layout): 4 bits; 8-bit codes under 32 and 64 (5- and 6-bit ones widened at
# load), laid out at 5 and 6 bits; 8 bits of any code (stored as signed q - 128).
WIDTHS = {"4": (4, 16, 4), "5": (8, 32, 5), "6": (8, 64, 6), "8": (8, 256, 8)}
LAYOUTS = {"4": mx.uint8, "5": mx.uint8, "6": mx.uint8, "8": mx.int8}


def interleaved(n: int, k: int, group: int, dtype: mx.Dtype, seed: int, width: str = "4"):
    """Weights [n, k] of `width` in MLX's packing and interleaved: (packed, scales, biases) each,
    the interleaved layout's bits those `WIDTHS` gives."""
    bits, levels, layout = WIDTHS[width]
    packed, scales, biases, _ = quantized(n, k, bits, group, dtype, seed)
    if levels < 2**bits:
        codes = mx.random.randint(0, levels, (n, k), key=mx.random.key(seed)).astype(mx.uint8)
        packed = pack_codes(codes, bits)
    *rows8, served = interleave_rows8(packed, scales, biases, bits)
    assert served == layout
    return (packed, scales, biases), tuple(rows8)


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
@pytest.mark.parametrize("int8", [1, 3])
def test_interleaved_rows_give_the_integer_product_of_mlxs_packing(
    isa: str, width: str, group: int, dtype: mx.Dtype, int8: int
):
    """The same integer sums, scaled and added in another order: MLX's layout's result within
    float32 rounding, every row count, and a row's bits the same alone and in any batch. With
    three int8 parts a value (`--cpu-precision exact`) both are the float32 products' within
    float32 rounding; with one, not."""
    bits, _, layout = WIDTHS[width]
    plain, rows8 = interleaved(72, 384, group, dtype, seed=group, width=width)
    assert rows8[0].dtype == LAYOUTS[width] and rows8[0].shape == (72, 384 * layout // 8)
    x = mx.random.normal((200, 384), key=mx.random.key(group))
    whole = native.quant_matmul(x, *rows8, group, layout, int8)
    reference = native.quant_matmul(x, *plain, group, bits, int8)
    scale = mx.abs(reference).max().item()
    assert mx.abs(whole - reference).max().item() < 1e-5 * scale
    assert not mx.array_equal(whole, reference).item()  # another order of float sums
    float32 = native.quant_matmul(x, *plain, group, bits, 0)
    assert (mx.abs(whole - float32).max().item() < 1e-5 * scale) == (int8 == 3)
    for size in (1, 2, 3, 4, 5, 7, 16, 33):
        parts = [
            native.quant_matmul(x[i : i + size], *rows8, group, layout, int8)
            for i in range(0, 200, size)
        ]
        assert mx.array_equal(mx.concatenate(parts), whole).item(), size
    prompt = native.quant_matmul(x.reshape(4, 50, 384), *rows8, group, layout, int8)
    assert mx.array_equal(prompt.reshape(200, 72), whole).item()


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("int8", [1, 3])
def test_an_infinite_or_nan_activation_leaves_its_rows_products_not_finite(
    isa: str, width: str, int8: int
):
    """As the float products: quantized, an overflow would become finite codes (a block's
    scale infinite, its codes 0), and a row's logits would hide it from the non-finite check.
    The integer products give NaN there."""
    bits, _, layout = WIDTHS[width]
    plain, rows8 = interleaved(72, 384, 64, mx.float16, seed=5, width=width)
    x = mx.random.normal((4, 384), key=mx.random.key(6))
    poisoned = mx.array(x)
    poisoned[1, 100] = float("inf")
    poisoned[2, 383] = float("nan")
    kinds = [(rows8, layout, int8), (plain, bits, int8), (plain, bits, 0)]  # 0: float32's
    for weights, w_bits, parts in kinds:
        clean = native.quant_matmul(x, *weights, 64, w_bits, parts)
        got = native.quant_matmul(poisoned, *weights, 64, w_bits, parts)
        broken = mx.logical_not(mx.isfinite(got)).all(axis=-1).tolist()
        assert broken == [False, True, True, False], parts
        assert mx.array_equal(got[::3], clean[::3]).item()  # the other rows' bits unchanged


@pytest.mark.parametrize("chunk_bytes", [8 << 20, 512])
@pytest.mark.parametrize("width", list(WIDTHS))
def test_interleaved_rows_undo_as_mlxs_packing(width: str, chunk_bytes: int, monkeypatch):
    """Both ways a layer at once, and eight rows at a time (as a large layer's rows are)."""
    monkeypatch.setattr(cpu_weights, "_INTERLEAVE_BYTES", chunk_bytes)
    bits, _, layout = WIDTHS[width]
    plain, rows8 = interleaved(48, 256, 64, mx.float16, seed=5, width=width)
    *undone, undone_bits = deinterleave_rows8(*rows8, layout)
    assert undone_bits == bits
    for got, want in zip(undone, plain, strict=True):
        assert got.dtype == want.dtype and mx.array_equal(got, want).item()


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
def test_a_packed_lookup_is_mx_dequantizes_rows_to_the_bit(width: str, group: int, dtype: mx.Dtype):
    """An embedding's lookup, one primitive, in MLX's packing and interleaved by eight: each
    id's row as mx.dequantize gives it from MLX's packing, ids of any shape, layout and integer
    dtype, the first and last rows of every eight; an id outside the rows a row of NaN, nothing
    read outside the layer."""
    bits, _, layout = WIDTHS[width]
    plain, rows8 = interleaved(48, 384, group, dtype, seed=group, width=width)
    ids = mx.array([[0, 7, 8, 47], [13, 13, 40, 1], [46, 9, 15, 16]])
    want = mx.dequantize(
        plain[0][ids],
        plain[1][ids].astype(mx.float32),
        plain[2][ids].astype(mx.float32),
        group_size=group,
        bits=bits,
    )
    for layer, width in ((plain, bits), (rows8, layout)):
        for kind in (mx.int32, mx.uint32, mx.int64):
            got = native.packed_lookup(ids.astype(kind), *layer, group, width)
            assert got.dtype == mx.float32 and got.shape == (3, 4, 384)
            assert mx.array_equal(got, want).item(), kind
        one = native.packed_lookup(mx.array([[47]]), *layer, group, width)
        assert mx.array_equal(one, want[0:1, 3:4]).item()
        strided = native.packed_lookup(ids.T, *layer, group, width)  # ids as a view
        assert mx.array_equal(strided, want.transpose(1, 0, 2)).item()
        outside = native.packed_lookup(mx.array([48, -1, 1, 1 << 20]), *layer, group, width)
        assert mx.isnan(outside).all(axis=-1).tolist() == [True, True, False, True]
        assert mx.array_equal(outside[2], want[1, 3]).item()  # row 1, as at [1, 3]


def test_a_packed_lookup_refuses_what_it_does_not_read():
    plain, rows8 = interleaved(16, 128, 32, mx.float16, seed=2)
    ids = mx.array([1, 2])
    three = mx.quantize(mx.ones((16, 128)), group_size=32, bits=3)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        native.packed_lookup(ids, *three, 32, 3)
    with pytest.raises(ValueError, match="multiple of 8"):
        native.packed_lookup(ids, rows8[0][:12], rows8[1][:12], rows8[2][:12], 32, 4)
    with pytest.raises(ValueError, match="one float dtype"):
        native.packed_lookup(ids, rows8[0], rows8[1], rows8[2].astype(mx.float32), 32, 4)
    with pytest.raises(ValueError, match="one float dtype"):
        native.packed_lookup(ids, *plain, 64, 4)  # scales of groups of 32
    with pytest.raises(ValueError, match="ids"):
        native.packed_lookup(ids.astype(mx.float32), *rows8, 32, 4)


def test_the_embeddings_lookup_is_one_primitive_and_mlxs_rows(
    embedded_model_dir: Path, tmp_path: Path
):
    """The embedded model's embedding (Q8_0) looks its rows up in one primitive on every path,
    in MLX's packing (float32) and interleaved as signed 8-bit codes (fast, exact): the same
    rows, those of mx.dequantize."""
    from hotlora.models.loader import load_model_dir

    model = load_model_dir(embedded_model_dir).model
    install_packed_kernels(model, threads=2, precision="float32")
    embedding = model.model.embed_tokens
    assert isinstance(embedding, PackedEmbedding) and not embedding.interleaved
    ids = mx.array([[0, 1, 7, 8, 42, 12345, 49144, 49151]])
    mlx = mx.dequantize(
        embedding.weight[ids],
        embedding.scales[ids].astype(mx.float32),
        embedding.biases[ids].astype(mx.float32),
        group_size=embedding.group_size,
        bits=embedding.bits,
    )

    def operations(rows: mx.array) -> list[str]:
        dot = tmp_path / "lookup.dot"
        mx.export_to_dot(str(dot), rows)
        return re.findall(r'label ?="([A-Za-z]+)"', dot.read_text())

    float32 = embedding(ids)
    assert operations(float32) == ["PackedLookup"]
    assert mx.array_equal(float32, mlx).item()
    set_cpu_precision(model, "fast")
    assert embedding.interleaved and embedding.weight.dtype == mx.int8
    fast = embedding(ids)
    assert operations(fast) == ["PackedLookup"]
    assert mx.array_equal(fast, mlx).item()


@pytest.mark.parametrize(("rows", "length"), [(1, 1), (3, 1), (16, 1), (2, 5)])
def test_interleaved_products_together_and_gathered_are_each_products_bits(
    isa: str, rows: int, length: int
):
    """q, k, v and a fourth product as one primitive, and one product with each row's
    residuals, on interleaved weights: each output is its own product's bits, as for MLX's
    packing."""
    x = mx.random.normal((rows, length, 128), key=mx.random.key(rows * length))
    layers = [interleaved(n, 128, 32, mx.float16, seed=n)[1] for n in (64, 32, 32, 96)]
    weights = [[layer[i] for layer in layers] for i in range(3)]
    outputs = native.quant_matmul_heads(x, *weights, HEADS, 32, [4] * 4, None, [], True)
    for layer, h, got in zip(layers, HEADS, outputs, strict=True):
        alone = heads_layout(native.quant_matmul(x, *layer, 32, 4, True), h)
        assert mx.array_equal(got, alone).item(), h
    pairs = gather_operands(128, 64, RANKS, seed=1)
    adapters = [native.adapter_pairs([(pairs[2 * i], pairs[2 * i + 1])]) for i in range(4)]
    batch = native.row_plan(adapters, *plan(row_entries(rows)))
    gathered = native.quant_matmul_gather(x, *layers[0], 32, 4, batch, 0, True)
    together = native.quant_matmul_heads(
        x, *weights, HEADS, 32, [4] * 4, batch, [0, -1, -1, -1], True
    )
    assert mx.array_equal(together[0], heads_layout(gathered, HEADS[0])).item()


def test_interleaved_rows_are_refused_where_their_kernel_does_not_read_them():
    plain, rows8 = interleaved(16, 128, 32, mx.float16, seed=2)
    x = mx.ones((1, 128))
    with pytest.raises(ValueError, match="interleaved"):
        native.quant_matmul(x, *rows8, 32, 4)  # float32 activations: MLX's packing only
    odd = (mx.zeros((12, 64), dtype=mx.uint8), rows8[1][:12], rows8[2][:12])
    with pytest.raises(ValueError, match="multiple of 8"):
        native.quant_matmul(x, *odd, 32, 4, True)
    signed = (mx.zeros((16, 64), dtype=mx.int8), rows8[1], rows8[2])
    with pytest.raises(ValueError, match="int8 for 8-bit codes"):
        native.quant_matmul(x, *signed, 32, 4, True)  # signed codes are 8-bit ones
    unsigned = (mx.zeros((16, 128), dtype=mx.uint8), rows8[1], rows8[2])
    with pytest.raises(ValueError, match="int8 for 8-bit codes"):
        native.quant_matmul(x, *unsigned, 32, 8, True)  # and 8-bit ones signed
    with pytest.raises(ValueError, match="4 or 8 bits only"):
        native.quant_matmul(x, *plain, 32, 5, True)  # 5 bits interleaved only
    mixed = [[plain[i], rows8[i]] for i in range(3)]  # x's codes in two orders
    with pytest.raises(ValueError, match="in one order"):
        native.quant_matmul_heads(x[None], *mixed, [0, 0], 32, [4, 4], None, [], True)


HEADS5 = [4, 2, 2, 2, 0]  # the mix's q, k, v and o, then a product without heads


@pytest.mark.parametrize(("rows", "length"), [(1, 1), (3, 1), (16, 1), (2, 5)])
def test_interleaved_products_of_other_widths_together_are_each_products_bits(
    isa: str, rows: int, length: int
):
    """A quant mix in one call: q 4-bit (Q4_K), k 5-bit (Q5_0) and v 6-bit codes (an MLX 6-bit
    layer) widened to 8 and laid out at 5 and 6, o signed 8-bit (Q8_0), each with scales of its own
    dtype, and a fifth of MLX's 8-bit packing: x quantized once (one int8 code a value, or three
    parts), each output its own product's bits. The same mix on float32 activations, MLX's
    packing, likewise."""
    x = mx.random.normal((rows, length, 128), key=mx.random.key(rows + length))
    mix = [
        (64, "4", mx.float32),
        (32, "5", mx.float16),
        (32, "6", mx.bfloat16),
        (32, "8", mx.float16),
    ]
    layers = [interleaved(n, 128, 32, dtype, seed=n, width=w) for n, w, dtype in mix]
    eight = quantized(96, 128, 8, 32, mx.float16, seed=9)[:3]
    interleaved_rows, plain = [rows8 for _, rows8 in layers], [p for p, _ in layers]
    layouts = [WIDTHS[w][2] for _, w, _ in mix] + [8]
    packings = [WIDTHS[w][0] for _, w, _ in mix] + [8]
    for int8, chosen, bits in (
        (1, interleaved_rows, layouts),
        (3, interleaved_rows, layouts),
        (0, plain, packings),
    ):
        chosen = [*chosen, eight]
        weights = [[layer[i] for layer in chosen] for i in range(3)]
        outputs = native.quant_matmul_heads(x, *weights, HEADS5, 32, bits, None, [], int8)
        for layer, b, h, got in zip(chosen, bits, HEADS5, outputs, strict=True):
            alone = heads_layout(native.quant_matmul(x, *layer, 32, b, int8), h)
            assert mx.array_equal(got, alone).item(), (int8, b, h)
    with pytest.raises(ValueError, match="bits"):
        native.quant_matmul_heads(x, *weights, HEADS5, 32, bits[:4], None, [], True)


def gather_operands(k: int, n: int, ranks: tuple[int, ...], seed: int) -> list[mx.array]:
    """Adapters' pairs as mounted, flat: A [k, r], B [r, n] for each rank."""
    pairs = []
    for i, rank in enumerate(ranks):
        keys = mx.random.split(mx.random.key(seed + i), 2)
        pairs.append(mx.random.normal((k, rank), key=keys[0]) * 0.1)
        pairs.append(mx.random.normal((rank, n), key=keys[1]) * 0.1)
    return pairs


def plan(rows: list[list[tuple[int, float]]]) -> tuple[list[int], list[int], list[float]]:
    """The kernel's plan of each row's entries (adapter index, scale), in order: the rows'
    offsets into the entries, each entry's adapter, each entry's scale."""
    offsets = [0]
    for entries in rows:
        offsets.append(offsets[-1] + len(entries))
    indices = [i for entries in rows for i, _ in entries]
    scales = [scale for entries in rows for _, scale in entries]
    return offsets, indices, scales


def row_plan(pairs: list[mx.array], rows: list[list[tuple[int, float]]], slot: int = 0) -> Any:
    """A batch's plan: adapter i holds pairs[2i], pairs[2i + 1] at `slot` (nothing elsewhere),
    and row m applies rows[m]'s entries."""
    adapters = [
        native.adapter_pairs([None] * slot + [(pairs[i], pairs[i + 1])])
        for i in range(0, len(pairs), 2)
    ]
    return native.row_plan(adapters, *plan(rows))


# Ranks below, at and beyond a vector's lanes; a row's entries: none, one, a stack in either
# order, one adapter twice.
RANKS = (16, 8, 24, 3)
ENTRIES = [[], [(0, 2.0)], [(1, 0.5), (0, -1.0)], [(0, -1.0), (1, 0.5)], [(3, 1.5), (3, 0.25)],
           [(2, 1.0), (1, 2.0), (3, -0.5)]]  # fmt: skip


def row_entries(rows: int) -> list[list[tuple[int, float]]]:
    return [ENTRIES[(3 * m + 1) % len(ENTRIES)] for m in range(rows)]


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_the_gather_kernel_adds_each_rows_own_adapters(isa: str, rows: int):
    packed, scales, biases, exact = quantized(200, 256, 4, 32, mx.float16, seed=5)
    pairs = gather_operands(256, 200, RANKS, seed=rows)
    x = mx.random.normal((rows, 1, 256), key=mx.random.key(rows))
    entries = row_entries(rows)
    got = native.quant_matmul_gather(x, packed, scales, biases, 32, 4, row_plan(pairs, entries), 0)
    base = native.quant_matmul(x, packed, scales, biases, 32, 4)
    for m, own in enumerate(entries):
        expected = x[m] @ exact.T
        for i, scale in own:
            expected = expected + scale * ((x[m] @ pairs[2 * i]) @ pairs[2 * i + 1])
        assert mx.allclose(got[m], expected, rtol=1e-4, atol=1e-3).item(), m
        if not own:  # no adapter: the base product, to the bit
            assert mx.array_equal(got[m], base[m]).item()


def test_the_residuals_passes_are_timed_and_the_clock_reset_when_read(isa: str):
    packed, scales, biases, _ = quantized(200, 256, 4, 32, mx.float16, seed=5)
    pairs = gather_operands(256, 200, RANKS, seed=3)
    x = mx.random.normal((4, 1, 256), key=mx.random.key(3))
    native.lora_seconds()  # whatever earlier calls left
    mx.eval(native.quant_matmul(x, packed, scales, biases, 32, 4))
    assert native.lora_seconds() == 0.0  # no residuals, no pass
    no_adapter = row_plan(pairs, [[]] * 4)
    mx.eval(native.quant_matmul_gather(x, packed, scales, biases, 32, 4, no_adapter, 0))
    assert native.lora_seconds() == 0.0
    planned = row_plan(pairs, row_entries(4))
    mx.eval(native.quant_matmul_gather(x, packed, scales, biases, 32, 4, planned, 0))
    took = native.lora_seconds()
    assert 0.0 < took < 10.0
    assert native.lora_seconds() == 0.0  # read once, then reset


def test_a_gathered_rows_result_is_the_same_bits_alone_as_in_any_batch(isa: str):
    """Each row alone, given only its own adapters (in another order among the pairs), gets the
    bits it gets among 16 rows of other adapters, and its prompt's tokens the same again."""
    packed, scales, biases, _ = quantized(300, 576, 4, 32, mx.float16, seed=6)
    pairs = gather_operands(576, 300, RANKS, seed=7)
    x = mx.random.normal((16, 1, 576), key=mx.random.key(8))
    entries = row_entries(16)
    whole = native.quant_matmul_gather(
        x, packed, scales, biases, 32, 4, row_plan(pairs, entries), 0
    )
    for m, own in enumerate(entries):
        used = sorted({i for i, _ in own}, reverse=True)
        mine = [array for i in used for array in pairs[2 * i : 2 * i + 2]]
        renumbered = [[(used.index(i), scale) for i, scale in own]]
        alone = native.quant_matmul_gather(
            x[m], packed, scales, biases, 32, 4, row_plan(mine, renumbered), 0
        )
        assert mx.array_equal(alone, whole[m]).item(), m
    # A prompt's tokens a row, 5 each: row s's tokens under row s's entries.
    prompt = mx.concatenate([x[:4]] * 5, axis=1)  # [4, 5, 576]
    chunked = native.quant_matmul_gather(
        prompt, packed, scales, biases, 32, 4, row_plan(pairs, entries[:4]), 0
    )
    for t in range(5):
        assert mx.array_equal(chunked[:, t], whole[:4, 0]).item(), t


@pytest.mark.parametrize("rows", [4, 8, 16])
def test_the_gathered_residuals_bits_do_not_depend_on_the_pools_threads(isa: str, rows: int):
    """At 4 rows a thread of the pool or more the residuals take one pass a row at a time, else
    items of spans of each row's outputs: at 1 to 4 threads these rows fall on either side, and
    each row's outputs are the same bits."""
    packed, scales, biases, _ = quantized(300, 576, 4, 32, mx.float16, seed=11)
    pairs = gather_operands(576, 300, RANKS, seed=12)
    x = mx.random.normal((rows, 1, 576), key=mx.random.key(13))
    plan = row_plan(pairs, row_entries(rows))
    try:
        results = []
        for threads in (1, 2, 3, 4):
            assert native.set_threads(threads) == threads
            results.append(native.quant_matmul_gather(x, packed, scales, biases, 32, 4, plan, 0))
            mx.eval(results[-1])
        assert all(mx.array_equal(r, results[0]).item() for r in results[1:])
    finally:
        native.set_threads(2)


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_float16_adapters_give_the_bits_of_the_float32_values_they_hold(isa: str, rows: int):
    """`--adapter-dtype float16` keeps pairs in float16: the kernel converts each value exactly,
    so a row's result is the bits of the same kernel on float32 pairs of those values, alone or
    among other rows, a decode step's or a prompt's."""
    packed, scales, biases, _ = quantized(300, 576, 4, 32, mx.float16, seed=10)
    halves = [pair.astype(mx.float16) for pair in gather_operands(576, 300, RANKS, seed=11)]
    singles = [pair.astype(mx.float32) for pair in halves]
    x = mx.random.normal((rows, 1, 576), key=mx.random.key(12))
    entries = row_entries(rows)
    got = native.quant_matmul_gather(x, packed, scales, biases, 32, 4, row_plan(halves, entries), 0)
    want = native.quant_matmul_gather(
        x, packed, scales, biases, 32, 4, row_plan(singles, entries), 0
    )
    assert mx.array_equal(got, want).item()
    # Adapters of both dtypes in one batch: each row the bits it gets with its own dtype's.
    mixed = halves[:4] + singles[4:]  # adapters 0 and 1 in float16, 2 and 3 in float32
    among = native.quant_matmul_gather(
        x, packed, scales, biases, 32, 4, row_plan(mixed, entries), 0
    )
    for m, own in enumerate(entries):
        used = {i for i, _ in own}
        if used and used <= {0, 1}:
            assert mx.array_equal(among[m], got[m]).item(), m
        elif used and used <= {2, 3}:
            assert mx.array_equal(among[m], want[m]).item(), m


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_rows_of_one_adapter_read_together_get_the_bits_each_gets_alone(isa: str, dtype: mx.Dtype):
    """Rows that apply the same pairs share the kernels' calls (up to four rows a call, the
    pairs read once for them): rows of one adapter at different scales, of a stack of it, and
    of the base alone, scattered among rows of other adapters, each get the bits they get alone;
    a prompt's tokens under one adapter, the bits of each token alone. On two threads, where 16
    rows and 9 tokens take the row-at-a-time pass that groups them."""
    assert native.set_threads(2) == 2
    packed, scales, biases, _ = quantized(300, 576, 4, 32, mx.float16, seed=14)
    pairs = [p.astype(dtype) for p in gather_operands(576, 300, RANKS, seed=15)]
    shared = [[(0, s)] for s in (2.0, -0.5, 1.0, 0.125, 3.0, -1.0, 0.75)]
    stacks = [[(0, 1.0), (1, s)] for s in (0.5, -2.0, 1.5)]
    others = [[(2, 1.0)], [(3, 0.5)], [], [(1, 1.0)], [], [(3, -1.0)]]
    entries = [shared[0], others[0], shared[1], stacks[0], shared[2], others[1], shared[3]]
    entries += [stacks[1], others[2], shared[4], shared[5], others[3], stacks[2], others[4]]
    entries += [shared[6], others[5]]
    assert len(entries) == 16
    x = mx.random.normal((16, 1, 576), key=mx.random.key(16))
    whole = native.quant_matmul_gather(
        x, packed, scales, biases, 32, 4, row_plan(pairs, entries), 0
    )
    for m, own in enumerate(entries):
        alone = native.quant_matmul_gather(
            x[m], packed, scales, biases, 32, 4, row_plan(pairs, [own]), 0
        )
        assert mx.array_equal(alone, whole[m]).item(), m
    # 9 tokens of one prompt under one stack: each token's bits those it gets alone.
    prompt = x[:9].reshape(1, 9, 576)
    chunk = native.quant_matmul_gather(
        prompt, packed, scales, biases, 32, 4, row_plan(pairs, [stacks[1]]), 0
    )
    for t in range(9):
        alone = native.quant_matmul_gather(
            x[t], packed, scales, biases, 32, 4, row_plan(pairs, [stacks[1]]), 0
        )
        assert mx.array_equal(chunk[0, t], alone[0]).item(), t


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("width", [300, 1100])
def test_a_few_rows_of_one_adapter_read_together_get_the_bits_each_gets_alone(
    isa: str, dtype: mx.Dtype, width: int
):
    """Fewer rows than four a thread take items of a group's residuals on a span of columns
    (one span of a product 300 wide, each item computing its group's activations; two of one
    1,100 wide, after a pass of every group's activations), where rows that apply the same
    pairs share the kernels' calls too: rows of one adapter at different scales, of a stack of
    it, of another adapter and of the base alone, each get the bits they get alone, at every
    row count from 2 to 7, and those of one thread's row-at-a-time pass; a prompt of 7 tokens
    under one stack (four and three tokens a call), the bits of each token alone."""
    assert native.set_threads(2) == 2
    packed, scales, biases, _ = quantized(width, 576, 4, 32, mx.float16, seed=17)
    pairs = [p.astype(dtype) for p in gather_operands(576, width, RANKS, seed=18)]
    entries = [[(0, 2.0)], [(0, 1.0), (1, 0.5)], [(0, -0.5)], [(2, 1.0)], [(0, 0.75)]]
    entries += [[(0, 1.0), (1, -2.0)], []]
    x = mx.random.normal((7, 1, 576), key=mx.random.key(19))

    def gather(x: mx.array, rows: list[list[tuple[int, float]]]) -> mx.array:
        got = native.quant_matmul_gather(x, packed, scales, biases, 32, 4, row_plan(pairs, rows), 0)
        mx.eval(got)
        return got

    alone = [gather(x[m], [own]) for m, own in enumerate(entries)]
    try:
        for rows in range(2, 8):
            together = gather(x[:rows], entries[:rows])
            for m in range(rows):
                assert mx.array_equal(alone[m], together[m]).item(), (rows, m)
            if rows >= 4:  # one thread: the row-at-a-time pass
                assert native.set_threads(1) == 1
                assert mx.array_equal(gather(x[:rows], entries[:rows]), together).item(), rows
                assert native.set_threads(2) == 2
    finally:
        native.set_threads(2)
    chunk = gather(x.reshape(1, 7, 576), [entries[1]])
    for t in range(7):
        assert mx.array_equal(chunk[0, t], gather(x[t], [entries[1]])[0]).item(), t


def test_a_few_rows_products_together_get_each_products_own_bits(isa: str):
    """Products of one call (one 1,100 wide, in two spans a group, one 300 wide) under a few
    rows' adapters, one adapter with weights at the first alone: each output the bits of its own
    product's call."""
    assert native.set_threads(2) == 2
    layers = [quantized(n, 576, 4, 32, mx.float16, seed=n) for n in (1100, 300)]
    wide = gather_operands(576, 1100, (16, 8), seed=20)
    narrow = gather_operands(576, 300, (16,), seed=21)
    adapters = [
        native.adapter_pairs([(wide[0], wide[1]), (narrow[0], narrow[1])]),
        native.adapter_pairs([(wide[2], wide[3])]),  # nothing at the second
    ]
    rows = [[(0, 1.0)], [(0, 0.5), (1, 2.0)], [(1, 1.0)], [(0, -1.0)], [(0, 1.0), (1, 2.0)]]
    batch = native.row_plan(adapters, *plan(rows))
    x = mx.random.normal((5, 1, 576), key=mx.random.key(22))
    outputs = native.quant_matmul_heads(
        x, *[[layer[i] for layer in layers] for i in range(3)], [0, 0], 32, [4, 4], batch, [0, 1]
    )
    for slot, ((w, s, b, _), got) in enumerate(zip(layers, outputs, strict=True)):
        alone = native.quant_matmul_gather(x, w, s, b, 32, 4, batch, slot)
        assert mx.array_equal(got, alone).item(), slot
        plain = native.quant_matmul(x, w, s, b, 32, 4)
        assert not mx.array_equal(got, plain).item(), slot  # the residuals are there


def half_precision_edges() -> mx.array:
    """float32 values where rounding to float16 is delicate: every midpoint between neighbouring
    float16 values (ties round to even), values just either side of them, subnormals, signed
    zeros, the edge of float16's range and past it."""
    halves = mx.arange(0, 0x7BFF, 7, dtype=mx.uint16).view(mx.float16).astype(mx.float32)
    following = (mx.arange(0, 0x7BFF, 7, dtype=mx.uint16) + 1).view(mx.float16)
    midpoints = (halves + following.astype(mx.float32)) / 2  # exact in float32
    subnormal = [5.96e-8, 2.98e-8, 2.99e-8, 1e-9, 6.1e-5]
    past = [65519.0, 65520.0, -65520.0, 1e6, float("inf"), float("-inf")]
    edges = mx.array([0.0, -0.0, *subnormal, 65504.0, *past])
    spread = mx.random.normal((4096,), key=mx.random.key(3)) * 10.0 ** mx.random.randint(
        -9, 6, (4096,), key=mx.random.key(4)
    ).astype(mx.float32)
    nudged = [midpoints * (1 + d) for d in (-1e-7, 1e-7)]
    return mx.concatenate([halves, midpoints, -midpoints, *nudged, edges, spread])


def test_to_half_rounds_as_mlx_astype_does():
    """`to_half` (float16 mounts): the bits of MLX's own astype, for row-major arrays and a
    transpose alike; each array flagged finite or not once rounded."""
    values = half_precision_edges()
    finite = mx.clip(values, -65504.0, 65504.0)  # the largest float16
    square = mx.random.normal((96, 40), key=mx.random.key(5))
    arrays = [values, finite, square.T]
    got, flags = native.to_half(arrays)
    for array, half in zip(arrays, got, strict=True):
        assert half.dtype == mx.float16 and half.shape == array.shape
        assert mx.array_equal(half.view(mx.uint16), array.astype(mx.float16).view(mx.uint16))
    assert flags == [False, True, True]
    with pytest.raises(ValueError, match="float32 arrays only"):
        native.to_half([square.astype(mx.float16)])


def test_a_pair_of_two_dtypes_or_a_view_is_refused():
    pairs = gather_operands(64, 16, (4,), seed=1)
    with pytest.raises(ValueError, match="both float32 or both float16, row-major"):
        native.adapter_pairs([(pairs[0], pairs[1].astype(mx.float16))])
    with pytest.raises(ValueError, match="both float32 or both float16, row-major"):
        native.adapter_pairs([(pairs[1].T, pairs[0].T)])  # [16, 4], [4, 64]: views


def test_an_entry_adds_nothing_at_a_slot_where_its_adapter_has_no_weights(isa: str):
    """An adapter's entries count only at the slots it has weights at: elsewhere its rows get
    the base product, or their other adapters' residuals alone, to the bit."""
    packed, scales, biases, _ = quantized(200, 256, 4, 32, mx.float16, seed=5)
    first, second = gather_operands(256, 200, (8,), seed=1), gather_operands(256, 200, (8,), seed=2)
    x = mx.random.normal((3, 1, 256), key=mx.random.key(3))
    both = [
        native.adapter_pairs([(first[0], first[1])]),  # slot 0 alone
        native.adapter_pairs([None, (second[0], second[1])]),  # slot 1 alone
    ]
    rows = [[(0, 1.0)], [(1, 1.0)], [(1, 2.0), (0, 0.5)]]
    batch = native.row_plan(both, *plan(rows))
    at_0 = native.quant_matmul_gather(x, packed, scales, biases, 32, 4, batch, 0)
    at_1 = native.quant_matmul_gather(x, packed, scales, biases, 32, 4, batch, 1)
    at_2 = native.quant_matmul_gather(x, packed, scales, biases, 32, 4, batch, 2)
    base = native.quant_matmul(x, packed, scales, biases, 32, 4)
    only_0 = native.quant_matmul_gather(
        x, packed, scales, biases, 32, 4, row_plan(first, [[(0, 1.0)], [], [(0, 0.5)]]), 0
    )
    only_1 = native.quant_matmul_gather(
        x, packed, scales, biases, 32, 4, row_plan(second, [[], [(0, 1.0)], [(0, 2.0)]]), 0
    )
    assert mx.array_equal(at_0, only_0).item()
    assert mx.array_equal(at_1, only_1).item()
    assert mx.array_equal(at_2, base).item()  # neither has weights there


# A plan whose last reference is the step's own (the request gone while its step ran): freed
# where the step ran, while another thread holds the GIL in mx.clear_cache (an eviction's), which
# waits for that step to end.
_PLAN_FREED_BESIDE_CLEAR_CACHE = """
import sys, threading
import mlx.core as mx
from hotlora.models.cpu import extension
native = extension.load(2)
w, s, b = mx.quantize(mx.random.normal((256, 256)), group_size=32, bits=4)
x = mx.random.normal((4, 1, 256))
mx.eval(w, s, b, x)
stop = False
def clearing():
    while not stop:
        mx.clear_cache()
thread = threading.Thread(target=clearing)
thread.start()
for _ in range(300):
    a, bb = mx.random.normal((256, 8)), mx.random.normal((8, 256))
    plan = native.row_plan([native.adapter_pairs([(a, bb)])], [0, 1, 1, 2, 2], [0, 0], [1.0, 0.5])
    y = native.quant_matmul_gather(x, w, s, b, 32, 4, plan, 0)
    del plan, a, bb
    mx.eval(y)
stop = True
thread.join()
print("ok")
"""


def test_a_plan_freed_where_its_step_ran_waits_for_no_python_thread():
    """The kernels' plans and adapters' pairs are freed in C++ alone wherever their last
    reference goes: a step that held the last one ends while another thread holds the GIL
    waiting for it (mx.clear_cache), where a reference that gave Python's object back to
    Python would wait for the GIL and hang both."""
    run = subprocess.run(
        [sys.executable, "-c", _PLAN_FREED_BESIDE_CLEAR_CACHE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


HEADS = [4, 2, 2, 0]  # q, k and v of an attention, then a product without heads


def together(
    x: mx.array, bits: int, batch: Any = None, slots: list[int] | None = None
) -> tuple[list[Any], list[mx.array]]:
    """Four quantized products of x [B, L, 128] (64, 32, 32 and 96 outputs, HEADS) as one
    primitive, with each output's rows' residuals at its slot of `batch` (-1: none): their
    layers (w, scales, biases, the exact weights) and their outputs."""
    layers = [quantized(n, 128, bits, 32, mx.float16, seed=n) for n in (64, 32, 32, 96)]
    weights = [[layer[i] for layer in layers] for i in range(3)]
    return layers, native.quant_matmul_heads(x, *weights, HEADS, 32, [bits] * 4, batch, slots or [])


def heads_layout(y: mx.array, heads: int) -> mx.array:
    """[B, L, N] as [B, heads, L, N / heads] (the attention's layout), or as it is for 0."""
    if not heads:
        return y
    return y.reshape(y.shape[0], y.shape[1], heads, -1).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize(("rows", "length"), [(1, 1), (3, 1), (16, 1), (2, 5), (1, 33)])
def test_products_together_add_each_rows_residuals_to_the_gathered_kernels_bits(
    isa: str, dtype: mx.Dtype, rows: int, length: int
):
    """q, k and v (and a product without heads) as one primitive under adapters: each output
    with residuals is quant_matmul_gather's to the bit, in the attention's layout, a prompt's
    tokens included; one without is quant_matmul's."""
    x = mx.random.normal((rows, length, 128), key=mx.random.key(rows + length))
    # Each adapter's pairs at slots 0, 1 and 2 (q, k and v's widths); none at 3.
    per_slot = [
        [p.astype(dtype) for p in gather_operands(128, n, RANKS, seed=n)] for n in (64, 32, 32)
    ]
    adapters = [
        native.adapter_pairs([(pairs[2 * i], pairs[2 * i + 1]) for pairs in per_slot])
        for i in range(len(RANKS))
    ]
    batch = native.row_plan(adapters, *plan(row_entries(rows)))
    layers, outputs = together(x, 4, batch, [0, 1, 2, -1])
    _, plain = together(x, 4)
    for slot, ((w, s, b, _), h, got) in enumerate(zip(layers, HEADS, outputs, strict=True)):
        if slot == 3:
            alone = native.quant_matmul(x, w, s, b, 32, 4)  # [B, L, N]
        else:
            alone = native.quant_matmul_gather(x, w, s, b, 32, 4, batch, slot)
        assert mx.array_equal(got, heads_layout(alone, h)).item(), h
    assert not mx.array_equal(outputs[0], plain[0]).item()  # the residuals are there


@pytest.mark.parametrize(("rows", "length"), [(1, 1), (3, 1), (2, 5)])
@pytest.mark.parametrize(("dims", "traditional"), [(16, False), (16, True), (8, False)])
@pytest.mark.parametrize("per_row", [False, True])
def test_q_and_k_rotated_in_the_products_call_are_rope_rows_bits(
    isa: str, rows: int, length: int, dims: int, traditional: bool, per_row: bool
):
    """The first two outputs (q and k) rotated as the product writes them: rope_rows of the
    unrotated outputs, to the bit, at one position for all rows or one per row; the others as
    they were."""
    x = mx.random.normal((rows, length, 128), key=mx.random.key(7 * rows + length))
    layers = [quantized(n, 128, 4, 32, mx.float16, seed=n) for n in (64, 32, 32, 96)]
    weights = [[layer[i] for layer in layers] for i in range(3)]
    offset = mx.array([5 + 3 * r for r in range(rows)] if per_row else [11], dtype=mx.int32)
    plain = native.quant_matmul_heads(x, *weights, HEADS, 32, [4] * 4)
    rope = (dims, traditional, 10000.0, 0.5)
    rotated = native.quant_matmul_heads(
        x, *weights, HEADS, 32, [4] * 4, None, [], False, offset, 2, *rope
    )
    for j, (got, was) in enumerate(zip(rotated, plain, strict=True)):
        want = native.rope_rows(was, offset, *rope) if j < 2 else was
        assert mx.array_equal(got, want).item(), j
    assert not mx.array_equal(rotated[0], plain[0]).item()


def test_products_together_refuse_a_rotation_that_does_not_fit():
    x = mx.ones((2, 1, 128))
    layers = [quantized(n, 128, 4, 32, mx.float16, seed=n) for n in (64, 32, 32, 96)]
    w = [[layer[i] for layer in layers] for i in range(3)]
    one = mx.array([3], dtype=mx.int32)
    with pytest.raises(ValueError, match="an int32 offset, one or one per row"):
        native.quant_matmul_heads(x, *w, HEADS, 32, [4] * 4, None, [], False, None, 2, 16)
    with pytest.raises(ValueError, match="an int32 offset, one or one per row"):
        three = mx.array([1, 2, 3], dtype=mx.int32)
        native.quant_matmul_heads(x, *w, HEADS, 32, [4] * 4, None, [], False, three, 2, 16)
    with pytest.raises(ValueError, match="even dims <= its head width"):
        native.quant_matmul_heads(x, *w, HEADS, 32, [4] * 4, None, [], False, one, 2, 15)
    with pytest.raises(ValueError, match="even dims <= its head width"):
        native.quant_matmul_heads(x, *w, [0, 2, 2, 0], 32, [4] * 4, None, [], False, one, 2, 16)
    with pytest.raises(ValueError, match="roped counts leading outputs"):
        native.quant_matmul_heads(x, *w, HEADS, 32, [4] * 4, None, [], False, one, 5, 16)


def test_products_together_refuse_plans_that_do_not_fit():
    (w, s, b, _), pairs = (
        quantized(16, 64, 4, 32, mx.float16, seed=9),
        gather_operands(64, 16, (4,), seed=1),
    )
    x = mx.ones((2, 1, 64))
    two = row_plan(pairs, [[(0, 1.0)]] * 2)
    with pytest.raises(ValueError, match="as many weights, scales, biases, heads, bits and slots"):
        native.quant_matmul_heads(x, [w, w], [s, s], [b, b], [0, 0], 32, [4, 4], two, [0])
    with pytest.raises(ValueError, match="rows must divide"):
        three = row_plan(pairs, [[(0, 1.0)]] * 3)
        native.quant_matmul_heads(x, [w], [s], [b], [0], 32, [4], three, [0])
    with pytest.raises(ValueError, match=r"pair at slot 0 is \[64, r\], \[r, 32\]"):
        wide = gather_operands(64, 32, (4,), seed=1)  # b [4, 32]: another product's
        native.quant_matmul_heads(
            x, [w], [s], [b], [0], 32, [4], row_plan(wide, [[(0, 1.0)]] * 2), [0]
        )


@pytest.mark.parametrize(
    ("offsets", "entries", "scales", "message"),
    [
        ([0, 1, 2], [0, 4], [1.0, 1.0], "each entry name one of the adapters"),  # 4 of 2
        ([0, 2, 1], [0, 1], [1.0, 1.0], "offsets must rise"),
        ([0, 1, 3], [0, 1], [1.0, 1.0], "offsets must rise from 0 to the entries' count"),
        ([0, 1, 2], [0, 1], [1.0], "with one scale each"),
        ([0], [], [], "one row at least"),
    ],
)
def test_a_wrong_plan_is_refused(
    offsets: list[int], entries: list[int], scales: list[float], message: str
):
    pairs = gather_operands(64, 16, (4, 4), seed=1)
    adapters = [native.adapter_pairs([(pairs[i], pairs[i + 1])]) for i in (0, 2)]
    with pytest.raises(ValueError, match=message):
        native.row_plan(adapters, offsets, entries, scales)


def test_a_plan_of_other_rows_is_refused():
    packed, scales, biases, _ = quantized(16, 64, 4, 32, mx.float16, seed=9)
    two = row_plan(gather_operands(64, 16, (4,), seed=1), [[(0, 1.0)], []])
    with pytest.raises(ValueError, match="rows must divide"):
        native.quant_matmul_gather(mx.ones((3, 64)), packed, scales, biases, 32, 4, two, 0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "length"), [(1, 1), (3, 1), (16, 1), (2, 5), (1, 33), (9, 2)])
def test_products_together_are_each_products_bits_in_the_attentions_layout(
    isa: str, bits: int, rows: int, length: int
):
    """q, k, v and a fourth projection without heads as one primitive: each output is
    quant_matmul's to the bit, reshaped to [B, heads, L, D] (or left [B, L, N] for 0 heads)."""
    x = mx.random.normal((rows, length, 128), key=mx.random.key(rows * length))
    layers, outputs = together(x, bits)
    for (w, s, b, _), h, got in zip(layers, HEADS, outputs, strict=True):
        alone = heads_layout(native.quant_matmul(x, w, s, b, 32, bits), h)  # [B, L, N] moved
        assert got.shape == alone.shape
        assert mx.array_equal(got, alone).item(), h


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize(("rows", "length"), [(1, 1), (3, 1), (2, 5)])
def test_products_together_after_a_norm_are_the_normed_inputs_products_bits(
    isa: str, int8: bool, rows: int, length: int
):
    """A layer's RMSNorm inside the products' call: each output is the products' of
    rms_norm_rows(x) to the bit, with residuals and a rotation too."""
    x = mx.random.normal((rows, length, 128), key=mx.random.key(rows + 7 * length)) * 3
    weight = mx.random.uniform(0.5, 1.5, (128,), key=mx.random.key(3))
    layers = [quantized(n, 128, 4, 32, mx.float16, seed=n)[:3] for n in (64, 32, 32, 96)]
    weights = [[layer[i] for layer in layers] for i in range(3)]
    pairs = gather_operands(128, 64, RANKS, seed=1)
    adapters = [native.adapter_pairs([(pairs[2 * i], pairs[2 * i + 1])]) for i in range(4)]
    batch = native.row_plan(adapters, *plan(row_entries(rows)))
    rope = {"offset": mx.array([5], dtype=mx.int32), "roped": 2, "rope_dims": 16}
    common = (*weights, HEADS, 32, [4] * 4, batch, [0, -1, -1, -1], int8)
    normed = native.rms_norm_rows(x, weight, 1e-5)
    want = native.quant_matmul_heads(normed, *common, **rope)
    got = native.quant_matmul_heads(x, *common, **rope, norm=weight, norm_eps=1e-5)
    for a, b in zip(got, want, strict=True):
        assert mx.array_equal(a, b).item()
    with pytest.raises(ValueError, match="norm weight"):
        native.quant_matmul_heads(x, *common, norm=weight[:64])


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize(("rows", "length"), [(1, 1), (3, 1), (2, 5)])
def test_gate_and_up_together_give_mlx_lms_swiglu_of_their_products_bits(
    isa: str, int8: bool, rows: int, length: int
):
    """An MLP's gate and up as one call with their activation: mlx_lm's swiglu (MLX's compiled
    SiLU, then the product) of the two products, to the bit, residuals and a norm included;
    inputs from small to large enough that exp overflows."""
    scale = mx.array([1e-3, 1.0, 30.0, 300.0])[mx.arange(rows * length) % 4]
    x = mx.random.normal((rows, length, 128), key=mx.random.key(rows + length))
    x = x * scale.reshape(rows, length, 1)
    weight = mx.random.uniform(0.5, 1.5, (128,), key=mx.random.key(4))
    layers = [quantized(96, 128, 4, 32, mx.float16, seed=n)[:3] for n in (1, 2)]
    weights = [[layer[i] for layer in layers] for i in range(3)]
    pairs = gather_operands(128, 96, RANKS, seed=2)
    adapters = [native.adapter_pairs([(pairs[2 * i], pairs[2 * i + 1])]) for i in range(4)]
    batch = native.row_plan(adapters, *plan(row_entries(rows)))
    common = (*weights, [0, 0], 32, [4, 4], batch, [0, -1], int8)
    for norm in ({}, {"norm": weight, "norm_eps": 1e-5}):  # the norm evens the scales out
        gate, up = native.quant_matmul_heads(x, *common, **norm)
        (got,) = native.quant_matmul_heads(x, *common, **norm, glu=True)
        want = llama.swiglu(gate, up)
        assert got.shape == want.shape and mx.array_equal(got, want).item(), norm
        if not norm and rows * length >= 4:
            assert mx.isinf(mx.exp(mx.abs(gate))).any().item()
    with pytest.raises(ValueError, match="glu"):
        native.quant_matmul_heads(x, *weights, [4, 0], 32, [4, 4], None, [], int8, glu=True)


def test_the_products_activation_is_mlx_lms_swiglu_through_exps_whole_range(isa: str):
    """Gate values swept densely from -130 to 130, through where MLX's exp overflows or
    underflows (|x| > 88) and the band just inside it: the one output of gate and up together
    is mlx_lm's swiglu of the two products, to the bit, each value's bits whatever the vector
    width and the threads' split."""
    # 97 outputs: each split of the values over the threads ends off the vectors' lanes too.
    layers = [quantized(97, 128, 4, 32, mx.float16, seed=n)[:3] for n in (5, 6)]
    weights = [[layer[i] for layer in layers] for i in range(3)]
    x0 = mx.random.normal((1, 1, 128), key=mx.random.key(8))
    gate0 = native.quant_matmul(x0, *layers[0], 32, 4)
    x = x0 * (130.0 / mx.abs(gate0).max()) * mx.linspace(-1.0, 1.0, 513).reshape(-1, 1, 1)
    gate, up = native.quant_matmul_heads(x, *weights, [0, 0], 32, [4, 4])
    (got,) = native.quant_matmul_heads(x, *weights, [0, 0], 32, [4, 4], glu=True)
    assert mx.array_equal(got, llama.swiglu(gate, up)).item()
    magnitude = mx.abs(gate)
    assert (magnitude > 100).sum().item() > 100  # exp past float32's range
    # Between MLX's cut-off (88) and where float32's exp overflows (88.72): the cut-off's own.
    assert ((magnitude > 88.0) & (magnitude < 88.73)).sum().item() > 10


def test_the_attentions_merged_output_is_its_output_with_the_heads_side_by_side(isa: str):
    keys = mx.random.split(mx.random.key(11), 3)
    q = mx.random.normal((2, 4, 3, 16), key=keys[0])
    k = mx.random.normal((2, 2, 9, 16), key=keys[1])
    v = mx.random.normal((2, 2, 9, 8), key=keys[2])
    mask = mx.broadcast_to(mx.arange(6, 9)[:, None] >= mx.arange(9)[None], (2, 1, 3, 9))
    heads = native.attention_rows(q, k, v, mask, 0.25)  # [B, H, L, Dv]
    merged = native.attention_rows_merged(q, k, v, mask, 0.25)  # [B, L, H * Dv]
    assert mx.array_equal(merged, heads.transpose(0, 2, 1, 3).reshape(2, 3, 32)).item()


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
        # 3 bits is served packed, widened to 4 (test_cpu_repack.py); mxfp4 is not affine.
        (lambda m: nn.quantize(m, group_size=32, bits=4, mode="mxfp4"), "mxfp4"),
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
    assert not any(isinstance(m, PackedLinear) for _, m in model.named_modules())


@pytest.mark.parametrize("precision", ["fast", "exact", "float32"])
def test_a_named_isa_serves_the_model_with_its_kernels_to_the_widest_ones_rounding(
    tmp_path: Path, precision: str
):
    """`--cpu-kernels-isa avx2` on a wider CPU: the setup says avx2 and the batched step takes at
    most avx2's rows; a prompt's and a batched step's logits are the widest kernels' to their
    rounding (vectors of another width sum in another order)."""
    widest = native.isa()
    if widest == "avx2" or not native.use_isa("avx2"):
        pytest.skip("needs a CPU wider than AVX2")
    native.use_isa(widest)
    tokens = mx.array([PROMPTS[0], PROMPTS[0][::-1], PROMPTS[0][2:] + [1, 2]])
    got = {}
    try:
        for isa in ("avx2", widest):
            model = tiny_model(quantize=True)
            setup = prepare_cpu(
                model,
                weights="packed",
                float_budget=None,
                vector_jit=False,
                batch_kernels=True,
                precision=precision,  # type: ignore[arg-type]
                home=tmp_path,
                isa=isa,
            )
            assert setup.packed and f"({isa}, " in (setup.batch_kernels or ""), setup
            assert native.isa() == isa and extension.max_rows == extension.MAX_ROWS[isa]
            cache = [BatchKVCache([0] * 3) for _ in model.layers]
            prompt = model(tokens, cache=cache)
            step = model(mx.array([[7], [8], [9]]), cache=cache)
            got[isa] = (prompt, step)
            mx.eval(got[isa])
    finally:
        extension.load(2, widest)
    # Sums of other widths: rounding; on int8 activations a last bit may also move a code.
    tolerance = 1e-3 if precision == "fast" else 1e-5
    for a, b in zip(got["avx2"], got[widest], strict=True):
        assert mx.abs(a - b).max().item() <= tolerance * mx.abs(b).max().item()


def test_an_isa_the_cpu_lacks_or_no_isa_at_all_is_refused_and_changes_nothing(tmp_path: Path):
    """Refused by the kernels' load, and by prepare_cpu before anything is loaded, whichever
    weights and kernels were asked for."""
    widest = native.isa()
    lacking = "neon" if native.use_isa("avx2") else "avx512vnni"
    native.use_isa(widest)
    model = tiny_model(quantize=True)
    try:
        with pytest.raises(ValueError, match=f"--cpu-kernels-isa {lacking}: this CPU lacks"):
            extension.load(2, lacking)
        with pytest.raises(ValueError, match="unknown kernels' ISA 'sse4'"):
            extension.load(2, "sse4")
        with pytest.raises(ValueError, match=f"--cpu-kernels-isa {lacking}: this CPU lacks"):
            prepare_cpu(
                model,
                weights="float32",
                float_budget=None,
                vector_jit=False,
                batch_kernels=False,
                home=tmp_path,
                isa=lacking,
            )
        assert native.isa() == widest
        assert isinstance(model.layers[0].mlp.up_proj, nn.QuantizedLinear)  # nothing converted
    finally:
        extension.load(2, widest)


def test_the_settings_name_the_kernels_isas():
    assert get_args(KernelsIsa) == ("auto", *extension.ISAS)


# The model: the tiny llama quantized as mlx-lm's converter does (tied embeddings, 4 bits),
# served packed, with adapters `a` and `b` mounted on it.

PROMPTS = [[5, 17, 3, 99, 42, 7, 60, 61, 9], [8, 8, 31], [100, 2, 77, 4, 5, 6]]
SPECS = ["", "a", "b", "a+b", "b@-0.5+a"]


@pytest.fixture(params=["float32", "float16"])
def packed(tmp_path: Path, request: pytest.FixtureRequest):
    """(model, manager): the tiny quantized llama with the kernels installed, `a` and `b`, kept
    in float32 and (`--adapter-dtype float16`) in float16."""
    model = tiny_model(quantize=True)
    state = install_packed_kernels(model, threads=2)
    assert state.enabled, state.reason
    kinds = {type(m) for _, m in model.named_modules()}
    assert {PackedLinear, PackedEmbedding} <= kinds
    dtype = mx.float16 if request.param == "float16" else mx.float32
    manager = AdapterManager(
        model, base_id=BASE_ID, adapter_root=tmp_path, max_rank=64, adapter_dtype=dtype
    )
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
        together, _ = decode_together(model, sets, steps)
        for row, (spec, adapters) in enumerate(zip(specs, sets, strict=True)):
            own = alone(model, adapters, PROMPTS[row], [len(PROMPTS[row])], steps[row])[1:]
            for step, logits in enumerate(own):
                assert mx.array_equal(together[step][row], logits[0]).item(), (specs, spec, step)


def step_products(model: nn.Module, tmp_path: Path, rows: int) -> dict[str, int]:
    """The packed products in the graph of one decode step of `rows` rows, by primitive."""
    cache = (
        make_prompt_cache(model) if rows == 1 else [BatchKVCache([0] * rows) for _ in model.layers]
    )
    mx.eval(model(mx.full((rows, 4), 5), cache=cache))
    logits = model(mx.full((rows, 1), 7), cache=cache)
    dot = tmp_path / "step.dot"
    mx.export_to_dot(str(dot), logits)
    mx.eval(logits)
    text = dot.read_text()
    return {
        name: text.count(f'label ="{name}"') + text.count(f'label="{name}"')
        for name in (
            "DecoderLayers", "QuantMatmul", "QuantMatmulHeads", "QuantMatmulGather", "Transpose",
            "SliceUpdate",
        )
    }  # fmt: skip


def separate_calls(patched: pytest.MonkeyPatch) -> None:
    """Decode steps whose decoder layers take their separate calls: no layer primitive."""
    patched.setattr(fused, "layers_step", lambda *_: None)
    patched.setattr(fused, "layer_step", lambda *_: None)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("layers_a_call", [1, 5])
def test_a_decode_steps_layers_are_one_primitive(
    packed, tmp_path, monkeypatch, rows, layers_a_call
):
    """A decode step's decoder layers are one primitive for each `LAYERS_A_CALL` of them (their
    products, norms, RoPE, cache writes, attention and residuals), the output layer's product
    the only other one, none of the separate calls; taken one at a time (`layer_step`, where a
    model's layers are not taken together), each layer is one."""
    model, _ = packed
    monkeypatch.setattr(fused, "LAYERS_A_CALL", layers_a_call)
    calls = -(-len(model.layers) // layers_a_call)
    assert step_products(model, tmp_path, rows) == {
        "DecoderLayers": calls,
        "QuantMatmul": 1,  # the tied output layer
        "QuantMatmulHeads": 0,
        "QuantMatmulGather": 0,
        "Transpose": 0,
        "SliceUpdate": 0,
    }
    monkeypatch.setattr(fused, "layers_step", lambda *_: None)
    assert step_products(model, tmp_path, rows)["DecoderLayers"] == len(model.layers)


@pytest.mark.parametrize("rows", [1, 3])
def test_under_adapters_a_decode_steps_layer_stays_one_primitive(packed, tmp_path, rows):
    """A decode step whose rows each have their own adapters: the layers still one primitive,
    which adds its rows' residuals to each projection's product."""
    model, manager = packed
    sets = [adapter_set(manager, spec) for spec in ("a", "b", "a+b")[:rows]]
    with activate(RowAdapterCache().for_rows(sets) if rows > 1 else sets[0]):
        counted = step_products(model, tmp_path, rows)
    assert counted["DecoderLayers"] == 1
    assert counted["QuantMatmul"] == 1  # the tied output layer
    assert counted["QuantMatmulHeads"] == counted["QuantMatmulGather"] == 0


@pytest.mark.parametrize("rows", [1, 3])
def test_without_the_layer_primitive_a_layer_takes_two_fused_products_and_two_alone(
    packed, tmp_path, monkeypatch, rows
):
    """Where a step's layer is not one primitive (a prompt's chunks, a cache without room),
    q, k and v are one product, gate and up another, o and down alone, and no transposes
    around the attention; under adapters o and down take the gathered kernel alone."""
    model, manager = packed
    separate_calls(monkeypatch)
    layers = len(model.layers)
    assert step_products(model, tmp_path, rows) == {
        "DecoderLayers": 0,
        "QuantMatmul": 2 * layers + 1,  # o_proj and down_proj, then the tied output layer
        "QuantMatmulHeads": 2 * layers,
        "QuantMatmulGather": 0,
        "Transpose": 0,
        "SliceUpdate": 2 * layers,
    }
    sets = [adapter_set(manager, spec) for spec in ("a", "b", "a+b")[:rows]]
    with activate(RowAdapterCache().for_rows(sets) if rows > 1 else sets[0]):
        counted = step_products(model, tmp_path, rows)
    assert (counted["QuantMatmulHeads"], counted["QuantMatmulGather"]) == (2 * layers, 2 * layers)


def decode_steps(
    model: nn.Module, rows: int, batch: AdapterSet | RowAdapters, grow_by: int
) -> tuple[list[mx.array], Any]:
    """Left-padded prompts prefilled, then twelve decode steps, the cache growing `grow_by`
    positions at a time (so that some steps find it full): each step's logits, and the cache."""
    prompts = [PROMPTS[row % len(PROMPTS)] for row in range(rows)]
    longest = max(map(len, prompts))
    if rows == 1:
        cache: Any = make_prompt_cache(model)
        tokens = mx.array(prompts)
    else:
        pads = [longest - len(p) for p in prompts]
        cache = [BatchKVCache(pads) for _ in model.layers]
        tokens = mx.array([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])
    for layer_cache in cache:
        layer_cache.step = grow_by
    out = []
    with activate(batch):
        model(tokens, cache=cache)
        for step in range(12):
            out.append(model(mx.full((rows, 1), 3 + 7 * step), cache=cache))
            mx.async_eval(out[-1])  # the next step built while this one runs, as served
    mx.eval(out)
    return out, cache


def held_to_separate_calls(
    model: nn.Module,
    rows: int,
    batch: AdapterSet | RowAdapters,
    grow_by: int,
    monkeypatch: pytest.MonkeyPatch,
    label: object = None,
) -> list[mx.array]:
    """`decode_steps` as the model takes them, held to its layers' separate calls: each step's
    logits the same bits, and at the end each layer's cache the same (keys, values, each row's
    offset, its position); returns the steps' logits."""
    one, one_cache = decode_steps(model, rows, batch, grow_by)
    with monkeypatch.context() as patched:
        separate_calls(patched)
        separate, separate_cache = decode_steps(model, rows, batch, grow_by)
    for step, (got, want) in enumerate(zip(one, separate, strict=True)):
        assert mx.array_equal(got, want).item(), (label, step)
    for got_layer, want_layer in zip(one_cache, separate_cache, strict=True):
        for got_state, want_state in zip(got_layer.state, want_layer.state, strict=True):
            assert mx.array_equal(got_state, want_state).item(), label
        assert got_layer.offset is not None
        if isinstance(got_layer.offset, int):
            assert got_layer.offset == want_layer.offset, label
        assert getattr(got_layer, "_idx", None) == getattr(want_layer, "_idx", None), label
    return one


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("specs", [("",), ("a+b", "b", "")])
@pytest.mark.parametrize("taken", ["layers", "each layer", "a layer a call"])
def test_a_decode_steps_layer_primitive_gives_the_separate_calls_bits(
    packed, monkeypatch, rows, specs, taken
):
    """Decode steps alone (mlx-lm's KVCache) and batched (its left-padded BatchKVCache), on the
    base and with each row's own adapters, the cache growing as they go: the layers as one
    primitive, a layer a primitive (`layer_step`) or one a call of the model's primitives give
    the logits of their separate calls, to the bit, and the same cache."""
    model, manager = packed
    sets = [adapter_set(manager, specs[row % len(specs)]) for row in range(rows)]
    batch = RowAdapterCache().for_rows(sets) if rows > 1 else sets[0]
    if taken == "each layer":
        monkeypatch.setattr(fused, "layers_step", lambda *_: None)
    elif taken == "a layer a call":
        monkeypatch.setattr(fused, "LAYERS_A_CALL", 1)
    held_to_separate_calls(model, rows, batch, 5, monkeypatch)


# Widths by projection as a GGUF's quant mix has them (q and gate Q4_K, k Q5_0, up Q5_K, v, down
# and the embedding Q8_0, o 6 bits): each call of a layer mixes widths, 5 and 6 bits widened to 8
# at load, 8 signed.
MIXED_BITS = {"q_proj": 4, "k_proj": 5, "v_proj": 8, "o_proj": 6, "gate_proj": 4, "up_proj": 5}


@pytest.mark.parametrize("precision", ["fast", "exact", "float32"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_layer_of_mixed_widths_is_one_primitive_with_the_separate_calls_bits(
    tmp_path, monkeypatch, precision, rows
):
    """A model whose projections are quantized at different widths, as a GGUF's quant mix has
    them: a decode step's layers are still one primitive, and give the separate calls' logits to
    the bit, on every precision."""
    model = tiny_model()
    nn.quantize(
        model,
        class_predicate=lambda path, module: (
            hasattr(module, "to_quantized")
            and {"group_size": 32, "bits": MIXED_BITS.get(path.split(".")[-1], 8)}
        ),
    )
    mx.eval(model.parameters())
    assert install_packed_kernels(model, threads=2).enabled
    set_cpu_precision(model, precision)
    counted = step_products(model, tmp_path, rows)
    assert counted["DecoderLayers"] == 1
    assert counted["QuantMatmulHeads"] == 0
    held_to_separate_calls(model, rows, BASE_ONLY, 5, monkeypatch)


def deep_llama(seed: int = 0) -> nn.Module:
    """The tiny llama with five layers, quantized: more than one `decoder_layers` primitive."""
    args = tiny_args()
    args.num_hidden_layers, args.layer_types = 5, ["full_attention"] * 5
    mx.random.seed(seed)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("rows", [1, 3])
def test_a_step_of_more_layers_than_a_primitive_takes_gives_the_separate_calls_bits(
    tmp_path, monkeypatch, rows
):
    """Five layers at four a primitive: a decode step is two primitives, the second taking the
    first's output; on the base and under each row's own adapters (`a` on the first three
    layers, `b` on the second alone, none on the last two) its logits and caches are the
    separate calls', to the bit."""
    assert fused.LAYERS_A_CALL == 4
    model = deep_llama()
    assert install_packed_kernels(model, threads=2).enabled
    manager = AdapterManager(model, base_id=BASE_ID, adapter_root=tmp_path, max_rank=64)
    for seed, (adapter_id, layers) in enumerate((("a", {0, 1, 2}), ("b", {1})), start=1):
        pairs = random_pairs(deep_llama(), seed=seed)
        kept = {path: pair for path, pair in pairs.items() if int(path.split(".")[2]) in layers}
        write_mlx_adapter(tmp_path / adapter_id, kept)
        manager.mount(adapter_id, adapter_id)
    assert step_products(model, tmp_path, rows)["DecoderLayers"] == 2
    for specs in (("",), ("a+b", "b", "")):
        sets = [adapter_set(manager, specs[row % len(specs)]) for row in range(rows)]
        batch = RowAdapterCache().for_rows(sets) if rows > 1 else sets[0]
        held_to_separate_calls(model, rows, batch, 5, monkeypatch, specs)


def test_a_model_of_sliding_window_layers_steps_each_layer_on_its_own(tmp_path, monkeypatch):
    """A llama whose layers mix sliding-window and full attention (a rotating cache for the
    sliding ones, masks of their own) is not stepped as one run of layers: its full-attention
    layer is a primitive of its own, the sliding one takes its separate calls, and the logits
    are the separate calls' to the bit."""
    args = tiny_args()
    args.layer_types, args.sliding_window = ["sliding_attention", "full_attention"], 6
    mx.random.seed(0)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    assert install_packed_kernels(model, threads=2).enabled
    assert type(model.model) is fused.FusedModel
    counted = step_products(model, tmp_path, 1)
    assert (counted["DecoderLayers"], counted["QuantMatmulHeads"]) == (1, 2)
    held_to_separate_calls(model, 1, BASE_ONLY, 5, monkeypatch)


def test_a_precision_set_again_reaches_the_layer_primitive(packed, monkeypatch):
    """The layer primitive's arguments are gathered once a block and kept from step to step;
    a precision set again (new layouts of the codes, other products) is taken at the next step:
    its logits are the separate calls' at that precision, to the bit."""
    model, manager = packed
    base = adapter_set(manager, "")
    steps = {}
    for precision in ("float32", "fast", "exact", "float32"):
        set_cpu_precision(model, precision)
        one = held_to_separate_calls(model, 1, base, 16, monkeypatch, precision)
        steps.setdefault(precision, one)
    for other in ("exact", "float32"):
        assert not mx.array_equal(steps[other][-1], steps["fast"][-1]).item(), other


def test_a_layers_arguments_are_kept_from_step_to_step_until_its_layers_change(packed, monkeypatch):
    """A block's layer primitive arguments are gathered at its first step and kept, under
    adapters and rows of their own too; new weights loaded into a projection (MLX's `update`,
    as `load_weights` does) or another module put in a projection's place are taken at the next
    step: its logits are the separate calls' on what the model now holds, to the bit."""
    model, manager = packed
    rows = RowAdapterCache().for_rows([adapter_set(manager, s) for s in ("a", "a+b", "")])
    before, _ = decode_steps(model, 3, rows, grow_by=16)
    kept = [layer.__dict__["_layer_arguments"] for layer in model.layers]
    decode_steps(model, 1, adapter_set(manager, "b"), grow_by=16)
    assert [layer.__dict__["_layer_arguments"] for layer in model.layers] == kept

    down = model.layers[0].mlp.down_proj["base"]
    down.update({"scales": down["scales"] * 2})  # new weights, the module unchanged
    loaded = held_to_separate_calls(model, 3, rows, 16, monkeypatch)
    assert not mx.array_equal(loaded[-1], before[-1]).item()
    assert model.layers[0].__dict__["_layer_arguments"] is not kept[0]

    attention = model.layers[1].self_attn  # a module of its own in a projection's place
    replace_module(model, "model.layers.1.self_attn.v_proj", attention.k_proj["base"])
    replaced = held_to_separate_calls(model, 3, rows, 16, monkeypatch)
    assert not mx.array_equal(replaced[-1], loaded[-1]).item()


@pytest.mark.parametrize("rows", [1, 3])
def test_a_step_asks_its_slots_for_residuals_once_for_each_active_set(packed, monkeypatch, rows):
    """Where no adapter set is active, a decode step's layer primitive asks none of its LoRA
    slots for residuals (`active_residuals`); under a set (or a batch's sets), every slot of
    every layer once, at its first step, the answers then kept for the later steps while that
    object lives; another batch's object is asked again, and a batch let go takes its kept
    answers with it. The steps' arguments are kept on the first layer from step to step. (All
    give the separate calls' bits:
    `test_a_decode_steps_layer_primitive_gives_the_separate_calls_bits`.)"""
    model, manager = packed
    asked: list[str] = []
    fused_residuals = LoRASlot.fused_residuals

    def counted(slot: LoRASlot, x: mx.array) -> Any:
        asked.append(slot.path)
        return fused_residuals(slot, x)

    monkeypatch.setattr(LoRASlot, "fused_residuals", counted)
    kept = []

    def steps(batch: AdapterSet | RowAdapters, count: int = 3) -> list[str]:
        cache = (
            make_prompt_cache(model)
            if rows == 1
            else [BatchKVCache([0] * rows) for _ in model.layers]
        )
        with activate(batch):
            mx.eval(model(mx.full((rows, 4), 5), cache=cache))  # a prompt: the fused products
            asked.clear()
            for _ in range(count):
                mx.eval(model(mx.full((rows, 1), 7), cache=cache))
                kept.append(model.layers[0].__dict__["_step_arguments"])
        return list(asked)

    assert steps(adapter_set(manager, "")) == []
    specs = [("a", "a+b", "")[:rows], ("b", "a", "b")[:rows]]

    def batch(which: int) -> AdapterSet | RowAdapters:
        sets = [adapter_set(manager, spec) for spec in specs[which]]
        return RowAdapterCache().for_rows(sets) if rows > 1 else sets[0]

    first = batch(0)
    under = steps(first)
    assert len(under) == 7 * len(model.layers)  # the first step asks each slot once, no more
    assert len(set(under)) == 7 * len(model.layers)
    assert steps(first) == []  # the same batch again: its answers kept
    arguments = kept[0]
    assert all(k is arguments for k in kept)
    assert len(arguments.residuals) == 1
    second = batch(1)
    assert len(steps(second)) == 7 * len(model.layers)  # another batch: asked again
    assert len(arguments.residuals) == 2
    del first
    gc.collect()
    assert len(arguments.residuals) == 1  # let go: its answers with it


def test_a_stepped_models_layers_are_freed_when_let_go_without_the_cycle_collector():
    """What a decode step keeps on a model's layers (`_layer_arguments`, `_step_arguments`)
    makes no reference cycle: a stepped model's layers (and the weights their operands hold) go
    as soon as the model does, not at some later collection."""
    model = tiny_model(quantize=True)
    assert install_packed_kernels(model, threads=2).enabled
    cache = make_prompt_cache(model)
    mx.eval(model(mx.full((1, 4), 5), cache=cache))
    mx.eval(model(mx.full((1, 1), 7), cache=cache))
    assert "_step_arguments" in model.layers[0].__dict__  # the step was the layer primitive's
    layers = [weakref.ref(layer) for layer in model.layers]
    gc.disable()
    try:
        del model, cache
        assert all(layer() is None for layer in layers)
    finally:
        gc.enable()


def test_a_steps_mask_made_by_the_kernels_is_mlx_lms():
    """The kernels' mask of a decode step (`step_key_mask`, through `cache_step_mask` while a
    model of quantized kernels runs) is what mlx-lm's `create_attention_mask` makes from the
    cache, broadcast as the attention kernel reads it: each row's keys from its left padding on
    in a BatchKVCache, every key in a KVCache; out of such a model's call, or for another
    cache, none."""
    assert not isinstance(extension.load(2), str)
    x = mx.zeros((3, 1, 8))
    batch = BatchKVCache([2, 0, 5])
    batch.update_and_fetch(mx.zeros((3, 2, 6, 4)), mx.zeros((3, 2, 6, 4)))
    single = KVCache()
    single.update_and_fetch(mx.zeros((1, 2, 6, 4)), mx.zeros((1, 2, 6, 4)))
    assert cache_step_mask(batch, 3, 7) is None  # no model of the kernels running
    with _rows_call("all"):
        for cache, rows in ((batch, 3), (single, 1)):
            made = cache_step_mask(cache, rows, 7)
            assert made is not None and made.dtype == mx.bool_ and made.shape == (rows, 1, 1, 7)
            want = step_mask(create_attention_mask(x[:rows], cache), rows, 7)
            assert want is not None and mx.array_equal(made, want).item(), type(cache)
        padded = cache_step_mask(batch, 3, 7)
        assert padded is not None
        assert padded[:, 0, 0].tolist() == [[s >= pad for s in range(7)] for pad in (2, 0, 5)]
        assert cache_step_mask(RotatingKVCache(max_size=8), 1, 7) is None
    with pytest.raises(ValueError, match="left padding"):
        native.step_key_mask(3, 7, mx.array([1, 2], dtype=mx.int32))


def test_a_decode_step_writes_no_cache_array_another_holds(packed):
    """The layer primitive writes the step's keys and values into the cache's buffer only where
    nothing else holds it (as MLX's own update does): an array that still reads the cache as it
    was keeps its values."""
    model, _ = packed
    cache = [BatchKVCache([0, 2]) for _ in model.layers]
    model(mx.array([[4, 5, 6, 7], [0, 0, 8, 9]]), cache=cache)
    mx.eval([c.state for c in cache])
    before = mx.array(np.array(cache[0].keys))  # a copy of the buffer's values
    held = cache[0].keys[:, :, :]  # a view that holds the buffer as it is
    logits = model(mx.full((2, 1), 3), cache=cache)
    mx.eval(logits, held)
    assert cache[0].keys.shape == before.shape  # written in place of the buffer: room was left
    assert mx.array_equal(held, before).item()
    assert not mx.array_equal(cache[0].keys, before).item()  # the step's keys are in


def layer_operands(layer: nn.Module, **changed: Any) -> dict[str, Any]:
    """`decoder_operands`' arguments for a packed llama layer of the model (the packed layers
    under its LoRA slots), with `changed` in place of those named."""
    attention, mlp = layer.self_attn, layer.mlp
    slots = [getattr(attention, f"{n}_proj") for n in "qkvo"] + [
        getattr(mlp, f"{n}_proj") for n in ("gate", "up", "down")
    ]
    projections = [slot["base"] for slot in slots]
    rope = attention.rope
    operands = {
        "ws": [p.weight for p in projections],
        "scales": [p.scales for p in projections],
        "biases": [p.biases for p in projections],
        "bits": [p.bits for p in projections],
        "groups": [p.group_size for p in projections[:4]],
        "int8": [p.int8_parts for p in projections[:4]],
        "norm1": layer.input_layernorm.weight,
        "norm2": layer.post_attention_layernorm.weight,
        "eps1": 1e-5,
        "eps2": 1e-5,
        "heads": attention.n_heads,
        "kv_heads": attention.n_kv_heads,
        "scale": attention.scale,
        "rope_dims": rope.dims,
        "rope_traditional": rope.traditional,
        "rope_base": rope.base,
        "rope_scale": rope.scale,
    }
    return {**operands, **changed}


def test_a_layers_step_that_does_not_fit_is_refused(packed):
    """decoder_layers refuses a mask or a position that does not fit the caches, a cache of
    other heads than its layer's (the second layer's, its own primitive's: the first's is not
    made either), lists of layers and caches that do not match, no layers a primitive, and
    leaves every cache's arrays as they were."""
    model, _ = packed
    cache = make_prompt_cache(model)
    model(mx.array([[4, 5, 6, 7]]), cache=cache)
    layers = model.layers
    keys = [c.keys for c in cache]
    values = [c.values for c in cache]
    kept = [(k, mx.array(np.array(k))) for k in keys]  # each layer's array and its values
    x = mx.zeros((1, 1, layers[0].input_layernorm.weight.shape[0]))
    operands = [native.decoder_operands(**layer_operands(layer)) for layer in layers]

    def call(at: int, span: int, **changed: Any) -> mx.array:
        arguments = {
            "x": x,
            "layers": operands,
            "keys": keys,
            "values": values,
            "at": at,
            "mask": mx.ones((1, 1, 1, span), dtype=mx.bool_),
            "positions": mx.array([at], dtype=mx.int32),
            "plan": None,
            "slots": [],
            "layers_a_call": 1,
            **changed,
        }
        return native.decoder_layers(**arguments)

    with pytest.raises(ValueError, match="mask"):
        call(4, 4)  # the mask must reach the written position
    with pytest.raises(ValueError, match="room"):
        call(keys[0].shape[2], keys[0].shape[2] + 1)  # past the buffers
    narrow = [keys[0], keys[1][..., :-2]]  # the second layer's keys 2 narrower
    with pytest.raises(ValueError, match="layer's heads"):
        call(4, 5, keys=narrow, values=[values[0], values[1][..., :-2]])
    with pytest.raises(ValueError, match="for each layer"):
        call(4, 5, keys=keys[:1])
    with pytest.raises(ValueError, match="one layer or more"):
        call(4, 5, layers=[], keys=[], values=[])
    with pytest.raises(ValueError, match="a primitive"):
        call(4, 5, layers_a_call=0)
    for (array, before), layer_cache in zip(kept, cache, strict=True):
        assert layer_cache.keys is array and mx.array_equal(layer_cache.keys, before).item()
    assert call(4, 5).shape == x.shape  # the same arguments that fit are taken
    assert not mx.array_equal(cache[1].keys, kept[1][1]).item()  # its keys written in place


def test_a_layers_operands_are_of_evaluated_arrays(packed):
    """decoder_operands holds a layer's weights for its steps to read, not as their inputs: it
    refuses an array not yet evaluated."""
    model, _ = packed
    operands = layer_operands(model.layers[0])
    lazy = operands["norm2"] * 1  # not evaluated
    with pytest.raises(ValueError, match="evaluated"):
        native.decoder_operands(**{**operands, "norm2": lazy})
    mx.eval(lazy)
    native.decoder_operands(**{**operands, "norm2": lazy})


def test_a_layers_operands_that_do_not_fit_are_refused(packed):
    """decoder_operands checks once what a layer's steps share: its projections' rows against
    its heads and width, its norms, its heads and its RoPE."""
    model, _ = packed
    layer = model.layers[0]
    operands = layer_operands(layer)
    native.decoder_operands(**operands)  # as the model has them: taken
    heads, width = operands["heads"], operands["norm1"].shape[0]
    strided = mx.ones((2 * width,))[::2]  # a view of every other value
    mx.eval(strided)
    refused = {
        "norm weights": {"norm2": mx.ones((width + 1,))},
        "row-contiguous norm": {"norm1": strided},  # the steps read it in place
        "multiple of the KV heads": {"kv_heads": heads + 1},
        "RoPE": {"rope_dims": 3},
        "rows": {  # q's weights where k's belong: more rows than the KV heads take
            name: [arrays[0], arrays[0], *arrays[2:]]
            for name, arrays in operands.items()
            if name in ("ws", "scales", "biases")
        },
        "four calls": {"groups": operands["groups"][:3]},
    }
    for words, changed in refused.items():
        with pytest.raises(ValueError, match=words):
            native.decoder_operands(**layer_operands(layer, **changed))


def test_fused_layers_give_the_separate_layers_bits_and_yield_to_adapters(packed):
    """Prefill and decode steps alone and batched, on the base and under an adapter set: the
    fused model's logits are those of the same layers under mlx-lm's own classes, to the bit
    (under a set, the fused products with their residuals against each projection's slot
    adding its residual to its own product, a prompt's chunks included)."""
    model, manager = packed
    assert {FusedAttention, FusedMLP, FusedBlock} <= {type(m) for _, m in model.named_modules()}

    def logits(rows: int, spec: str) -> list[mx.array]:
        cache = (
            make_prompt_cache(model)
            if rows == 1
            else [BatchKVCache([0] * rows) for _ in model.layers]
        )
        prompt = mx.array([PROMPTS[0]] * rows)
        with activate(adapter_set(manager, spec)):
            out = [model(prompt[:, :5], cache=cache), model(prompt[:, 5:], cache=cache)]
            out += [model(mx.full((rows, 1), t), cache=cache) for t in (3, 40)]
        mx.eval(out)
        return out

    cases = [(rows, spec) for rows in (1, 3) for spec in ("", "a+b")]
    fused = {case: logits(*case) for case in cases}
    assert relative_difference(fused[1, "a+b"][-1], fused[1, ""][-1]) > 1e-3
    uninstall_fused(model)
    try:
        for case, expected in fused.items():
            for got, want in zip(logits(*case), expected, strict=True):
                assert mx.array_equal(got, want).item(), case
    finally:
        install_fused(model)


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
            precision="float32",
        )
    assert setup.packed and not setup.float32
    assert setup.batch_kernels is not None and f"({native.isa()}, 1 threads)" in setup.batch_kernels
    logged = [r.getMessage() for r in caplog.records]
    assert f"serving packed weights: {setup.weights}" in logged
    assert f"native kernels: {setup.batch_kernels}" in logged
    # The packed arrays stay as loaded; everything else is float32.
    embedding = model.model.embed_tokens
    assert isinstance(embedding, PackedEmbedding) and embedding.weight.dtype == mx.uint32
    assert embedding(mx.array([[3, 4]])).dtype == mx.float32
    assert model.model.norm.weight.dtype == mx.float32
    native.set_threads(2)


# Six adapters of ranks 4 to 64 (a vector's lanes and beyond), on rows of their own and stacked.
MANY = {"c": 4, "d": 8, "e": 16, "f": 24, "g": 64, "h": 3}
MANY_SPECS = ["c", "d+e", "f", "g@0.5+c", "h", "e@-1+h+d", "", "g", "c+d+e+f+g+h", "f@2"]


@pytest.fixture(params=["float32", "float16"])
def many(tmp_path: Path, request: pytest.FixtureRequest):
    """(model, manager): the tiny quantized llama served packed, with the six adapters, kept in
    float32 and (`--adapter-dtype float16`) in float16."""
    model = tiny_model(quantize=True)
    assert install_packed_kernels(model, threads=2).enabled
    dtype = mx.float16 if request.param == "float16" else mx.float32
    manager = AdapterManager(
        model, base_id=BASE_ID, adapter_root=tmp_path, max_rank=64, adapter_dtype=dtype
    )
    for seed, (adapter_id, rank) in enumerate(MANY.items(), start=3):
        pairs = random_pairs(tiny_model(), rank=rank, seed=seed)
        write_mlx_adapter(tmp_path / adapter_id, pairs, rank=rank)
        manager.mount(adapter_id, adapter_id)
        assert manager.get(adapter_id).ram_bytes == sum(
            a.size * dtype.size + b.size * dtype.size for a, b in pairs.values()
        )
    return model, manager


def decode_together(
    model: nn.Module, batch: AdapterSet | RowAdapters | list[AdapterSet], steps: list[list[int]]
) -> tuple[list[mx.array], list]:
    """The prompts left-padded and prefilled together, then a decode step a column of steps."""
    longest = max(map(len, PROMPTS))
    prompts = [PROMPTS[row % len(PROMPTS)] for row in range(len(steps))]
    pads = [longest - len(p) for p in prompts]
    cache = [BatchKVCache(pads) for _ in model.layers]
    tokens = mx.array([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])
    if isinstance(batch, list):
        batch = RowAdapterCache().for_rows(batch)
    with activate(batch):
        model(tokens, cache=cache)
        together = [
            model(mx.array(column)[:, None], cache=cache)[:, 0]
            for column in zip(*steps, strict=True)
        ]
    mx.eval(together)
    return together, cache


def test_many_distinct_adapters_and_stacks_decode_the_same_bits_alone_and_together(many):
    model, manager = many
    sets = [adapter_set(manager, spec) for spec in MANY_SPECS]
    steps = [[10 + row, 40 + row, 70 + row] for row in range(len(sets))]
    together, _ = decode_together(model, RowAdapterCache().for_rows(sets), steps)
    for row, (spec, adapters) in enumerate(zip(MANY_SPECS, sets, strict=True)):
        prompt = PROMPTS[row % len(PROMPTS)]
        own = alone(model, adapters, prompt, [len(prompt)], steps[row])[1:]
        for step, logits in enumerate(own):
            assert mx.array_equal(together[step][row], logits[0]).item(), (spec, step)


def test_a_stack_on_packed_weights_is_the_float_reference_within_the_tolerance(many):
    """The gathered sums against mlx-lm's own LoRA form on the dequantized weights."""
    model, manager = many
    reference = dequantized_reference(tiny_model(quantize=True))
    for spec in ("g@0.5+c", "e@-1+h+d"):
        adapters = adapter_set(manager, spec)
        for path, slot in find_targets(reference, (nn.Linear,)).items():
            terms = [
                (*entry.mounted.adapter.weights[path], entry.scale)
                for entry in adapters.entries
                if path in entry.mounted.adapter.weights
            ]
            replace_module(reference, path, Residuals(slot, terms))
        for prompt in PROMPTS:
            got = alone(model, adapters, prompt, [len(prompt)], [])[0]
            expected = reference(mx.array([prompt]))[0]
            difference = relative_difference(got, expected)
            assert difference < LOGIT_TOLERANCE, (spec, difference)
        reference = dequantized_reference(tiny_model(quantize=True))


class Residuals(nn.Module):
    """A float projection plus scale * (x @ A) @ B for each term: mlx-lm's LoRALinear, summed."""

    def __init__(self, base: nn.Module, terms: list[tuple[mx.array, mx.array, float]]):
        super().__init__()
        self.base = base
        self.terms = terms

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        for a, b, scale in self.terms:
            y = y + scale * ((x @ a) @ b)
        return y


def test_a_mixed_batch_copies_no_adapter(many):
    """The adapters' memory is their mounted arrays alone: a batch of ten sets, and a set
    alone, build no side-by-side pair or layout of their own; once their arrays are dropped,
    what they keep is far less than the smallest adapter's bytes."""
    model, manager = many
    sets = [adapter_set(manager, spec) for spec in MANY_SPECS]
    smallest = min(entry.mounted.adapter.ram_bytes for s in sets for entry in s.entries)
    steps = [[10 + row] for row in range(len(sets))]
    decode_together(model, [BASE_ONLY] * len(sets), steps)  # the graph's buffers, once
    mx.eval(alone(model, BASE_ONLY, PROMPTS[0], [9], [5]))
    mx.clear_cache()
    before = mx.get_active_memory()
    cache = RowAdapterCache()
    decode_together(model, cache.for_rows(sets), steps)
    alone(model, sets[1], PROMPTS[0], [9], [5])
    kept = mx.get_active_memory() - before
    assert all(side_by_side.columns == 0 for side_by_side in cache.kept)
    assert kept < smallest, (kept, smallest)


def test_a_set_used_alone_is_not_kept_alive_by_its_plan(many):
    """`lone_rows` keeps a set's plan only while the set lives: once nothing holds the set, its
    entry goes, and with it the last hold on the mounted adapters' arrays it named."""
    model, manager = many
    adapters = adapter_set(manager, "c+d")
    alone(model, adapters, PROMPTS[0], [9], [5])
    assert adapters in gathered._LONE
    held = weakref.ref(adapters)
    del adapters
    gc.collect()
    assert held() is None
    assert len(gathered._LONE) == 0
