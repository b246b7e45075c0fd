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
(`hotlora.models.cpu.layers.lora_gather`) takes one plan for the batch, built once: the
adapters its rows use, each's pairs as mounted (held by the native extension, so a step's graph
carries none of their arrays), and per row the adapters of its set in the set's order with
their scales; a call names the plan and its slot's number. Each row computes its own low-rank
products alone. A set alone on every row goes through it too (`lone_rows`), so a row's result
is the same bits alone and beside any other sets, and adapters cost their own arrays whatever
the traffic.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from weakref import WeakKeyDictionary

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_files import LoadedAdapter
from hotlora.adapters.adapter_set import AdapterSet, AppliedAdapter, MountedAdapter
from hotlora.models.cpu import extension
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

# One slot's operands of the gathered kernel: the batch's plan (its adapters, each once, and
# each row's entries) and the slot's number, -1 where none of those adapters has weights there.
Gather = tuple[object, int]

_SLOT_NUMBERS: dict[str, int] = {}  # each slot's path, numbered in order of first use
_SLOT_LOCK = threading.Lock()


def slot_number(path: str) -> int:
    """The number the gathered kernels know the LoRA slot at `path` by: one per path, for the
    life of the process (an adapter's pairs and a kernel call name slots by it)."""
    number = _SLOT_NUMBERS.get(path)
    if number is None:
        with _SLOT_LOCK:
            number = _SLOT_NUMBERS.setdefault(path, len(_SLOT_NUMBERS))
    return number


_PAIRS: WeakKeyDictionary[LoadedAdapter, object] = WeakKeyDictionary()


def gathered_pairs(adapter: LoadedAdapter) -> object | None:
    """The adapter's pairs as the gathered kernels read them, by slot number: its own arrays,
    held (not copied) for as long as a batch's plan uses them, kept while the adapter lives.
    None where those kernels do not read them (no extension, or arrays other than all float32
    or all float16)."""
    native = extension.native
    if native is None or adapter.dtype not in _GATHERED:
        return None
    pairs = _PAIRS.get(adapter)
    if pairs is None:
        numbered = {slot_number(path): pair for path, pair in adapter.weights.items()}
        by_slot: list[tuple[mx.array, mx.array] | None] = [None] * (max(numbered, default=-1) + 1)
        for number, pair in numbered.items():
            by_slot[number] = pair
        try:
            pairs = native.adapter_pairs(by_slot)
        except ValueError:  # a view (mounts are row-major): its row-major copy, held there
            rows = [
                None if p is None else (mx.contiguous(p[0]), mx.contiguous(p[1])) for p in by_slot
            ]
            pairs = native.adapter_pairs(rows)
        _PAIRS[adapter] = pairs
    return pairs


class GatheredRows:
    """Each row's own adapters, read where they are mounted: what packed quantized weights apply.

    The kernels take one plan for the batch, the same at every slot: the adapters the rows'
    sets use, each once (each's pairs at every slot, `gathered_pairs`), and for each row its
    set's entries in the set's order (an adapter named twice is two entries), each an index into
    those adapters and the entry's scale. At a slot, an entry whose adapter has no weights there
    adds nothing. Nothing is copied, and a step's graph carries no adapter array: a call names
    the plan and its slot's number.
    """

    def __init__(self, rows: Sequence[AdapterSet]):
        # The rows' entries, not their sets: `lone_rows` keeps this beside a set it holds weakly.
        self._rows = tuple(adapters.entries for adapters in rows)
        self._slots: dict[str, int] = {}
        self._plan: object | None = None
        self._planned = False
        # The adapters the rows' entries apply (weight not 0), each once in order of first use,
        # and each row's entries as indices into them.
        used: dict[MountedAdapter, int] = {}
        self._offsets = [0]
        self._entries: list[int] = []
        self._scales: list[float] = []
        for row in self._rows:
            for entry in row:
                if entry.weight != 0.0:
                    self._entries.append(used.setdefault(entry.mounted, len(used)))
                    self._scales.append(entry.scale)
            self._offsets.append(len(self._entries))
        self._used = tuple(used)

    def project(self, path: str, x: mx.array, base: nn.Module) -> mx.array | None:
        """`base(x)` plus each row's residuals through the packed kernel (x [S, L, in], S the
        rows, or any shape for one row); None where that kernel does not serve (other weights,
        inputs than float32, adapters other than float32 or float16)."""
        operands = self.operands(path, x, base)
        if operands is None:
            return None
        plan, slot = operands
        if slot < 0:
            return base(x)
        return lora_gather(x, base, plan, slot)

    def operands(self, path: str, x: mx.array, base: nn.Module) -> Gather | None:
        """The gathered kernel's operands at `path` for this call: the batch's plan and the
        slot's number (-1 when no row's adapters have weights there); None where that kernel
        does not serve (see `project`)."""
        if not (serves_every_row(base) and serves_rows(x, base)):
            return None
        plan = self._native_plan()
        if plan is None:
            return None
        slot = self._slots.get(path)
        if slot is None:
            present = any(path in mounted.adapter.weights for mounted in self._used)
            slot = self._slots[path] = slot_number(path) if present else -1
        return plan, slot

    def _native_plan(self) -> object | None:
        """The kernels' plan, built on first use; None unless they read every adapter's pairs."""
        if not self._planned:
            self._planned = True
            pairs = [gathered_pairs(mounted.adapter) for mounted in self._used]
            if all(p is not None for p in pairs) and extension.native is not None:
                self._plan = extension.native.row_plan(
                    pairs, self._offsets, self._entries, self._scales
                )
        return self._plan


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
    other sets. The plan (one for every slot) is kept while the set lives; the adapters'
    arrays are read where they are mounted."""
    rows = _LONE.get(adapters)
    if rows is None:
        rows = _LONE[adapters] = GatheredRows([adapters])
    return rows
