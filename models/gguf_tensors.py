"""GGUF tensor data as MLX arrays, one tensor at a time: floats as stored, quantized blocks as
MLX affine triplets (`weight` uint32, `scales`, `biases`; group size 32).

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K hold each 32 values as `scale * q + bias` with
one scale and one bias, which is MLX's affine quantization at 4, 5 or 8 bits: their codes are
repacked as they are, so dequantizing the triplet gives what llama.cpp dequantizes. Q6_K, Q3_K
and Q2_K give every 16 values a scale of their own, which no MLX group size (32, 64, 128)
expresses; they are dequantized and quantized again to 8 bits, a slice of rows at a time, so no
float copy of more than that slice exists.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

Q = GGMLQuantizationType
GROUP_SIZE = 32
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# Types whose blocks are MLX affine groups of 32, and the bits each takes.
EXACT_BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q5_K: 5}
# Types with 16-value sub-blocks, requantized. 8 bits rather than 4: a 4-bit grid's half step (a
# group's range / 30) is about four times Q6_K's own rounding and half Q3_K's; 8 bits' is 1/17.
REQUANTIZED_BITS = {Q.Q6_K: 8, Q.Q3_K: 8, Q.Q2_K: 8}
SUPPORTED_TYPES = (*FLOAT_TYPES, *EXACT_BITS, *REQUANTIZED_BITS)
# Rows are converted in slices of about this many values, to bound the float intermediates.
SLICE_VALUES = 1 << 22


def tensor_bytes(kind: int, shape: tuple[int, ...]) -> int:
    """The size in the file of a tensor of GGUF type `kind` and numpy-order `shape`."""
    block, size = GGML_QUANT_SIZES[Q(kind)]
    return math.prod(shape) // block * size


def read_tensor(raw: np.ndarray, kind: int, shape: tuple[int, ...]) -> tuple[mx.array, ...]:
    """Convert one tensor's bytes (`raw`, uint8) into `(weight,)` for a float type or
    `(weight, scales, biases)` for a quantized one; `shape` in numpy order (rows first)."""
    kind = Q(kind)
    if kind == Q.F32:
        return (mx.array(raw.view("<f4").reshape(shape)),)
    if kind == Q.F16:
        return (mx.array(raw.view("<f2").reshape(shape)),)
    if kind == Q.BF16:
        # mx.array has no bfloat16 numpy source: carry the bits as uint16 and reinterpret.
        return (mx.array(raw.view("<u2").reshape(shape)).view(mx.bfloat16),)
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    convert = _repack if kind in EXACT_BITS else _requantize
    row_bytes = len(raw) // rows
    step = max(1, SLICE_VALUES // cols)
    parts = [
        convert(raw[start * row_bytes : (start + step) * row_bytes], kind, cols)
        for start in range(0, rows, step)
    ]
    weight, scales, biases = (np.concatenate(p) for p in zip(*parts, strict=True))
    lead = shape[:-1]
    return (
        mx.array(weight.reshape(*lead, -1)),
        mx.array(scales.reshape(*lead, -1)),
        mx.array(biases.reshape(*lead, -1)),
    )


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing of `bits`-bit codes: every 8 values fill `bits` bytes, lowest bits first.

    `q` is uint8 [rows, cols]; the result is uint32 [rows, cols * bits / 32].
    """
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(q[:, 0::2] | q[:, 1::2] << 4).view(np.uint32)
    eights = q.reshape(rows, cols // 8, 8)
    words = np.zeros((rows, cols // 8), np.uint64)
    for k in range(8):
        words |= eights[..., k].astype(np.uint64) << np.uint64(k * bits)
    packed = words.view(np.uint8).reshape(rows, cols // 8, 8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)


def _blocks(raw: np.ndarray, kind: Q) -> np.ndarray:
    return raw.reshape(-1, GGML_QUANT_SIZES[kind][1])


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)  # [n_blocks, 1]


def _repack(raw: np.ndarray, kind: Q, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scales and biases of whole rows, read from the blocks without rounding.

    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 scales are float16 in the file and stay so; a K-quant's are the
    product of a float16 and a 6-bit integer, which float32 holds exactly and float16 does not.
    """
    blocks = _blocks(raw, kind)
    n = len(blocks)
    q: np.ndarray  # codes, uint8
    dtype: type[np.floating[Any]]
    if kind == Q.Q8_0:
        d = _f16(blocks[:, :2])
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scales, biases, dtype = d, -128 * d, np.float16
    elif kind in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        d = _f16(blocks[:, :2])
        offset = kind in (Q.Q4_1, Q.Q5_1)  # a float16 bias after d, not a fixed code offset
        qs = blocks[:, -16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # value j low, value j + 16 high
        if kind in (Q.Q5_0, Q.Q5_1):
            # 4 bytes before the nibbles: bit i (little-endian) is the top bit of value i.
            at = 4 if offset else 2
            q |= np.unpackbits(blocks[:, at : at + 4], axis=-1, bitorder="little") << 4
        middle = 2 ** (EXACT_BITS[kind] - 1)
        biases = _f16(blocks[:, 2:4]) if offset else -middle * d
        scales, dtype = d, np.float16
    else:  # Q4_K, Q5_K: a 256-value super-block of eight 32-value sub-blocks
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] each
        qs = blocks[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        q = (qs & 0x0F).reshape(n, 8, 32)  # each 32 bytes: low nibbles, then high nibbles
        if kind == Q.Q5_K:
            qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = q | ((qh & 1) << 4)  # bit i of byte l is the top bit of value 32 * i + l
        scales, biases, dtype = d * sc, -(dmin * m), np.float32
    bits = EXACT_BITS[kind]
    weight = pack(q.reshape(-1, cols), bits)
    return (
        weight,
        scales.astype(dtype).reshape(-1, cols // GROUP_SIZE),
        biases.astype(dtype).reshape(-1, cols // GROUP_SIZE),
    )


def _requantize(raw: np.ndarray, kind: Q, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole rows dequantized as llama.cpp does, then put on each 32-value group's own grid from
    its minimum to its maximum in 255 steps (float32 scales): no value moves more than half a
    step. (`mx.quantize` keeps the larger edge exact instead, which can cost a whole step.)"""
    bits = REQUANTIZED_BITS[kind]
    values = dequantize(_blocks(raw, kind), kind).reshape(-1, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = values.min(-1, keepdims=True), values.max(-1, keepdims=True)  # [rows, groups, 1]
    scales = (high - low) / (2**bits - 1)
    q = np.clip(np.round((values - low) / np.where(scales > 0, scales, 1)), 0, 2**bits - 1)
    weight = pack(q.astype(np.uint8).reshape(-1, cols), bits)
    groups = cols // GROUP_SIZE
    return weight, scales.reshape(-1, groups), low.reshape(-1, groups)
