"""Different adapter sets on different rows of one batched model call.

The base projection runs once for the whole batch; each slot then adds every row's own
residual. The sets present in a batch are laid side by side along the rank axis, one
`[in, R]` / `[R, out]` pair per slot (R: the ranks of every set, summed), and a per-row mask
keeps each row's own columns, at its own scale, and zeroes the others:

    y[b] += ((x[b] @ A_cat) * mask[b]) @ B_cat

Two dense matmuls per slot whatever the number of sets. A masked column contributes an exact
zero, so a row gets its own set's residual and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from hotlora.adapters.adapter_set import AdapterSet

# Per set: the span of its columns in the side-by-side pair, and the scale on them.
Span = tuple[int, int, float]


class SideBySide:
    """The distinct adapter sets of a batch (one per `key`), side by side per slot; built
    lazily, then kept."""

    def __init__(self, sets: Sequence[AdapterSet]):
        self.sets = tuple(sets)
        self.keys = frozenset(adapters.key for adapters in self.sets)
        self._slots: dict[str, tuple[mx.array, mx.array, tuple[Span, ...]] | None] = {}

    def slot(self, path: str) -> tuple[mx.array, mx.array, tuple[Span, ...]] | None:
        """`(A_cat [in, R], B_cat [R, out], spans)` at one slot; None when no set has weights
        there. Built on first use, on the thread that runs the model (MLX streams are per
        thread)."""
        if path not in self._slots:
            self._slots[path] = self._build(path)
        return self._slots[path]

    def _build(self, path: str) -> tuple[mx.array, mx.array, tuple[Span, ...]] | None:
        a_parts, b_parts, spans = [], [], []
        start = 0
        for adapters in self.sets:
            terms = adapters.slot_terms(path)
            if not terms:
                spans.append((start, start, 0.0))
                continue
            ((a, b, scale),) = terms  # a set's terms at one slot are fused into one pair
            a_parts.append(a)
            b_parts.append(b)
            spans.append((start, start + a.shape[1], scale))
            start += a.shape[1]
        if not a_parts:
            return None
        a_cat = mx.concatenate(a_parts, axis=1)  # [in, R]
        b_cat = mx.concatenate(b_parts, axis=0)  # [R, out]
        return a_cat, b_cat, tuple(spans)


class RowAdapters:
    """What the LoRA slots apply during one batched call: each row adds its own set's residual."""

    def __init__(self, side_by_side: SideBySide, rows: Sequence[AdapterSet]):
        self.side_by_side = side_by_side
        index = {adapters.key: i for i, adapters in enumerate(side_by_side.sets)}
        self._which = [index[adapters.key] if adapters.entries else -1 for adapters in rows]
        self._masks: dict[tuple[tuple[Span, ...], int], mx.array] = {}

    def apply(self, path: str, x: mx.array, y: mx.array) -> mx.array:
        """`x` [B, L, in] and the base output `y` [B, L, out]; y plus each row's residual."""
        slot = self.side_by_side.slot(path)
        if slot is None:
            return y
        a_cat, b_cat, spans = slot
        batch, length = x.shape[0], x.shape[1]
        mask = self._mask(spans, a_cat)  # [B, R]
        # As matrices of rows ([B * L, ...]): one product each for the whole batch.
        h = x.reshape(batch * length, -1) @ a_cat  # [B * L, R]
        if length == 1:
            h = h * mask
        else:
            h = (h.reshape(batch, length, -1) * mask[:, None, :]).reshape(batch * length, -1)
        flat = y.reshape(batch * length, -1)  # [B * L, out]
        if h.dtype == flat.dtype == b_cat.dtype:
            return mx.addmm(flat, h, b_cat).reshape(y.shape)  # y + h @ B_cat in one product
        return (flat + (h @ b_cat).astype(y.dtype)).reshape(y.shape)

    def _mask(self, spans: tuple[Span, ...], a_cat: mx.array) -> mx.array:
        """[B, R]: a row's own columns at its set's scale, zero elsewhere. Slots with the
        same layout (most of a model's) share one mask."""
        width = a_cat.shape[1]
        mask = self._masks.get((spans, width))
        if mask is None:
            rows = []
            for which in self._which:
                row = [0.0] * width
                if which >= 0:
                    start, stop, scale = spans[which]
                    row[start:stop] = [scale] * (stop - start)
                rows.append(row)
            mask = mx.array(rows, dtype=a_cat.dtype)
            self._masks[(spans, width)] = mask
        return mask


class RowAdapterCache:
    """Builds what the slots apply for a batch of rows.

    Side-by-side pairs copy their sets' arrays, so they are built only when a batch needs a
    set that none of the kept ones holds; a kept superset serves any batch whose sets it holds
    (the columns of absent sets are masked out). Rows joining and leaving therefore rebuild
    nothing while the same requests run.
    """

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._built: list[SideBySide] = []  # most recently used last

    def clear(self) -> None:
        """Forget every kept pair (the batch is empty: nothing would reuse them)."""
        self._built.clear()

    def for_rows(self, rows: Sequence[AdapterSet]) -> AdapterSet | RowAdapters:
        """`rows[b]` is row b's set. One set on every row is applied as is (no mask).

        Sets are told apart by their `key` (ids, revisions and weights): the requests that
        name the same adapters hold sets of their own that compute the same, and share columns.
        """
        distinct: dict[tuple[str, ...], AdapterSet] = {}
        for adapters in rows:
            if adapters.entries:
                distinct.setdefault(adapters.key, adapters)
        if not distinct:
            return rows[0]
        if len(distinct) == 1 and all(adapters.entries for adapters in rows):
            return rows[0]
        for side_by_side in reversed(self._built):
            if side_by_side.keys.issuperset(distinct):
                self._built.remove(side_by_side)
                break
        else:
            side_by_side = SideBySide(list(distinct.values()))
            if len(self._built) >= self.keep:
                self._built.pop(0)
        self._built.append(side_by_side)
        return RowAdapters(side_by_side, rows)
