"""The batched decode kernel: BLAS's products to rounding, the same bits for a row whatever the
batch, and only where a batched decode step calls it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import llama
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from hotlora.models.cpu import extension, install_rows_kernels
from hotlora.models.cpu.attention import cpu_attention, install_cpu_attention
from hotlora.models.cpu.extension import MAX_ROWS
from hotlora.models.cpu.layers import NativeEmbedding, NativeLinear, NativeRMSNorm, NativeRoPE
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import next_tokens

from tests.support.tiny import write_tiny_llama
from tests.unit.test_cpu_kernels import ATTENTION_CASES, attention_inputs

if (_why := extension.unavailable()) is not None:
    pytest.skip(f"batched decode kernel: {_why}", allow_module_level=True)
try:
    from hotlora.models.cpu import _rows_matmul as native
except ImportError:
    pytest.fail("the batched decode kernel is not built: run `make setup`")


@pytest.fixture(autouse=True)
def mlx_lm_attention(monkeypatch):
    """Each test starts from mlx-lm's own attention function, and leaves it as it was: installing
    the kernels points the architecture's module global elsewhere."""
    monkeypatch.setattr(
        llama, "scaled_dot_product_attention", mlx_lm_base.scaled_dot_product_attention
    )


def normal(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


# (rows, in, out): short rows (8 a pass, 2 weight rows a block) and long ones (4 and 4), with
# widths off the 16-lane vectors and weight rows off the blocks.
SHAPES = [(2, 64, 96), (8, 576, 1536), (16, 576, 192), (3, 1536, 576), (11, 100, 37), (5, 7, 9)]


@pytest.fixture(params=["avx512vbmi", "avx512", "avx2"])
def isa(request):
    """Each kernel this CPU runs; the widest one again afterwards."""
    widest = native.isa()
    if not native.use_isa(request.param):
        pytest.skip(f"the CPU lacks {request.param}")
    yield request.param
    native.use_isa(widest)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_computes_x_times_w_transposed(isa: str, shape: tuple[int, int, int]):
    rows, k, n = shape
    x, w = normal((rows, k), 1), normal((n, k), 2)
    got = native.rows_matmul(x, w)
    assert got.shape == (rows, n)
    assert mx.allclose(got, x @ w.T, rtol=1e-4, atol=1e-4 * k**0.5).item()


def test_a_rows_result_does_not_depend_on_the_other_rows(isa: str):
    rows = MAX_ROWS[isa]
    x, w = normal((rows, 576), 3), normal((300, 576), 4)
    whole = native.rows_matmul(x, w)
    for size in (1, 2, 5, 8):
        parts = [native.rows_matmul(x[i : i + size], w) for i in range(0, rows, size)]
        assert mx.array_equal(mx.concatenate(parts)[:rows], whole).item(), size
    # Another batch around row 0: its bits stay.
    other = mx.concatenate([x[:1], normal((6, 576), 5)])
    assert mx.array_equal(native.rows_matmul(other, w)[0], whole[0]).item()


def test_the_thread_count_changes_nothing_but_the_threads(isa: str):
    x, w = normal((8, 576), 3), normal((1000, 576), 4)
    try:
        results = []
        for threads in (1, 2, 3):
            assert native.set_threads(threads) == threads
            results.append(native.rows_matmul(x, w))
        assert all(mx.array_equal(r, results[0]).item() for r in results)
    finally:
        native.set_threads(1)


def lora_operands(rows: int, k: int, n: int, rank: int, seed: int) -> tuple[mx.array, ...]:
    x, w = normal((rows, k), seed), normal((n, k), seed + 1)
    a_t, b_t = normal((rank, k), seed + 2), normal((n, rank), seed + 3)
    mask = mx.where(normal((rows, rank), seed + 4) > 0, 2.0, 0.0)  # per row: a scale, or none
    return x, w, a_t, b_t, mask


@pytest.mark.parametrize("shape", [(8, 576, 1536, 48), (3, 1536, 576, 16), (5, 100, 37, 7)])
def test_the_lora_kernel_adds_each_rows_masked_residual(isa: str, shape: tuple[int, ...]):
    x, w, a_t, b_t, mask = lora_operands(*shape, seed=10)
    got = native.rows_matmul_lora(x, w, a_t, b_t, mask)
    expected = x @ w.T + ((x @ a_t.T) * mask) @ b_t.T
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-3).item()
    # A row whose mask is zero gets the base projection alone.
    bare = native.rows_matmul_lora(x, w, a_t, b_t, mx.zeros_like(mask))
    assert mx.allclose(bare, x @ w.T, rtol=1e-4, atol=1e-3).item()


def test_a_lora_rows_result_does_not_depend_on_the_other_rows(isa: str):
    x, w, a_t, b_t, mask = lora_operands(8, 576, 300, 48, seed=20)
    whole = native.rows_matmul_lora(x, w, a_t, b_t, mask)
    for i in range(8):
        alone = native.rows_matmul_lora(x[i : i + 1], w, a_t, b_t, mask[i : i + 1])
        assert mx.array_equal(alone[0], whole[i]).item(), i


def test_the_lora_kernels_thread_count_changes_nothing_but_the_threads(isa: str):
    # Both phases are split among the threads: the low-rank activations, then the outputs.
    x, w, a_t, b_t, mask = lora_operands(8, 576, 300, 48, seed=25)
    try:
        results = []
        for threads in (1, 2, 3):
            assert native.set_threads(threads) == threads
            results.append(native.rows_matmul_lora(x, w, a_t, b_t, mask))
        assert all(mx.array_equal(r, results[0]).item() for r in results)
    finally:
        native.set_threads(1)


def test_a_decode_steps_three_dimensional_rows_keep_their_shape():
    x, w, a_t, b_t, mask = lora_operands(6, 64, 40, 8, seed=35)
    x3, mask3 = x.reshape(6, 1, 64), mask.reshape(6, 1, 8)
    plain = native.rows_matmul(x3, w)
    assert plain.shape == (6, 1, 40)
    assert mx.array_equal(plain.reshape(6, 40), native.rows_matmul(x, w)).item()
    lora = native.rows_matmul_lora(x3, w, a_t, b_t, mask3)
    assert lora.shape == (6, 1, 40)
    assert mx.array_equal(lora.reshape(6, 40), native.rows_matmul_lora(x, w, a_t, b_t, mask)).item()


def test_lora_operands_of_the_wrong_shape_are_refused():
    x, w, a_t, b_t, mask = lora_operands(4, 64, 32, 8, seed=30)
    with pytest.raises(ValueError, match="mask \\[\\.\\.\\., R\\] \\(M rows\\)"):
        native.rows_matmul_lora(x, w, a_t, b_t, mask[:, :4])
    with pytest.raises(ValueError, match="mask"):  # R columns, but not one row of them per x row
        native.rows_matmul_lora(x, w, a_t, b_t, mask[:2])
    with pytest.raises(ValueError, match="float32"):
        native.rows_matmul_lora(x, w, a_t.astype(mx.float16), b_t, mask)


def test_strided_inputs_are_read_as_their_values():
    x, w = normal((64, 8), 6).T, normal((40, 64), 7)  # x: a transposed view [8, 64]
    assert mx.allclose(native.rows_matmul(x, w), x @ w.T, rtol=1e-5, atol=1e-5).item()
    # Every operand of the LoRA form a view: transposed, sliced with a step, broadcast.
    w_view = normal((64, 80), 8).T[::2]  # [40, 64]
    a_t, b_t = normal((64, 6), 9).T, normal((6, 40), 10).T  # [6, 64], [40, 6]
    mask = mx.broadcast_to(mx.array([[0.5, 0.0, 2.0, 1.0, 0.0, 3.0]]), (8, 6))
    got = native.rows_matmul_lora(x, w_view, a_t, b_t, mask)
    expected = x @ w_view.T + ((x @ a_t.T) * mask) @ b_t.T
    assert mx.allclose(got, expected, rtol=1e-4, atol=1e-4).item()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="x \\[\\.\\.\\., K\\] and w \\[N, K\\]"):
        native.rows_matmul(normal((2, 8), 1), normal((3, 9), 2))
    with pytest.raises(ValueError, match="two or more dimensions"):
        native.rows_matmul(normal((8,), 1), normal((3, 8), 2))
    with pytest.raises(ValueError, match="rows not empty"):  # no division by a zero width
        native.rows_matmul(mx.zeros((2, 0)), mx.zeros((3, 0)))
    with pytest.raises(ValueError, match="weight \\[D\\]"):
        native.rms_norm_rows(mx.zeros((2, 1, 0)), mx.zeros((0,)), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        native.rows_matmul(normal((2, 8), 1).astype(mx.float16), normal((3, 8), 2))


@pytest.mark.parametrize("shape", [(8, 1, 576), (1, 1, 576), (1, 37, 576), (3, 5, 100)])
def test_the_norm_is_mlxs_rms_norm_to_the_bit(shape: tuple[int, ...]):
    for seed in range(5):
        x = normal(shape, 40 + seed) * (1 + seed)
        weight = 1.0 + 0.1 * normal((shape[-1],), 50 + seed)
        for eps in (1e-5, 1e-6):
            got = native.rms_norm_rows(x, weight, eps)
            assert got.shape == x.shape
            assert mx.array_equal(got, mx.fast.rms_norm(x, weight, eps)).item()
    view = normal((shape[-1], 5), 42).T[:, None, :]  # [5, 1, D], strided
    expected = mx.fast.rms_norm(view, weight, 1e-6)
    assert mx.array_equal(native.rms_norm_rows(view, weight, 1e-6), expected).item()
    with pytest.raises(ValueError, match="weight \\[D\\]"):
        native.rms_norm_rows(x, weight[:50], 1e-5)


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 49155])
def test_rows_argmax_is_mx_argmax_and_flags_every_non_finite_row(vocab: int):
    """A decode step's greedy tokens (`rows_argmax`): each row's first largest value, as
    mx.argmax chooses: ties in one lane and across lanes (a later lane holding the earlier
    index), the largest in the values past the last whole vector of lanes, tokens held off at
    -inf and every token held off; a row flagged finite only where every value is, a NaN or an
    infinity in the lanes or past them; a row's results the same alone and in the batch, and
    from a strided view."""
    x = normal((6, vocab), vocab)
    at = mx.arange(vocab)
    tied = (at == 2 % vocab) | (at == 17) | (at == 18) | (at == vocab // 2) | (at == vocab - 1)
    ties = mx.where(tied, 50.0, x[0])  # 2 (lane 2) before 17 (lane 1) and 18 (lane 2 again)
    last = mx.where(at == vocab - 1, 50.0, x[1])  # past the lanes where 16 does not divide V
    held = mx.where(at % 3 == 1, -mx.inf, x[2])  # none held where the vocabulary is one token
    nan, inf = float("nan"), float("inf")
    spoiled = [x[3].at[i].add(v) for i, v in ((vocab // 3, nan), (vocab - 1, nan), (0, inf))]
    rows = mx.stack([x[4], ties, last, held, mx.full((vocab,), -mx.inf), x[5], *spoiled, -x[3]])
    rows = rows.at[9, vocab // 2].add(-inf)  # -inf in a row otherwise finite
    got = native.rows_argmax(rows)
    assert got.dtype == mx.uint32 and got.shape == (10, 2)
    assert got[:, 1].tolist() == [1, 1, 1, int(vocab == 1), 0, 1, 0, 0, 0, 0]
    finite = mx.array([0, 1, 2, 3, 4, 5, 9])  # and those held off, whole or in part
    assert got[finite, 0].tolist() == mx.argmax(rows[finite], axis=-1).tolist()
    assert got[1, 0].item() == (0 if vocab == 1 else 2) and got[2, 0].item() == vocab - 1
    assert got[4, 0].item() == 0  # every token held off: the first, as mx.argmax
    for i in range(10):
        assert mx.array_equal(native.rows_argmax(rows[i : i + 1])[0], got[i])
    assert mx.array_equal(native.rows_argmax(mx.contiguous(rows.T).T), got)
    with pytest.raises(ValueError, match="float32 logits"):
        native.rows_argmax(rows.astype(mx.float16))


def test_a_steps_greedy_tokens_and_finite_flags_are_the_same_natively_and_in_mlx(monkeypatch):
    """`scanned` takes the kernels' pass where they are loaded (float32 logits) and MLX's
    argmax and finite sum elsewhere (float16 logits, or no kernels): the same flags, and the
    same tokens for the rows that hold no NaN."""
    logits = normal((16, 4099), 9) * 8
    logits = logits.at[3, 17].add(float("nan")).at[5, 4098].add(float("-inf"))
    monkeypatch.setattr(extension, "native", native)
    calls, rows_argmax = [], native.rows_argmax
    monkeypatch.setattr(native, "rows_argmax", lambda x: calls.append(x) or rows_argmax(x))
    natively = next_tokens.scanned(logits)
    in_halves = next_tokens.scanned(logits.astype(mx.float16))
    monkeypatch.setattr(extension, "native", None)
    in_mlx = next_tokens.scanned(logits)
    assert len(calls) == 1  # float32 only
    without_nan = mx.array([i for i in range(16) if i != 3])
    for got in (natively, in_halves):
        assert got[0].dtype == mx.uint32 and got[1].dtype == mx.bool_
        assert got[1].tolist() == in_mlx[1].tolist() == [i not in (3, 5) for i in range(16)]
    assert natively[0][without_nan].tolist() == in_mlx[0][without_nan].tolist()
    halves = logits.astype(mx.float16)
    assert in_halves[0].tolist() == mx.argmax(halves, axis=-1).tolist()


# [B, heads, L, D]: decode steps of one row and of several, and prefills.
ROPE_SHAPES = [(1, 9, 1, 64), (6, 9, 1, 64), (1, 9, 17, 64), (2, 4, 6, 32)]


@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(("dims", "base", "scale"), [(1.0, 10000.0, 1.0), (0.5, 100000.0, 0.25)])
def test_rope_is_mlxs_rope_to_the_bit(
    shape: tuple[int, ...], traditional: bool, dims: float, base: float, scale: float
):
    x = normal(shape, 43)
    rotated = int(shape[-1] * dims)
    rows = shape[0]
    for offset in (0, 5, 511, 2999):
        at = mx.array([offset], dtype=mx.int32)  # one position for every row
        expected = mx.fast.rope(
            x, rotated, traditional=traditional, base=base, scale=scale, offset=offset
        )
        got = native.rope_rows(x, at, rotated, traditional, base, scale)
        assert got.shape == x.shape
        assert mx.array_equal(got, expected).item()
    each = mx.array([(37 * r) % 600 - 2 * r for r in range(rows)], dtype=mx.int32)  # one a row
    expected = mx.fast.rope(
        x, rotated, traditional=traditional, base=base, scale=scale, offset=each
    )
    assert mx.array_equal(native.rope_rows(x, each, rotated, traditional, base, scale), expected)
    if rotated < shape[-1]:  # the features past `dims` pass through
        assert mx.array_equal(got[..., rotated:], x[..., rotated:]).item()
    # A transposed view, as keys come from their projection.
    keys = normal((rows, shape[2], shape[1], shape[3]), 44).transpose(0, 2, 1, 3)
    expected = mx.fast.rope(
        keys, rotated, traditional=traditional, base=base, scale=scale, offset=7
    )
    got = native.rope_rows(keys, mx.array([7], dtype=mx.int32), rotated, traditional, base, scale)
    assert mx.array_equal(got, expected).item()


def test_rope_refuses_what_it_does_not_compute():
    x = normal((2, 3, 1, 8), 45)
    offset = mx.array([1, 2], dtype=mx.int32)
    with pytest.raises(ValueError, match="even dims"):
        native.rope_rows(x, offset, 5, False, 10000.0, 1.0)
    with pytest.raises(ValueError, match="int32 offset"):
        native.rope_rows(x, mx.array([1, 2, 3], dtype=mx.int32), 8, False, 10000.0, 1.0)
    with pytest.raises(ValueError, match="float32"):
        native.rope_rows(x.astype(mx.float16), offset, 8, False, 10000.0, 1.0)


def attention_operands(
    rows: int, heads: int, kv_heads: int, length: int, width: int, seed: int
) -> tuple[mx.array, ...]:
    """A decode step's queries, its keys and values as views of a larger cache (as
    `BatchKVCache` hands them over), and a mask with each row's own left padding."""
    queries = normal((rows, heads, 1, width), seed)
    keys = normal((rows, kv_heads, length + 30, width), seed + 1)[..., :length, :]
    values = normal((rows, kv_heads, length + 30, width), seed + 2)[..., :length, :]
    padding = mx.array([(3 * r) % min(length, 7) for r in range(rows)])
    mask = create_causal_mask(1, offset=length - 1, left_padding=padding)  # [B, 1, 1, S]
    return queries, keys, values, mask


# (rows, query heads, KV heads, keys, width): the embedded model's 9 heads on 3, one KV head for
# all, no grouping, widths off the vector lanes.
ATTENTION = [(8, 9, 3, 37, 64), (2, 4, 4, 5, 20), (3, 8, 2, 300, 64), (16, 6, 1, 17, 72)]


@pytest.mark.parametrize("shape", ATTENTION)
def test_attention_is_mlxs_to_rounding(isa: str, shape: tuple[int, ...]):
    queries, keys, values, mask = attention_operands(*shape, seed=50)
    scale = shape[-1] ** -0.5
    got = native.attention_rows(queries, keys, values, mask, scale)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    assert got.shape == expected.shape == queries.shape
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(got, cpu_attention(queries, keys, values, None, scale, mask), atol=1e-6)
    # Values stored transposed: read as their values.
    strided = mx.swapaxes(mx.swapaxes(values, -1, -2) * 1, -1, -2)
    again = native.attention_rows(queries, keys, strided, mask, scale)
    assert mx.allclose(again, expected, rtol=1e-5, atol=1e-6).item()


def test_a_rows_attention_does_not_depend_on_the_other_rows(isa: str):
    queries, keys, values, mask = attention_operands(8, 9, 3, 40, 64, seed=60)
    whole = native.attention_rows(queries, keys, values, mask, 0.125)
    for rows in ([0, 1], [5, 2, 7]):
        pick = mx.array(rows)
        part = native.attention_rows(queries[pick], keys[pick], values[pick], mask[pick], 0.125)
        assert mx.array_equal(part, whole[pick]).item()
    # A key a row does not see changes nothing of its result, however large.
    hidden = mx.where(mask[:, :, 0, :, None], keys, 1e30)
    assert mx.array_equal(native.attention_rows(queries, hidden, values, mask, 0.125), whole)


@pytest.mark.parametrize("heads", [(9, 3), (8, 2)])  # tiles of 4 tokens, and of 3 at 4 heads
def test_a_prompt_chunks_tokens_get_their_bits_alone(isa: str, heads: tuple[int, int]):
    """A chunk's tokens at once, taken in tiles and the keys in blocks, are each token's bits
    computed alone: past several blocks of keys, under left padding, beside a token that sees
    no key, and with the positions it does not see holding anything."""
    rows, length, chunk = 2, 330, 37
    h, kv_heads = heads
    queries = normal((rows, h, chunk, 64), 90)
    keys = normal((rows, kv_heads, length, 64), 91)
    values = normal((rows, kv_heads, length, 64), 92)
    mask = create_causal_mask(chunk, offset=length - chunk, left_padding=mx.array([0, 150]))
    mask = mx.broadcast_to(mask, (rows, 1, chunk, length))
    mask = mx.concatenate([mask[:, :, :5], mx.zeros_like(mask[:, :, 5:6]), mask[:, :, 6:]], axis=2)
    whole = native.attention_rows(queries, keys, values, mask, 0.125)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask)
    assert mx.allclose(whole, expected, rtol=1e-5, atol=1e-6).item()
    for t in range(chunk):
        alone = native.attention_rows(
            queries[:, :, t : t + 1], keys, values, mask[:, :, t : t + 1], 0.125
        )
        assert mx.array_equal(alone, whole[:, :, t : t + 1]).item(), t
    hidden = mx.where(mask[:, :, -1, :, None], keys, 1e30)  # what the last token does not see
    last = native.attention_rows(queries[:, :, -1:], hidden, values, mask[:, :, -1:], 0.125)
    assert mx.array_equal(last, whole[:, :, -1:]).item()


def test_a_row_that_sees_no_key_weighs_every_value_alike_as_mlx_does():
    queries, keys, values, mask = attention_operands(3, 4, 2, 9, 16, seed=80)
    mask = mx.concatenate([mask[:1], mx.zeros_like(mask[1:2]), mask[2:]])  # row 1 sees nothing
    got = native.attention_rows(queries, keys, values, mask, 0.25)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(got[1, 0, 0], values[1, 0].mean(axis=0), atol=1e-6).item()


def test_attention_refuses_what_it_does_not_compute():
    queries, keys, values, mask = attention_operands(2, 4, 2, 6, 8, seed=70)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        native.attention_rows(queries[:, :3], keys, values, mask, 1.0)
    with pytest.raises(ValueError, match="bool mask"):
        native.attention_rows(queries, keys, values, mask[..., :5], 1.0)
    with pytest.raises(ValueError, match="bool mask"):
        native.attention_rows(queries, keys, values, mask.astype(mx.float32), 1.0)
    with pytest.raises(ValueError, match="float32"):
        native.attention_rows(queries, keys.astype(mx.float16), values, mask, 1.0)


def decode_logits(model: nn.Module, rows: int) -> tuple[mx.array, mx.array]:
    """Prefill logits of a left-padded batch of `rows`, then one batched decode step's."""
    prompts = mx.array([[(7 * r + j) % 120 + 1 for j in range(6)] for r in range(rows)])
    cache = [BatchKVCache([r % 3 for r in range(rows)]) for _ in model.layers]
    prefill = model(prompts, cache=cache)
    step = model(mx.array([[r + 3] for r in range(rows)]), cache=cache)
    mx.eval(prefill, step)
    return prefill, step


def test_installed_it_serves_batched_decode_steps_only(tmp_path: Path):
    model = load_model_dir(write_tiny_llama(tmp_path / "tiny")).model
    model.set_dtype(mx.float32)
    prefill, step = decode_logits(model, 4)
    _, alone = decode_logits(model, 1)

    state = install_rows_kernels(model, threads=2)
    assert state.enabled, state.reason
    assert f"({native.isa()}, 2 threads)" in state.reason
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is NativeLinear for m in linears)
    assert type(model.model.embed_tokens) is NativeEmbedding  # the tied output layer
    norms = [m for _, m in model.named_modules() if isinstance(m, nn.RMSNorm)]
    ropes = [m for _, m in model.named_modules() if isinstance(m, nn.RoPE)]
    assert norms and all(type(m) is NativeRMSNorm for m in norms)
    assert ropes and all(type(m) is NativeRoPE for m in ropes)
    assert "projections and llama attention through the rows kernels" in state.reason
    assert f"{len(norms)} norms and {len(ropes)} RoPEs as one operation each" in state.reason
    assert isinstance(model, llama.Model) and type(model).__name__ == "Model"

    prefill_after, step_after = decode_logits(model, 4)
    _, alone_after = decode_logits(model, 1)
    # Prefill and a 1-row step are MLX's to the bit (BLAS's products; norms and RoPEs that
    # compute MLX's operations); the batched step is the kernels'.
    assert mx.array_equal(prefill_after, prefill).item()
    assert mx.array_equal(alone_after, alone).item()
    assert not mx.array_equal(step_after, step).item()
    assert mx.allclose(step_after, step, rtol=1e-4, atol=1e-4).item()
    assert mx.array_equal(mx.argmax(step_after, -1), mx.argmax(step, -1)).item()


class CountingAttention:
    """The extension, counting its attention and masked softmax calls."""

    def __init__(self, native: object):
        self.native, self.calls, self.softmax_calls = native, 0, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.native, name)

    def attention_rows(self, *args: object) -> mx.array:
        self.calls += 1
        return self.native.attention_rows(*args)  # type: ignore[attr-defined]

    def masked_softmax(self, *args: object) -> mx.array:
        self.softmax_calls += 1
        return self.native.masked_softmax(*args)  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", [c for c in ATTENTION_CASES if c[-1] in ("causal", "bool")])
def test_the_masked_softmax_gives_mlxs_attention_to_the_bit(isa: str, case: tuple):
    q, k, v, mask = attention_inputs(*case, seed=90)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.7, mask=mask)
    got = cpu_attention(q, k, v, None, 0.7, mask, masked_softmax=native.masked_softmax)
    assert mx.array_equal(got, expected).item()


def test_the_masked_softmax_is_mlxs_on_hidden_rows_and_extreme_scores(isa: str):
    scores = normal((2, 3, 5, 700), seed=91) * 60  # exponents beyond MLX's +-88 cut-offs
    mask = normal((2, 1, 5, 700), seed=92) > -0.5
    mask[1, :, 2, :] = False  # a row that sees no key weighs all alike
    wide = mx.broadcast_to(mask, scores.shape)
    lowest = mx.array(mx.finfo(mx.float32).min)
    expected = mx.softmax(mx.where(wide, scores, lowest), axis=-1, precise=True)
    assert mx.array_equal(native.masked_softmax(scores, wide), expected).item()
    with pytest.raises(ValueError, match="same shape"):
        native.masked_softmax(scores, mask)


def test_an_installed_models_prefill_chunks_take_the_masked_softmax(tmp_path: Path, monkeypatch):
    model = load_model_dir(write_tiny_llama(tmp_path / "tiny")).model
    model.set_dtype(mx.float32)

    def chunks() -> list[mx.array]:
        # A prompt's first chunk, then one after its cached prefix.
        cache = make_prompt_cache(model)
        logits = [model(mx.array([list(range(5, 25))]), cache=cache)]
        logits.append(model(mx.array([list(range(40, 47))]), cache=cache))
        mx.eval(logits)
        return logits

    before = chunks()  # mlx-lm's attention
    install_cpu_attention(model)
    assert install_rows_kernels(model, threads=2).enabled
    counting = CountingAttention(extension.native)
    monkeypatch.setattr(extension, "native", counting)
    after = chunks()
    assert counting.softmax_calls == 2 * len(model.layers)
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after, strict=True))


def test_a_model_without_the_kernels_keeps_mlxs_attention(tmp_path: Path, monkeypatch):
    # Two models of one architecture share its attention function: only an installed model's
    # steps may take the kernel, and every other call keeps the function the module had.
    path = write_tiny_llama(tmp_path / "tiny")
    plain, installed = (load_model_dir(path).model for _ in range(2))
    for model in (plain, installed):
        model.set_dtype(mx.float32)
    before = decode_logits(plain, 4)
    assert install_rows_kernels(installed, threads=2).enabled
    fallback = llama.scaled_dot_product_attention.rows_fallback  # type: ignore[attr-defined]
    assert fallback is mlx_lm_base.scaled_dot_product_attention
    counting = CountingAttention(extension.native)
    monkeypatch.setattr(extension, "native", counting)
    after = decode_logits(plain, 4)
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after, strict=True))
    decode_logits(installed, 1)
    assert counting.calls == 0
    # The installed model's batched step, and only it, takes the kernel: once a layer. Its
    # logits are the kernels', to rounding of the plain model's.
    prefill, step = decode_logits(installed, 4)
    assert counting.calls == len(installed.layers)
    assert mx.array_equal(prefill, before[0]).item()
    assert mx.allclose(step, before[1], rtol=1e-4, atol=1e-4).item()
    assert not mx.array_equal(step, before[1]).item()


def test_a_quantized_model_keeps_its_layers(tmp_path: Path):
    model = load_model_dir(write_tiny_llama(tmp_path / "tiny", quantize=True)).model
    install_rows_kernels(model, threads=2)
    assert not any(isinstance(m, NativeLinear | NativeEmbedding) for _, m in model.named_modules())


def test_it_explains_a_missing_build(monkeypatch):
    def missing(name: str):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(extension.importlib, "import_module", missing)
    state = install_rows_kernels(nn.Linear(4, 4))
    assert not state.enabled
    assert "not built" in state.reason and "make setup" in state.reason


def test_no_kernel_without_the_vector_instructions(monkeypatch):
    monkeypatch.setattr(extension, "cpu_features", lambda: {"sse2", "avx", "avx2"})
    linear = nn.Linear(4, 4)
    state = install_rows_kernels(linear)
    assert not state.enabled
    assert state.reason == "the CPU lacks AVX-512 and AVX2 with FMA, or F16C"
    assert type(linear) is nn.Linear
