"""Which weights the CPU serves: quantized weights kept packed for the native kernels, a
float32 copy through BLAS, or the weights as loaded for MLX's own kernels.

MLX's CPU kernels for quantized and half-precision matmuls do not use BLAS: they are slow on
prompts and gain nothing from batching. The native kernels (`layers.PackedLinear`) read
the packed weights themselves, a fraction of a float32 copy's bytes, for every row count. So on
a machine without a GPU, `auto` keeps quantized weights packed when those kernels serve them
(`packed`); otherwise (half-precision weights, other quantizations, a CPU without AVX2) it
serves a float32 copy through BLAS (OpenBLAS where preloaded) when it fits a memory budget (half
the RAM unless set). With a GPU (Metal, CUDA) the weights stay as loaded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model

CpuWeights = Literal["auto", "packed", "float32", "mlx"]
_HALF = (mx.float16, mx.bfloat16)
KERNEL_BITS = (4, 8)
# Codes the kernels do not take, and the width each is repacked to: the same integer, so the
# same value under the group's scale and bias.
REPACKED_BITS = {1: 4, 2: 4, 3: 4, 5: 8, 6: 8}
_PACKED_KEYS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class WeightsChoice:
    """Whether the CPU serves a float32 copy of the weights, or keeps quantized ones packed for
    the native kernels (`packed`), and why; neither: the weights as loaded."""

    float32: bool
    reason: str
    packed: bool = False


def has_gpu() -> bool:
    """Whether MLX runs on a GPU here (Metal or CUDA)."""
    cuda = getattr(mx, "cuda", None)
    return bool(mx.metal.is_available() or (cuda is not None and cuda.is_available()))


def default_float_budget() -> int:
    """Half the machine's physical memory, in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def float32_bytes(model: nn.Module) -> int:
    """What the model's parameters take once dequantized to float32."""
    total = 0
    modules = cast(
        list[tuple[str, Any]], tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    )
    for _, module in modules:
        params = cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            rows, packed = module.weight.shape
            total += 4 * rows * (packed * 32 // module.bits)
            params = [(k, v) for k, v in params if k not in ("weight", "scales", "biases")]
        total += 4 * sum(v.size for _, v in params)
    return total


def _low_precision(model: nn.Module) -> str | None:
    """What makes the weights slow on the CPU: 'quantized', 'float16', ... or None."""
    for _, value in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())):
        if value.dtype == mx.uint32:
            return "quantized"
        if value.dtype in _HALF:
            return str(value.dtype).rsplit(".", 1)[-1]
    return None


def any_quantized(model: nn.Module) -> bool:
    """Whether any of the model's parameters is a quantized layer's packed codes."""
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return any(value.dtype == mx.uint32 for _, value in params)


def all_float32(model: nn.Module) -> bool:
    """Whether every parameter is float32 already (a float32 model directory, or after
    `to_float32`)."""
    return _low_precision(model) is None


def choose_cpu_weights(
    model: nn.Module,
    setting: CpuWeights,
    budget: int | None = None,
    *,
    unpacked: str | None = "the native kernels were not asked",
) -> WeightsChoice:
    """What `setting` means for this model on this machine; `unpacked`: why the native kernels
    cannot serve its quantized weights packed (None: they can)."""
    kind = _low_precision(model)
    if kind is None:
        return WeightsChoice(False, "the weights are float32 already")
    if setting == "mlx":
        return WeightsChoice(False, f"{kind} weights kept for MLX's kernels (--cpu-weights mlx)")
    size = float32_bytes(model)
    if setting == "float32":
        return WeightsChoice(True, f"--cpu-weights float32, {size / 1e6:.0f} MB")
    if has_gpu():
        return WeightsChoice(False, f"{kind} weights kept: MLX runs on a GPU here")
    if unpacked is None:
        return WeightsChoice(
            False,
            f"no GPU; {kind} weights kept packed ({packed_bytes(model) / 1e6:.0f} MB) for the "
            "native kernels",
            packed=True,
        )
    why = f"not packed: {unpacked}; " if setting == "packed" or kind == "quantized" else ""
    budget = default_float_budget() if budget is None else budget
    if size > budget:
        return WeightsChoice(
            False,
            f"{why}{kind} weights kept: a float32 copy ({size / 1e6:.0f} MB) exceeds the "
            f"{budget / 1e6:.0f} MB budget",
        )
    return WeightsChoice(
        True,
        f"{why}no GPU; {kind} weights as float32 take {size / 1e6:.0f} MB of the "
        f"{budget / 1e6:.0f} MB budget",
    )


def packed_bytes(model: nn.Module) -> int:
    """What the model's parameters take served packed: quantized arrays as they are (codes
    `repack` widens at their wider width, until interleaved), the other float parameters as
    float32."""
    total = 0
    modules = cast(
        list[tuple[str, Any]], tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    )
    for _, module in modules:
        quantized = isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
        for key, value in cast(list[tuple[str, mx.array]], tree_flatten(module.parameters())):
            kept = quantized and key in _PACKED_KEYS
            total += value.nbytes if kept else 4 * value.size
            if kept and key == "weight" and value.dtype == mx.uint32:  # not interleaved yet
                total += value.nbytes * (served_bits(module.bits) - module.bits) // module.bits
    return total


def served_bits(bits: int) -> int:
    """The bits a layer's codes are served at: 4 and 8 as they are, others as `REPACKED_BITS`."""
    return REPACKED_BITS.get(bits, bits)


def unpack_codes(weight: mx.array, bits: int) -> mx.array:
    """MLX's packed `bits`-bit codes (uint32 [..., cols * bits / 32]) as uint8 [..., cols].

    MLX fills every `bits` bytes with 8 codes, lowest bits first; a code spans at most two of
    those bytes, so each of the 8 is read from a 16-bit pair."""
    lead = weight.shape[:-1]
    raw = weight.view(mx.uint8).reshape(*lead, -1, bits)
    mask = (1 << bits) - 1
    codes = []
    for k in range(8):
        byte, shift = divmod(k * bits, 8)
        pair = raw[..., byte].astype(mx.uint16)
        if byte + 1 < bits:
            pair = pair | (raw[..., byte + 1].astype(mx.uint16) << 8)
        codes.append(((pair >> shift) & mask).astype(mx.uint8))
    return mx.stack(codes, axis=-1).reshape(*lead, -1)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """uint8 codes [..., cols] as MLX packs them at 4 or 8 bits (uint32 words)."""
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    elif bits != 8:
        raise ValueError(f"codes are packed here at 4 or 8 bits, not {bits}")
    return mx.contiguous(codes).view(mx.uint32)


@dataclass(frozen=True)
class Repacked:
    """What `repack` widened: the layers by (from, to) bits, and the bytes their codes took
    before and after."""

    layers: dict[tuple[int, int], list[str]]
    bytes_before: int
    bytes_after: int
    seconds: float = 0.0

    def describe(self) -> str:
        """'166 from 5 to 8 bits (codes +29 MB, 0.4 s)', or 'none'."""
        if not self.layers:
            return "none"
        parts = [f"{len(paths)} from {a} to {b} bits" for (a, b), paths in self.layers.items()]
        grown = (self.bytes_after - self.bytes_before) / 1e6
        return f"{', '.join(parts)} (codes +{grown:.0f} MB, {self.seconds:.1f} s)"


def half_float_layers(model: nn.Module) -> list[tuple[str, int]]:
    """The model's unquantized projections and embeddings whose weights are float16 or
    bfloat16, with the bytes each takes as float32: served beside packed layers, `to_packed`
    casts them to float32 copies (the float kernels read float32)."""
    return [
        (path, 4 * module.weight.size)
        for path, module in model.named_modules()
        if type(module) in (nn.Linear, nn.Embedding) and module.weight.dtype in _HALF
    ]


def _widens(module: nn.Module) -> bool:
    """Whether `repack` widens this layer: affine codes of a width the kernels do not take, in
    MLX's packing (an interleaved layer's 5 or 6 bits are a layout of the kernels' own)."""
    return (
        isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
        and getattr(module, "mode", "affine") == "affine"
        and module.bits in REPACKED_BITS
        and module.weight.dtype == mx.uint32
    )


def widened(model: nn.Module) -> int:
    """How many of the model's quantized layers `repack` widens."""
    return sum(_widens(module) for _, module in model.named_modules())


def repack(model: nn.Module) -> Repacked:
    """Widen every affine quantized layer's codes the kernels do not take to the width
    `REPACKED_BITS` names, in place, one layer at a time (each evaluated before the next, so at
    most one layer's intermediates exist); scales and biases stay as they are."""
    layers: dict[tuple[int, int], list[str]] = {}
    before = after = 0
    began = time.perf_counter()
    for path, module in model.named_modules():
        if not _widens(module):
            continue
        bits = module.bits
        wider = REPACKED_BITS[bits]
        old = module.weight
        module.weight = pack_codes(unpack_codes(old, bits), wider)
        module.bits = wider
        mx.eval(module.weight)
        before, after = before + old.nbytes, after + module.weight.nbytes
        layers.setdefault((bits, wider), []).append(path)
    return Repacked(layers, before, after, time.perf_counter() - began)


def to_packed(model: nn.Module) -> Repacked:
    """Widen the codes the kernels do not take (`repack`), and cast every float parameter but
    the quantized layers' packed weights, scales and biases to float32, in place; the packed
    arrays made row-contiguous, as the native kernels read them. Returns what was repacked."""
    repacked = repack(model)
    packed = _PACKED_KEYS
    for _, module in model.named_modules():
        quantized = isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
        for key, value in list(module.items()):
            if not isinstance(value, mx.array):
                continue
            if quantized and key in packed:
                module[key] = mx.contiguous(value)
            elif mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32:
                module[key] = value.astype(mx.float32)
    mx.eval(model.parameters())
    return repacked


def interleave_rows8(
    weight: mx.array, scales: mx.array, biases: mx.array, bits: int
) -> tuple[mx.array, mx.array, mx.array, int]:
    """A 4- or 8-bit layer's packed weight (uint32 [N, K * bits / 32], N a multiple of 8), scales
    and biases laid out for the integer products' interleaved kernel (`int8_rows8_range`,
    models/cpu/native/kernels/int8_matmul.h), and the bits of that layout: eight rows' block of 32
    codes `32 * bits` bytes together, one 32-bit lane a row: at 4 bits byte 32j + 4i + k holds
    row i's code 8j + k in its low half and its code 8j + 4 + k in its high half, at 8 bits row
    i's code 4j + k; the scales and biases [N, K / group], each group's eight rows side by side.
    8-bit codes all under 32 or 64 (5- and 6-bit ones widened by `repack`: a GGUF's Q5 layers,
    MLX's 5- and 6-bit models) take 5 or 6 bits: their low four bits as at 4 bits, then a plane
    of 32 bytes for each higher bit, byte 4i + k holding that bit of row i's code 4m + k in its
    bit m. Other 8-bit codes become int8 q - 128. The same codes: `deinterleave_rows8` undoes
    it. Made a few MB of rows at a time (`_by_rows`)."""
    layout = bits
    if bits == 8:
        top = cast(int, mx.max(weight.view(mx.uint8)).item())
        layout = 5 if top < 32 else 6 if top < 64 else 8
    packed = _by_rows(weight, lambda rows: _interleaved_codes(rows, bits, layout))
    n = weight.shape[0]
    return packed, _eights(scales, n), _eights(biases, n), layout


_INTERLEAVE_BYTES = 8 << 20  # the rows of a layer changed at once


def _by_rows(weight: mx.array, change: Callable[[mx.array], mx.array]) -> mx.array:
    """`change` of the weight's rows (N a multiple of 8) a few MB at a time, each part evaluated
    before the next, so that a large layer (an output head) takes little more memory than
    itself while it changes layout."""
    n, row_bytes = weight.shape[0], weight.shape[1] * weight.itemsize
    step = max(8, (_INTERLEAVE_BYTES // row_bytes) // 8 * 8)
    parts = []
    for at in range(0, n, step):
        part = change(weight[at : at + step])
        mx.eval(part)
        parts.append(part)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def _interleaved_codes(weight: mx.array, bits: int, layout: int) -> mx.array:
    """`interleave_rows8`'s codes for rows of a layer (a multiple of 8 of them) at `bits`, laid
    out at `layout` bits."""
    n = weight.shape[0]
    k = weight.shape[1] * 32 // bits
    packed = weight.view(mx.uint8)  # 4 bits: codes 2p and 2p + 1 in byte p's halves
    if bits == 4:
        packed = mx.stack([packed & 15, packed >> 4], axis=-1)
    codes = packed.reshape(n // 8, 8, k // 32, 8, 4).transpose(0, 2, 3, 1, 4)  # G, b, m, i, k
    if layout == 8:  # some code of the layer 64 or more
        return (codes.reshape(n, k) ^ 0x80).view(mx.int8)
    nibbles = (codes[:, :, 0::2] & 15) | ((codes[:, :, 1::2] & 15) << 4)  # G, b, j, i, k
    blocks = [nibbles.reshape(n // 8, k // 32, 128)]
    m = mx.arange(8, dtype=mx.uint8).reshape(8, 1, 1)  # a plane byte's bit m: code 4m + k's
    for p in range(layout - 4):  # each plane's bytes [G, b, i, k]
        plane = (((codes >> (4 + p)) & 1) << m).sum(axis=2).astype(mx.uint8)
        blocks.append(plane.reshape(n // 8, k // 32, 32))
    return mx.concatenate(blocks, axis=-1).reshape(n, k * layout // 8)


def deinterleave_rows8(
    weight: mx.array, scales: mx.array, biases: mx.array, bits: int
) -> tuple[mx.array, mx.array, mx.array, int]:
    """`interleave_rows8` undone: MLX's packing of the same codes, scales and biases, and its
    bits (8 for the 5- and 6-bit layouts); a few MB of rows at a time, as it was made."""
    packed = _by_rows(weight, lambda rows: _deinterleaved_codes(rows, bits))
    n = weight.shape[0]
    return packed, _rows(scales, n), _rows(biases, n), 4 if bits == 4 else 8


def _deinterleaved_codes(weight: mx.array, bits: int) -> mx.array:
    """`deinterleave_rows8`'s codes for rows of a layer (a multiple of 8 of them), packed as MLX
    packs them at 4 bits, or at 8 for the 5-, 6- and 8-bit layouts."""
    n = weight.shape[0]
    k = weight.shape[1] * 8 // bits
    if bits == 8:
        codes = (weight.view(mx.uint8) ^ 0x80).reshape(n // 8, k // 32, 8, 8, 4)  # G, b, m, i, k
    else:
        blocks = weight.reshape(n // 8, k // 32, 32 * bits)
        nibbles = blocks[..., :128].reshape(n // 8, k // 32, 4, 1, 8, 4)  # G, b, j, h, i, k
        codes = mx.concatenate([nibbles & 15, nibbles >> 4], axis=3)
        codes = codes.reshape(n // 8, k // 32, 8, 8, 4)  # m = 2j + h
        m = mx.arange(8, dtype=mx.uint8).reshape(8, 1, 1)
        for p in range(bits - 4):
            plane = blocks[..., 128 + 32 * p : 160 + 32 * p].reshape(n // 8, k // 32, 1, 8, 4)
            codes = codes | (((plane >> m) & 1) << (4 + p))
    return pack_codes(codes.transpose(0, 3, 1, 2, 4).reshape(n, k), 4 if bits == 4 else 8)


def _eights(params: mx.array, n: int) -> mx.array:
    """Scales or biases [N, groups] with each group's eight rows side by side."""
    return params.reshape(n // 8, 8, -1).transpose(0, 2, 1).reshape(n, -1)


def _rows(params: mx.array, n: int) -> mx.array:
    """`_eights` undone: a row's scales or biases together again."""
    return params.reshape(n // 8, -1, 8).transpose(0, 2, 1).reshape(n, -1)


def to_float32(model: nn.Module) -> None:
    """Dequantize every quantized layer and cast every float parameter to float32, in place."""
    dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
