"""Per-row attention masks for architectures whose attention does not broadcast them itself.

A batched call of left-padded rows passes each layer a per-row mask `[B, 1, L, S]`. gemma2's
attention (mlx-lm's `gemma2.py`) groups the query heads sharing a KV head as scores
`[B, n_kv_heads, repeats, L, S]` and applies the mask to them as given: broadcast against
those, a `[B, 1, L, S]` mask lines its batch axis up with the KV heads, so a batch of as many
rows as KV heads gets other rows' masks and other rows fail to broadcast. `install_row_masks`
swaps such attention modules' classes for subclasses that give the mask the scores' layout
`[B, 1, 1, L, S]`; mlx-lm's files and the weights are untouched.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2

from hotlora.models.module_classes import swap_classes


class _Gemma2RowMasks(gemma2.Attention):
    """gemma2's attention with a per-row mask laid out as its grouped scores."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4 and self.repeats > 1:
            mask = mx.expand_dims(mask, 2)  # [B, 1, L, S] -> [B, 1, 1, L, S]
        return super().__call__(x, mask, cache)


_ROW_MASKS: dict[type[nn.Module], type[nn.Module]] = {gemma2.Attention: _Gemma2RowMasks}


def install_row_masks(model: nn.Module) -> int:
    """Give the model's attention modules that need it the per-row mask layout of their scores;
    returns how many modules changed (0 for architectures that broadcast the mask themselves)."""
    return sum(swap_classes(model, _ROW_MASKS).values())
