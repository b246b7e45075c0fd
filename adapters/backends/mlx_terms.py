"""LoRA residuals in MLX's own operations: the backend of MLX's layers, the GPU included.

A set alone adds its own terms (`AdapterSet.apply`: one pair per adapter, a stack fused into
one) in mlx-lm's `LoRALinear` form. A set per row adds the side-by-side pair of the batch's
adapters, masked per row (`side_by_side.MaskedRows`): two dense products per slot whatever the
number of sets. No fused kernel takes these layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_set import AdapterSet
from hotlora.adapters.backends.base import Gather
from hotlora.adapters.backends.side_by_side import add_residuals

if TYPE_CHECKING:
    from hotlora.adapters.backends.per_row import RowAdapters


class MLXTerms:
    """The residual backend of MLX's own layers: per-set terms, or the masked side-by-side pair
    for a set per row."""

    name = "mlx"
    fuses = False

    def project_set(
        self, path: str, base: nn.Module, adapters: AdapterSet, x: mx.array
    ) -> mx.array:
        """`base(x)` plus the set's terms (`AdapterSet.apply`)."""
        return adapters.apply(path, x, base(x))

    def project_rows(self, path: str, base: nn.Module, rows: RowAdapters, x: mx.array) -> mx.array:
        """`base(x)` plus each row's masked columns of the side-by-side pair."""
        plan = rows.masked.plan(path, kernel=False)
        if plan is None:
            return base(x)
        return add_residuals(x, base(x), plan.a_cat, plan.b_cat, plan.mask)

    def gather_set(
        self, path: str, base: nn.Module, adapters: AdapterSet, x: mx.array
    ) -> Gather | None:
        """None: no fused kernel takes MLX's layers."""
        return None

    def gather_rows(
        self, path: str, base: nn.Module, rows: RowAdapters, x: mx.array
    ) -> Gather | None:
        """None: no fused kernel takes MLX's layers."""
        return None
