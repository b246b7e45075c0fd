"""Which residual backend serves each LoRA slot: chosen once, when the slots are installed.

The choice follows the weights the base serves, which start-up has settled by then
(`models.cpu.prepare_cpu`): packed quantized weights on the native kernels take `Gathered`,
float32 weights on the native kernels `NativeSideBySide`, MLX's own layers `MLXTerms`; with a
GPU, MLX's layers serve whatever the weights. A model can mix kinds (a projection left
unquantized beside packed ones), so each slot gets the backend of its own projection.
"""

from __future__ import annotations

import mlx.nn as nn

from hotlora.adapters.backends.base import ResidualBackend
from hotlora.adapters.backends.gathered import Gathered
from hotlora.adapters.backends.mlx_terms import MLXTerms
from hotlora.adapters.backends.side_by_side import NativeSideBySide
from hotlora.models.cpu.layers import lora_kernel
from hotlora.models.cpu.weights import has_gpu

# The backends hold no state of their own: one of each serves every slot of its kind.
MLX = MLXTerms()
SIDE_BY_SIDE = NativeSideBySide()
GATHERED = Gathered(fallback=MLX)

_BY_KERNEL: dict[str | None, ResidualBackend] = {
    "lora_gather": GATHERED,
    "lora_rows": SIDE_BY_SIDE,
    None: MLX,
}


def select_backend(base: nn.Module, *, gpu: bool | None = None) -> ResidualBackend:
    """The residual backend for a slot over `base`: the native kernel its kind takes
    (`layers.lora_kernel`), else MLX's operations; MLX's on a GPU (`gpu`: None asks MLX)."""
    if has_gpu() if gpu is None else gpu:
        return MLX
    return _BY_KERNEL[lora_kernel(base)]
