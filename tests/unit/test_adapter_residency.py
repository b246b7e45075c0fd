"""Many adapters on one server: mounts on first use, one load for concurrent first requests,
eviction of the least recently used past a budget, pins, and refusals that mount nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from hotlora.adapters import (
    AdapterConflict,
    AdapterLease,
    AdapterManager,
    AdapterNotFound,
    AdapterOverBudget,
    Budget,
    InvalidAdapter,
    MountEvent,
    activate,
    adapter_files,
    parse_adapter_spec,
)
from hotlora.adapters.first_use import SingleFlight
from hotlora.config.errors import ModelNotFound

from tests.support.adapter_builders import (
    BASE_ID,
    logits,
    random_pairs,
    tiny_model,
    write_mlx_adapter,
)

IDS = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four adapters under the root, by name, and one whose weights file is not safetensors."""
    root = tmp_path_factory.mktemp("adapters")
    for seed, adapter_id in enumerate(IDS, start=1):
        write_mlx_adapter(root / adapter_id, random_pairs(tiny_model(), seed=seed))
    broken = write_mlx_adapter(root / "broken", random_pairs(tiny_model(), seed=9))
    (broken / "adapters.safetensors").write_bytes(b"not a safetensors file")
    return root


class Heard:
    """The manager's events, as its listeners hear them."""

    def __init__(self) -> None:
        self.events: list[MountEvent] = []

    def __call__(self, event: MountEvent) -> None:
        self.events.append(event)

    def count(self, kind: str, adapter_id: str | None = None) -> int:
        return sum(
            1
            for event in self.events
            if event.kind == kind and (adapter_id is None or event.adapter_id == adapter_id)
        )


def manager_on(
    root: Path, heard: Heard, *, auto_mount: bool = True, **budget: int
) -> AdapterManager:
    return AdapterManager(
        tiny_model(),
        base_id=BASE_ID,
        adapter_root=root,
        max_rank=64,
        listeners=[heard],
        budget=Budget(budget.get("max_adapters"), budget.get("max_bytes")),
        auto_mount=auto_mount,
    )


def select(manager: AdapterManager, spec: str) -> AdapterLease:
    return manager.select(BASE_ID, parse_adapter_spec(spec))


def resident(manager: AdapterManager) -> set[str]:
    return {info.id for info in manager.list()}


# Every manager here wraps a model of the same weights (`tiny_model()` is seeded): one model
# computes for all, its slots applying whichever set is active.
MODEL = tiny_model()
AdapterManager(MODEL, base_id=BASE_ID, adapter_root=Path("."), max_rank=64)


def computed(lease: AdapterLease) -> mx.array:
    with activate(lease.adapters):
        return logits(MODEL)


def alone(root: Path, adapter_id: str) -> mx.array:
    """`adapter_id`'s logits from a manager of its own where it is mounted by hand."""
    manager = AdapterManager(tiny_model(), base_id=BASE_ID, adapter_root=root, max_rank=64)
    manager.mount(adapter_id, adapter_id)
    return computed(select(manager, adapter_id))


@pytest.fixture
def slow_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every adapter read, recorded, and held open a moment so concurrent requests overlap."""
    reads: list[Path] = []
    read = adapter_files.read_adapter

    def slow(directory: Path, *args, **kwargs):
        reads.append(directory)
        time.sleep(0.3)
        return read(directory, *args, **kwargs)

    monkeypatch.setattr(adapter_files, "read_adapter", slow)
    return reads


def at_once(count: int, call: Callable[[], object]) -> list[object]:
    """`call` on `count` threads released together; each one's result or exception."""
    start = threading.Barrier(count)
    results: list[object] = [None] * count

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - the caller inspects it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_a_request_naming_an_adapter_under_the_root_mounts_it(root):
    heard = Heard()
    manager = manager_on(root, heard)
    assert resident(manager) == set()
    lease = select(manager, "a")
    assert resident(manager) == {"a"}
    info = manager.get("a")
    assert info.on_demand and not info.pinned and info.in_use == 1
    assert heard.count("loaded", "a") == 1 and heard.count("mounted") == 0
    assert mx.array_equal(computed(lease), alone(root, "a")).item()
    # The model field names it as well.
    by_model = manager.select("b")
    assert by_model.adapters.ids == ("b",)


def test_without_auto_mount_an_unmounted_adapter_is_not_found(root):
    manager = manager_on(root, Heard(), auto_mount=False)
    with pytest.raises(AdapterNotFound):
        select(manager, "a")
    with pytest.raises(ModelNotFound):
        manager.select("a")
    with pytest.raises(AdapterNotFound):
        manager.try_select(BASE_ID, parse_adapter_spec("a+b"))
    assert resident(manager) == set()


def test_try_select_says_when_a_load_is_needed(root):
    manager = manager_on(root, Heard())
    assert manager.try_select(BASE_ID, parse_adapter_spec("a")) is None
    assert resident(manager) == set()  # it loads nothing
    with pytest.raises(AdapterNotFound):
        manager.try_select(BASE_ID, parse_adapter_spec("nowhere"))
    select(manager, "a").release()
    lease = manager.try_select(BASE_ID, parse_adapter_spec("a"))
    assert lease is not None and lease.adapters.ids == ("a",)


def test_many_concurrent_first_requests_share_one_load(root, slow_reads):
    heard = Heard()
    manager = manager_on(root, heard)
    leases = at_once(12, lambda: select(manager, "a"))
    assert all(isinstance(lease, AdapterLease) for lease in leases), leases
    assert slow_reads == [root / "a"]  # one read of the files for twelve requests
    assert heard.count("loaded", "a") == 1
    mounted = {id(lease.adapters.entries[0].mounted) for lease in leases}  # type: ignore[union-attr]
    assert len(mounted) == 1
    assert manager.get("a").in_use == 12


def test_a_failed_load_is_every_waiters_error_and_mounts_nothing(root, slow_reads):
    heard = Heard()
    manager = manager_on(root, heard)
    errors = at_once(6, lambda: select(manager, "broken"))
    assert slow_reads == [root / "broken"]
    for error in errors:
        assert isinstance(error, InvalidAdapter), error
        assert "'broken' could not be loaded" in error.message
        assert "adapters.safetensors" in error.message  # what is wrong with it
        assert error.param == "adapter"
    assert resident(manager) == set() and heard.events == []
    # Nothing is remembered of the failure: the next request tries the files again.
    with pytest.raises(InvalidAdapter):
        select(manager, "broken")
    assert len(slow_reads) == 2


def test_the_least_recently_used_free_adapter_is_evicted_and_comes_back(root):
    heard = Heard()
    manager = manager_on(root, heard, max_adapters=2)
    select(manager, "a").release()
    select(manager, "b").release()
    select(manager, "a").release()  # `b` is now the least recently used
    c = select(manager, "c")
    assert resident(manager) == {"a", "c"}
    assert heard.count("evicted", "b") == 1
    entries = {entry.id: entry for entry in manager.root_entries()}
    assert entries["b"].state == "evicted" and entries["b"].ram_bytes
    assert entries["d"].state == "on disk" and entries["d"].ram_bytes is None
    assert entries["c"].state == "resident"
    c.release()
    b = select(manager, "b")  # evicted: loaded again on its next request
    assert heard.count("loaded", "b") == 2
    assert mx.array_equal(computed(b), alone(root, "b")).item()
    assert len(resident(manager)) == 2


def test_held_adapters_are_never_evicted_and_keep_their_weights(root):
    heard = Heard()
    manager = manager_on(root, heard, max_adapters=1)
    a = select(manager, "a")
    b = select(manager, "b")  # over the budget while `a` runs: neither is evicted
    c = select(manager, "c")
    assert resident(manager) == {"a", "b", "c"} and heard.count("evicted") == 0
    for lease, adapter_id in ((a, "a"), (b, "b"), (c, "c")):
        assert mx.array_equal(computed(lease), alone(root, adapter_id)).item()
    a.release()  # let go: evicted, the budget being exceeded
    assert resident(manager) == {"b", "c"}
    b.release()
    assert resident(manager) == {"c"}
    assert heard.count("evicted") == 2
    # A request still holding an evicted adapter computes with it until it ends.
    d_first = select(manager, "d")
    c.release()
    assert resident(manager) == {"d"}
    assert mx.array_equal(computed(d_first), alone(root, "d")).item()


def test_an_adapter_let_go_during_an_admin_change_is_evicted_after_it(root):
    """A request ending while an unmount (or any admin change) holds the admin lock cannot
    evict then; its adapter is evicted once the change is done, not at some later release."""
    heard = Heard()
    manager = manager_on(root, heard, max_adapters=1)
    a = select(manager, "a")
    b = select(manager, "b")  # over the budget while `a` runs
    with manager._admin:  # an admin change under way
        a.release()
        time.sleep(0.1)
        assert resident(manager) == {"a", "b"}
    deadline = time.monotonic() + 10
    while resident(manager) != {"b"} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resident(manager) == {"b"} and heard.count("evicted", "a") == 1
    b.release()


def test_requests_keep_their_adapter_while_loads_evict_around_them(root):
    """Threads selecting random adapters under a budget of two: every lease computes its own
    adapter's residual, whatever was evicted and loaded meanwhile."""
    manager = manager_on(root, Heard(), max_adapters=2)
    reference = {adapter_id: alone(root, adapter_id) for adapter_id in IDS}
    failures: list[str] = []

    def client(seed: int) -> None:
        for step in range(6):
            adapter_id = IDS[(seed * 7 + step * 3) % len(IDS)]
            lease = select(manager, adapter_id)
            try:
                # The arrays are read on this thread; evictions happen on the others.
                got = computed(lease)
                if not mx.array_equal(got, reference[adapter_id]).item():
                    failures.append(f"client {seed} step {step}: not {adapter_id}'s weights")
            finally:
                lease.release()

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    assert len(resident(manager)) <= 2


def test_a_pinned_mount_is_never_evicted(root):
    heard = Heard()
    manager = manager_on(root, heard, max_adapters=2)
    info = manager.mount("kept", "a", pin=True)
    assert info.pinned and not info.on_demand
    for adapter_id in ("b", "c", "d", "b"):
        select(manager, adapter_id).release()
    assert "kept" in resident(manager) and heard.count("evicted", "kept") == 0
    assert heard.count("evicted") >= 2
    # Pins that would fill the budget are refused, and change nothing.
    manager.mount("other", "b", pin=True)
    with pytest.raises(AdapterOverBudget) as refused:
        manager.mount("third", "c", pin=True)
    assert refused.value.param == "pin"
    assert "third" not in resident(manager)


def test_a_hand_mount_evicted_comes_back_from_its_files(root):
    heard = Heard()
    manager = manager_on(root, heard, auto_mount=False, max_adapters=1)
    manager.mount("sft", "a")
    manager.mount("dpo", "b")  # evicts `sft`: no request holds it
    assert resident(manager) == {"dpo"} and heard.count("evicted", "sft") == 1
    lease = select(manager, "sft")  # not auto-mount, but it was mounted: it comes back
    assert mx.array_equal(computed(lease), alone(root, "a")).item()
    lease.release()
    # Unmounting an evicted adapter forgets it.
    manager.unmount("dpo")
    manager.mount("dpo", "b")  # evicts `sft` again
    manager.unmount("sft")
    with pytest.raises(AdapterNotFound):
        select(manager, "sft")


def test_an_adapter_alone_larger_than_the_budget_is_refused(root):
    probe = manager_on(root, Heard(), auto_mount=False)
    size = probe.mount("a", "a").ram_bytes
    heard = Heard()
    manager = manager_on(root, heard, max_bytes=size - 1)
    with pytest.raises(AdapterOverBudget) as refused:
        manager.mount("a", "a")
    assert str(size) in refused.value.message
    with pytest.raises(InvalidAdapter) as lazily:  # a request naming it: a 400, not a mount
        select(manager, "a")
    assert "could not be loaded" in lazily.value.message
    assert lazily.value.code == "adapter_over_budget"
    assert resident(manager) == set() and heard.events == []
    assert manager.resident_bytes == 0


def test_a_bytes_budget_evicts_by_memory(root):
    heard = Heard()
    probe = manager_on(root, Heard(), auto_mount=False)
    size = probe.mount("a", "a").ram_bytes
    manager = manager_on(root, heard, max_bytes=2 * size)
    for adapter_id in IDS:
        select(manager, adapter_id).release()
    assert resident(manager) == {"c", "d"}
    assert manager.resident_bytes == 2 * size
    assert heard.count("evicted") == 2


def test_errors_name_a_few_of_thousands_of_adapters(root):
    manager = manager_on(root, Heard(), auto_mount=False)
    for i in range(25):
        manager.mount(f"x{i:02d}", "a")
    with pytest.raises(AdapterNotFound) as missing:
        select(manager, "nowhere")
    assert "x00, x01" in missing.value.message and "x19 and 5 more." in missing.value.message
    assert "x20" not in missing.value.message
    with pytest.raises(ModelNotFound) as unknown:
        manager.select("nowhere")
    assert "and 6 more." in unknown.value.message  # the base, then the adapters


def test_an_evicted_hand_mount_whose_files_changed_is_not_served(tmp_path):
    for seed, name in enumerate(("x", "y"), start=1):
        write_mlx_adapter(tmp_path / name, random_pairs(tiny_model(), seed=seed))
    manager = manager_on(tmp_path, Heard(), auto_mount=False, max_adapters=1)
    manager.mount("sft", "x")
    manager.mount("dpo", "y")  # evicts `sft`
    write_mlx_adapter(tmp_path / "x", random_pairs(tiny_model(), seed=5))  # other weights
    with pytest.raises(AdapterConflict) as changed:
        select(manager, "sft")
    assert changed.value.code == "adapter_changed" and changed.value.param == "adapter"
    assert resident(manager) == {"dpo"}


def test_a_step_waits_for_a_load_in_flight_a_bounded_time(root, slow_reads):
    """`yield_to_loads`, which the generation worker calls before each step: it returns at once
    when nothing loads, when the load ends while one runs, and after `most` seconds when the
    load takes longer, so that a long load lets steps run."""
    manager = manager_on(root, Heard())
    began = time.perf_counter()
    manager.yield_to_loads(most=5.0)
    assert time.perf_counter() - began < 0.1  # nothing loads

    loading = threading.Thread(target=lambda: select(manager, "a"))
    loading.start()
    while not slow_reads:  # the load has begun: its read is held open 0.3 s
        time.sleep(0.005)
    began = time.perf_counter()
    manager.yield_to_loads(most=0.05)
    waited = time.perf_counter() - began
    assert 0.04 <= waited < 0.25 and resident(manager) == set()  # bounded; still loading
    manager.yield_to_loads(most=5.0)
    assert resident(manager) == {"a"}  # returned when the load ended, not after 5 s
    assert time.perf_counter() - began < 2.0
    loading.join(timeout=10)


def test_a_load_under_way_for_long_holds_no_step_back():
    """Only loads begun less than `younger` seconds ago hold a step back: a load that takes long
    (a large file, a slow disk) lets steps run at their own pace after its first moments."""
    flight = SingleFlight()
    release = threading.Event()
    loading = threading.Thread(target=lambda: flight.run("big", lambda: release.wait(10)))
    loading.start()
    try:
        time.sleep(0.05)
        began = time.perf_counter()
        assert not flight.wait_idle(most=0.1, younger=5.0)  # young: waited the whole 0.1 s
        assert time.perf_counter() - began >= 0.09
        began = time.perf_counter()
        assert flight.wait_idle(most=5.0, younger=0.01)  # old: no wait
        assert time.perf_counter() - began < 0.05
    finally:
        release.set()
        loading.join(timeout=10)
    assert flight.wait_idle(most=5.0)  # none under way
