"""Different adapter sets on different rows of one batched model call: the state the backends
read, and the cache that keeps it while a batch's rows stay the same.

`RowAdapters` holds a batch's rows and, built lazily by whichever backend serves a slot, their
side-by-side pair with its masks (`side_by_side.MaskedRows`) and their gathered plan
(`gathered.GatheredRows`). `RowAdapterCache` hands the scheduler one per batched call.
"""

from __future__ import annotations

from collections.abc import Sequence

from hotlora.adapters.adapter_set import AdapterSet, AppliedAdapter, MountedAdapter
from hotlora.adapters.backends.gathered import GatheredRows
from hotlora.adapters.backends.side_by_side import MaskedRows, SideBySide


class RowAdapters:
    """What the LoRA slots apply during one batched call: each row adds its own set's residual.

    A decode step calls every slot once, so what each slot needs (pair, mask, the kernel's
    operands, the gathered plan) is looked up once per batch and kept: `RowAdapterCache` hands
    the same object to every step while the batch's rows stay the same.
    """

    def __init__(self, side_by_side: SideBySide, rows: Sequence[AdapterSet]):
        self.side_by_side = side_by_side
        self.masked = MaskedRows(side_by_side, rows)
        self.gathered = GatheredRows(rows)
        self._rows = tuple(rows)

    def same_rows(self, rows: Sequence[AdapterSet]) -> bool:
        """Whether these are this batch's rows (the same sets, in the same order)."""
        return len(rows) == len(self._rows) and all(
            mine is theirs for mine, theirs in zip(self._rows, rows, strict=True)
        )


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
