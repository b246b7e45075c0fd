"""LoRA residual backends: one per kind of base weights, behind one interface, chosen once.

`base.ResidualBackend` declares what a LoRA slot asks; `mlx_terms` (MLX's layers, the GPU
included), `side_by_side` (float32 weights on the native kernels) and `gathered` (packed
quantized weights) implement it; `selector.select_backend` picks one per slot when the slots are
installed. `per_row` holds a batch's rows, each with its own set, as the backends read them.
"""

from hotlora.adapters.backends.base import Gather, ResidualBackend
from hotlora.adapters.backends.per_row import RowAdapterCache, RowAdapters
from hotlora.adapters.backends.selector import select_backend

__all__ = ["Gather", "ResidualBackend", "RowAdapterCache", "RowAdapters", "select_backend"]
