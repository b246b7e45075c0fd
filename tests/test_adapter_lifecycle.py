"""Usage counting, isolation between threads, and memory across many mounts."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from hotlora.adapters import AdapterNotFound
from hotlora.adapters.lora import BASE_ONLY, activate, current_adapters

from adapter_support import logits, make_manager, random_pairs, tiny_model, write_mlx_adapter


@pytest.fixture
def mounted(tmp_path: Path):
    model, manager = make_manager(tmp_path)
    write_mlx_adapter(tmp_path / "a", random_pairs(tiny_model(), seed=1))
    write_mlx_adapter(tmp_path / "b", random_pairs(tiny_model(), seed=2))
    manager.mount("a", "a")
    manager.mount("b", "b")
    return model, manager


def test_leases_count_requests_per_adapter(mounted):
    _, manager = mounted
    both, only_a = manager.resolve("a+b"), manager.resolve("a")
    with manager.lease(both), manager.lease(only_a):
        assert {info.id: info.in_use for info in manager.list()} == {"a": 2, "b": 1}
        manager.unmount("b")  # a running request may lose its adapter from the registry
    assert [(info.id, info.in_use) for info in manager.list()] == [("a", 0)]
    with manager.lease(BASE_ONLY):
        assert manager.get("a").in_use == 0


def test_lease_is_released_when_the_request_fails(mounted):
    _, manager = mounted
    with pytest.raises(RuntimeError), manager.lease(manager.resolve("a")):
        raise RuntimeError("generation failed")
    assert manager.get("a").in_use == 0


def test_unknown_ids_list_what_is_mounted(mounted):
    _, manager = mounted
    with pytest.raises(AdapterNotFound) as caught:
        manager.resolve("a+zzz")
    assert "'zzz'" in str(caught.value) and "a, b" in str(caught.value)
    assert caught.value.code == "adapter_not_found"
    with pytest.raises(AdapterNotFound):
        manager.unmount("zzz")
    with pytest.raises(AdapterNotFound):
        manager.get("zzz")


def test_each_thread_sees_only_its_own_set(mounted):
    model, manager = mounted
    sets = {"a": manager.resolve("a"), "b": manager.resolve("b"), "": BASE_ONLY}
    expected = {}
    for name, active in sets.items():
        with activate(active):
            expected[name] = logits(model)
    barrier = threading.Barrier(len(sets))
    seen: dict[str, list] = {name: [] for name in sets}

    def worker(name: str) -> None:
        with activate(sets[name]):
            for _ in range(20):
                barrier.wait()  # every thread is inside its own `activate` at the same time
                seen[name].append(current_adapters())

    threads = [threading.Thread(target=worker, args=(name,)) for name in sets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["a"] == [sets["a"]] * 20 and seen["b"] == [sets["b"]] * 20
    assert seen[""] == [None] * 20  # the base set takes the plain path
    assert current_adapters() is None
    for name, active in sets.items():
        with activate(active):
            assert mx.array_equal(logits(model), expected[name])


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
        with activate(manager.resolve("a")):
            mx.eval(model(mx.array([[1, 2]])))
        manager.unmount("a")
    gc.collect()
    mx.clear_cache()
    assert len(manager) == 0 and manager.list() == []
    # 200 mounts of 32 KiB each; a leak of even one would exceed the tolerance.
    assert abs(mx.get_active_memory() - start) < info.ram_bytes
    assert mx.array_equal(logits(model), base)
