"""Different adapter sets on different rows of one batched model call.

The base projection runs once for the whole batch; each slot then adds every row's own
residual. The adapters the batch's sets use are laid side by side along the rank axis, each
once, however many sets name it: one `[in, R]` / `[R, out]` pair per slot (R: the ranks of
those adapters, summed). A per-row mask holds, on each adapter's columns, the scale the row's
set gives it (its weight times the adapter's own scale), and zero on the others:

    y[b] += ((x[b] @ A_cat) * mask[b]) @ B_cat

Two dense matmuls per slot whatever the number of sets, and a stack such as `a+b` beside `a`
and `b` adds no columns of its own. A zero column contributes an exact zero, so a row gets its
own set's residual and nothing else. A batched decode step on the CPU's float32 weights runs the
base projection and both products as one call of the batch kernel
(`hotlora.models.cpu.layers.lora_rows`), on transposed copies of the pair. The side-by-side pair
serves float32 weights and MLX's own layers (the GPU included); it is the only copy of adapter
weights beyond each mounted adapter's own, and holds the batch's adapters alone: one layout per
slot, a few kept per `RowAdapterCache`, dropped as soon as no batch uses them.

Packed quantized weights copy nothing (`GatheredRows`, Punica's gathered form): their kernel
(`hotlora.models.cpu.layers.lora_gather`) takes each adapter's pair as mounted and, per row, the
adapters of its set in the set's order with their scales, and computes each row's own low-rank
products alone. A set alone on every row goes through it too (`lone_rows`), so a row's result is
the same bits alone and beside any other sets, and adapters cost their own arrays whatever the
traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from weakref import WeakKeyDictionary

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_set import AdapterSet, AppliedAdapter, MountedAdapter
from hotlora.models.cpu.layers import (
    lora_gather,
    lora_rows,
    serves_every_row,
    serves_lora,
    serves_rows,
)

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


_GATHERED = (mx.float32, mx.float16)  # the pairs' dtypes the gathered kernel reads

# One slot's operands of the gathered kernel: each adapter's pair as mounted, once ([in, r],
# [r, out], flat), the plan (int32 [S + 1 + E]) and its entries' scales (float32 [E]).
Gather = tuple[list[mx.array], mx.array, mx.array]
# Each row's entries at a slot: (index into the slot's adapters, scale), in the set's order.
PlanRows = tuple[tuple[tuple[int, float], ...], ...]


class GatheredRows:
    """Each row's own adapters, read where they are mounted: what packed quantized weights apply.

    Per slot, the kernel takes the pairs of the adapters the rows' sets use there, each once,
    and a plan: for each row, its set's entries in the set's order (an adapter named twice is
    two entries), each an index into the pairs and the entry's scale. Nothing is copied; a plan
    is a few integers, and slots whose rows name the same entries share one.
    """

    def __init__(self, rows: Sequence[AdapterSet]):
        # The rows' entries, not their sets: `lone_rows` keeps this beside a set it holds weakly.
        self._rows = tuple(adapters.entries for adapters in rows)
        self._slots: dict[str, Gather | None] = {}
        self._plans: dict[PlanRows, tuple[mx.array, mx.array]] = {}
        # The adapters the rows' entries apply (weight not 0), each once in order of first use,
        # and the rows' entries as indices into them: every slot's plan where each of those
        # adapters has weights (most slots, often all), found without walking the rows again.
        used: dict[MountedAdapter, int] = {}
        self._everywhere: PlanRows = tuple(
            tuple(
                (used.setdefault(entry.mounted, len(used)), entry.scale)
                for entry in row
                if entry.weight != 0.0
            )
            for row in self._rows
        )
        self._used = tuple(used)
        # Whether their arrays are all of one dtype the kernel reads: then no slot's pairs need
        # checking one by one.
        dtypes = [mounted.adapter.dtype for mounted in self._used]
        one = bool(dtypes) and all(d is not None and d == dtypes[0] for d in dtypes)
        self._checked = one and dtypes[0] in _GATHERED

    def project(self, path: str, x: mx.array, base: nn.Module) -> mx.array | None:
        """`base(x)` plus each row's residuals through the packed kernel (x [S, L, in], S the
        rows, or any shape for one row); None where that kernel does not serve (other weights,
        inputs than float32, adapters other than float32 or float16 or of both)."""
        operands = self.operands(path, x, base)
        if operands is None:
            return None
        pairs, plan, scales = operands
        if not pairs:
            return base(x)
        return lora_gather(x, base, pairs, plan, scales)

    def operands(self, path: str, x: mx.array, base: nn.Module) -> Gather | None:
        """The gathered kernel's operands at `path` for this call: each adapter's pair once (none
        when no row's adapters have weights there), the plan and its scales; None where that
        kernel does not serve (see `project`)."""
        if not (serves_every_row(base) and serves_rows(x, base)):
            return None
        if path not in self._slots:
            self._slots[path] = self._slot(path)
        return self._slots[path]

    def _slot(self, path: str) -> Gather | None:
        found = [mounted.adapter.weights.get(path) for mounted in self._used]
        if all(pair is not None for pair in found):  # the composition's own plan
            present = [pair for pair in found if pair is not None]
            return self._gather(present, self._everywhere, checked=self._checked)
        index: dict[MountedAdapter, int] = {}  # in order of first use
        pairs: list[tuple[mx.array, mx.array]] = []
        rows: list[tuple[tuple[int, float], ...]] = []
        for row in self._rows:
            entries: list[tuple[int, float]] = []
            for entry in row:
                pair = entry.mounted.adapter.weights.get(path)
                if pair is None or entry.weight == 0.0:
                    continue  # adds nothing here
                if entry.mounted not in index:
                    index[entry.mounted] = len(index)
                    pairs.append(pair)
                entries.append((index[entry.mounted], entry.scale))
            rows.append(tuple(entries))
        return self._gather(pairs, tuple(rows))

    def _gather(
        self, pairs: list[tuple[mx.array, mx.array]], rows: PlanRows, *, checked: bool = False
    ) -> Gather | None:
        """The kernel's operands: the pairs, flat, and the plan of the rows' entries (index,
        scale), which slots share; None unless the pairs are all float32 or all float16
        (`checked`: known to be, from their adapters' own dtype)."""
        if not checked:
            dtype = pairs[0][0].dtype if pairs else mx.float32
            mixed = any(a.dtype != dtype or b.dtype != dtype for a, b in pairs)
            if mixed or dtype not in _GATHERED:
                return None
        planned = self._plans.get(rows)
        if planned is None:
            offsets = [0]
            for own in rows:
                offsets.append(offsets[-1] + len(own))
            indices = [i for own in rows for i, _ in own]
            scales = [scale for own in rows for _, scale in own]
            planned = self._plans[rows] = (
                mx.array(offsets + indices, dtype=mx.int32),  # [S + 1 + E]
                mx.array(scales, dtype=mx.float32),  # [E]
            )
        return [array for pair in pairs for array in pair], *planned


# What a slot does for one batch: nothing (no adapter has weights there), or its side-by-side
# pair with the rows' mask, and the batch kernel's operands where that kernel serves the slot.
_Plan = tuple[mx.array, mx.array, mx.array, tuple[mx.array, mx.array, mx.array] | None] | None


class RowAdapters:
    """What the LoRA slots apply during one batched call: each row adds its own set's residual.

    A decode step calls every slot once, so what each slot needs (pair, mask, the kernel's
    operands) is looked up once per batch and kept: `RowAdapterCache` hands the same object to
    every step while the batch's rows stay the same.
    """

    def __init__(self, side_by_side: SideBySide, rows: Sequence[AdapterSet]):
        self.side_by_side = side_by_side
        self.gathered = GatheredRows(rows)
        self._rows = tuple(rows)
        self._masks: dict[Layout, mx.array] = {}
        self._plans: dict[str, _Plan] = {}

    def same_rows(self, rows: Sequence[AdapterSet]) -> bool:
        """Whether these are this batch's rows (the same sets, in the same order)."""
        return len(rows) == len(self._rows) and all(
            mine is theirs for mine, theirs in zip(self._rows, rows, strict=True)
        )

    def project(self, path: str, x: mx.array, base: nn.Module) -> mx.array:
        """`base(x)` plus each row's residual: one call of the batch kernel where it serves."""
        gathered = self.gathered.project(path, x, base)
        if gathered is not None:
            return gathered
        plan = self._plans[path] if path in self._plans else self._plan(path, base)
        if plan is None:
            return base(x)
        a_cat, b_cat, mask, fused = plan
        if fused is not None and serves_rows(x, base):
            return lora_rows(x, base, *fused)
        return _add_residuals(x, base(x), a_cat, b_cat, mask)

    def _plan(self, path: str, base: nn.Module) -> _Plan:
        kernel = serves_lora(base) and self._float32(path)
        slot = self.side_by_side.slot(path, transposed=kernel)
        plan: _Plan = None
        if slot is not None:
            a_cat, b_cat, layout = slot
            mask = self._mask(layout, a_cat)  # [B, 1, R]
            fused = None
            if kernel and a_cat.dtype == b_cat.dtype == mx.float32:
                operands = self.side_by_side.transposed(path, a_cat, b_cat)
                fused = (*operands, mask)
            plan = (a_cat, b_cat, mask, fused)
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
            mask = mx.array(rows, dtype=a_cat.dtype)
            self._masks[layout] = mask
        return mask


def _add_residuals(
    x: mx.array, y: mx.array, a_cat: mx.array, b_cat: mx.array, mask: mx.array
) -> mx.array:
    h = (x @ a_cat) * mask  # [B, L, R]
    if h.dtype == y.dtype == b_cat.dtype:
        return mx.addmm(y, h, b_cat)  # y + h @ B_cat in one product
    return y + (h @ b_cat).astype(y.dtype)


class RowAdapterCache:
    """Builds what the slots apply for a batch of rows.

    Side-by-side pairs copy their adapters' arrays, so they are built only when a batch uses an
    adapter that none of the kept ones holds; a kept superset serves any batch whose adapters
    it holds (the columns of absent ones are masked out) while it holds no more than twice as
    many. Rows joining and leaving therefore rebuild nothing while the same adapters are in use.
    At most `keep` pairs are kept (a step's prefill call and its decode call may each need one),
    and one that `idle` calls in a row have not used is dropped: what adapters cost beyond their
    own arrays is the running batch's adapters, never every combination that ever met.
    """

    def __init__(self, keep: int = 2, idle: int = 4):
        self.keep = keep
        self.idle = idle
        self._built: dict[SideBySide, int] = {}  # -> the call that last used it; oldest first
        self._calls = 0
        self._last: RowAdapters | None = None

    def clear(self) -> None:
        """Forget every kept pair (the batch is empty: nothing would reuse them)."""
        self._built.clear()
        self._last = None

    @property
    def kept(self) -> tuple[SideBySide, ...]:
        """The side-by-side pairs kept now, least recently used first."""
        return tuple(self._built)

    def for_rows(self, rows: Sequence[AdapterSet]) -> AdapterSet | RowAdapters:
        """`rows[b]` is row b's set. One set on every row is applied as is (no mask).

        Sets are told apart by their entries: the mounted adapters themselves (by identity)
        and their weights. Requests that name the same mounts hold sets of their own that
        compute the same, and share columns. Ids and revisions are not enough: an adapter
        unmounted and mounted again from the same files, or replaced away and back, has its
        old revision under a new mount, and a request started before holds the old one.
        """
        self._calls += 1
        self._drop_idle()
        distinct: dict[tuple[AppliedAdapter, ...], AdapterSet] = {}
        for adapters in rows:
            if adapters.entries:
                distinct.setdefault(adapters.entries, adapters)
        if not distinct or (len(distinct) == 1 and all(adapters.entries for adapters in rows)):
            self._last = None  # one set for all: nothing of the last batch's is needed
            return rows[0]
        if self._last is not None and self._last.same_rows(rows):
            self._use(self._last.side_by_side)
            return self._last  # the same rows as the last step: its masks and plans hold
        # Adapters compare by identity: a replaced id is another adapter. In order of first use.
        used = {
            entry.mounted: None
            for adapters in distinct.values()
            for entry in adapters.entries
            if entry.weight != 0.0
        }
        for side_by_side in reversed(self._built):
            members = side_by_side.members
            if members.issuperset(used) and len(members) <= 2 * max(1, len(used)):
                break
        else:
            # A kept pair of some of these adapters would only duplicate the new one's columns.
            for kept in [k for k in self._built if k.members.issubset(used)]:
                self._drop(kept)
            while len(self._built) >= self.keep:
                self._drop(next(iter(self._built)))
            side_by_side = SideBySide(_in_order(used))
        self._use(side_by_side)
        self._last = RowAdapters(side_by_side, rows)
        return self._last

    def _use(self, side_by_side: SideBySide) -> None:
        self._built.pop(side_by_side, None)
        self._built[side_by_side] = self._calls  # most recently used last

    def _drop_idle(self) -> None:
        for side_by_side, last in list(self._built.items()):
            if self._calls - last > self.idle:
                self._drop(side_by_side)

    def _drop(self, side_by_side: SideBySide) -> None:
        del self._built[side_by_side]
        if self._last is not None and self._last.side_by_side is side_by_side:
            self._last = None


def _in_order(
    adapters: Sequence[MountedAdapter] | dict[MountedAdapter, None],
) -> list[MountedAdapter]:
    """The adapters side by side in one order whatever the batch: by id (a set never names two
    mounts of one id), so that a row's columns come in the same order alone and beside others."""
    return sorted(adapters, key=lambda mounted: mounted.id)


_LONE: WeakKeyDictionary[AdapterSet, GatheredRows] = WeakKeyDictionary()


def lone_rows(adapters: AdapterSet) -> GatheredRows:
    """`adapters` on every row of a call, planned as a batch of sets plans it: what the slots of
    packed quantized weights apply, so that a row's residual is the same bits alone as beside
    other sets. The plan (a few integers a slot) is kept while the set lives; the adapters'
    arrays are read where they are mounted."""
    rows = _LONE.get(adapters)
    if rows is None:
        rows = _LONE[adapters] = GatheredRows([adapters])
    return rows
