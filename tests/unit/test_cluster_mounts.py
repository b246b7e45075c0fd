"""Replicas following one adapter registry, in one process: the registry is a plain object here,
where Ray Serve runs it as an actor."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from hotlora.adapters import AdapterConflict, AdapterManager, AdapterNotFound
from hotlora.server.telemetry.prometheus import Metrics

from tests.support.adapter_builders import BASE_ID, random_pairs, tiny_model, write_mlx_adapter

pytest.importorskip("ray")
from hotlora.server.ray.cluster_registry import (  # noqa: E402 - only with the `ray` extra
    AdapterRegistry,
    ClusterMounts,
    RegistryClient,
)


class InProcess(RegistryClient):
    """The registry called directly instead of through Ray."""

    def __init__(self, registry: AdapterRegistry):
        self.registry = registry

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.registry, method)(*args)

    async def call_async(self, method: str, *args: Any) -> Any:
        return self.call(method, *args)

    def send(self, method: str, *args: Any) -> None:
        self.call(method, *args)


class Replica:
    """A manager on its own copy of the tiny model, following the registry."""

    def __init__(self, root: Path, registry: AdapterRegistry, **options: Any):
        self.mounts = ClusterMounts(InProcess(registry), **options)
        self.metrics = Metrics()
        self.manager = AdapterManager(
            tiny_model(),
            base_id=BASE_ID,
            adapter_root=root,
            max_rank=64,
            journal=self.mounts,
            listeners=[self.metrics.adapter_changed],
        )
        self.mounts.restore(self.manager)

    def admit(self, *wanted: str, release: bool = True) -> Any:
        done = asyncio.run(self.mounts.admit(wanted))
        if release:
            done()
        return done

    def mounted(self) -> dict[str, str]:
        return {info.id: info.path.rsplit("/", 1)[-1] for info in self.manager.list()}

    def counted(self) -> tuple[float | None, ...]:
        """The metrics' mounts, unmounts and evictions on this replica."""
        read = self.metrics.registry.get_sample_value
        return tuple(
            read(f"hotlora_adapter_{kind}_total") for kind in ("mounts", "unmounts", "evictions")
        )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    for seed, name in enumerate(("a", "b", "c", "a2"), start=1):
        write_mlx_adapter(root / name, random_pairs(tiny_model(), seed=seed))
    return root


@pytest.fixture
def registry() -> AdapterRegistry:
    return AdapterRegistry()


def test_a_change_on_one_replica_reaches_the_other_on_admission(root, registry):
    one, two = Replica(root, registry), Replica(root, registry)
    one.manager.mount("a", "a")
    assert two.mounted() == {}
    two.admit()
    assert two.mounted() == {"a": "a"}
    two.manager.mount("a", "a2", replace=True)
    one.admit()
    assert one.mounted() == {"a": "a2"}
    one.manager.unmount("a")
    two.admit()
    assert two.mounted() == {}
    with pytest.raises(AdapterNotFound):
        two.manager.get("a")


def test_an_admission_while_a_change_is_mounted_waits_for_it(root, registry, monkeypatch):
    one, two = Replica(root, registry), Replica(root, registry)
    one.manager.mount("a", "a")
    two.admit()
    one.manager.mount("a", "a2", replace=True)
    mounting, finish = threading.Event(), threading.Event()
    mount = two.manager.mount

    def slow_mount(*args: Any, **kwargs: Any) -> Any:
        mounting.set()
        assert finish.wait(10)
        return mount(*args, **kwargs)

    monkeypatch.setattr(two.manager, "mount", slow_mount)

    async def admitted_with(*wanted: str) -> dict[str, str]:
        release = await two.mounts.admit(wanted)
        seen = two.mounted()
        release()
        return seen

    async def changes() -> None:
        following = asyncio.create_task(admitted_with())  # the watcher's round, say
        assert await asyncio.to_thread(mounting.wait, 10)
        request = asyncio.create_task(admitted_with("a"))
        await asyncio.sleep(0.1)
        # The registry's new revision is being mounted: the request may not go ahead on the old.
        assert not request.done()
        finish.set()
        assert await following == {"a": "a2"}
        assert await request == {"a": "a2"}

    try:
        asyncio.run(changes())
    finally:
        finish.set()


def test_the_registry_refuses_as_one_server_would(root, registry):
    one, two = Replica(root, registry), Replica(root, registry)
    one.manager.mount("a", "a")
    # `two` has not followed yet: its own manager would take other files, the registry not.
    with pytest.raises(AdapterConflict, match="already mounted from"):
        two.manager.mount("a", "a2")
    assert two.mounted() == {}
    assert two.manager.mount("a", "a").id == "a"  # the same files: recorded, unchanged
    one.manager.unmount("a")
    with pytest.raises(AdapterNotFound):
        two.manager.unmount("a")  # gone from the registry: a 404, and nothing changes here
    assert two.mounted() == {"a": "a"}
    two.admit()
    assert two.mounted() == {}


def test_a_new_replica_starts_with_the_registrys_set(root, registry):
    one = Replica(root, registry, startup={"a": "a"})
    one.manager.mount("b", "b")
    one.manager.mount("a", "a2", replace=True)
    # The registry's entry wins over the start-up flag naming the same id.
    two = Replica(root, registry, startup={"a": "a", "c": "c"})
    assert two.mounted() == {"a": "a2", "b": "b", "c": "c"}
    one.admit()
    assert one.mounted() == two.mounted()


def test_a_capped_replica_keeps_the_most_recently_used(root, registry):
    one = Replica(root, registry)
    for name in ("a", "b", "c"):
        one.manager.mount(name, name)
    two = Replica(root, registry, max_mounted=2)
    assert two.mounted() == {"a": "a", "b": "b"}  # the first two, until asked for others
    two.admit("c")
    assert two.mounted() == {"b": "b", "c": "c"}
    two.admit("b")
    two.admit("a")
    assert two.mounted() == {"a": "a", "b": "b"}  # c was the least recently used
    # Admitted and not yet selected: never evicted, the cap is exceeded instead.
    holding = [two.admit(name, release=False) for name in ("a", "b", "c")]
    assert set(two.mounted()) == {"a", "b", "c"}
    for release in holding:
        release()
    two.admit("c")
    assert set(two.mounted()) == {"b", "c"}
    # An id the registry does not hold is left to the app's 404.
    two.admit("zzz")
    assert set(two.mounted()) == {"b", "c"}


def test_every_change_on_a_replica_is_counted_whatever_made_it(root, registry):
    one = Replica(root, registry)
    for name in ("a", "b", "c"):
        one.manager.mount(name, name)
    two = Replica(root, registry, max_mounted=2)
    assert two.counted() == (2, 0, 0)  # a and b, mounted from the registry at start
    two.admit("c")
    assert two.mounted() == {"b": "b", "c": "c"}
    assert two.counted() == (3, 0, 1)  # c mounted for the request, a evicted for it
    one.manager.mount("b", "a2", replace=True)
    one.manager.unmount("c")
    two.admit()
    assert two.mounted() == {"a": "a", "b": "a2"}
    # c's unmount followed, b's new revision too, and a mounted again in the room c left.
    assert two.counted() == (5, 1, 1)
    assert one.counted() == (4, 1, 0)


def test_files_changed_since_registered_are_reported_and_dropped(root, registry, caplog):
    one = Replica(root, registry)
    one.manager.mount("a", "a")
    one.manager.mount("b", "b")
    shutil.rmtree(root / "a")
    shutil.copytree(root / "a2", root / "a")
    with caplog.at_level(logging.WARNING, logger="hotlora.adapters"):
        two = Replica(root, registry)
    assert two.mounted() == {"b": "b"}
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "recorded adapter a " in warning and "changed since it was recorded" in warning
    # Dropped from the registry: the replica still holding the old revision unmounts it too.
    one.admit()
    assert one.mounted() == {"b": "b"}


def test_a_restarted_registry_is_given_back_the_replicas_set(root, registry):
    one = Replica(root, registry)
    one.manager.mount("a", "a")
    one.admit()
    restarted = AdapterRegistry()  # an actor restarted without a record: empty, new generation
    one.mounts._registry = InProcess(restarted)
    one.admit()
    assert one.mounted() == {"a": "a"}
    [record] = restarted.snapshot(None)[2]
    assert (record.id, record.path) == ("a", str(root / "a"))
