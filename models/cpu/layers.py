"""The model's layers on the native CPU kernels: projections, tied output layer, norms, RoPEs.

OpenBLAS packs the whole weight matrix into blocks on every call, whatever the row count, so a
projection of a few rows costs several times its 1-row product. The extension's `rows_matmul`
reads each weight row from memory once, straight into registers, and multiplies every row of x
by it while it is there. Each output is one dot product summed in a fixed order, so a row's
result does not depend on the rest of the batch. It differs from BLAS in the last bits, so it
serves only batched calls of one token per row (`[B, 1, K]` inputs, 2 <= B <= the kernels' most
rows): decode steps, and a batched prefill whose chunks are all one token long. A request
alone, and every longer prefill, keep BLAS and mlx-lm's results to the bit.

The model's RMSNorms and RoPEs take one primitive each (`RowsRMSNorm`, `RowsRoPE`): MLX's CPU
backend composes them from ten to thirty small operations, each of which costs more to schedule
than to compute at a few rows, and they were most of a decode step's graph. Each computes MLX's
composition operation for operation, with MLX's own exp, sin and cos, so its results are MLX's
to the bit: every float32 call takes it, a request decoding alone and prefill included.

`swap_layers` changes the modules' classes in place; their weights are untouched.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma, gemma2, gemma3_text

from hotlora.models.cpu import extension


def serves_rows(x: mx.array) -> bool:
    """Whether x is a batched decode step's input ([B, 1, in], float32) the kernel takes."""
    return extension.one_token_rows(x, 3)


def _decode_rows(x: mx.array, weight: mx.array) -> mx.array | None:
    """`x @ weight.T` through the kernel when x is a batched decode step's input, else None."""
    if weight.dtype != mx.float32 or not serves_rows(x):
        return None
    assert extension.native is not None
    return extension.native.rows_matmul(x, weight)  # [B, 1, out]


def serves_lora(linear: nn.Module) -> bool:
    """Whether `lora_rows` takes this projection, for inputs `serves_rows` takes."""
    return (
        extension.native is not None
        and type(linear) is RowsLinear
        and "bias" not in linear
        and linear.weight.dtype == mx.float32
    )


def lora_rows(
    x: mx.array, linear: nn.Module, a_t: mx.array, b_t: mx.array, mask: mx.array
) -> mx.array:
    """`linear(x) + ((x @ a_t.T) * mask) @ b_t.T` for a batched decode step, in one kernel call
    (`serves_lora` and `serves_rows` say when): x [B, 1, in], a_t [R, in], b_t [out, R],
    mask [B, R] or [B, 1, R], each row's scale on each low-rank column. Where the base
    projection's weights are read, so are the low-rank pair's: one pass over the weights instead
    of three separate products."""
    assert extension.native is not None
    return extension.native.rows_matmul_lora(x, linear.weight, a_t, b_t, mask)  # [B, 1, out]


class RowsLinear(nn.Linear):
    """`nn.Linear` whose batched decode steps go through the kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _decode_rows(x, self.weight)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


class RowsEmbedding(nn.Embedding):
    """`nn.Embedding` whose use as the output layer (tied weights) does the same."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _decode_rows(x, self.weight)
        return super().as_linear(x) if y is None else y


class RowsRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` as one primitive, not MLX's ten, on float32: MLX's results to the bit, so
    every call takes it (a request alone and prefill too)."""

    def __call__(self, x: mx.array) -> mx.array:
        native = extension.native
        if native is not None and x.dtype == self.weight.dtype == mx.float32 and x.size:
            return native.rms_norm_rows(x, self.weight, self.eps)
        return super().__call__(x)


class RowsOffsetRMSNorm(nn.Module):
    """The Gemma families' RMSNorm, whose weight is stored less one (`rms_norm(x, 1 + w)`), as
    one primitive like `RowsRMSNorm`: the same `1.0 + weight` then the same norm, MLX's bits."""

    weight: mx.array
    eps: float

    def __call__(self, x: mx.array) -> mx.array:
        weight = 1.0 + self.weight
        native = extension.native
        if native is not None and x.dtype == weight.dtype == mx.float32 and x.size:
            return native.rms_norm_rows(x, weight, self.eps)
        return mx.fast.rms_norm(x, weight, self.eps)


class RowsRoPE(nn.RoPE):
    """`nn.RoPE` as one primitive, not MLX's thirty, on float32 [B, heads, L, D] with one
    position for all rows or one per row: MLX's results to the bit, so every call takes it."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if isinstance(offset, int) and -(2**31) <= offset < 2**31:
            offset = mx.array([offset], dtype=mx.int32)
        native = extension.native
        if (
            native is not None
            and x.ndim == 4
            and x.size
            and x.dtype == mx.float32
            and isinstance(offset, mx.array)
            and offset.dtype == mx.int32
            and offset.shape in ((1,), (x.shape[0],))
        ):
            return native.rope_rows(x, offset, self.dims, self.traditional, self.base, self.scale)
        return super().__call__(x, offset)  # type: ignore[arg-type]  # mlx-lm passes arrays


_ROWS_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: RowsLinear,
    nn.Embedding: RowsEmbedding,
    nn.RMSNorm: RowsRMSNorm,
    nn.RoPE: RowsRoPE,
    gemma.RMSNorm: RowsOffsetRMSNorm,
    gemma2.RMSNorm: RowsOffsetRMSNorm,
    gemma3_text.RMSNorm: RowsOffsetRMSNorm,
}


def mlx_layers(model: nn.Module) -> Counter[str]:
    """The model's layers with weights of their own that no Rows class serves, by class name
    (an MoE's expert layers, say): they run MLX's own operations."""
    rows_classes = set(_ROWS_CLASSES.values())
    kept: Counter[str] = Counter()
    for _, module in model.named_modules():
        if type(module) in rows_classes or "weight" not in module:
            continue
        kept[f"{type(module).__module__.rsplit('.', 1)[-1]}.{type(module).__name__}"] += 1
    return kept


def swap_layers(model: nn.Module) -> Counter[type[nn.Module]]:
    """Give the model's float layers their Rows class, in place; returns how many of each. The
    layers take the kernels once `extension.load` has succeeded."""
    swapped: Counter[type[nn.Module]] = Counter()
    for _, module in model.named_modules():
        rows_class = _ROWS_CLASSES.get(type(module))
        if rows_class is not None:
            module.__class__ = rows_class
            swapped[rows_class] += 1
    return swapped
