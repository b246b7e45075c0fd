"""Leases and usage counts, isolation between threads, and memory across many mounts."""

from __future__ import annotations

import gc
import os
import platform
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from hotlora.adapters import (
    AdapterConflict,
    AdapterLease,
    AdapterManager,
    AdapterNotFound,
    MountEvent,
    activate,
    parse_adapter_spec,
)

from tests.bench.soak import rss_mb
from tests.support.adapter_builders import (
    BASE_ID,
    TOKENS,
    adapter_set,
    logits,
    make_manager,
    manager_with_a_and_b,
    random_pairs,
    tiny_model,
    write_mlx_adapter,
)


def select(manager: AdapterManager, spec: str) -> AdapterLease:
    return manager.select(BASE_ID, parse_adapter_spec(spec))


@pytest.fixture
def mounted(tmp_path: Path):
    return manager_with_a_and_b(tmp_path)


def test_leases_count_requests_per_adapter(mounted):
    _, manager = mounted
    both, only_a = select(manager, "a+b"), select(manager, "a")
    assert {info.id: info.in_use for info in manager.list()} == {"a": 2, "b": 1}
    manager.unmount("b")  # a running request may lose its adapter from the manager
    both.release()
    only_a.release()
    assert [(info.id, info.in_use) for info in manager.list()] == [("a", 0)]
    base = select(manager, "")
    assert manager.get("a").in_use == 0
    base.release()


def test_a_lease_released_twice_counts_once(mounted):
    _, manager = mounted
    first, second = select(manager, "a"), select(manager, "a")
    first.release()
    first.release()
    assert manager.get("a").in_use == 1
    second.release()
    assert manager.get("a").in_use == 0


def test_a_refused_selection_holds_nothing(mounted):
    _, manager = mounted
    with pytest.raises(AdapterNotFound) as caught:
        select(manager, "a+zzz")
    assert "'zzz'" in str(caught.value) and "a, b" in str(caught.value)
    assert caught.value.code == "adapter_not_found"
    assert [info.in_use for info in manager.list()] == [0, 0]
    with pytest.raises(AdapterNotFound):
        manager.unmount("zzz")
    with pytest.raises(AdapterNotFound):
        manager.get("zzz")


def test_each_thread_computes_with_only_its_own_set(mounted):
    model, manager = mounted
    sets = {name: adapter_set(manager, name) for name in ("a", "b", "")}
    expected = {}
    for name, adapters in sets.items():
        with activate(adapters):
            expected[name] = logits(model)
    barrier = threading.Barrier(len(sets))
    evaluating = threading.Lock()
    seen: dict[str, list[mx.array]] = {name: [] for name in sets}

    def worker(name: str) -> None:
        with activate(sets[name]):
            for _ in range(5):
                barrier.wait()  # every thread is inside its own `activate` at the same time
                out = model(TOKENS)  # the graph is built now, with this thread's set
                barrier.wait()
                with evaluating:  # evaluated one at a time, each on its own thread
                    mx.eval(out)
                seen[name].append(out)

    threads = [threading.Thread(target=worker, args=(name,)) for name in sets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, outs in seen.items():
        assert len(outs) == 5 and all(mx.array_equal(out, expected[name]) for out in outs), name
    assert mx.array_equal(logits(model), expected[""])  # nothing is left active here


def test_mount_unmount_many_times_keeps_memory_flat(tmp_path: Path):
    model, manager = make_manager(tmp_path)
    write_mlx_adapter(tmp_path / "a", random_pairs(tiny_model(), seed=1))
    base = logits(model)
    manager.mount("a", "a")
    manager.unmount("a")
    gc.collect()
    mx.clear_cache()
    start = mx.get_active_memory()
    for _ in range(200):
        info = manager.mount("a", "a")
        with activate(adapter_set(manager, "a")):
            mx.eval(model(mx.array([[1, 2]])))
        manager.unmount("a")
    gc.collect()
    mx.clear_cache()
    assert manager.list() == []
    # 200 mounts of 32 KiB each; a leak of even one would exceed the tolerance.
    assert abs(mx.get_active_memory() - start) < info.ram_bytes
    assert mx.array_equal(logits(model), base)


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's heap on Linux: the memory an unmount is to give back",
)
def test_unmounted_adapters_give_their_memory_back_to_the_system(tmp_path: Path):
    """An adapter's arrays are buffers of tens of KiB each, which glibc's heap holds: once an
    unmount frees them, the process's resident memory falls by about their bytes, even though
    buffers allocated after them (here another adapter's, still mounted) stay above them."""
    _, manager = make_manager(tmp_path, max_rank=128)
    write_mlx_adapter(tmp_path / "a", random_pairs(tiny_model(), rank=128, seed=1), rank=128)
    ids = [f"a{i}" for i in range(64)]
    mounted = sum(manager.mount(i, "a").ram_bytes for i in ids)
    manager.mount("kept", "a")  # allocated after the others: the heap's top stays in use
    gc.collect()
    before = rss_mb(os.getpid())
    for i in ids:
        manager.unmount(i)
    gc.collect()
    given_back = (before - rss_mb(os.getpid())) * (1 << 20)
    assert mounted >= 64 << 20  # 64 mounts of 1 MiB each, in buffers of 16 to 64 KiB
    assert given_back > mounted // 2, (given_back, mounted)
    assert [info.id for info in manager.list()] == ["kept"]


def test_in_use_counts_requests_on_every_revision_of_an_id(tmp_path: Path):
    _, manager = make_manager(tmp_path)
    write_mlx_adapter(tmp_path / "v1", random_pairs(tiny_model(), seed=1))
    write_mlx_adapter(tmp_path / "v2", random_pairs(tiny_model(), seed=2))
    manager.mount("a", "v1")
    on_v1 = select(manager, "a")
    replaced = manager.mount("a", "v2", replace=True)
    assert replaced.in_use == 1  # the request on v1 is still running
    assert manager.get("a").in_use == 1
    on_v2 = select(manager, "a")
    [old], [new] = on_v1.adapters.entries, on_v2.adapters.entries
    assert old.mounted.adapter.revision != new.mounted.adapter.revision == replaced.revision
    assert manager.get("a").in_use == 2
    on_v1.release()
    assert manager.get("a").in_use == 1
    on_v2.release()
    assert manager.get("a").in_use == 0


def test_in_use_follows_an_id_through_unmount_and_mount(tmp_path: Path):
    _, manager = make_manager(tmp_path)
    write_mlx_adapter(tmp_path / "v1", random_pairs(tiny_model(), seed=1))
    write_mlx_adapter(tmp_path / "v2", random_pairs(tiny_model(), seed=2))
    manager.mount("a", "v1")
    running = select(manager, "a")
    assert manager.unmount("a").in_use == 1
    assert manager.mount("a", "v2").in_use == 1  # the request on v1 still holds an `a`
    running.release()
    assert manager.get("a").in_use == 0
    select(manager, "a").release()
    assert [(info.id, info.in_use) for info in manager.list()] == [("a", 0)]


def test_listeners_hear_each_change_once_made_and_nothing_else(tmp_path: Path):
    for seed, name in enumerate(("a", "a2"), start=1):
        write_mlx_adapter(tmp_path / name, random_pairs(tiny_model(), seed=seed))
    heard: list[tuple[str, str, str]] = []
    seen_mounted: list[list[str]] = []

    def listener(event: MountEvent) -> None:
        heard.append((event.kind, event.adapter_id, event.revision))
        seen_mounted.append([info.id for info in manager.list()])

    def failing(event: MountEvent) -> None:
        raise RuntimeError("a listener that fails")

    manager = AdapterManager(
        tiny_model(),
        base_id=BASE_ID,
        adapter_root=tmp_path,
        max_rank=64,
        listeners=[failing, listener],
    )
    first = manager.mount("a", "a").revision
    assert manager.mount("a", "a").revision == first  # the same files: no change, no event
    with pytest.raises(AdapterConflict):
        manager.mount("a", "a2")
    second = manager.mount("a", "a2", replace=True).revision
    with pytest.raises(AdapterNotFound):
        manager.unmount("zzz")
    manager.unmount("a")
    manager.mount("a", "a")
    manager.unmount("a", evicted=True)
    assert heard == [
        ("mounted", "a", first),
        ("mounted", "a", second),
        ("unmounted", "a", second),
        ("mounted", "a", first),
        ("evicted", "a", first),
    ]
    # Told after the change: the listener already sees it; a failing listener undoes nothing.
    assert seen_mounted == [["a"], ["a"], [], ["a"], []]
