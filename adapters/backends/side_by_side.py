"""A set per row through one side-by-side pair per slot, masked per row; on float32 weights with
the native kernels, a decode step's base product and both low-rank products in one call.

The adapters the batch's sets use are laid side by side along the rank axis, each once, however
many sets name it: one `[in, R]` / `[R, out]` pair per slot (R: the ranks of those adapters,
summed). A per-row mask holds, on each adapter's columns, the scale the row's set gives it (its
weight times the adapter's own scale), and zero on the others:

    y[b] += ((x[b] @ A_cat) * mask[b]) @ B_cat

Two dense matmuls per slot whatever the number of sets, and a stack such as `a+b` beside `a`
and `b` adds no columns of its own. A zero column contributes an exact zero, so a row gets its
own set's residual and nothing else. A batched decode step on the CPU's float32 weights runs the
base projection and both products as one call of the batch kernel
(`hotlora.models.cpu.layers.lora_rows`), on transposed copies of the pair (`NativeSideBySide`).
The side-by-side pair serves float32 weights and MLX's own layers (the GPU included); it is the
only copy of adapter weights beyond each mounted adapter's own, and holds the batch's adapters
alone: one layout per slot, a few kept per `per_row.RowAdapterCache`, dropped as soon as no
batch uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_set import AdapterSet, MountedAdapter
from hotlora.adapters.backends.base import Gather
from hotlora.models.cpu.layers import lora_rows

if TYPE_CHECKING:
    from hotlora.adapters.backends.per_row import RowAdapters

# One slot's layout: each adapter with weights there, and the span of its columns.
Layout = tuple[tuple[MountedAdapter, int, int], ...]


class SideBySide:
    """Distinct adapters (mounted revisions), side by side per slot; built lazily, then kept.

    Each slot is built in one layout: the batch kernel's where that kernel serves it (`A_cat.T`
    [R, in], `B_cat.T` [out, R]), else `A_cat` [in, R], `B_cat` [R, out].
    The other layout, when a call needs it, is a transposed view of the same arrays, not a copy.
    """

    def __init__(self, adapters: Sequence[MountedAdapter]):
        self.adapters = tuple(adapters)
        self.members = frozenset(self.adapters)
        self.columns = 0  # rank columns built so far, over every slot: what this copy holds
        self._slots: dict[str, tuple[mx.array, mx.array, Layout] | None] = {}
        self._transposed: dict[str, tuple[mx.array, mx.array]] = {}

    def slot(
        self, path: str, *, transposed: bool = False
    ) -> tuple[mx.array, mx.array, Layout] | None:
        """`(A_cat [in, R], B_cat [R, out], layout)` at one slot; None when no adapter has
        weights there. Built on first use, on the thread that runs the model (MLX streams are
        per thread); `transposed` builds it in the batch kernel's layout, if it is not built yet.
        """
        if path not in self._slots:
            self._slots[path] = self._build(path, transposed)
        return self._slots[path]

    def transposed(self, path: str, a_cat: mx.array, b_cat: mx.array) -> tuple[mx.array, mx.array]:
        """`(A_cat.T [R, in], B_cat.T [out, R])` at a slot, contiguous: the batch kernel's
        layout. Built on first use, and only where that kernel runs; where the slot was built
        in that layout these are its own arrays."""
        pair = self._transposed.get(path)
        if pair is None:
            pair = self._transposed[path] = (mx.contiguous(a_cat.T), mx.contiguous(b_cat.T))
        return pair

    def _build(self, path: str, transposed: bool) -> tuple[mx.array, mx.array, Layout] | None:
        a_parts, b_parts, layout = [], [], []
        start = 0
        for mounted in self.adapters:
            pair = mounted.adapter.weights.get(path)
            if pair is None:
                continue
            a, b = pair
            a_parts.append(a)
            b_parts.append(b)
            layout.append((mounted, start, start + a.shape[1]))
            start += a.shape[1]
        if not a_parts:
            return None
        self.columns += start
        if transposed:
            a_t = mx.concatenate([a.T for a in a_parts], axis=0)  # [R, in]
            b_t = mx.concatenate([b.T for b in b_parts], axis=1)  # [out, R]
            self._transposed[path] = (a_t, b_t)
            return a_t.T, b_t.T, tuple(layout)  # views: [in, R], [R, out]
        a_cat = mx.concatenate(a_parts, axis=1)  # [in, R]
        b_cat = mx.concatenate(b_parts, axis=0)  # [R, out]
        return a_cat, b_cat, tuple(layout)


@dataclass(frozen=True)
class SlotPlan:
    """What one slot adds for one batch: its side-by-side pair with the rows' mask, and the
    batch kernel's operands (`A_cat.T`, `B_cat.T`, mask) where that kernel serves the slot."""

    a_cat: mx.array  # [in, R]
    b_cat: mx.array  # [R, out]
    mask: mx.array  # [B, 1, R]
    kernel: tuple[mx.array, mx.array, mx.array] | None


class MaskedRows:
    """One batch's rows over a side-by-side pair: each slot's plan and each layout's mask.

    A decode step calls every slot once, so what each slot needs (pair, mask, the kernel's
    operands) is looked up once per batch and kept.
    """

    def __init__(self, side_by_side: SideBySide, rows: Sequence[AdapterSet]):
        self.side_by_side = side_by_side
        self._rows = tuple(rows)
        self._masks: dict[Layout, mx.array] = {}
        self._plans: dict[str, SlotPlan | None] = {}

    def plan(self, path: str, *, kernel: bool) -> SlotPlan | None:
        """The slot's plan; None when none of the batch's adapters has weights there. `kernel`:
        the slot's backend runs the batch kernel (float32 adapters only), so the pair is built
        in its layout. A slot is always served by one backend, so the first call decides."""
        if path in self._plans:
            return self._plans[path]
        kernel = kernel and self._float32(path)
        slot = self.side_by_side.slot(path, transposed=kernel)
        plan = None
        if slot is not None:
            a_cat, b_cat, layout = slot
            mask = self._mask(layout, a_cat)  # [B, 1, R]
            operands = None
            if kernel and a_cat.dtype == b_cat.dtype == mx.float32:
                operands = (*self.side_by_side.transposed(path, a_cat, b_cat), mask)
            plan = SlotPlan(a_cat, b_cat, mask, operands)
        self._plans[path] = plan
        return plan

    def _float32(self, path: str) -> bool:
        """Whether the batch's adapters at `path` are float32 (what the kernel takes)."""
        for mounted in self.side_by_side.adapters:
            pair = mounted.adapter.weights.get(path)
            if pair is not None:
                return pair[0].dtype == mx.float32
        return False

    def _mask(self, layout: Layout, a_cat: mx.array) -> mx.array:
        """[B, 1, R]: on each adapter's columns, the scale the row's set gives it (summed if
        the set names it twice); zero elsewhere. Slots with the same layout (most of a
        model's) share one mask."""
        mask = self._masks.get(layout)
        if mask is None:
            spans = {mounted: (start, stop) for mounted, start, stop in layout}
            rows = []
            for adapters in self._rows:
                row = [0.0] * a_cat.shape[1]
                for entry in adapters.entries:
                    span = spans.get(entry.mounted)
                    if span is not None:  # a weight of 0 adds a scale of 0
                        for column in range(*span):
                            row[column] += entry.scale
                rows.append([row])
            mask = mx.array(rows, dtype=a_cat.dtype)  # [B, 1, R]
            self._masks[layout] = mask
        return mask


def add_residuals(
    x: mx.array, y: mx.array, a_cat: mx.array, b_cat: mx.array, mask: mx.array
) -> mx.array:
    """`y + ((x @ a_cat) * mask) @ b_cat`: each row's masked columns of the pair."""
    h = (x @ a_cat) * mask  # [B, L, R]
    if h.dtype == y.dtype == b_cat.dtype:
        return mx.addmm(y, h, b_cat)  # y + h @ B_cat in one product
    return y + (h @ b_cat).astype(y.dtype)


class NativeSideBySide:
    """The residual backend of float32 weights on the native kernels (`lora_rows`): a set alone
    adds its terms as MLX's layers do; a set per row takes the batch kernel on the inputs the
    layer's kernel takes (`takes`: a batched decode step, or every float32 call where every
    call is the kernel's), else the masked pair."""

    name = "side-by-side"
    fuses = False

    def project_set(
        self, path: str, base: nn.Module, adapters: AdapterSet, x: mx.array
    ) -> mx.array:
        """`base(x)` plus the set's terms (`AdapterSet.apply`), as MLX's layers add them."""
        return adapters.apply(path, x, base(x))

    def project_rows(self, path: str, base: nn.Module, rows: RowAdapters, x: mx.array) -> mx.array:
        """`base(x)` plus each row's residual: one call of the batch kernel where it serves."""
        plan = rows.masked.plan(path, kernel=True)
        if plan is None:
            return base(x)
        if plan.kernel is not None and base.takes(x):
            return lora_rows(x, base, *plan.kernel)
        return add_residuals(x, base(x), plan.a_cat, plan.b_cat, plan.mask)

    def gather_set(
        self, path: str, base: nn.Module, adapters: AdapterSet, x: mx.array
    ) -> Gather | None:
        """None: the fused kernels take packed weights only."""
        return None

    def gather_rows(
        self, path: str, base: nn.Module, rows: RowAdapters, x: mx.array
    ) -> Gather | None:
        """None: the fused kernels take packed weights only."""
        return None
