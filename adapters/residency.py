"""Which adapters stay resident: least-recently-used order, pins and a budget on one server.

The adapter manager keeps its table of mounted adapters; `Residency` keeps, beside it, the order
they were last used in, which are pinned, how many bytes they hold and what was evicted (so that
it can be loaded again on next use). It is not thread-safe: the manager calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hotlora.adapters.adapter_errors import AdapterOverBudget
from hotlora.adapters.adapter_files import LoadedAdapter
from hotlora.config.errors import listed


@dataclass(frozen=True)
class Budget:
    """What one server keeps resident at most; None: no bound."""

    max_adapters: int | None = None
    max_bytes: int | None = None  # the mounted arrays (`ram_bytes`), summed

    @property
    def bounded(self) -> bool:
        return self.max_adapters is not None or self.max_bytes is not None


@dataclass(frozen=True)
class Evicted:
    """An adapter evicted to keep within the budget: mounted again from `path` on next use."""

    id: str
    path: str
    revision: str
    ram_bytes: int
    size_bytes: int
    on_demand: bool  # mounted by a request (any revision of its files) or by hand (this one)
    evicted_at: int  # unix seconds


@dataclass(frozen=True)
class PinQuota:
    """The most adapters with ids under `prefix` that may be pinned at once (a tenant-admin's
    `max_pinned`), so that one tenant's pins cannot take the whole budget."""

    prefix: str
    most: int

    def check(self, adapter_id: str, pinned: Iterable[str]) -> None:
        """Raise `AdapterOverBudget` where pinning `adapter_id` would pass the quota."""
        others = sorted(i for i in pinned if i.startswith(self.prefix) and i != adapter_id)
        if len(others) >= self.most:
            raise AdapterOverBudget(
                f"adapter '{adapter_id}' cannot be pinned: {listed(others)} already pinned, this "
                f"key's most ({self.most}, its max_pinned); unpin or unmount one first",
                param="pin",
            )


class Residency:
    """Resident adapters' order of use, pins and bytes, and the evicted ones, under a budget."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self._used: OrderedDict[str, int] = OrderedDict()  # id -> ram bytes, least recent first
        self._bytes = 0
        self.pinned: set[str] = set()
        self.on_demand: set[str] = set()  # resident ids a request mounted, not an admin
        self.evicted: dict[str, Evicted] = {}

    @property
    def resident_bytes(self) -> int:
        return self._bytes

    def check(self, adapter_id: str, ram_bytes: int, *, pin: bool) -> None:
        """Refuse an adapter that can never fit: alone over the bytes budget, or pinned where
        the pinned ones (never evicted) would go past the budget. Changes nothing."""
        most = self.budget.max_bytes
        if most is not None and ram_bytes > most:
            raise AdapterOverBudget(
                f"adapter '{adapter_id}' needs {ram_bytes} bytes mounted, more than this "
                f"server's --adapter-memory-bytes ({most}) allows for all adapters together"
            )
        if not pin:
            return
        pinned = self.pinned - {adapter_id}
        pinned_bytes = sum(self._used.get(i, 0) for i in pinned) + ram_bytes
        count = self.budget.max_adapters
        if count is not None and len(pinned) + 1 > count:
            raise AdapterOverBudget(
                f"adapter '{adapter_id}' cannot be pinned: {len(pinned)} pinned adapters already "
                f"fill --max-mounted-adapters ({count}); unpin or unmount one first",
                param="pin",
            )
        if most is not None and pinned_bytes > most:
            raise AdapterOverBudget(
                f"adapter '{adapter_id}' cannot be pinned: with the pinned adapters it needs "
                f"{pinned_bytes} bytes, more than --adapter-memory-bytes ({most})",
                param="pin",
            )

    def added(self, adapter_id: str, ram_bytes: int, *, pin: bool, on_demand: bool) -> None:
        """`adapter_id` is resident now (a replace included), the most recently used."""
        self.removed(adapter_id)
        self.evicted.pop(adapter_id, None)
        self._used[adapter_id] = ram_bytes
        self._bytes += ram_bytes
        if pin:
            self.pinned.add(adapter_id)
        if on_demand:
            self.on_demand.add(adapter_id)

    def removed(self, adapter_id: str) -> None:
        """`adapter_id` is no longer resident (unmounted, replaced or evicted)."""
        self._bytes -= self._used.pop(adapter_id, 0)
        self.pinned.discard(adapter_id)
        self.on_demand.discard(adapter_id)

    def evict(self, adapter_id: str, adapter: LoadedAdapter) -> None:
        """`adapter_id` is evicted: no longer resident, and mounted again on next use."""
        self.evicted[adapter_id] = Evicted(
            adapter_id,
            str(adapter.path),
            adapter.revision,
            adapter.ram_bytes,
            adapter.size_bytes,
            adapter_id in self.on_demand,
            int(time.time()),
        )
        self.removed(adapter_id)

    def touch(self, adapter_ids: tuple[str, ...]) -> None:
        """These were just used: the last to be evicted."""
        for adapter_id in adapter_ids:
            if adapter_id in self._used:
                self._used.move_to_end(adapter_id)

    def over(self) -> bool:
        """Whether more is resident than the budget allows."""
        count, most = self.budget.max_adapters, self.budget.max_bytes
        return (count is not None and len(self._used) > count) or (
            most is not None and self._bytes > most
        )

    def victims(self, busy: Callable[[str], bool]) -> list[str]:
        """The least recently used ids to evict to get within the budget, skipping pinned
        ones and those `busy` says a request holds or waits for; fewer (the budget exceeded
        until they are let go) when only those are left."""
        count, most = self.budget.max_adapters, self.budget.max_bytes
        resident, total = len(self._used), self._bytes
        chosen = []
        for adapter_id, ram_bytes in self._used.items():
            within = (count is None or resident <= count) and (most is None or total <= most)
            if within:
                break
            if adapter_id in self.pinned or busy(adapter_id):
                continue
            chosen.append(adapter_id)
            resident -= 1
            total -= ram_bytes
        return chosen
