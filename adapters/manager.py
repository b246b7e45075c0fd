"""The adapter manager: one per app, owning every mounted adapter's arrays.

`select` is the one call a request makes: from its `model` and `adapter` fields to a leased,
request-owned `AdapterSet`, mounting on first use what it may (`auto_mount`, or an adapter
evicted to keep within the budget: its `first_use.FirstUseMounts` says which, and shares each
load). What requests hold is counted in `leases.Holders`. Every change to what is mounted,
whatever asked for it (the admin API, start-up, a request, the budget, the mount record, the
Ray cluster's registry), is told to the manager's listeners as a `MountEvent`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_errors import (
    AdapterConflict,
    AdapterError,
    AdapterNotFound,
    InvalidAdapter,
)
from hotlora.adapters.adapter_files import MAX_ADAPTER_BYTES, read_to_mount, resolve_under_root
from hotlora.adapters.adapter_info import (
    AdapterInfo,
    MountEvent,
    MountListener,
    evicted_info,
    mounted_info,
)
from hotlora.adapters.adapter_set import (
    BASE_ONLY,
    AdapterSet,
    AppliedAdapter,
    MountedAdapter,
)
from hotlora.adapters.first_use import LOAD_PRECEDENCE_S, FirstUseMounts
from hotlora.adapters.leases import AdapterLease, Holders
from hotlora.adapters.projections import target_dims, with_base_layout
from hotlora.adapters.residency import Budget, Evicted, PinQuota, Residency
from hotlora.adapters.root_listing import RootEntry, list_root
from hotlora.adapters.slots import install_slots, probe_input_dtypes
from hotlora.adapters.spec import (
    AdapterRef,
    adapter_id_problem,
    format_adapter_spec,
    parse_selection,
    selecting_field,
)
from hotlora.config.log_text import printable
from hotlora.models.cpu import give_back_freed_memory

if TYPE_CHECKING:
    from hotlora.adapters.mount_journal import MountJournal

log = logging.getLogger("hotlora.adapters")


class AdapterManager:
    """Mounts, unmounts and selects LoRA adapters over one base model that never reloads.

    Construction wraps the base's target projections in `LoRASlot`s once. After that,
    `mount`/`unmount` only change the manager's table of mounted adapters (under a lock), and
    requests get their own immutable `AdapterSet` from `select`, so the worker thread's model
    calls never see a change half-way. Each change is then told to every listener, in the order
    the changes were made; a listener must not mount or unmount itself.

    With a `budget`, the least recently used adapters that no request holds and no admin pinned
    are evicted past it, and mounted again when a request names them. With `auto_mount`, a
    request naming a directory under the adapter root that is not mounted mounts it (its id is
    the directory's name). Concurrent first requests for one adapter share one load.

    Adapters are kept in `adapter_dtype` where the model computes in float32; float16 halves
    what each adapter holds and what a step reads of it. Where the activations are float16 or
    bfloat16, adapters are kept in that dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        base_id: str,
        adapter_root: Path,
        max_rank: int,
        max_bytes: int = MAX_ADAPTER_BYTES,
        journal: MountJournal | None = None,
        listeners: Iterable[MountListener] = (),
        budget: Budget | None = None,
        auto_mount: bool = False,
        adapter_dtype: mx.Dtype = mx.float32,
    ):
        self.base_id = base_id
        self.adapter_root = Path(adapter_root).expanduser().resolve()
        self.max_rank = max_rank
        self.max_bytes = max_bytes  # per adapter file, checked on disk before reading
        self.auto_mount = auto_mount
        slots = install_slots(model)
        if not slots:
            log.warning("%s has no q/k/v/o/gate/up/down projections", type(model).__name__)
        dtypes = probe_input_dtypes(model)
        dims = {
            path: target_dims(slot.base, dtypes.get(path), adapter_dtype)
            for path, slot in slots.items()
        }
        self._targets = with_base_layout(model, dims)
        self._lock = threading.Lock()
        # Mounts and unmounts one at a time: each is recorded in the journal (the mount record,
        # the Ray cluster's registry), which may refuse it, before the table here changes.
        self._journal = journal
        self._listeners = tuple(listeners)
        self._admin = threading.Lock()
        self._eviction_waits = False  # a thread waits on `_admin` to evict what was let go
        self._mounted: dict[str, MountedAdapter] = {}
        self._residency = Residency(budget or Budget())
        self._first_use = FirstUseMounts(
            self._mount_on_first_use,
            self._residency,
            base_id=base_id,
            adapter_root=self.adapter_root,
            auto_mount=auto_mount,
        )
        self._holders = Holders()

    def select(self, model: str, refs: tuple[AdapterRef, ...] = ()) -> AdapterLease:
        """What a request with these `model` and `adapter` fields is served with, leased.

        `model` may name the base (then `refs` select the adapters), a mounted adapter id, or
        `"<base-id>:<spec>"`. Raises `ModelNotFound` for any other model, `InvalidRequest` when
        both fields select adapters or the model's spec is malformed, and `AdapterNotFound`
        for an id that is neither mounted nor loadable. An adapter evicted by the budget, or
        (with `auto_mount`) a directory under the root, is mounted first: this call blocks on
        its files then, and a load that fails raises `InvalidAdapter` naming the problem.
        Nothing is counted as in use unless this returns.
        """
        first_use = self._first_use
        waiting: tuple[str, ...] = ()  # ids this request is counted as waiting for
        try:
            while True:
                with self._lock:
                    selectable = first_use.selectable(self._mounted)
                    named = parse_selection(self.base_id, model, refs, selectable)
                    missing = tuple(ref.id for ref in named if ref.id not in self._mounted)
                    if not missing:
                        lease = self._lease(model, named)
                        first_use.wait(waiting, -1)
                        waiting = ()
                        return lease
                    for adapter_id in missing:
                        if not first_use.loadable(adapter_id):
                            field = selecting_field(refs)
                            raise AdapterNotFound(adapter_id, self._mounted, param=field)
                    first_use.wait(tuple(i for i in missing if i not in waiting), 1)
                    waiting = tuple(dict.fromkeys((*waiting, *missing)))
                try:
                    first_use.load_all(missing)
                except (InvalidAdapter, AdapterConflict) as exc:
                    if selecting_field(refs) == exc.param:
                        raise
                    # Named in `model`: the same error (shared by the load's waiters), its field.
                    raise type(exc)(exc.message, param="model", code=exc.code) from None
        finally:
            if waiting:
                with self._lock:
                    first_use.wait(waiting, -1)

    def try_select(self, model: str, refs: tuple[AdapterRef, ...] = ()) -> AdapterLease | None:
        """`select` without loading: None when an adapter must be mounted first (then call
        `select` where blocking is fine). Raises as `select` does."""
        with self._lock:
            selectable = self._first_use.selectable(self._mounted)
            named = parse_selection(self.base_id, model, refs, selectable)
            for ref in named:
                if ref.id not in self._mounted:
                    if self._first_use.loadable(ref.id):
                        return None
                    raise AdapterNotFound(ref.id, self._mounted, param=selecting_field(refs))
            return self._lease(model, named)

    def yield_to_loads(self, most: float = LOAD_PRECEDENCE_S) -> None:
        """Block while adapters are being mounted on first use, `most` seconds at most (the
        generation worker calls this before each step: `FirstUseMounts.yield_to_loads`)."""
        self._first_use.yield_to_loads(most)

    def mount(
        self,
        adapter_id: str,
        path: str | Path,
        replace: bool = False,
        *,
        revision: str | None = None,
        record: bool = True,
        pin: bool = False,
    ) -> AdapterInfo:
        """Validate the adapter at `path` (under the adapter root) and mount it as `adapter_id`.

        All or nothing: any problem raises before anything changes. The same files under
        the same id return the existing info; other files raise `AdapterConflict` unless
        `replace`, which swaps atomically while running requests keep the old arrays.
        With `revision`, files that no longer hash to it are refused (`AdapterConflict`, code
        `adapter_changed`): a recorded mount is made again exactly or not at all. The journal
        records the change first; `record=False` applies one recorded elsewhere. `pin` keeps
        it from eviction; an adapter that can never fit the budget raises `AdapterOverBudget`.
        """
        info, _ = self._mount(adapter_id, path, replace, revision=revision, record=record, pin=pin)
        return info

    def mount_reporting_change(
        self,
        adapter_id: str,
        path: str | Path,
        replace: bool = False,
        *,
        pin: bool = False,
        within: Path | None = None,
        pin_quota: PinQuota | None = None,
    ) -> tuple[AdapterInfo, bool]:
        """`mount`, and whether this call mounted the files (False: the same revision was
        mounted already, by an earlier call or one running beside it; pinning it is no new
        mount). Told under the manager's lock, so of concurrent mounts of the same files
        exactly one says True. `within`: a folder under the root every file read must resolve
        under (a tenant's own), links included. `pin_quota`: the most pinned ids under a prefix
        (a tenant's own) a pin may make."""
        return self._mount(
            adapter_id,
            path,
            replace,
            revision=None,
            record=True,
            pin=pin,
            within=within,
            pin_quota=pin_quota,
        )

    def _mount(
        self,
        adapter_id: str,
        path: str | Path,
        replace: bool,
        *,
        revision: str | None,
        record: bool,
        pin: bool = False,
        on_demand: bool = False,
        within: Path | None = None,
        pin_quota: PinQuota | None = None,
    ) -> tuple[AdapterInfo, bool]:
        problem = adapter_id_problem(adapter_id)
        if problem is None and adapter_id == self.base_id:
            problem = f"'{adapter_id}' is the base model's id; choose another adapter id"
        if problem:
            raise InvalidAdapter(problem, param="id")
        directory = resolve_under_root(path, self.adapter_root)
        began = time.perf_counter()
        loaded = read_to_mount(
            adapter_id,
            directory,
            self._targets,
            revision=revision,
            max_rank=self.max_rank,
            max_bytes=self.max_bytes,
            # One mounted on first use reads its files from its own directory alone: no link
            # in it reads another's (a tenant-admin's folder may be such a directory).
            root=within or (directory if on_demand else self.adapter_root),
        )
        with self._admin:
            with self._lock:
                if pin and pin_quota is not None:
                    pin_quota.check(adapter_id, self._residency.pinned)
                current = self._mounted.get(adapter_id)
                same = current is not None and current.adapter.revision == loaded.revision
                # An admin mounting what a request mounted makes it theirs: recorded, kept.
                adopt = same and not on_demand and adapter_id in self._residency.on_demand
                if same and not adopt:
                    assert current is not None
                    # The same files: a pin asked for is added; a replace without one unpins,
                    # as a replace with other files does; else nothing changes.
                    pinned = adapter_id in self._residency.pinned
                    if pin == pinned or not (pin or replace):
                        return self._info(current), False
                    if pin:
                        self._residency.check(adapter_id, loaded.ram_bytes, pin=True)
                elif current is not None and not replace and not adopt:
                    raise AdapterConflict(
                        f"adapter '{adapter_id}' is already mounted from {current.adapter.path} "
                        f"(revision {current.short_revision}); unmount it or mount with replace"
                    )
                elif (gone := self._rebinds_evicted(adapter_id, loaded.revision)) and not (
                    replace or on_demand
                ):
                    # Evicted, the id still names its files (the next request mounts them).
                    raise AdapterConflict(
                        f"adapter '{adapter_id}' is mounted from {gone.path} (revision "
                        f"{gone.revision[:12]}), evicted until its next use; unmount it or mount "
                        "with replace"
                    )
                else:
                    try:
                        self._residency.check(adapter_id, loaded.ram_bytes, pin=pin)
                    except AdapterError:
                        del loaded
                        give_back_freed_memory()
                        raise
            if same and not adopt:
                return self._pin(current, pin, replace, record=record), False
            if record and self._journal is not None:
                self._journal.mounted(
                    adapter_id, str(directory), loaded.revision, replace or adopt, pin=pin
                )
            with self._lock:
                current = self._mounted.get(adapter_id)
                mounted = MountedAdapter(adapter_id, loaded, int(time.time()))
                self._mounted[adapter_id] = mounted
                self._residency.added(adapter_id, loaded.ram_bytes, pin=pin, on_demand=on_demand)
                info = self._info(mounted)
            took = time.perf_counter() - began
            kind: Literal["mounted", "loaded"] = "loaded" if on_demand else "mounted"
            self._tell(MountEvent(kind, adapter_id, info.revision, took, info.ram_bytes))
            self._evict_over_budget(keep=adapter_id)
        if current is not None:
            del current
            give_back_freed_memory()
        log.info(
            "%s adapter %s from %s (rev %s)",
            kind,
            printable(adapter_id),
            printable(directory),
            info.revision[:12],
        )
        # An admin adopting what a request mounted mounts again the revision already there.
        return info, not adopt

    def _rebinds_evicted(self, adapter_id: str, revision: str) -> Evicted | None:
        """The evicted adapter of this id, where its files are not those of `revision`."""
        gone = self._residency.evicted.get(adapter_id)
        return gone if gone is not None and gone.revision != revision else None

    def _mount_on_first_use(self, adapter_id: str) -> None:
        """Mount `adapter_id` for the requests that name it, unless it is mounted by now: from
        where it was evicted, else from its directory under the root."""
        with self._lock:
            if adapter_id in self._mounted:
                return  # a load that ended before this caller asked
            gone = self._residency.evicted.get(adapter_id)
        path = gone.path if gone is not None else adapter_id
        # An adapter mounted by hand comes back as it was mounted, or not at all.
        revision = gone.revision if gone is not None and not gone.on_demand else None
        on_demand = gone is None or gone.on_demand
        self._mount(adapter_id, path, False, revision=revision, record=False, on_demand=on_demand)

    def _pin(
        self, mounted: MountedAdapter | None, pin: bool, replace: bool, *, record: bool
    ) -> AdapterInfo:
        """Pin or unpin what is mounted already, recorded first as a mount is. Called holding
        `_admin`."""
        assert mounted is not None
        adapter = mounted.adapter
        if record and self._journal is not None:
            self._journal.mounted(mounted.id, str(adapter.path), adapter.revision, replace, pin=pin)
        with self._lock:
            if pin:
                self._residency.pinned.add(mounted.id)
            else:
                self._residency.pinned.discard(mounted.id)
            return self._info(mounted)

    def unmount(
        self, adapter_id: str, *, record: bool = True, evicted: bool = False
    ) -> AdapterInfo:
        """Forget `adapter_id` and free its arrays once no running request holds them.

        The slots hold no adapter state, so dropping the table's entry is all it takes; new
        requests naming it get `AdapterNotFound`. The journal records it first, as in `mount`.
        `evicted`: made to keep within a cap on mounted adapters, not asked for; the listeners
        hear an "evicted" event instead of "unmounted". An adapter evicted by the budget is
        forgotten too: it is not mounted again on next use.
        """
        with self._admin:
            with self._lock:
                gone = self._residency.evicted.get(adapter_id)
                if adapter_id not in self._mounted and gone is None:
                    raise AdapterNotFound(adapter_id, self._mounted)
            # What a request mounted on first use was never recorded.
            on_demand = adapter_id in self._residency.on_demand or bool(gone and gone.on_demand)
            if record and self._journal is not None and not on_demand:
                self._journal.unmounted(adapter_id)
            with self._lock:
                mounted = self._mounted.pop(adapter_id, None)
                self._residency.removed(adapter_id)
                self._residency.evicted.pop(adapter_id, None)
                info = self._info(mounted) if mounted is not None else None
            if info is None:
                assert gone is not None
                return evicted_info(gone)
            self._tell(MountEvent("evicted" if evicted else "unmounted", adapter_id, info.revision))
        del mounted
        give_back_freed_memory()
        log.info("unmounted adapter %s", printable(adapter_id))
        return info

    def resolve(self, refs: tuple[AdapterRef, ...]) -> AdapterSet:
        """The set `refs` name, not counted as in use (`select` is what requests call)."""
        with self._lock:
            return self._resolve(refs)

    def list(self) -> list[AdapterInfo]:
        """Every resident adapter, in mount order."""
        with self._lock:
            return [self._info(mounted) for mounted in self._mounted.values()]

    def get(self, adapter_id: str) -> AdapterInfo:
        """One mounted adapter's info; `AdapterNotFound` when it is not mounted."""
        with self._lock:
            mounted = self._mounted.get(adapter_id)
            if mounted is None:
                raise AdapterNotFound(adapter_id, self._mounted)
            return self._info(mounted)

    @property
    def budget(self) -> Budget:
        """What this server keeps resident at most."""
        return self._residency.budget

    @property
    def resident_bytes(self) -> int:
        """What the resident adapters' arrays hold, summed."""
        with self._lock:
            return self._residency.resident_bytes

    def root_entries(
        self, folder: Path | None = None, shown: Callable[[str], bool] = lambda adapter_id: True
    ) -> Sequence[RootEntry]:
        """What the adapter root holds and every evicted adapter, resident or not, those whose
        id is `shown`, by id; then the adapters in `folder` (a tenant's, under the root) none of
        those was mounted from."""
        with self._lock:
            mounted = [
                (i, m.adapter, i in self._residency.pinned) for i, m in self._mounted.items()
            ]
            evicted = list(self._residency.evicted.values())
        return list_root(
            self.adapter_root, mounted, evicted, skip=self.base_id, folder=folder, shown=shown
        )

    def _lease(self, model: str, named: tuple[AdapterRef, ...]) -> AdapterLease:
        adapters = self._resolve(named)
        self._holders.add(adapters, 1)
        self._residency.touch(adapters.ids)
        if model != self.base_id:
            label = model
        else:
            label = f"{self.base_id}:{format_adapter_spec(named)}" if named else self.base_id
        return AdapterLease(label, adapters, lambda: self._uncount(adapters))

    def _evict_over_budget(self, keep: str | None = None) -> None:
        """Evict, least recently used first, what is resident past the budget and free: not
        pinned, not held by a request, not waited for, not `keep` (just mounted). Called
        holding `_admin`."""
        evicted: list[MountedAdapter] = []
        with self._lock:
            if not self._residency.over():
                return

            def busy(adapter_id: str) -> bool:
                held = self._holders.count(adapter_id) or self._first_use.waited_for(adapter_id)
                return adapter_id == keep or bool(held)

            for adapter_id in self._residency.victims(busy):
                mounted = self._mounted.pop(adapter_id)
                self._residency.evict(adapter_id, mounted.adapter)
                evicted.append(mounted)
        for mounted in evicted:
            self._tell(
                MountEvent(
                    "evicted",
                    mounted.id,
                    mounted.adapter.revision,
                    ram_bytes=mounted.adapter.ram_bytes,
                )
            )
            log.info("evicted adapter %s", printable(mounted.id))
        if evicted:
            del evicted, mounted
            give_back_freed_memory()

    def _tell(self, event: MountEvent) -> None:
        """Tell every listener of a change already made; one that fails cannot undo it."""
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - the change stands; the failure is logged
                log.exception("a listener failed on %s %s", event.kind, printable(event.adapter_id))

    def _resolve(self, refs: tuple[AdapterRef, ...]) -> AdapterSet:
        if not refs:
            return BASE_ONLY
        entries = []
        for ref in refs:
            mounted = self._mounted.get(ref.id)
            if mounted is None:
                raise AdapterNotFound(ref.id, self._mounted)
            entries.append(AppliedAdapter(mounted, ref.weight))
        return self._holders.shared(tuple(entries))

    def _uncount(self, adapters: AdapterSet) -> None:
        with self._lock:
            self._holders.add(adapters, -1)
            over = self._residency.over()
            if not over or self._eviction_waits:
                return
        # What a request let go may now be evicted. Never wait here (the caller may be the
        # event loop): while an admin change holds `_admin` (an unmount, a pin, a mount
        # already past its own eviction), a thread waits its turn.
        if self._admin.acquire(blocking=False):
            try:
                self._evict_over_budget()
            finally:
                self._admin.release()
            return
        with self._lock:
            if self._eviction_waits:
                return
            self._eviction_waits = True
        threading.Thread(target=self._evict_when_free, name="hotlora-evict", daemon=True).start()

    def _evict_when_free(self) -> None:
        with self._admin:
            with self._lock:
                self._eviction_waits = False
            self._evict_over_budget()

    def _info(self, mounted: MountedAdapter) -> AdapterInfo:
        return mounted_info(
            mounted,
            in_use=self._holders.count(mounted.id),
            pinned=mounted.id in self._residency.pinned,
            on_demand=mounted.id in self._residency.on_demand,
        )
