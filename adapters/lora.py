"""LoRA slots in the base model, and the per-call active adapter set they read.

The slots hold no adapter state. Which adapters apply is decided by the `ActiveAdapters`
current in the calling thread (a `ContextVar`, so asyncio tasks are isolated too) at the
moment the model is called, which is when MLX builds the graph. Two requests with different
sets therefore never see each other's weights, however their model calls interleave, and
mounting or unmounting never changes a set that a running request already holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from .files import LoadedAdapter
from .targets import find_targets, replace_module

SHORT_REVISION = 12


class _Residuals(Protocol):
    def apply(self, path: str, x: mx.array, y: mx.array) -> mx.array: ...


_ACTIVE: ContextVar[_Residuals | None] = ContextVar("hotlora_active_adapters", default=None)


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
        y = self.base(x)
        active = _ACTIVE.get()
        if active is None:
            return y
        return active.apply(self.path, x, y)


@dataclass(frozen=True, eq=False)
class MountedAdapter:
    """A validated adapter under its id, as the registry holds it at one point in time."""

    id: str
    adapter: LoadedAdapter
    mounted_at: int

    @property
    def short_revision(self) -> str:
        return self.adapter.revision[:SHORT_REVISION]


@dataclass(frozen=True)
class AppliedAdapter:
    """One mounted adapter in a request's set, with the request's weight on it."""

    mounted: MountedAdapter
    weight: float = 1.0

    @property
    def scale(self) -> float:
        """The effective scale: the adapter's own scale times the request's weight."""
        return self.mounted.adapter.config.scale * self.weight

    @property
    def key(self) -> str:
        part = f"{self.mounted.id}@{self.mounted.short_revision}"
        return part if self.weight == 1.0 else f"{part}*{self.weight!r}"


@dataclass(frozen=True, eq=False)
class ActiveAdapters:
    """An immutable adapter set for one request, summed in order.

    It holds references to each adapter's arrays, so unmounting or replacing an adapter
    never changes what a request holding this set computes. `key` identifies the set's
    exact weights (for prompt-cache keying); `label` is the human spelling, "" for the base.

    Batching: a future batched path would pass one set per row; `apply` is the single hook,
    where a batched variant can stack each slot's A/B into `[n, in, r]` / `[n, r, out]` and
    use `mx.gather_mm` with per-row adapter indices.
    """

    entries: tuple[AppliedAdapter, ...] = ()
    key: tuple[str, ...] = field(init=False)
    label: str = field(init=False)
    _by_slot: Mapping[str, tuple[tuple[mx.array, mx.array, float], ...]] = field(
        init=False, repr=False
    )
    # Stacks fused per slot on first use, on the thread that runs the model: MLX streams are
    # per thread, so arrays built while resolving (on the event loop) could not be evaluated.
    _fused: dict[str, tuple[tuple[mx.array, mx.array, float], ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        by_slot: dict[str, list[tuple[mx.array, mx.array, float]]] = {}
        for entry in self.entries:
            if entry.weight == 0.0:
                continue  # contributes nothing; skip the matmuls
            for path, (a, b) in entry.mounted.adapter.weights.items():
                by_slot.setdefault(path, []).append((a, b, entry.scale))
        frozen = {path: tuple(terms) for path, terms in by_slot.items()}
        object.__setattr__(self, "_by_slot", MappingProxyType(frozen))
        object.__setattr__(self, "_fused", {})
        object.__setattr__(self, "key", tuple(entry.key for entry in self.entries))
        object.__setattr__(self, "label", "+".join(e.mounted.id for e in self.entries))

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(entry.mounted.id for entry in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def apply(self, path: str, x: mx.array, y: mx.array) -> mx.array:
        """Add this set's residuals for the slot at `path` to its base output `y`."""
        terms = self._fused.get(path)
        if terms is None:
            terms = self._fused[path] = _fused(self._by_slot.get(path, ()))
        for a, b, scale in terms:
            residual = (x @ a) @ b
            if scale != 1.0:
                residual = scale * residual
            if residual.dtype != x.dtype:
                residual = residual.astype(x.dtype)
            y = y + residual
        return y


def _fused(
    terms: tuple[tuple[mx.array, mx.array, float], ...],
) -> tuple[tuple[mx.array, mx.array, float], ...]:
    """One slot's terms; a stack becomes one low-rank pair of the summed ranks.

    `sum_i s_i * (x @ A_i) @ B_i == (x @ [A_1 .. A_n]) @ [s_1 B_1; ..; s_n B_n]`: two matmuls
    per slot instead of two per adapter, which is most of a stack's decode cost. A single
    adapter keeps mlx-lm's own `scale * ((x @ A) @ B)`, so its numbers match mlx-lm's exactly.
    The fused arrays belong to this request's set and are built once, on first use.
    """
    if len(terms) < 2:
        return terms
    a = mx.concatenate([a for a, _, _ in terms], axis=1)  # [in, r_1 + .. + r_n]
    b = mx.concatenate([(s * b).astype(b.dtype) for _, b, s in terms], axis=0)  # [sum r, out]
    return ((a, b, 1.0),)


BASE_ONLY = ActiveAdapters()


@contextmanager
def activate(active: ActiveAdapters | None) -> Iterator[None]:
    """Make `active` the adapter set for model calls made inside this block, in this context.

    Wrap each model call (prefill, each decode step), not a generator that yields to other
    code: the set current when the model is called is the one the graph is built with.
    An empty set takes the plain base path.
    """
    token = _ACTIVE.set(active if active else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_adapters() -> ActiveAdapters | None:
    """The set active in this context, if any."""
    active = _ACTIVE.get()
    return active if isinstance(active, ActiveAdapters) else None


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
