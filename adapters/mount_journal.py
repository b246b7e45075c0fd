"""The record of the mounted set: which adapter ids are mounted from which files, at which revision.

`MountedSet` holds the set (each id's path, revision and replace history) and applies mounts and
unmounts with the manager's rules. `MountFile` keeps one on disk under HOTLORA_HOME, rewritten
atomically on every change, and mounts it again on start-up; an entry whose files changed or
vanished since is reported and left unmounted. The registry of a Ray cluster (the actor in
`server/ray/cluster_registry.py`) holds the same `MountedSet` for many replicas.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hotlora.adapters.adapter_errors import AdapterConflict, AdapterError, AdapterNotFound
from hotlora.adapters.adapter_set import SHORT_REVISION
from hotlora.config.log_text import printable

if TYPE_CHECKING:
    from hotlora.adapters.manager import AdapterManager
    from hotlora.config.settings import Settings

log = logging.getLogger("hotlora.adapters")

MOUNTS_FILE = "mounts.json"
FILE_FORMAT = 1
HISTORY_LIMIT = 16  # past revisions kept per id


class MountJournal(Protocol):
    """Where the manager records a change before it makes it; raising refuses the change."""

    def mounted(
        self, adapter_id: str, path: str, revision: str, replace: bool, *, pin: bool = False
    ) -> None:
        """`adapter_id` is about to be mounted from `path` (a directory) at `revision`; `pin`:
        kept from eviction (the same revision again with `pin` is a pin added, with `replace`
        and no `pin` a pin dropped)."""

    def unmounted(self, adapter_id: str) -> None:
        """`adapter_id` is about to be unmounted."""


class MountStore(MountJournal, Protocol):
    """A journal that also brings a new manager to the recorded set before it serves."""

    def restore(self, manager: AdapterManager) -> None:
        """Mount what is recorded, on the runtime's start-up thread, before it is ready."""


@dataclass(frozen=True)
class PastRevision:
    """What an id was mounted from until a replace swapped it."""

    path: str
    revision: str
    mounted_at: int
    replaced_at: int


@dataclass(frozen=True)
class MountRecord:
    """One mounted id: the directory it was read from and the content hash it had then."""

    id: str
    path: str
    revision: str
    mounted_at: int
    history: tuple[PastRevision, ...] = field(default=())  # oldest first
    pinned: bool = False  # never evicted to keep within the budget

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MountRecord:
        history = tuple(PastRevision(**past) for past in data.get("history", ()))
        return cls(
            id=str(data["id"]),
            path=str(data["path"]),
            revision=str(data["revision"]),
            mounted_at=int(data["mounted_at"]),
            history=history,
            pinned=bool(data.get("pinned", False)),  # absent from records made before pins
        )


class MountedSet:
    """The mounted ids in mount order, and a version that grows with every change.

    `mount` follows the manager's rules: the same revision again changes nothing but adds a
    pin, other files under a mounted id conflict unless `replace`, which keeps the old revision
    in the history and pins the new one only if asked to.
    """

    def __init__(self, records: dict[str, MountRecord] | None = None, version: int = 0):
        self.records: dict[str, MountRecord] = dict(records or {})
        self.version = version

    def mount(
        self,
        adapter_id: str,
        path: str,
        revision: str,
        *,
        replace: bool,
        pin: bool = False,
        now: int | None = None,
    ) -> bool:
        """Record the mount; False when nothing changed. The revision recorded already: a pin
        asked for is added, a replace without one unpins, else nothing changes."""
        current = self.records.get(adapter_id)
        if current is not None and current.revision == revision:
            if pin == current.pinned or not (pin or replace):
                return False
            self.records[adapter_id] = dataclasses.replace(current, pinned=pin)
            self.version += 1
            return True
        if current is not None and not replace:
            raise AdapterConflict(
                f"adapter '{adapter_id}' is already mounted from {current.path} (revision "
                f"{current.revision[:SHORT_REVISION]}); unmount it or mount with replace"
            )
        now = int(time.time()) if now is None else now
        history: tuple[PastRevision, ...] = ()
        if current is not None:
            past = PastRevision(current.path, current.revision, current.mounted_at, now)
            history = (*current.history, past)[-HISTORY_LIMIT:]
        self.records[adapter_id] = MountRecord(adapter_id, path, revision, now, history, pin)
        self.version += 1
        return True

    def unmount(self, adapter_id: str) -> MountRecord:
        """Forget `adapter_id`; `AdapterNotFound` when it is not recorded."""
        record = self.records.pop(adapter_id, None)
        if record is None:
            raise AdapterNotFound(adapter_id, self.records)
        self.version += 1
        return record

    def copy(self) -> MountedSet:
        return MountedSet(copy.copy(self.records), self.version)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FILE_FORMAT,
            "version": self.version,
            "adapters": [record.to_json() for record in self.records.values()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MountedSet:
        if data.get("format") != FILE_FORMAT:
            raise ValueError(f"unknown format {data.get('format')!r} (expected {FILE_FORMAT})")
        records = [MountRecord.from_json(entry) for entry in data.get("adapters", ())]
        return cls({record.id: record for record in records}, int(data.get("version", 0)))


def read_mounted_set(path: Path) -> MountedSet:
    """The set recorded at `path`; empty when there is no file yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return MountedSet()
    try:
        return MountedSet.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a mounted-adapter record: {exc}") from None


def open_mounted_set(path: Path) -> MountedSet:
    """The set recorded at `path`, for the one process that keeps it: first the temporary files
    of its writes that a killed process left are deleted."""
    removed = remove_stale_temporaries(path)
    if removed:
        names = ", ".join(removed)
        log.info("removed %s: writes of %s that did not finish", names, printable(path))
    return read_mounted_set(path)


def write_mounted_set(path: Path, mounted: MountedSet) -> None:
    """Replace the file at `path` in one step: a crash leaves the old file or the new, whole
    (and, killed before the rename, a temporary file that `remove_stale_temporaries` clears)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=_temporary_prefix(path))
    try:
        with os.fdopen(descriptor, "w") as stream:
            json.dump(mounted.to_json(), stream, indent=2)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_directory(path.parent)


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def remove_stale_temporaries(path: Path) -> list[str]:
    """Delete the temporary files a killed `write_mounted_set` left beside `path`; their names.

    Only names `mkstemp` gives with this file's prefix (eight of its characters after it) are
    touched. Call it before anything writes the file: a write under way has one of these too.
    """
    stale = re.compile(re.escape(_temporary_prefix(path)) + r"[a-z0-9_]{8}")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in path.parent.iterdir():
            if stale.fullmatch(entry.name) and entry.is_file():
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed.append(entry.name)
    return removed


def _sync_directory(directory: Path) -> None:
    """Make the rename itself durable (not every file system allows opening a directory)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


class MountFile:
    """The mounted set of one server, kept in a JSON file (`--persist-mounts`).

    Each change is written before the manager makes it, so the file never names an adapter
    that was not mounted; a failed write refuses the change. Opening it clears the temporary
    files of writes that a killed server left (one server keeps one file).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._set = open_mounted_set(self.path)

    @property
    def records(self) -> list[MountRecord]:
        with self._lock:
            return list(self._set.records.values())

    def mounted(
        self, adapter_id: str, path: str, revision: str, replace: bool, *, pin: bool = False
    ) -> None:
        with self._lock:
            updated = self._set.copy()
            if updated.mount(adapter_id, path, revision, replace=replace, pin=pin):
                write_mounted_set(self.path, updated)
                self._set = updated

    def unmounted(self, adapter_id: str) -> None:
        with self._lock:
            updated = self._set.copy()
            updated.unmount(adapter_id)
            write_mounted_set(self.path, updated)
            self._set = updated

    def restore(self, manager: AdapterManager) -> None:
        """Mount every recorded adapter again, exactly as recorded (pinned if it was) or not at
        all.

        An entry whose directory vanished, whose files no longer hash to the recorded revision,
        or that the manager refuses for any other reason is logged (WARNING, naming it and why)
        and dropped from the record.
        """
        dropped = []
        for record in self.records:
            try:
                manager.mount(
                    record.id,
                    record.path,
                    revision=record.revision,
                    record=False,
                    pin=record.pinned,
                )
            except AdapterError as exc:
                report_unmountable(record, exc)
                dropped.append(record.id)
        if dropped:
            with self._lock:
                updated = self._set.copy()
                for adapter_id in dropped:
                    updated.unmount(adapter_id)
                write_mounted_set(self.path, updated)
                self._set = updated
        if self._set.records:
            count = len(self._set.records)
            log.info("mounted %d recorded adapters from %s", count, printable(self.path))


def report_unmountable(record: MountRecord, exc: AdapterError) -> None:
    """The WARNING for a recorded adapter that is not mounted again."""
    log.warning(
        "not mounting recorded adapter %s (from %s, revision %s): %s",
        printable(record.id),
        printable(record.path),
        printable(record.revision[:SHORT_REVISION]),
        printable(exc.message),
    )


def mount_file(settings: Settings) -> MountFile | None:
    """The server's mount record under HOTLORA_HOME, with `--persist-mounts`; else None."""
    if not settings.persist_mounts:
        return None
    return MountFile(settings.home.expanduser() / MOUNTS_FILE)
