"""Each row's own adapters read where they are mounted: the residual backend of packed weights.

Packed quantized weights copy nothing (Punica's gathered form): their kernel
(`hotlora.models.cpu.layers.lora_gather`) takes one plan for the batch, built once: the
adapters its rows use, each's pairs as mounted (held by the native extension, so a step's graph
carries none of their arrays), and per row the adapters of its set in the set's order with
their scales; a call names the plan and its slot's number. Each row computes its own low-rank
products alone. A set alone on every row goes through it too (`lone_rows`), so a row's result
is the same bits alone and beside any other sets, and adapters cost their own arrays whatever
the traffic. The fused layers (`models.cpu.fused`) take the same operands.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_files import LoadedAdapter
from hotlora.adapters.adapter_set import AdapterSet, MountedAdapter
from hotlora.adapters.backends.base import Gather, ResidualBackend
from hotlora.models.cpu import extension
from hotlora.models.cpu.layers import lora_gather

if TYPE_CHECKING:
    from hotlora.adapters.backends.per_row import RowAdapters

_GATHERED = (mx.float32, mx.float16)  # the pairs' dtypes the gathered kernel reads

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
        rows, or any shape for one row; `base` packed); None where that kernel does not serve
        (inputs other than float32, adapters other than float32 or float16)."""
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
        if not base.takes(x):
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


class Gathered:
    """The residual backend of packed quantized weights: every call through the gathered
    kernel, a set alone planned as a batch of one set. Where that kernel does not serve a call
    (an input other than float32, adapters in another dtype than float32 or float16), the
    `fallback` backend (MLX's operations) adds the residuals instead."""

    name = "gathered"
    fuses = True

    def __init__(self, fallback: ResidualBackend):
        self._fallback = fallback

    def project_set(
        self, path: str, base: nn.Module, adapters: AdapterSet, x: mx.array
    ) -> mx.array:
        """`base(x)` plus the set's residuals, the same bits as beside other sets."""
        y = lone_rows(adapters).project(path, x, base)
        return self._fallback.project_set(path, base, adapters, x) if y is None else y

    def project_rows(self, path: str, base: nn.Module, rows: RowAdapters, x: mx.array) -> mx.array:
        """`base(x)` plus each row's own residuals."""
        y = rows.gathered.project(path, x, base)
        return self._fallback.project_rows(path, base, rows, x) if y is None else y

    def gather_set(
        self, path: str, base: nn.Module, adapters: AdapterSet, x: mx.array
    ) -> Gather | None:
        """The set's plan (a batch of one set) and the slot's number."""
        return lone_rows(adapters).operands(path, x, base)

    def gather_rows(
        self, path: str, base: nn.Module, rows: RowAdapters, x: mx.array
    ) -> Gather | None:
        """The batch's plan and the slot's number."""
        return rows.gathered.operands(path, x, base)
