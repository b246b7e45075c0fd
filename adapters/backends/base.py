"""What a LoRA slot asks of the residual backend that serves its projection.

One backend per kind of base weights, chosen once per slot when the slots are installed
(`selector.select_backend`): `mlx_terms.MLXTerms` for MLX's own layers (the GPU included),
`side_by_side.NativeSideBySide` for float32 weights on the native kernels, `gathered.Gathered`
for packed quantized weights. A call's adapters are one set on every row or a set per row
(`per_row.RowAdapters`); the slot hands the backend whichever is active, through the method for
that state, so the hot path tests no types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_set import AdapterSet
from hotlora.models.cpu.fused import Gather

if TYPE_CHECKING:
    from hotlora.adapters.backends.per_row import RowAdapters

__all__ = ["Gather", "ResidualBackend"]


class ResidualBackend(Protocol):
    """The base product plus the active rows' residuals at one slot, for one kind of weights.

    `path` names the slot (the adapters' pairs are keyed by it), `base` is its projection, `x`
    [..., in] its input. `gather_*` answer the fused layers (`models.cpu.fused`): the gathered
    kernel's operands for this call, or None where this backend has none (then the fused layer
    calls each projection on its own).
    """

    name: str  # what the start-up log calls it
    fuses: bool  # whether its slots can take part in a fused product (packed weights)

    def project_set(
        self, path: str, base: nn.Module, adapters: AdapterSet, x: mx.array
    ) -> mx.array:
        """`base(x)` plus the residuals of `adapters`, the one set on every row."""
        ...

    def project_rows(self, path: str, base: nn.Module, rows: RowAdapters, x: mx.array) -> mx.array:
        """`base(x)` plus each row's residuals of its own set (x [B, L, in], B the rows)."""
        ...

    def gather_set(
        self, path: str, base: nn.Module, adapters: AdapterSet, x: mx.array
    ) -> Gather | None:
        """The gathered kernel's operands of `adapters` on every row; None: not this call."""
        ...

    def gather_rows(
        self, path: str, base: nn.Module, rows: RowAdapters, x: mx.array
    ) -> Gather | None:
        """The gathered kernel's operands of each row's own set; None: not this call."""
        ...
