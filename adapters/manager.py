"""The adapter manager: one per app, owning every mounted adapter's arrays.

`select` is the one call a request makes: from its `model` and `adapter` fields to a leased,
request-owned `AdapterSet`. Every change to what is mounted, whatever asked for it (the admin
API, start-up, the mount record, the Ray cluster's registry), is told to the manager's listeners
as a `MountEvent`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_errors import (
    AdapterConflict,
    AdapterError,
    AdapterNotFound,
    InvalidAdapter,
)
from hotlora.adapters.adapter_files import MAX_ADAPTER_BYTES, read_adapter, resolve_under_root
from hotlora.adapters.adapter_set import (
    BASE_ONLY,
    SHORT_REVISION,
    AdapterSet,
    AppliedAdapter,
    MountedAdapter,
)
from hotlora.adapters.projections import TargetDims, linear_dims
from hotlora.adapters.slots import LoRASlot, install_slots, probe_input_dtypes
from hotlora.adapters.spec import (
    AdapterRef,
    adapter_id_problem,
    format_adapter_spec,
    parse_selection,
)
from hotlora.config.log_text import printable

if TYPE_CHECKING:
    from hotlora.adapters.mount_journal import MountJournal

log = logging.getLogger("hotlora.adapters")

# Adapter arrays follow half-precision activations (half the memory, no per-call upcast);
# against float32 activations they stay float32, which is how mlx-lm keeps trained adapters.
_HALF = (mx.float16, mx.bfloat16)


@dataclass(frozen=True)
class AdapterInfo:
    """What the admin API reports about one mounted adapter."""

    id: str
    path: str
    rank: int
    scale: float
    rslora: bool
    revision: str
    size_bytes: int  # the weight file on disk
    ram_bytes: int  # the mounted arrays
    mounted_layers: int  # slots it attaches to
    mounted_at: int  # unix seconds
    in_use: int  # requests computing with any revision mounted under this id now

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MountEvent:
    """One change to the mounted set, told to the manager's listeners once it is made."""

    kind: Literal["mounted", "unmounted", "evicted"]  # a replace is "mounted"
    adapter_id: str
    revision: str  # what was mounted, or what was unmounted or evicted


MountListener = Callable[[MountEvent], None]


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


class AdapterManager:
    """Mounts, unmounts and selects LoRA adapters over one base model that never reloads.

    Construction wraps the base's target projections in `LoRASlot`s once. After that,
    `mount`/`unmount` only change the manager's table of mounted adapters (under a lock), and
    requests get their own immutable `AdapterSet` from `select`, so the worker thread's model
    calls never see a change half-way. Each change is then told to every listener, in the order
    the changes were made; a listener must not mount or unmount itself.
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
    ):
        self.base_id = base_id
        self.adapter_root = Path(adapter_root).expanduser().resolve()
        self.max_rank = max_rank
        self.max_bytes = max_bytes  # per adapter file, checked on disk before reading
        slots = install_slots(model)
        if not slots:
            log.warning("%s has no q/k/v/o/gate/up/down projections", type(model).__name__)
        dtypes = probe_input_dtypes(model)
        self._targets = {path: _target(slot, dtypes.get(path)) for path, slot in slots.items()}
        self._lock = threading.Lock()
        # Mounts and unmounts one at a time: each is recorded in the journal (the mount record,
        # the Ray cluster's registry), which may refuse it, before the table here changes.
        self._journal = journal
        self._listeners = tuple(listeners)
        self._admin = threading.Lock()
        self._mounted: dict[str, MountedAdapter] = {}
        # Counted per id, not per revision: a request that started before a `replace` or an
        # unmount still holds that id's arrays, and admins watching `in_use` must see it.
        self._in_use: dict[str, int] = {}
        self._sets: weakref.WeakValueDictionary[tuple[AppliedAdapter, ...], AdapterSet] = (
            weakref.WeakValueDictionary()
        )

    def mount(
        self,
        adapter_id: str,
        path: str | Path,
        replace: bool = False,
        *,
        revision: str | None = None,
        record: bool = True,
    ) -> AdapterInfo:
        """Validate the adapter at `path` (under the adapter root) and mount it as `adapter_id`.

        All or nothing: any problem raises before anything changes. The same files under
        the same id return the existing info; other files raise `AdapterConflict` unless
        `replace`, which swaps atomically while running requests keep the old arrays.
        With `revision`, files that no longer hash to it are refused (`AdapterConflict`, code
        `adapter_changed`): a recorded mount is made again exactly or not at all. The journal
        records the change first; `record=False` applies one recorded elsewhere.
        """
        problem = adapter_id_problem(adapter_id)
        if problem is None and adapter_id == self.base_id:
            problem = f"'{adapter_id}' is the base model's id; choose another adapter id"
        if problem:
            raise InvalidAdapter(problem, param="id")
        directory = resolve_under_root(path, self.adapter_root)
        try:
            loaded = read_adapter(
                directory,
                self._targets,
                max_rank=self.max_rank,
                max_bytes=self.max_bytes,
                root=self.adapter_root,
            )
        except AdapterError as exc:
            # The traceback's frames hold the refused file's arrays: drop them and free the
            # memory now, not whenever the error is collected.
            exc.__context__ = None
            exc.with_traceback(None)
            mx.clear_cache()
            raise
        if revision is not None and loaded.revision != revision:
            found = loaded.revision
            del loaded  # free the arrays of files that will not be mounted
            mx.clear_cache()
            raise AdapterConflict(
                f"adapter '{adapter_id}' at {directory} changed since it was recorded (revision "
                f"{revision[:SHORT_REVISION]}, now {found[:SHORT_REVISION]})",
                code="adapter_changed",
            )
        with self._admin:
            with self._lock:
                current = self._mounted.get(adapter_id)
                if current is not None and current.adapter.revision == loaded.revision:
                    return self._info(current)
                if current is not None and not replace:
                    raise AdapterConflict(
                        f"adapter '{adapter_id}' is already mounted from {current.adapter.path} "
                        f"(revision {current.short_revision}); unmount it or mount with replace"
                    )
            if record and self._journal is not None:
                self._journal.mounted(adapter_id, str(directory), loaded.revision, replace)
            with self._lock:
                current = self._mounted.get(adapter_id)
                mounted = MountedAdapter(adapter_id, loaded, int(time.time()))
                self._mounted[adapter_id] = mounted
                info = self._info(mounted)
            self._tell(MountEvent("mounted", adapter_id, info.revision))
        if current is not None:
            del current
            mx.clear_cache()
        log.info(
            "mounted adapter %s from %s (rev %s)",
            printable(adapter_id),
            printable(directory),
            info.revision[:12],
        )
        return info

    def unmount(
        self, adapter_id: str, *, record: bool = True, evicted: bool = False
    ) -> AdapterInfo:
        """Forget `adapter_id` and free its arrays once no running request holds them.

        The slots hold no adapter state, so dropping the table's entry is all it takes; new
        requests naming it get `AdapterNotFound`. The journal records it first, as in `mount`.
        `evicted`: made to keep within a cap on mounted adapters, not asked for; the listeners
        hear an "evicted" event instead of "unmounted".
        """
        with self._admin:
            with self._lock:
                if adapter_id not in self._mounted:
                    raise AdapterNotFound(adapter_id, self._mounted)
            if record and self._journal is not None:
                self._journal.unmounted(adapter_id)
            with self._lock:
                mounted = self._mounted.pop(adapter_id)
                info = self._info(mounted)
            self._tell(MountEvent("evicted" if evicted else "unmounted", adapter_id, info.revision))
        del mounted
        mx.clear_cache()
        log.info("unmounted adapter %s", printable(adapter_id))
        return info

    def select(self, model: str, refs: tuple[AdapterRef, ...] = ()) -> AdapterLease:
        """What a request with these `model` and `adapter` fields is served with, leased.

        `model` may name the base (then `refs` select the adapters), a mounted adapter id, or
        `"<base-id>:<spec>"`. Raises `ModelNotFound` for any other model, `InvalidRequest` when
        both fields select adapters or the model's spec is malformed, and `AdapterNotFound`
        for an id that is not mounted. Nothing is counted as in use unless this returns.
        """
        with self._lock:
            named = parse_selection(self.base_id, model, refs, self._mounted)
            adapters = self._resolve(named)
            self._count(adapters, 1)
        if model != self.base_id:
            label = model
        else:
            label = f"{self.base_id}:{format_adapter_spec(named)}" if named else self.base_id
        return AdapterLease(label, adapters, lambda: self._uncount(adapters))

    def resolve(self, refs: tuple[AdapterRef, ...]) -> AdapterSet:
        """The set `refs` name, not counted as in use (`select` is what requests call)."""
        with self._lock:
            return self._resolve(refs)

    def list(self) -> list[AdapterInfo]:
        """Every mounted adapter, in mount order."""
        with self._lock:
            return [self._info(mounted) for mounted in self._mounted.values()]

    def get(self, adapter_id: str) -> AdapterInfo:
        """One mounted adapter's info; `AdapterNotFound` when it is not mounted."""
        with self._lock:
            mounted = self._mounted.get(adapter_id)
            if mounted is None:
                raise AdapterNotFound(adapter_id, self._mounted)
            return self._info(mounted)

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
        # Requests naming the same mounted adapters at the same weights share one set, so a
        # stack is fused once, not once per request. Held weakly: a set lives only as long as
        # a request holds it, and a remounted adapter is a new `MountedAdapter`, so a new set.
        identity = tuple(entries)
        adapters = self._sets.get(identity)
        if adapters is None:
            adapters = self._sets[identity] = AdapterSet(identity)
        return adapters

    def _count(self, adapters: AdapterSet, change: int) -> None:
        for entry in adapters.entries:
            adapter_id = entry.mounted.id
            left = self._in_use.get(adapter_id, 0) + change
            if left:
                self._in_use[adapter_id] = left
            else:
                del self._in_use[adapter_id]

    def _uncount(self, adapters: AdapterSet) -> None:
        with self._lock:
            self._count(adapters, -1)

    def _info(self, mounted: MountedAdapter) -> AdapterInfo:
        adapter = mounted.adapter
        return AdapterInfo(
            id=mounted.id,
            path=str(adapter.path),
            rank=adapter.config.rank,
            scale=adapter.config.scale,
            rslora=adapter.config.rslora,
            revision=adapter.revision,
            size_bytes=adapter.size_bytes,
            ram_bytes=adapter.ram_bytes,
            mounted_layers=len(adapter.weights),
            mounted_at=mounted.mounted_at,
            in_use=self._in_use.get(mounted.id, 0),
        )


def _target(slot: LoRASlot, input_dtype: mx.Dtype | None) -> TargetDims:
    dims = linear_dims(slot.base)
    dtype = input_dtype if input_dtype is not None and input_dtype in _HALF else mx.float32
    return TargetDims(dims.in_dims, dims.out_dims, dtype)
