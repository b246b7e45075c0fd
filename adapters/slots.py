"""LoRA slots in the base model, and the context that tells them which adapter set applies.

The slots hold no adapter state. Which adapters apply is decided by the `AdapterSet` current in
the calling thread (a `ContextVar`, so asyncio tasks are isolated too) at the moment the model
is called, which is when MLX builds the graph. Two requests with different sets therefore never
see each other's weights, however their model calls interleave, and mounting or unmounting
never changes a set that a running request already holds. How a slot adds the residuals is its
residual backend's job (`backends`), chosen once when the slot is installed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal, Protocol

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_set import AdapterSet
from hotlora.adapters.backends import Gather, ResidualBackend, RowAdapters, select_backend
from hotlora.adapters.projections import find_targets, replace_module
from hotlora.models.cpu.changes import Watched
from hotlora.models.cpu.layers import PackedLinear
from hotlora.models.cpu.weights import has_gpu

log = logging.getLogger("hotlora.adapters")


class _Active(Protocol):
    """The adapters of the model call under way, as a slot asks them: `project` gives the
    slot's output for `x`, `gather` the fused kernel's operands (None: not this call)."""

    def project(self, slot: LoRASlot, x: mx.array) -> mx.array: ...

    def gather(self, slot: LoRASlot, x: mx.array) -> Gather | None: ...


class _OneSet:
    """One set on every row of the call."""

    __slots__ = ("adapters",)

    def __init__(self, adapters: AdapterSet):
        self.adapters = adapters

    def project(self, slot: LoRASlot, x: mx.array) -> mx.array:
        return slot.backend.project_set(slot.path, slot["base"], self.adapters, x)

    def gather(self, slot: LoRASlot, x: mx.array) -> Gather | None:
        return slot.backend.gather_set(slot.path, slot["base"], self.adapters, x)


class _PerRow:
    """A set per row of the call."""

    __slots__ = ("rows",)

    def __init__(self, rows: RowAdapters):
        self.rows = rows

    def project(self, slot: LoRASlot, x: mx.array) -> mx.array:
        return slot.backend.project_rows(slot.path, slot["base"], self.rows, x)

    def gather(self, slot: LoRASlot, x: mx.array) -> Gather | None:
        return slot.backend.gather_rows(slot.path, slot["base"], self.rows, x)


_ACTIVE: ContextVar[_Active | None] = ContextVar("hotlora_active_adapters", default=None)


class LoRASlot(Watched):
    """Wraps one base projection; adds the residuals of whatever adapter set is active.

    `y = base(x) + sum_i (scale_i * ((x @ A_i) @ B_i)).astype(x.dtype)`, mlx-lm `LoRALinear`'s
    form, computed by the slot's residual `backend`, chosen from the base's kind.
    With no active set the base output is returned as is. The base module is kept, not copied,
    as the child `base`; its weights are never changed.
    """

    def __init__(self, base: nn.Module, path: str = "", *, gpu: bool | None = None):
        super().__init__()
        self.base = base
        self.path = path
        self._gpu = has_gpu() if gpu is None else gpu
        self._backend = select_backend(base, gpu=self._gpu)
        self._chosen_for: type[nn.Module] = type(base)

    @property
    def backend(self) -> ResidualBackend:
        """The residual backend of the base's kind, chosen when the slot is made. Start-up
        may give the base its native class after that (the kernels are installed on a model
        whose slots exist): the choice is made again then, once, not on every call."""
        base = self["base"]  # an item, not an attribute: a failed attribute lookup costs ~2 us
        if type(base) is not self._chosen_for:
            self._backend = select_backend(base, gpu=self._gpu)
            self._chosen_for = type(base)
        return self._backend

    def __call__(self, x: mx.array) -> mx.array:
        active = _ACTIVE.get()
        if active is None:
            return self["base"](x)
        return active.project(self, x)

    def fused_layer(self) -> PackedLinear | None:
        """The packed base of a fused product (`models.cpu.fused.FusedProjection`); None when
        the slot's backend takes no fused kernel."""
        return self["base"].fused_layer() if self.backend.fuses else None

    def fused_residuals(self, x: mx.array) -> Gather | Literal[False] | None:
        """The gathered kernel's operands of the active adapters' residuals on this call (None:
        none apply here; False: the fused kernel does not add them, the slot is called)."""
        active = _ACTIVE.get()
        if active is None:
            return None
        operands = active.gather(self, x)
        if operands is None:
            return False
        return operands if operands[1] >= 0 else None

    @staticmethod
    def active_residuals() -> object | None:
        """What the slots add the residuals of in this context (`activate`'s set, or its rows'
        sets; `models.cpu.fused.FusedProjection`), None where nothing is active: one object
        from step to step while a batch's rows stay (`RowAdapterCache`), whose operands each
        slot gives the same every call (its plan and the slot's number). Anything else active
        (the dtypes' probe) is itself, whose slots the fused kernels do not take."""
        active = _ACTIVE.get()
        if type(active) is _PerRow:
            return active.rows
        if type(active) is _OneSet:
            return active.adapters
        return active


@contextmanager
def activate(adapters: AdapterSet | RowAdapters) -> Iterator[None]:
    """Make `adapters` what the slots apply to model calls made inside this block, in this
    context: one set for every row, or `RowAdapters` for a set per row.

    Wrap each model call (prefill, each decode step), not a generator that yields to other
    code: the set current when the model is called is the one the graph is built with.
    An empty set takes the plain base path.
    """
    # Told apart once per model call here, so that no slot tests the kind on its own call.
    active: _Active | None
    if isinstance(adapters, RowAdapters):
        active = _PerRow(adapters)
    else:
        active = _OneSet(adapters) if adapters.entries else None
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def install_slots(model: nn.Module) -> dict[str, LoRASlot]:
    """Wrap every target projection in a `LoRASlot`, once; slots already there are reused.
    Each new slot's residual backend is chosen here, from its projection's kind."""
    gpu = has_gpu()
    slots: dict[str, LoRASlot] = {}
    for path, module in find_targets(model, (nn.Linear, nn.QuantizedLinear, LoRASlot)).items():
        if not isinstance(module, LoRASlot):
            module = LoRASlot(module, path, gpu=gpu)
            replace_module(model, path, module)
        slots[path] = module
    backends = Counter(slot.backend.name for slot in slots.values())
    if backends:
        log.info(
            "LoRA residuals: %s",
            ", ".join(f"{count} slots {name}" for name, count in sorted(backends.items())),
        )
    return slots


class _DtypeProbe:
    """Records the activation dtype reaching each slot; adds nothing."""

    def __init__(self) -> None:
        self.dtypes: dict[str, mx.Dtype] = {}

    def project(self, slot: LoRASlot, x: mx.array) -> mx.array:
        self.dtypes[slot.path] = x.dtype
        return slot.base(x)

    def gather(self, slot: LoRASlot, x: mx.array) -> Gather | None:
        return None  # each projection on its own, so that every slot is probed


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
