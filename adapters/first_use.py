"""Mounting adapters on first use: a request naming one that is not resident waits for one load.

`FirstUseMounts` is the part of the adapter manager that `select` runs through: an adapter
evicted to keep within the budget, or (with `auto_mount`) a directory under the adapter root,
is mounted when a request names it. `SingleFlight` makes concurrent first requests for one
adapter share that load, its result or its error.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from hotlora.adapters.adapter_errors import (
    AdapterConflict,
    AdapterError,
    AdapterNotFound,
    InvalidAdapter,
)
from hotlora.adapters.spec import AdapterRef, adapter_id_problem, parse_selection

if TYPE_CHECKING:
    from hotlora.adapters.adapter_info import AdapterInfo
    from hotlora.adapters.adapter_set import MountedAdapter
    from hotlora.adapters.manager import AdapterLease
    from hotlora.adapters.residency import Residency


LOAD_PRECEDENCE_S = 0.1  # the longest a step waits for loads in flight before it runs
LOAD_PRECEDENCE_FOR_S = 1.0  # loads older than this no longer hold steps back


class SingleFlight:
    """One load per adapter id at a time: the first caller loads, the others wait for it and get
    its result, or its exception."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads: dict[str, Future[None]] = {}
        self._started: dict[str, float] = {}  # each load's start, time.monotonic()
        self._idle = threading.Condition(self._lock)  # notified when a load ends

    def run(self, key: str, load: Callable[[], None]) -> None:
        """Run `load` unless a load of `key` is under way; then wait for that one instead."""
        with self._lock:
            future = self._loads.get(key)
            leader = future is None
            if future is None:
                future = self._loads[key] = Future()
                self._started[key] = time.monotonic()
        if not leader:
            future.result()
            return
        try:
            load()
        except BaseException as exc:
            future.set_exception(exc)
            raise
        else:
            future.set_result(None)
        finally:
            with self._lock:
                del self._loads[key], self._started[key]
                self._idle.notify_all()

    def wait_idle(self, most: float, younger: float = LOAD_PRECEDENCE_FOR_S) -> bool:
        """Block while a load that began less than `younger` seconds ago is under way, `most`
        seconds at most; whether none is."""

        def idle() -> bool:
            now = time.monotonic()
            return all(now - began >= younger for began in self._started.values())

        with self._lock:
            return self._idle.wait_for(idle, timeout=most)


class FirstUseMounts:
    """`select` and `try_select` of the adapter manager, mounting what a request may load.

    A mixin: the manager owns the table, the lock and the residency it reads, and `_mount` and
    `_lease`, which it calls. Ids requests are waiting to have loaded are counted in `_waiting`,
    so that the budget never evicts one between its load and the request's lease.
    """

    base_id: str
    adapter_root: Path
    auto_mount: bool
    _lock: threading.Lock
    _mounted: dict[str, MountedAdapter]
    _residency: Residency
    _loads: SingleFlight
    _waiting: dict[str, int]  # ids requests wait to be loaded: never evicted

    if TYPE_CHECKING:

        def _lease(self, model: str, named: tuple[AdapterRef, ...]) -> AdapterLease: ...

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
        ) -> AdapterInfo: ...

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
        waiting: tuple[str, ...] = ()
        try:
            while True:
                with self._lock:
                    named = parse_selection(self.base_id, model, refs, _Selectable(self))
                    missing = tuple(ref.id for ref in named if ref.id not in self._mounted)
                    if not missing:
                        lease = self._lease(model, named)
                        self._wait(waiting, -1)
                        waiting = ()
                        return lease
                    for adapter_id in missing:
                        if not self._loadable(adapter_id):
                            raise AdapterNotFound(adapter_id, self._mounted)
                    self._wait(tuple(i for i in missing if i not in waiting), 1)
                    waiting = tuple(dict.fromkeys((*waiting, *missing)))
                for adapter_id in missing:
                    self._loads.run(adapter_id, functools.partial(self._load, adapter_id))
        finally:
            if waiting:
                with self._lock:
                    self._wait(waiting, -1)

    def yield_to_loads(self, most: float = LOAD_PRECEDENCE_S) -> None:
        """Block while adapters are being mounted on first use, `most` seconds at most.

        The generation worker calls this before each step. A load is mostly CPU work (~30 ms
        for a 20 MB adapter on one core), and the requests waiting on it cannot start until it
        ends: with the decoding threads beside it on a few cores, it took several times as
        long. So a load goes first, and a step waits for it, `most` seconds at most; a load
        under way for a second or more (a large file, a slow disk) holds no step back.
        """
        self._loads.wait_idle(most)

    def try_select(self, model: str, refs: tuple[AdapterRef, ...] = ()) -> AdapterLease | None:
        """`select` without loading: None when an adapter must be mounted first (then call
        `select` where blocking is fine). Raises as `select` does."""
        with self._lock:
            named = parse_selection(self.base_id, model, refs, _Selectable(self))
            for ref in named:
                if ref.id not in self._mounted:
                    if self._loadable(ref.id):
                        return None
                    raise AdapterNotFound(ref.id, self._mounted)
            return self._lease(model, named)

    def _loadable(self, adapter_id: str) -> bool:
        """Whether `adapter_id`, not mounted, can be mounted on first use."""
        if adapter_id in self._residency.evicted:
            return True
        if not self.auto_mount or adapter_id_problem(adapter_id) or adapter_id == self.base_id:
            return False
        return (self.adapter_root / adapter_id).is_dir()

    def _load(self, adapter_id: str) -> None:
        """Mount `adapter_id` for the requests waiting on it: from where it was evicted, else
        from its directory under the root. A failure is the requests' error (`param`
        adapter), naming the problem."""
        with self._lock:
            if adapter_id in self._mounted:
                return  # a load that ended before this caller asked
            gone = self._residency.evicted.get(adapter_id)
        path = gone.path if gone is not None else adapter_id
        # An adapter mounted by hand comes back as it was mounted, or not at all.
        revision = gone.revision if gone is not None and not gone.on_demand else None
        try:
            self._mount(
                adapter_id,
                path,
                False,
                revision=revision,
                record=False,
                pin=False,
                on_demand=gone is None or gone.on_demand,
            )
        except AdapterError as exc:
            if isinstance(exc, AdapterConflict) and exc.code != "adapter_changed":
                return  # an admin mounted it meanwhile: the requests get that one
            error = AdapterConflict if isinstance(exc, AdapterConflict) else InvalidAdapter
            raise error(
                f"adapter '{adapter_id}' could not be loaded: {exc.message}",
                param="adapter",
                code=exc.code,
            ) from None

    def _wait(self, adapter_ids: tuple[str, ...], change: int) -> None:
        for adapter_id in adapter_ids:
            left = self._waiting.get(adapter_id, 0) + change
            if left:
                self._waiting[adapter_id] = left
            else:
                del self._waiting[adapter_id]


class _Selectable(Collection[str]):
    """The ids a request's `model` may name: those mounted, and those it may mount on first
    use. Iterates over the mounted ones alone (what an error lists)."""

    def __init__(self, mounts: FirstUseMounts):
        self._mounts = mounts

    def __contains__(self, adapter_id: object) -> bool:
        mounts = self._mounts
        if not isinstance(adapter_id, str):
            return False
        return adapter_id in mounts._mounted or mounts._loadable(adapter_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._mounts._mounted)

    def __len__(self) -> int:
        return len(self._mounts._mounted)
