"""The mount record: the mounted set kept on disk, and mounted again exactly or not at all."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hotlora.adapters import (
    AdapterConflict,
    AdapterManager,
    AdapterNotFound,
    MountedSet,
    MountFile,
)
from hotlora.adapters.mount_journal import HISTORY_LIMIT, read_mounted_set
from hotlora.server.ray.cluster_registry import AdapterRegistry

from tests.support.adapter_builders import (
    BASE_ID,
    random_pairs,
    tiny_model,
    write_mlx_adapter,
)


def write_adapter(root: Path, name: str, seed: int) -> Path:
    return write_mlx_adapter(root / name, random_pairs(tiny_model(), seed=seed))


def manager_with(root: Path, record: MountFile) -> AdapterManager:
    """A fresh model and manager (a restarted server) with `record` as its journal, restored."""
    manager = AdapterManager(
        tiny_model(), base_id=BASE_ID, adapter_root=root, max_rank=64, journal=record
    )
    record.restore(manager)
    return manager


def revisions(manager: AdapterManager) -> dict[str, str]:
    return {info.id: info.revision for info in manager.list()}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    for seed, name in enumerate(("a", "b", "a2"), start=1):
        write_adapter(root, name, seed)
    return root


@pytest.fixture
def record_path(tmp_path: Path) -> Path:
    return tmp_path / "home" / "mounts.json"


# The set's own rules: the manager's, without a model.

MOUNT_CASES = [
    # (first revision, second revision, replace, expected outcome)
    ("r1", "r1", False, "unchanged"),
    ("r1", "r2", False, "conflict"),
    ("r1", "r2", True, "replaced"),
]


@pytest.mark.parametrize(("first", "second", "replace", "outcome"), MOUNT_CASES)
def test_the_set_mounts_with_the_managers_rules(first, second, replace, outcome):
    mounted = MountedSet()
    assert mounted.mount("a", "/x/a", first, replace=False, now=1)
    assert mounted.version == 1
    if outcome == "conflict":
        with pytest.raises(AdapterConflict, match="already mounted from /x/a"):
            mounted.mount("a", "/x/a2", second, replace=replace, now=2)
        assert (mounted.records["a"].revision, mounted.version) == (first, 1)
        return
    changed = mounted.mount("a", "/x/a2", second, replace=replace, now=2)
    assert changed == (outcome == "replaced")
    record = mounted.records["a"]
    if outcome == "replaced":
        assert (record.path, record.revision, record.mounted_at, mounted.version) == (
            "/x/a2",
            second,
            2,
            2,
        )
        [past] = record.history
        assert (past.path, past.revision) == ("/x/a", first)
        assert (past.mounted_at, past.replaced_at) == (1, 2)
    else:
        assert (record.path, record.history, mounted.version) == ("/x/a", (), 1)


def test_the_history_keeps_the_latest_replaces():
    mounted = MountedSet()
    for n in range(HISTORY_LIMIT + 5):
        mounted.mount("a", f"/x/{n}", f"r{n}", replace=True, now=n)
    history = mounted.records["a"].history
    assert len(history) == HISTORY_LIMIT
    assert history[-1].revision == f"r{HISTORY_LIMIT + 3}"


def test_unmounting_an_unknown_id_is_not_found():
    mounted = MountedSet()
    mounted.mount("a", "/x/a", "r1", replace=False)
    with pytest.raises(AdapterNotFound, match="Mounted adapters: a"):
        mounted.unmount("zzz")
    assert mounted.unmount("a").id == "a"
    assert (mounted.records, mounted.version) == ({}, 2)


# The file.


def test_the_file_is_written_whole_and_read_back(root, record_path):
    record = MountFile(record_path)
    manager = manager_with(root, record)
    manager.mount("a", "a")
    manager.mount("b", "b")
    manager.mount("a", "a2", replace=True)
    data = json.loads(record_path.read_text())
    assert [entry["id"] for entry in data["adapters"]] == ["a", "b"]
    a = data["adapters"][0]
    assert a["path"] == str(root / "a2") and a["revision"] == manager.get("a").revision
    assert [past["path"] for past in a["history"]] == [str(root / "a")]
    # Written through a temporary file and a rename: nothing else is left beside it.
    assert [path.name for path in record_path.parent.iterdir()] == ["mounts.json"]
    manager.unmount("b")
    assert [record.id for record in read_mounted_set(record_path).records.values()] == ["a"]


def test_a_restarted_server_mounts_the_same_adapters(root, record_path):
    first = manager_with(root, MountFile(record_path))
    first.mount("a", "a")
    first.mount("b", "b")
    first.mount("a", "a2", replace=True)
    again = manager_with(root, MountFile(record_path))
    assert revisions(again) == revisions(first)
    assert [info.path for info in again.list()] == [str(root / "a2"), str(root / "b")]
    # The restore itself recorded nothing new: the history is the one written before.
    [a] = [r for r in read_mounted_set(record_path).records.values() if r.id == "a"]
    assert len(a.history) == 1


def test_changed_and_vanished_adapters_are_reported_and_not_mounted(root, record_path, caplog):
    first = manager_with(root, MountFile(record_path))
    for name in ("a", "b", "a2"):
        first.mount(name, name)
    write_adapter(root, "a", seed=9)  # other weights under the same path
    shutil.rmtree(root / "b")
    with caplog.at_level(logging.WARNING, logger="hotlora.adapters"):
        again = manager_with(root, MountFile(record_path))
    assert list(revisions(again)) == ["a2"]
    reports = [r.getMessage() for r in caplog.records]
    warnings = {m.split()[4]: m for m in reports if m.startswith("not mounting recorded adapter")}
    assert set(warnings) == {"a", "b"}
    assert "changed since it was recorded" in warnings["a"]
    assert str(root / "a") in warnings["a"]
    assert "does not exist" in warnings["b"]
    # Dropped from the record too: the file names only what is mounted.
    assert list(read_mounted_set(record_path).records) == ["a2"]


def test_a_record_that_cannot_be_written_refuses_the_change(root, record_path, monkeypatch):
    record = MountFile(record_path)
    manager = manager_with(root, record)
    manager.mount("a", "a")

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hotlora.adapters.mount_journal.os.replace", full)
    with pytest.raises(OSError):
        manager.mount("b", "b")
    with pytest.raises(OSError):
        manager.unmount("a")
    assert list(revisions(manager)) == ["a"]
    assert [r.id for r in record.records] == ["a"]
    assert [path.name for path in record_path.parent.iterdir()] == ["mounts.json"]


# A process that records a mount and is killed (SIGKILL) between writing the new record and
# renaming it over the old one, as a crash or an OOM kill can.
KILLED_MID_WRITE = """
import os, signal, sys
from hotlora.adapters import MountFile
from hotlora.adapters import mount_journal

def killed(src, dst):
    os.kill(os.getpid(), signal.SIGKILL)

mount_journal.os.replace = killed
MountFile(sys.argv[1]).mounted("b", "/adapters/b", "r2", False)
"""


def test_writes_a_killed_server_left_are_cleared_at_start(record_path, caplog):
    MountFile(record_path).mounted("a", "/adapters/a", "r1", False)
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(record_path)])
    assert killed.returncode == -signal.SIGKILL
    home = record_path.parent
    [left] = [path.name for path in home.iterdir() if path.name != "mounts.json"]
    assert left.startswith(".mounts.json.")
    # Names the record's writes never take stay.
    others = [".mounts.json.keep", "mounts.json.bak", ".mounts.jsonabcdefgh", ".other.abcdefgh"]
    for name in others:
        (home / name).write_text("mine")
    with caplog.at_level(logging.INFO, logger="hotlora.adapters"):
        record = MountFile(record_path)
    assert sorted(path.name for path in home.iterdir()) == sorted(["mounts.json", *others])
    assert [r.id for r in record.records] == ["a"]  # the killed writes changed nothing
    assert f"removed {left}: writes of {record_path} that did not finish" in caplog.messages
    # So does a cluster's registry, which keeps the same file.
    subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(record_path)])
    assert len(list(home.iterdir())) == len(others) + 2
    _, _, records = AdapterRegistry(str(record_path)).snapshot()
    assert sorted(path.name for path in home.iterdir()) == sorted(["mounts.json", *others])
    assert [r.id for r in records] == ["a"]


def test_a_journal_that_refuses_leaves_the_manager_unchanged(root):
    class Refusing:
        def mounted(self, adapter_id, path, revision, replace, pin=False):
            raise AdapterConflict(f"no {adapter_id}")

        def unmounted(self, adapter_id):
            raise AdapterConflict(f"no {adapter_id}")

    manager = AdapterManager(
        tiny_model(), base_id=BASE_ID, adapter_root=root, max_rank=64, journal=Refusing()
    )
    manager.mount("a", "a", record=False)
    with pytest.raises(AdapterConflict, match="no b"):
        manager.mount("b", "b")
    with pytest.raises(AdapterConflict, match="no a"):
        manager.mount("a", "a2", replace=True)
    with pytest.raises(AdapterConflict, match="no a"):
        manager.unmount("a")
    assert [(info.id, info.path) for info in manager.list()] == [("a", str(root / "a"))]


def test_a_mount_at_a_stated_revision_refuses_other_files(root):
    manager = AdapterManager(tiny_model(), base_id=BASE_ID, adapter_root=root, max_rank=64)
    revision = manager.mount("a", "a").revision
    manager.unmount("a")
    assert manager.mount("a", "a", revision=revision).revision == revision
    with pytest.raises(AdapterConflict) as caught:
        manager.mount("b", "b", revision=revision)
    assert caught.value.code == "adapter_changed"
    assert [info.id for info in manager.list()] == ["a"]


def test_an_unreadable_record_stops_the_start(record_path):
    record_path.parent.mkdir(parents=True)
    record_path.write_text("{not json")
    with pytest.raises(ValueError, match="not a mounted-adapter record"):
        MountFile(record_path)
