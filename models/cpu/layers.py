"""The model's layers on the native CPU kernels: projections, tied output layer, norms, RoPEs.

OpenBLAS packs the whole weight matrix into blocks on every call, whatever the row count, so a
projection of a few rows costs several times its 1-row product. The extension's `rows_matmul`
reads each weight row from memory once, straight into registers, and multiplies every row of x
by it while it is there. Each output is one dot product summed in a fixed order, so a row's
result does not depend on the rest of the batch. It differs from BLAS in the last bits, so it
serves only batched calls of one token per row (`[B, 1, K]` inputs, 2 <= B <= the kernels' most
rows): decode steps, and a batched prefill whose chunks are all one token long. A request
alone, and every longer prefill, keep BLAS and mlx-lm's results to the bit.

The model's RMSNorms and RoPEs take one primitive each (`NativeRMSNorm`, `NativeRoPE`): MLX's CPU
backend composes them from ten to thirty small operations, each of which costs more to schedule
than to compute at a few rows, and they were most of a decode step's graph. Each computes MLX's
composition operation for operation, with MLX's own exp, sin and cos, so its results are MLX's
to the bit: every float32 call takes it, a request decoding alone and prefill included.

Quantized weights (MLX's affine mode, 4 or 8 bits; other bits widened to those at load by
`weights.repack`, and 5- and 6-bit codes laid out at 5 and 6 bits again where the integer
products interleave them, `weights.interleave_rows8`) stay packed: `PackedLinear` and
`PackedEmbedding` (the lookup and a tied output layer) send every call, whatever its row
count, through the extension's `quant_matmul`, which dequantizes a tile of weight rows at a time
in cache and gives each output one fixed-order sum. A row's result is then the same bits alone,
in any batch and in any chunking of its prompt; the float layers of such a model take the float
kernel on every call (`BatchInvariantLinear`, `BatchInvariantEmbedding`) for the same reason.

`swap_layers` changes the modules' classes in place; their weights are untouched.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma, gemma2, gemma3_text

from hotlora.models.cpu import extension
from hotlora.models.cpu.changes import Watched, changed
from hotlora.models.cpu.weights import (
    KERNEL_BITS,
    deinterleave_rows8,
    interleave_rows8,
    served_bits,
)
from hotlora.models.module_classes import swap_classes


def decode_step(x: mx.array) -> bool:
    """Whether the float kernel takes x for a batch-dependent layer: a batched decode step's
    input ([B, 1, in], float32, the kernels loaded)."""
    return extension.one_token_rows(x, 3)


def float32_input(x: mx.array) -> bool:
    """Whether the kernels take x for a layer they serve on every call: any float32 input."""
    return extension.native is not None and x.dtype == mx.float32 and x.size > 0


def _decode_rows(x: mx.array, weight: mx.array) -> mx.array | None:
    """`x @ weight.T` through the kernel when x is a batched decode step's input, else None."""
    if weight.dtype != mx.float32 or not decode_step(x):
        return None
    assert extension.native is not None
    return extension.native.rows_matmul(x, weight)  # [B, 1, out]


LoRAKernel = Literal["lora_gather", "lora_rows"]


def lora_kernel(linear: nn.Module) -> LoRAKernel | None:
    """Which native kernel adds LoRA residuals to this projection's product, from its kind:
    `lora_gather` for packed quantized weights, `lora_rows` for float32 weights without a bias
    (for the inputs the layer's `takes` accepts); None: MLX's own operations. Asked once, when
    the LoRA slots are installed: a layer's kind does not change while it serves."""
    if extension.native is None:
        return None
    if type(linear) is PackedLinear:
        return "lora_gather"
    if (
        type(linear) in (NativeLinear, BatchInvariantLinear)
        and "bias" not in linear
        and linear.weight.dtype == mx.float32
    ):
        return "lora_rows"
    return None


def lora_rows(
    x: mx.array, linear: nn.Module, a_t: mx.array, b_t: mx.array, mask: mx.array
) -> mx.array:
    """`linear(x) + ((x @ a_t.T) * mask) @ b_t.T` for a batched decode step, in one kernel call
    (`lora_kernel` and the layer's `takes` say when): x [B, 1, in], a_t [R, in], b_t [out, R],
    mask [B, R] or [B, 1, R], each row's scale on each low-rank column. Where the base
    projection's weights are read, so are the low-rank pair's: one pass over the weights
    instead of three separate products."""
    assert extension.native is not None
    mask = mx.broadcast_to(mask, (*x.shape[:-1], mask.shape[-1]))  # a row's scales, each token
    return extension.native.rows_matmul_lora(x, linear.weight, a_t, b_t, mask)  # [B, 1, out]


def lora_gather(x: mx.array, linear: nn.Module, plan: object, slot: int) -> mx.array:
    """`linear(x)` plus each row's own adapters' residuals at one LoRA slot, for packed
    quantized weights (`lora_kernel`), any number of tokens a row: x [S, L, in] or
    [L, in] (S = 1). `plan`: the extension's `row_plan` of the batch (its adapters' pairs, each
    once, and each row's entries, in order, with their scales); `slot`: the slot's number in
    those pairs. A row computes its own entries only, in order: its bits depend on its own
    adapters alone."""
    assert extension.native is not None
    y = extension.native.quant_matmul_gather(
        x,
        linear.weight,
        linear.scales,
        linear.biases,
        linear.group_size,
        linear.bits,
        plan,
        slot,
        linear.int8_parts,
    )
    return y + linear.bias if "bias" in linear else y


class NativeLinear(nn.Linear):
    """`nn.Linear` whose batched decode steps go through the kernel."""

    def takes(self, x: mx.array) -> bool:
        """Whether the kernels take x as this layer's input: a batched decode step's."""
        return decode_step(x)

    def __call__(self, x: mx.array) -> mx.array:
        y = _decode_rows(x, self.weight)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


class NativeEmbedding(nn.Embedding):
    """`nn.Embedding` whose use as the output layer (tied weights) does the same."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _decode_rows(x, self.weight)
        return super().as_linear(x) if y is None else y


class BatchInvariantLinear(NativeLinear):
    """`nn.Linear` of a model served by the quantized kernels: every call through the float
    kernel, so that its rows too give the same bits in any batch."""

    def takes(self, x: mx.array) -> bool:
        """Whether the kernels take x as this layer's input: any float32 input."""
        return float32_input(x)

    def __call__(self, x: mx.array) -> mx.array:
        if not (float32_input(x) and self.weight.dtype == mx.float32):
            return super().__call__(x)
        assert extension.native is not None
        y = extension.native.rows_matmul(x, self.weight)
        return y + self.bias if "bias" in self else y


class BatchInvariantEmbedding(NativeEmbedding):
    """`nn.Embedding` of such a model, whose use as the output layer does the same."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not (float32_input(x) and self.weight.dtype == mx.float32):
            return super().as_linear(x)
        assert extension.native is not None
        return extension.native.rows_matmul(x, self.weight)


def _quant_rows(x: mx.array, layer: PackedLinear | PackedEmbedding) -> mx.array:
    assert extension.native is not None
    return extension.native.quant_matmul(
        x,
        layer["weight"],  # items, not attributes: a failed attribute lookup first costs ~2 us
        layer["scales"],
        layer["biases"],
        layer.group_size,
        layer.bits,
        layer.int8_parts,
    )


class Interleaving(nn.Module):
    """What a packed layer does to take the interleaved integer kernel: its codes laid out by
    `weights.interleave_rows8`, or back as MLX packs them."""

    bits: int

    @property
    def interleaved(self) -> bool:
        """Whether the codes are laid out for the interleaved integer kernel (uint8 or int8: MLX's
        own operations refuse them, nothing reads them as MLX's packing by mistake)."""
        return self["weight"].dtype in (mx.uint8, mx.int8)

    def interleave(self, on: bool) -> None:
        """Lay the codes out for the interleaved integer kernel, or back as MLX packs them; a
        layer the kernel does not take in that layout (not 4 or 8 bits, rows not in eights, no
        such kernel here) keeps MLX's. `bits` follows the layout: 8-bit codes all under 32 or
        64 (5- and 6-bit ones widened at load: a GGUF's Q5 layers, MLX's 5- and 6-bit models)
        are laid out at 5 or 6 bits, and back at 8."""
        native = extension.native
        if on == self.interleaved or (
            on
            and (
                native is None
                or not native.interleaves()
                or self.bits not in (4, 8)
                or self["weight"].shape[0] % 8
            )
        ):
            return
        change = interleave_rows8 if on else deinterleave_rows8
        *packed, self.bits = change(self["weight"], self["scales"], self["biases"], self.bits)
        for key, value in zip(("weight", "scales", "biases"), packed, strict=True):
            self[key] = mx.contiguous(value)
        mx.eval(self["weight"], self["scales"], self["biases"])
        mx.clear_cache()  # the buffers it was made in, back to the system before the next layer


class PackedLinear(nn.QuantizedLinear, Interleaving, Watched):
    """`nn.QuantizedLinear` whose every float32 call goes through the quantized kernel: each
    row's activations quantized to int8 in blocks of 32, `int8_parts` codes a value (1 at
    `--cpu-precision fast`, 3 at `exact`), and integer dot products; with none, float32 products
    with the dequantized weights."""

    int8_parts = 0  # set per layer by `set_cpu_precision`

    def takes(self, x: mx.array) -> bool:
        """Whether the kernels take x as this layer's input: any float32 input."""
        return float32_input(x)

    def fused_layer(self) -> PackedLinear | None:
        """The packed layer of a fused product (`fused.FusedProjection`): itself; None with a
        bias, which the fused kernel does not add."""
        return None if "bias" in self else self

    def fused_residuals(self, x: mx.array) -> None:
        """No residuals to add (`fused.FusedProjection`)."""
        return None

    @staticmethod
    def active_residuals() -> None:
        """None ever (`fused.FusedProjection`)."""
        return None

    def __call__(self, x: mx.array) -> mx.array:
        if not float32_input(x):
            if not self.interleaved:
                return super().__call__(x)
            if x.size == 0:
                return mx.zeros((*x.shape[:-1], self["weight"].shape[0]), dtype=x.dtype)
            return self(x.astype(mx.float32)).astype(x.dtype)
        y = _quant_rows(x, self)
        return y + self.bias if "bias" in self else y


class PackedEmbedding(nn.QuantizedEmbedding, Interleaving):
    """`nn.QuantizedEmbedding` whose lookup gives float32 rows (dequantized as MLX does, in
    float32) and whose use as the output layer goes through the quantized kernel (int8
    activations as `PackedLinear`'s)."""

    int8_parts = 0  # set per layer by `set_cpu_precision`

    def __call__(self, x: mx.array) -> mx.array:
        assert self.biases is not None  # the affine mode's
        native = extension.native
        if native is not None and (self.bits in (4, 8) or self.interleaved):  # mx.dequantize's rows
            ids = x if x.dtype in (mx.int32, mx.uint32, mx.int64) else x.astype(mx.int32)
            return native.packed_lookup(
                ids, self.weight, self.scales, self.biases, self.group_size, self.bits
            )
        assert not self.interleaved  # nothing is interleaved without the kernels
        return mx.dequantize(
            self.weight[x],
            self.scales[x].astype(mx.float32),
            self.biases[x].astype(mx.float32),
            group_size=self.group_size,
            bits=self.bits,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        if not float32_input(x):
            return super().as_linear(x)
        return _quant_rows(x, self)


# `--cpu-precision`: int8 activations and integer dot products, each value one int8 code (fast) or
# three int8 parts (exact: about float32's precision, models/cpu/native/kernels/types.h); or
# float32 activations times the dequantized weights' float32 values (float32).
CpuPrecision = Literal["fast", "exact", "float32"]

# Each precision's int8 parts a value of the activations (0: float32 products).
INT8_PARTS: dict[CpuPrecision, int] = {"fast": 1, "exact": 3, "float32": 0}


def set_cpu_precision(model: nn.Module, precision: CpuPrecision) -> int:
    """Make every packed layer of the model take `precision`'s products; returns how many.
    One precision for the whole model, set before it serves: a row's bits then depend on its
    own values alone, as on each path. On int8 activations the 4- and 8-bit layers whose rows
    come in eights take the interleaved layout where the kernel reads it (`interleave_rows8`:
    the same bytes, about half the operations a weight); float32 ones take MLX's packing back."""
    parts = INT8_PARTS[precision]
    layers = [m for _, m in model.named_modules() if isinstance(m, PackedLinear | PackedEmbedding)]
    for layer in layers:
        layer.int8_parts = parts
        layer.interleave(parts > 0)
    return len(layers)


def narrowed(model: nn.Module) -> str:
    """'; laid out again for the integer products: 166 at 5 bits, codes -29 MB': the layers
    whose 8-bit codes, all under 32 or 64, take that width again interleaved
    (`Interleaving.interleave`), or ''."""
    layers = [
        m
        for _, m in model.named_modules()
        if isinstance(m, Interleaving) and m.interleaved and m.bits in (5, 6)
    ]
    if not layers:
        return ""
    counts = Counter(m.bits for m in layers)
    widths = ", ".join(f"{count} at {bits} bits" for bits, count in sorted(counts.items()))
    saved = sum(m["weight"].size * (8 - m.bits) // m.bits for m in layers)
    return f"; laid out again for the integer products: {widths}, codes -{saved / 1e6:.0f} MB"


class NativeRMSNorm(nn.RMSNorm, Watched):
    """`nn.RMSNorm` as one primitive, not MLX's ten, on float32: MLX's results to the bit, so
    every call takes it (a request alone and prefill too)."""

    def __call__(self, x: mx.array) -> mx.array:
        native = extension.native
        weight = self["weight"]  # an item: see `_quant_rows`
        if native is not None and x.dtype == weight.dtype == mx.float32 and x.size:
            return native.rms_norm_rows(x, weight, self.eps)
        return super().__call__(x)


class NativeOffsetRMSNorm(nn.Module):
    """The Gemma families' RMSNorm, whose weight is stored less one (`rms_norm(x, 1 + w)`), as
    one primitive like `NativeRMSNorm`: the same `1.0 + weight` then the same norm, MLX's bits."""

    weight: mx.array
    eps: float

    def __call__(self, x: mx.array) -> mx.array:
        weight = 1.0 + self.weight
        native = extension.native
        if native is not None and x.dtype == weight.dtype == mx.float32 and x.size:
            return native.rms_norm_rows(x, weight, self.eps)
        return mx.fast.rms_norm(x, weight, self.eps)


class NativeRoPE(nn.RoPE, Watched):
    """`nn.RoPE` as one primitive, not MLX's thirty, on float32 [B, heads, L, D] with one
    position for all rows or one per row: MLX's results to the bit, so every call takes it."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        native = extension.native
        if native is not None and x.ndim == 4 and x.size and x.dtype == mx.float32:
            positions = self.positions(offset, x.shape[0])
            if positions is not None:
                return native.rope_rows(
                    x, positions, self.dims, self.traditional, self.base, self.scale
                )
        return super().__call__(x, offset)  # type: ignore[arg-type]  # mlx-lm passes arrays

    @staticmethod
    def positions(offset: int | mx.array, batch: int) -> mx.array | None:
        """The native kernels' positions for `batch` rows at `offset`: int32, one for all rows
        or one per row; None where they do not take it."""
        if isinstance(offset, int) and -(2**31) <= offset < 2**31:
            return mx.array([offset], dtype=mx.int32)
        if (
            isinstance(offset, mx.array)
            and offset.dtype == mx.int32
            and offset.shape in ((1,), (batch,))
        ):
            return offset
        return None


_ROWS_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: NativeLinear,
    nn.Embedding: NativeEmbedding,
    nn.RMSNorm: NativeRMSNorm,
    nn.RoPE: NativeRoPE,
    gemma.RMSNorm: NativeOffsetRMSNorm,
    gemma2.RMSNorm: NativeOffsetRMSNorm,
    gemma3_text.RMSNorm: NativeOffsetRMSNorm,
}


_ALL_ROWS_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: BatchInvariantLinear,
    nn.Embedding: BatchInvariantEmbedding,
    nn.QuantizedLinear: PackedLinear,
    nn.QuantizedEmbedding: PackedEmbedding,
    nn.RMSNorm: NativeRMSNorm,
    nn.RoPE: NativeRoPE,
    gemma.RMSNorm: NativeOffsetRMSNorm,
    gemma2.RMSNorm: NativeOffsetRMSNorm,
    gemma3_text.RMSNorm: NativeOffsetRMSNorm,
}


def quantized_unserved(model: nn.Module) -> str | None:
    """Why the quantized kernels cannot serve this model's quantized layers; None when they
    can (MLX's affine mode, 4 or 8 bits or bits `weights.repack` widens to those, groups of 32,
    64 or 128, float scales)."""
    for path, module in model.named_modules():
        if type(module) not in (nn.QuantizedLinear, nn.QuantizedEmbedding):
            if "scales" in module:  # another kind of quantized layer (e.g. experts')
                return f"{path} is a quantized {type(module).__name__}"
            continue
        mode = getattr(module, "mode", "affine")
        if (
            mode != "affine"
            or served_bits(module.bits) not in KERNEL_BITS
            or module.group_size not in (32, 64, 128)
            or module.scales.dtype not in (mx.float32, mx.float16, mx.bfloat16)
        ):
            return (
                f"{path} is quantized as {mode}, {module.bits} bits, groups of "
                f"{module.group_size}: the kernels take affine 1-6 or 8 bits (4 and 8 as they "
                "are, the others widened to 4 or 8 at load), groups of 32-128"
            )
    return None


def mlx_layers(model: nn.Module) -> Counter[str]:
    """The model's layers with weights of their own that no native class serves, by class name
    (an MoE's expert layers, say): they run MLX's own operations."""
    rows_classes = set(_ROWS_CLASSES.values()) | set(_ALL_ROWS_CLASSES.values())
    kept: Counter[str] = Counter()
    for _, module in model.named_modules():
        if type(module) in rows_classes or "weight" not in module:
            continue
        kept[f"{type(module).__module__.rsplit('.', 1)[-1]}.{type(module).__name__}"] += 1
    return kept


def swap_layers(model: nn.Module, all_rows: bool = False) -> Counter[type[nn.Module]]:
    """Give the model's layers their native class, in place; returns how many of each. The
    layers take the kernels once `extension.load` has succeeded. `all_rows`: the classes of a
    model whose quantized weights the kernels serve, every call of every layer."""
    swapped = swap_classes(model, _ALL_ROWS_CLASSES if all_rows else _ROWS_CLASSES)
    changed()  # the classes swapped were not watched: a kept decoder layer's arguments go
    return swapped
