"""A request's own adapter set: which mounted adapters apply, at which weights, summed in order.

The set is built once per request and never changes: it holds references to each adapter's
arrays, so unmounting or replacing an adapter never changes what a request holding it computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import mlx.core as mx

from hotlora.adapters.adapter_files import SHORT_REVISION, LoadedAdapter

# One low-rank term of a slot: A [in, r], B [r, out] and the scale on `(x @ A) @ B`.
Term = tuple[mx.array, mx.array, float]


@dataclass(frozen=True, eq=False)
class MountedAdapter:
    """A validated adapter under its id, as the adapter manager holds it at one point in time."""

    id: str
    adapter: LoadedAdapter
    mounted_at: int

    @property
    def short_revision(self) -> str:
        return self.adapter.revision[:SHORT_REVISION]


@dataclass(frozen=True)
class AppliedAdapter:
    """One mounted adapter in a request's set, with the request's weight on it.

    Two entries are equal when they hold the same mount (by identity: a re-mount of the same
    files is another mount) at the same weight, so a tuple of entries keys what a set builds.
    """

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
class AdapterSet:
    """An immutable adapter set for one request, summed in order; empty serves the base.

    `key` identifies the set's exact weights (for prompt-cache keying). `apply` is the one hook
    the residual backends call when every row of a call uses this set; `backends.per_row` mixes
    sets per row.
    """

    entries: tuple[AppliedAdapter, ...] = ()
    key: tuple[str, ...] = field(init=False)
    _terms_by_slot: Mapping[str, tuple[Term, ...]] = field(init=False, repr=False)
    # Stacks fused per slot on first use, on the thread that runs the model: MLX streams are
    # per thread, so arrays built while selecting (on the event loop) could not be evaluated.
    _fused_by_slot: dict[str, tuple[Term, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_slot: dict[str, list[Term]] = {}
        for entry in self.entries:
            if entry.weight == 0.0:
                continue  # contributes nothing; skip the matmuls
            for path, (a, b) in entry.mounted.adapter.weights.items():
                by_slot.setdefault(path, []).append((a, b, entry.scale))
        frozen = {path: tuple(terms) for path, terms in by_slot.items()}
        object.__setattr__(self, "_terms_by_slot", MappingProxyType(frozen))
        object.__setattr__(self, "_fused_by_slot", {})
        object.__setattr__(self, "key", tuple(entry.key for entry in self.entries))

    @property
    def ids(self) -> tuple[str, ...]:
        """The mounted ids in the set, in order; empty for the base alone."""
        return tuple(entry.mounted.id for entry in self.entries)

    def slot_terms(self, path: str) -> tuple[Term, ...]:
        """This set's terms at the slot `path`: none, or one pair (a stack is fused)."""
        terms = self._fused_by_slot.get(path)
        if terms is None:
            terms = self._fused_by_slot[path] = _fuse_terms(self._terms_by_slot.get(path, ()))
        return terms

    def apply(self, path: str, x: mx.array, y: mx.array) -> mx.array:
        """Add this set's residuals for the slot at `path` to its base output `y`.

        `x` [..., in] is taken as one matrix of rows [N, in]: one matrix product over the
        whole batch rather than one per leading index.
        """
        terms = self.slot_terms(path)
        if not terms:
            return y
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        for a, b, scale in terms:
            residual = (rows @ a) @ b  # [N, out]
            if scale != 1.0:
                residual = scale * residual
            if residual.dtype != x.dtype:
                residual = residual.astype(x.dtype)
            y = y + residual.reshape(y.shape)
        return y


def _fuse_terms(terms: tuple[Term, ...]) -> tuple[Term, ...]:
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


BASE_ONLY = AdapterSet()
