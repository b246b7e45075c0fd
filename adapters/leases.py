"""What running requests hold: each request's lease, and per adapter the leases holding it.

A request's `AdapterLease` holds its `AdapterSet` until it is released. `Holders` counts, per
adapter id, the leases holding it (what the budget never evicts and admins see as `in_use`),
and keeps one set per distinct selection, shared by the requests that make it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from hotlora.adapters.adapter_set import AdapterSet, AppliedAdapter


class AdapterLease:
    """What one request is served with, its adapters counted as in use until `release()`."""

    def __init__(self, model: str, adapters: AdapterSet, release: Callable[[], None]):
        self.model = model  # what the response's `model` echoes: what was served
        self.adapters = adapters
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Stop counting the adapters as in use; later calls do nothing."""
        release, self._release = self._release, None
        if release is not None:
            release()


class Holders:
    """The leases holding each adapter id, and the sets they share. Not thread-safe: the
    adapter manager calls it under its lock."""

    def __init__(self) -> None:
        # Counted per id, not per revision: a request that started before a `replace` or an
        # unmount still holds that id's arrays, and admins watching `in_use` must see it.
        self._counts: dict[str, int] = {}
        self._sets: weakref.WeakValueDictionary[tuple[AppliedAdapter, ...], AdapterSet] = (
            weakref.WeakValueDictionary()
        )

    def shared(self, entries: tuple[AppliedAdapter, ...]) -> AdapterSet:
        """The set of these entries that requests hold now, else a new one.

        Requests naming the same mounted adapters at the same weights share one set, so a
        stack is fused once, not once per request. Held weakly: a set lives only as long as a
        request holds it, and a remounted adapter is a new `MountedAdapter`, so a new set.
        """
        adapters = self._sets.get(entries)
        if adapters is None:
            adapters = self._sets[entries] = AdapterSet(entries)
        return adapters

    def add(self, adapters: AdapterSet, change: int) -> None:
        """Count a lease of `adapters` taken (+1) or released (-1)."""
        for entry in adapters.entries:
            adapter_id = entry.mounted.id
            left = self._counts.get(adapter_id, 0) + change
            if left:
                self._counts[adapter_id] = left
            else:
                del self._counts[adapter_id]

    def count(self, adapter_id: str) -> int:
        """The leases holding `adapter_id`."""
        return self._counts.get(adapter_id, 0)
