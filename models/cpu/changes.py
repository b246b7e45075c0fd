"""A count of the changes made to the layers a decoder layer's step primitive reads.

`fused.py` gathers what a decoder layer's decode steps share (its projections' packed
weights and precision, its norms, its RoPE, the modules it reads them from) once, and keeps it
from step to step. Checking at every step that each of those objects is still the one gathered
cost more than the layer's native call; instead the classes they are read from count every
change made to their items and attributes (`Watched`): an item or attribute set or deleted
(MLX's `update`, `load_weights` and `quantize` set items; a precision sets attributes and
items), a class swapped, a projection replaced (a LoRA slot installed). A layer whose kept
arguments were gathered at another count gathers them anew at its next step.

A change is counted once made, so that arguments gathered meanwhile on another thread are
gathered again. What the count does not see: an array changed in place (`weight[0] = ...`,
which the objects' identities did not show either), and a module's dict changed through
`dict`'s own methods (`pop`, `clear`, `setdefault`, `dict.__setitem__`), which MLX does not
use on modules: call `changed()` after such a change.
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
        super().__setattr__(name, value)
        changed()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        changed()

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        changed()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        changed()
