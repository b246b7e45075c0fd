"""Q4_K, Q5_K and Q6_K blocks written from float weights in ggml's byte layout (gguf-py can
dequantize these types but not quantize them).

The rounding is the plain one (each sub-block's range on the grid), not llama.cpp's search for
the best scales: the layout is what an importer reads, and `gguf.quants.dequantize` of the
bytes is the reference either way.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

QK_K = 256


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the float16 bytes [n, 2], the float32 value they hold [n, 1])."""
    half = x.astype(np.float16).reshape(-1, 1)
    return half.view(np.uint8), half.astype(np.float32)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins [n, 8] into 12 bytes, as ggml's get_scale_min_k4
    reads them: bytes 0-3 and 4-7 hold sub-blocks 0-3 and the top bits of 4-7, 8-11 the rest."""
    low = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6], 1)
    return np.concatenate([low, (sc[:, 4:] & 0x0F) | (m[:, 4:] & 0x0F) << 4], 1).astype(np.uint8)


def _affine_k(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's `d * sc * q - dmin * m` per 32-value sub-block of 256-value super-blocks.

    Returns (d bytes, dmin bytes, packed scales, codes [n, 256] uint8).
    """
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [n, sub-block, value]
    low = np.minimum(x.min(-1), 0)  # the bias -dmin * m cannot be positive
    scale, offset = (x.max(-1) - low) / levels, -low  # [n, 8]
    d_bytes, d = _f16(scale.max(-1) / 63)
    dmin_bytes, dmin = _f16(offset.max(-1) / 63)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(offset / np.where(dmin > 0, dmin, 1)), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]  # [n, 8, 1]
    q = np.round((x + (dmin * m)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(-1, QK_K)
    return d_bytes, dmin_bytes, _pack_scales(sc, m), q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """128 bytes per super-block: byte 32j + l holds value 64j + l low, 64j + 32 + l high."""
    q = q.reshape(-1, 4, 2, 32) & 0x0F
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)


def q4_k(w: np.ndarray) -> np.ndarray:
    """144 bytes per 256 values: d, dmin (float16), 12 bytes of scales, 128 of 4-bit codes."""
    d, dmin, scales, q = _affine_k(w, 15)
    return np.concatenate([d, dmin, scales, _nibbles(q)], 1)


def q5_k(w: np.ndarray) -> np.ndarray:
    """176 bytes per 256 values: as Q4_K, with 32 bytes of fifth bits before the nibbles."""
    d, dmin, scales, q = _affine_k(w, 31)
    high = (q.reshape(-1, 8, 32) >> 4).astype(np.uint8)  # [n, sub-block, l]
    qh = (high << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(1, dtype=np.uint8)
    return np.concatenate([d, dmin, scales, qh, _nibbles(q)], 1)


def q6_k(w: np.ndarray) -> np.ndarray:
    """210 bytes per 256 values: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
    scales (one per 16 values), d (float16); a value is `d * scale * (q - 32)`."""
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [n, sub-block, value]
    scale = np.abs(x).max(-1) / 31  # [n, 16]
    d_bytes, d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)), -128, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = np.clip(np.round(x / np.where(step > 0, step, 1)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, QK_K)
    low = (q & 0x0F).reshape(-1, 2, 2, 64)  # [n, half, nibble, l]: value 128h + 64k + l
    ql = (low[:, :, 0] | low[:, :, 1] << 4).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)  # [n, half, pair, l]: value 128h + 32s + l
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    qh = (high << shifts).sum(2, dtype=np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], 1)


ENCODERS = {Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k}


def quantize_k(w: np.ndarray, kind: Q) -> np.ndarray:
    """`w` [rows, cols] (cols a multiple of 256) as GGUF stores it for K-quant `kind`:
    uint8 [rows, bytes per row]."""
    rows = w.shape[0]
    return ENCODERS[kind](w).reshape(rows, -1)
