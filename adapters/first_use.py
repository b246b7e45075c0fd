"""Mounting adapters on first use: a request naming one that is not resident waits for one load.

The adapter manager owns a `FirstUseMounts`, which its `select` asks: an adapter evicted to keep
within the budget, or (with `auto_mount`) a directory under the adapter root, is mounted when a
request names it. `SingleFlight` makes concurrent first requests for one adapter share that
load, its result or its error.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path

from hotlora.adapters.adapter_errors import AdapterConflict, AdapterError, InvalidAdapter
from hotlora.adapters.residency import Residency
from hotlora.adapters.spec import adapter_id_problem

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
    """Which adapters a request may mount on first use, one load of each at a time, and the ids
    requests wait to have loaded, which the budget must not evict between the load and the
    request's lease.

    Owned by the adapter manager: `loadable`, `selectable`, `wait` and `waited_for` are called
    holding its lock, which guards the counts too; `load_all` and `yield_to_loads` without it.
    `residency` is the manager's, read for what it evicted. `mount` is the manager's mount of
    an adapter for requests that name it, from where it was evicted or else from its directory
    under the root; it does nothing when the adapter is mounted by the time it runs.
    """

    def __init__(
        self,
        mount: Callable[[str], None],
        residency: Residency,
        *,
        base_id: str,
        adapter_root: Path,
        auto_mount: bool,
    ) -> None:
        self._mount = mount
        self._residency = residency
        self._base_id = base_id
        self._adapter_root = adapter_root
        self._auto_mount = auto_mount
        self._loads = SingleFlight()
        self._waiting: dict[str, int] = {}  # ids requests wait to be loaded: never evicted

    def loadable(self, adapter_id: str) -> bool:
        """Whether `adapter_id`, not mounted, can be mounted on first use."""
        if adapter_id in self._residency.evicted:
            return True
        if not self._auto_mount or adapter_id_problem(adapter_id) or adapter_id == self._base_id:
            return False
        return (self._adapter_root / adapter_id).is_dir()

    def selectable(self, mounted: Mapping[str, object]) -> Collection[str]:
        """The ids a request's `model` may name: those `mounted`, and those it may mount on
        first use."""
        return _Selectable(mounted, self.loadable)

    def wait(self, adapter_ids: tuple[str, ...], change: int) -> None:
        """Count requests waiting for these ids to be loaded (+1), or no longer (-1)."""
        for adapter_id in adapter_ids:
            left = self._waiting.get(adapter_id, 0) + change
            if left:
                self._waiting[adapter_id] = left
            else:
                del self._waiting[adapter_id]

    def waited_for(self, adapter_id: str) -> bool:
        """Whether a request waits for `adapter_id` to be loaded."""
        return adapter_id in self._waiting

    def load_all(self, adapter_ids: tuple[str, ...]) -> None:
        """Mount each of `adapter_ids`, sharing a load under way for it; raises the first
        failure as the requests' error (`param` adapter), naming the problem."""
        for adapter_id in adapter_ids:
            self._loads.run(adapter_id, functools.partial(self._load, adapter_id))

    def yield_to_loads(self, most: float = LOAD_PRECEDENCE_S) -> None:
        """Block while adapters are being mounted on first use, `most` seconds at most.

        The generation worker calls this before each step. A load is mostly CPU work (~30 ms
        for a 20 MB adapter on one core), and the requests waiting on it cannot start until it
        ends: with the decoding threads beside it on a few cores, it took several times as
        long. So a load goes first, and a step waits for it, `most` seconds at most; a load
        under way for a second or more (a large file, a slow disk) holds no step back.
        """
        self._loads.wait_idle(most)

    def _load(self, adapter_id: str) -> None:
        try:
            self._mount(adapter_id)
        except AdapterError as exc:
            if isinstance(exc, AdapterConflict) and exc.code != "adapter_changed":
                return  # an admin mounted it meanwhile: the requests get that one
            error = AdapterConflict if isinstance(exc, AdapterConflict) else InvalidAdapter
            raise error(
                f"adapter '{adapter_id}' could not be loaded: {exc.message}",
                param="adapter",
                code=exc.code,
            ) from None


class _Selectable(Collection[str]):
    """Ids mounted, or mountable on first use. Iterates over the mounted ones alone (what an
    error lists)."""

    def __init__(self, mounted: Mapping[str, object], loadable: Callable[[str], bool]):
        self._mounted = mounted
        self._loadable = loadable

    def __contains__(self, adapter_id: object) -> bool:
        if not isinstance(adapter_id, str):
            return False
        return adapter_id in self._mounted or self._loadable(adapter_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._mounted)

    def __len__(self) -> int:
        return len(self._mounted)
