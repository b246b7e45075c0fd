"""The adapter registry of a Ray Serve deployment: one named actor that every replica follows.

`AdapterRegistry` (a Ray actor) holds the cluster's `MountedSet`, also written to
$HOTLORA_HOME/mounts.json with `--persist-mounts`. `ClusterMounts` is one replica's side: its
adapter manager's journal (an admin change made through any replica is recorded in the registry
before that replica makes it, and refused there as on one machine), and what keeps the replica's
own mounts at the registry's revisions: before it reports ready, on each request's admission,
and every second in the background. With `max_mounted_adapters` a replica keeps only the most
recently used adapters mounted and mounts others from the registry when a request names them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ray

from hotlora.adapters import (
    MOUNTS_FILE,
    AdapterConflict,
    AdapterError,
    AdapterManager,
    AdapterNotFound,
    MountedSet,
    MountRecord,
    open_mounted_set,
    report_unmountable,
    write_mounted_set,
)
from hotlora.config.log_text import printable
from hotlora.config.settings import Settings

log = logging.getLogger("hotlora.adapters")

NAMESPACE = "hotlora"
WATCH_SECONDS = 1.0

# What `snapshot` answers: the registry's generation (new each time the actor starts), its
# version, and its records in mount order.
Snapshot = tuple[str, int, list[MountRecord]]


class AdapterRegistry:
    """The mounted set of a whole deployment, as a Ray actor: calls run one at a time."""

    def __init__(self, record_path: str | None = None):
        self._path = Path(record_path) if record_path else None
        self._set = open_mounted_set(self._path) if self._path else MountedSet()
        self._generation = uuid.uuid4().hex

    def snapshot(self, known: tuple[str, int] | None = None) -> Snapshot | None:
        """The set, or None when `known` (generation, version) is already the current one."""
        if known == (self._generation, self._set.version):
            return None
        return self._generation, self._set.version, list(self._set.records.values())

    def mount(self, adapter_id: str, path: str, revision: str, replace: bool) -> str | None:
        """Record a mount; the conflict's message when it is refused."""
        updated = self._set.copy()
        try:
            changed = updated.mount(adapter_id, path, revision, replace=replace)
        except AdapterConflict as exc:
            return exc.message
        if changed:
            self._commit(updated)
        return None

    def unmount(self, adapter_id: str) -> list[str] | None:
        """Forget an id; the registered ids when it is not one of them."""
        if adapter_id not in self._set.records:
            return list(self._set.records)
        updated = self._set.copy()
        updated.unmount(adapter_id)
        self._commit(updated)
        return None

    def forget(self, adapter_id: str, revision: str) -> bool:
        """Drop an entry whose files no replica can mount again, if it still has `revision`."""
        record = self._set.records.get(adapter_id)
        if record is None or record.revision != revision:
            return False
        updated = self._set.copy()
        updated.unmount(adapter_id)
        self._commit(updated)
        return True

    def _commit(self, updated: MountedSet) -> None:
        if self._path is not None:
            write_mounted_set(self._path, updated)
        self._set = updated


def registry_name(app_name: str) -> str:
    return f"adapters:{app_name}"


class RegistryClient:
    """Calls to the registry actor: blocking ones for worker threads, awaitable ones for the
    event loop, and ones sent without waiting (calls from one caller run in order)."""

    def __init__(self, actor: Any):
        self._actor = actor

    def call(self, method: str, *args: Any) -> Any:
        return ray.get(getattr(self._actor, method).remote(*args))

    async def call_async(self, method: str, *args: Any) -> Any:
        return await getattr(self._actor, method).remote(*args)

    def send(self, method: str, *args: Any) -> None:
        getattr(self._actor, method).remote(*args)


def registry_actor(app_name: str, settings: Settings) -> Any:
    """The app's registry actor, started by whichever replica asks first.

    Detached: it outlives the replica that started it, so a replica restart never loses the
    set. With `persist_mounts` it reads and writes the mount record under HOTLORA_HOME.
    """
    record = str(settings.home / MOUNTS_FILE) if settings.persist_mounts else None
    actor = ray.remote(AdapterRegistry).options(
        name=registry_name(app_name),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
    )
    return actor.remote(record)


class ClusterMounts:
    """One replica's link to the registry: its manager's journal, and its mounts kept in step.

    Thread-safe: the manager calls the journal methods on worker threads; `admit` and `watch`
    run on the replica's event loop and apply changes on a worker thread, one at a time.
    """

    def __init__(
        self,
        registry: RegistryClient,
        *,
        max_mounted: int | None = None,
        startup: dict[str, str] | None = None,
    ):
        self._registry = registry
        self._max = max_mounted
        self._startup = dict(startup or {})
        self._manager: AdapterManager | None = None
        self._state = threading.Lock()
        self._records: dict[str, MountRecord] = {}  # the registry's set, as last applied
        self._known: tuple[str, int] | None = None  # its (generation, version)
        self._used: OrderedDict[str, None] = OrderedDict()  # mounted here, least recent first
        self._pins: Counter[str] = Counter()  # ids requests in flight were admitted with
        self._applying: asyncio.Lock | None = None

    # The journal: the manager records here before it changes (admin routes, start-up flags).

    def mounted(
        self, adapter_id: str, path: str, revision: str, replace: bool, *, pin: bool = False
    ) -> None:
        # A replica keeps its own cap over the registry's set; a pin is no part of that set.
        problem = self._registry.call("mount", adapter_id, path, revision, replace)
        if problem is not None:
            raise AdapterConflict(problem)
        self._touch([adapter_id])

    def unmounted(self, adapter_id: str) -> None:
        registered = self._registry.call("unmount", adapter_id)
        if registered is not None:
            raise AdapterNotFound(adapter_id, registered)

    def restore(self, manager: AdapterManager) -> None:
        """Mount the registry's set (up to the cap) before the replica reports ready; then the
        start-up adapters the registry does not hold yet (its own entry wins over the flag)."""
        self._manager = manager
        self._apply(self._registry.call("snapshot", None), set())
        for adapter_id, path in self._startup.items():
            if adapter_id not in self._records:
                manager.mount(adapter_id, path)

    # Keeping in step.

    async def admit(self, wanted: Iterable[str] = ()) -> Callable[[], None]:
        """Bring this replica to the registry's current set, with the `wanted` ids it holds
        mounted here; they stay mounted until the returned release is called.

        A request admitted after this returns is served with the revisions the registry held
        when it was called. Ids the registry does not hold are left to the app's 404.
        """
        wanted = set(wanted)
        with self._state:
            self._pins.update(wanted)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                with self._state:
                    self._pins.subtract(wanted)
                    self._pins += Counter()  # drop the zero counts

        try:
            snapshot = await self._registry.call_async("snapshot", self._known)
            if snapshot is not None or self._missing(wanted) or self._over_cap():
                if self._applying is None:
                    self._applying = asyncio.Lock()
                async with self._applying:
                    await asyncio.to_thread(self._apply, snapshot, wanted)
            self._touch(wanted & set(self._records))
        except BaseException:
            release()
            raise
        return release

    async def watch(self, every: float = WATCH_SECONDS) -> None:
        """Follow the registry while idle, so a change is mounted before a request asks."""
        while True:
            await asyncio.sleep(every)
            try:
                (await self.admit())()
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("could not follow the adapter registry: %s", printable(exc))

    def _over_cap(self) -> bool:
        """More mounted than the cap: what admitted requests held beyond it is evictable once
        they let go."""
        assert self._manager is not None
        return self._max is not None and len(self._manager.list()) > self._max

    def _missing(self, wanted: set[str]) -> bool:
        assert self._manager is not None
        here = {info.id for info in self._manager.list()}
        return any(i in self._records and i not in here for i in wanted)

    def _apply(self, snapshot: Snapshot | None, wanted: set[str]) -> None:
        """Make this replica's mounts match the registry's set; on a worker thread."""
        manager = self._manager
        assert manager is not None
        records, known = self._records, self._known
        if snapshot is not None and self._newer(snapshot):
            generation, version, listed = snapshot
            if known is not None and generation != known[0]:
                self._offer_to_new_registry(manager, listed)
                generation, version, listed = self._registry.call("snapshot", None)
            records = {record.id: record for record in listed}
            known = (generation, version)
        here = {info.id: info.revision for info in manager.list()}
        for adapter_id in here:
            if adapter_id not in records:
                self._unmount(manager, adapter_id)
        for adapter_id, record in records.items():
            have = here.get(adapter_id)
            if have == record.revision:
                continue
            if have is None and adapter_id not in wanted and self._full(manager):
                continue  # mounted when a request asks for it
            self._mount(manager, record, stale=have is not None)
        self._evict(manager, keep=wanted)
        # Only now is this version the one followed: an admission that finds it current goes
        # ahead without waiting, so it must find its revisions mounted.
        self._records, self._known = records, known

    def _newer(self, snapshot: Snapshot) -> bool:
        if self._known is None or snapshot[0] != self._known[0]:
            return True
        return snapshot[1] > self._known[1]

    def _offer_to_new_registry(self, manager: AdapterManager, records: list[MountRecord]) -> None:
        """The registry actor restarted without a record: give it back what is mounted here
        (the first replica to offer an id wins)."""
        registered = {record.id for record in records}
        for info in manager.list():
            if info.id not in registered:
                self._registry.send("mount", info.id, info.path, info.revision, False)
        log.warning("the adapter registry restarted; offered it this replica's adapters")

    def _mount(self, manager: AdapterManager, record: MountRecord, *, stale: bool) -> None:
        try:
            manager.mount(
                record.id, record.path, replace=True, revision=record.revision, record=False
            )
        except AdapterError as exc:
            # Files that no longer hash to the registered revision: nobody can mount it again.
            report_unmountable(record, exc)
            if stale:
                self._unmount(manager, record.id)  # never serve a revision it no longer holds
            self._registry.call("forget", record.id, record.revision)
            return
        self._touch([record.id])

    def _unmount(self, manager: AdapterManager, adapter_id: str, *, evicted: bool = False) -> None:
        with contextlib.suppress(AdapterNotFound):  # an admin call got there first
            manager.unmount(adapter_id, record=False, evicted=evicted)
        with self._state:
            self._used.pop(adapter_id, None)

    def _full(self, manager: AdapterManager) -> bool:
        return self._max is not None and len(manager.list()) >= self._max

    def _evict(self, manager: AdapterManager, keep: set[str]) -> None:
        """Unmount the least recently used adapters beyond the cap, never one that a request in
        flight was admitted with (the cap is exceeded rather than that)."""
        if self._max is None:
            return
        here = [info.id for info in manager.list()]
        with self._state:
            for adapter_id in here:
                if adapter_id not in self._used:
                    self._used[adapter_id] = None
                    self._used.move_to_end(adapter_id, last=False)
            candidates = [
                i for i in self._used if i in here and i not in keep and not self._pins[i]
            ]
        for adapter_id in candidates[: max(0, len(here) - self._max)]:
            self._unmount(manager, adapter_id, evicted=True)

    def _touch(self, ids: Iterable[str]) -> None:
        with self._state:
            for adapter_id in ids:
                self._used[adapter_id] = None
                self._used.move_to_end(adapter_id)
