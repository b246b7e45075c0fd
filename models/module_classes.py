"""Swapping a model's modules' classes in place, their weights untouched."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import mlx.nn as nn


def swap_classes(
    model: nn.Module, classes: Mapping[type[nn.Module], type[nn.Module]]
) -> Counter[type[nn.Module]]:
    """Give each module of `model` whose class `classes` maps the class it maps to; returns how
    many modules took each new class."""
    swapped: Counter[type[nn.Module]] = Counter()
    for _, module in model.named_modules():
        new_class = classes.get(type(module))
        if new_class is not None:
            module.__class__ = new_class
            swapped[new_class] += 1
    return swapped
