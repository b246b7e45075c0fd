"""A count of the changes made to the layers a decoder layer's step primitive reads.

`fused.layer_step` gathers what a decoder layer's decode steps share (its projections' packed
weights and precision, its norms, its RoPE, the modules it reads them from) once, and keeps it
from step to step. Checking at every step that each of those objects is still the one gathered
cost more than the layer's native call; instead the classes they are read from count every
change made to their items and attributes (`Watched`): an item or attribute set or deleted
(MLX's `update`, `load_weights` and `quantize` set items; a precision sets attributes and
items), a class swapped, a projection replaced (a LoRA slot installed). A layer whose kept
arguments were gathered at another count gathers them anew at its next step.

What the count does not see is what the identity of the objects did not see either: an array
changed in place (`weight[0] = ...`), or a module's dict changed through `dict` itself.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

_count = 0


def count() -> int:
    """How many changes the watched layers have counted in this process."""
    return _count


def changed() -> None:
    """Count a change (one the classes do not see: a class swapped on an unwatched module)."""
    global _count
    _count += 1


class Watched(nn.Module):
    """Mixed into a layer class after its MLX class (so that `__mro__[1]` stays that class):
    every item or attribute set or deleted on its modules counts as a change (`count`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        changed()
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        changed()
        super().__delattr__(name)

    def __setitem__(self, key: str, value: Any) -> None:
        changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        changed()
        super().__delitem__(key)
