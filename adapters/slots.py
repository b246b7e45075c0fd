"""LoRA slots in the base model, and the context that tells them which adapter set applies.

The slots hold no adapter state. Which adapters apply is decided by the `AdapterSet` current in
the calling thread (a `ContextVar`, so asyncio tasks are isolated too) at the moment the model
is called, which is when MLX builds the graph. Two requests with different sets therefore never
see each other's weights, however their model calls interleave, and mounting or unmounting
never changes a set that a running request already holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_set import AdapterSet
from hotlora.adapters.projections import find_targets, replace_module
from hotlora.adapters.row_sets import Gather, RowAdapters, lone_rows
from hotlora.models.cpu.layers import serves_every_row


class _Residuals(Protocol):
    def apply(self, path: str, x: mx.array, y: mx.array) -> mx.array: ...


_ACTIVE: ContextVar[_Residuals | RowAdapters | None] = ContextVar(
    "hotlora_active_adapters", default=None
)


class LoRASlot(nn.Module):
    """Wraps one base projection; adds the residuals of whatever adapter set is active.

    `y = base(x) + sum_i (scale_i * ((x @ A_i) @ B_i)).astype(x.dtype)`, mlx-lm `LoRALinear`'s
    form. With no active set the base output is returned as is. The base module is kept, not
    copied, as the child `base`; its weights are never changed.
    """

    def __init__(self, base: nn.Module, path: str = ""):
        super().__init__()
        self.base = base
        self.path = path

    def __call__(self, x: mx.array) -> mx.array:
        active = _ACTIVE.get()
        if active is None:
            return self.base(x)
        if isinstance(active, RowAdapters):  # a set per row: the base and residuals at once
            return active.project(self.path, x, self.base)
        if isinstance(active, AdapterSet) and serves_every_row(self.base):
            # Packed weights: a set alone computes as a batch of sets does, to the same bits.
            y = lone_rows(active).project(self.path, x, self.base)
            if y is not None:
                return y
        return active.apply(self.path, x, self.base(x))

    def gathered(self, x: mx.array) -> tuple[nn.Module, Gather | None] | None:
        """What a layer needs to compute this call of the projection together with its
        neighbours' (its base product among theirs), then add the residuals: the base
        projection and the gathered kernel's operands (None: no adapter applies); None when the
        residuals of the set active now do not take that kernel here."""
        active = _ACTIVE.get()
        if active is None:
            return self.base, None
        if isinstance(active, RowAdapters):
            operands = active.gathered.operands(self.path, x, self.base)
        elif isinstance(active, AdapterSet) and serves_every_row(self.base):
            operands = lone_rows(active).operands(self.path, x, self.base)
        else:
            return None
        if operands is None:
            return None
        return self.base, operands if operands[1] >= 0 else None


@contextmanager
def activate(adapters: AdapterSet | RowAdapters) -> Iterator[None]:
    """Make `adapters` what the slots apply to model calls made inside this block, in this
    context: one set for every row, or `RowAdapters` for a set per row.

    Wrap each model call (prefill, each decode step), not a generator that yields to other
    code: the set current when the model is called is the one the graph is built with.
    An empty set takes the plain base path.
    """
    empty = isinstance(adapters, AdapterSet) and not adapters.entries
    token = _ACTIVE.set(None if empty else adapters)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def install_slots(model: nn.Module) -> dict[str, LoRASlot]:
    """Wrap every target projection in a `LoRASlot`, once; slots already there are reused."""
    slots: dict[str, LoRASlot] = {}
    for path, module in find_targets(model, (nn.Linear, nn.QuantizedLinear, LoRASlot)).items():
        if not isinstance(module, LoRASlot):
            module = LoRASlot(module, path)
            replace_module(model, path, module)
        slots[path] = module
    return slots


class _DtypeProbe:
    def __init__(self) -> None:
        self.dtypes: dict[str, mx.Dtype] = {}

    def apply(self, path: str, x: mx.array, y: mx.array) -> mx.array:
        self.dtypes[path] = x.dtype
        return y


def probe_input_dtypes(model: nn.Module) -> dict[str, mx.Dtype]:
    """The activation dtype reaching each slot, from one traced (never evaluated) call.

    MLX is lazy, so this builds a one-token graph and drops it. Models whose call needs more
    than token ids give `{}`.
    """
    probe = _DtypeProbe()
    token = _ACTIVE.set(probe)
    try:
        model(mx.array([[0]]))
    except Exception:
        return {}
    finally:
        _ACTIVE.reset(token)
    return probe.dtypes
