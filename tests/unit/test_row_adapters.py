"""A set per row: each row of a batched call gets exactly its own set's residual."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from hotlora.adapters import BASE_ONLY, AdapterSet, RowAdapterCache, RowAdapters, activate
from hotlora.adapters.adapter_config import AdapterConfig
from hotlora.adapters.adapter_files import LoadedAdapter
from hotlora.adapters.adapter_set import AppliedAdapter, MountedAdapter
from hotlora.adapters.backends import side_by_side
from hotlora.adapters.backends.gathered import GatheredRows
from hotlora.adapters.slots import LoRASlot
from hotlora.models.cpu import extension, install_rows_kernels, layers

from tests.support.adapter_builders import TOKENS, adapter_set, logits, manager_with_a_and_b

SPECS = ["", "a", "b", "a+b", "a@0.5+b", "b@-1"]


@pytest.fixture(scope="module")
def manager_and_model(tmp_path_factory: pytest.TempPathFactory):
    model, manager = manager_with_a_and_b(tmp_path_factory.mktemp("adapters"))
    return manager, model


@pytest.fixture(scope="module")
def setup(manager_and_model):
    manager, model = manager_and_model
    return model, {spec: adapter_set(manager, spec) for spec in SPECS}


def solo_logits(model, adapters: AdapterSet, tokens: mx.array) -> mx.array:
    with activate(adapters):
        return logits(model, tokens)


def test_each_row_gets_its_own_sets_residual(setup):
    model, sets = setup
    rows = [sets[spec] for spec in SPECS]
    tokens = mx.concatenate([TOKENS] * len(rows))  # [rows, L]: the same prompt on every row
    mixed = RowAdapterCache().for_rows(rows)
    assert isinstance(mixed, RowAdapters)
    with activate(mixed):
        batched = logits(model, tokens)
    for i, spec in enumerate(SPECS):
        alone = solo_logits(model, sets[spec], TOKENS)
        difference = mx.abs(batched[i : i + 1] - alone).max().item()
        assert difference < 1e-4, f"row {i} ({spec or 'base'}) differs by {difference}"
    # The sets really differ from each other on this prompt.
    assert mx.abs(batched[1] - batched[2]).max().item() > 1e-2
    assert mx.abs(batched[0] - batched[3]).max().item() > 1e-2


def test_one_set_on_every_row_is_applied_as_is(setup):
    _, sets = setup
    cache = RowAdapterCache()
    assert cache.for_rows([sets["a"]] * 3) is sets["a"]
    assert cache.for_rows([BASE_ONLY, BASE_ONLY]) is BASE_ONLY


def test_steps_with_the_same_rows_share_one_batch_and_a_changed_row_gets_its_own(setup):
    model, sets = setup
    cache = RowAdapterCache()
    rows = [sets["a"], sets["b"], BASE_ONLY]
    first = cache.for_rows(rows)
    assert isinstance(first, RowAdapters)
    with activate(first):
        before = logits(model, mx.concatenate([TOKENS] * 3))
    assert cache.for_rows(list(rows)) is first  # the next step: masks and plans as they were
    # A row joins, a row leaves, two swap: each is another batch, with masks of its own.
    for changed in ([*rows, sets["a+b"]], rows[:2], [sets["b"], sets["a"], BASE_ONLY]):
        batch = cache.for_rows(changed)
        assert isinstance(batch, RowAdapters) and batch is not first
        with activate(batch):
            got = logits(model, mx.concatenate([TOKENS] * len(changed)))
        for i, adapters in enumerate(changed):
            alone = solo_logits(model, adapters, TOKENS)
            assert mx.abs(got[i : i + 1] - alone).max().item() < 1e-4
    # The first batch's rows again: the kept batch is not the one handed out any more.
    again = cache.for_rows(rows)
    assert again is not first
    with activate(again):
        assert mx.array_equal(logits(model, mx.concatenate([TOKENS] * 3)), before).item()
    cache.clear()
    assert cache.for_rows(rows) is not again


def test_a_kept_superset_serves_later_batches_without_a_rebuild(setup):
    model, sets = setup
    cache = RowAdapterCache(keep=1)
    first = cache.for_rows([sets["a"], sets["b"], sets["a+b"]])
    later = cache.for_rows([sets["b"], BASE_ONLY])  # rows left: a subset of the sets
    assert isinstance(first, RowAdapters) and isinstance(later, RowAdapters)
    assert later.side_by_side is first.side_by_side
    tokens = mx.concatenate([TOKENS, TOKENS])
    with activate(later):
        batched = logits(model, tokens)
    assert mx.abs(batched[0:1] - solo_logits(model, sets["b"], TOKENS)).max().item() < 1e-4
    assert mx.abs(batched[1:2] - solo_logits(model, BASE_ONLY, TOKENS)).max().item() < 1e-4
    # Other sets of the same adapters (another weight, another order) reuse its columns.
    stacked = cache.for_rows([sets["a@0.5+b"], sets["b@-1"], sets["a"]])
    assert isinstance(stacked, RowAdapters) and stacked.side_by_side is first.side_by_side
    with activate(stacked):
        batched = logits(model, mx.concatenate([TOKENS] * 3))
    for i, spec in enumerate(["a@0.5+b", "b@-1", "a"]):
        alone = solo_logits(model, sets[spec], TOKENS)
        assert mx.abs(batched[i : i + 1] - alone).max().item() < 1e-4


def test_an_adapter_no_kept_pair_holds_gets_a_new_one(tmp_path):
    model, manager = manager_with_a_and_b(tmp_path)
    cache = RowAdapterCache(keep=1)
    first = cache.for_rows([adapter_set(manager, "a"), BASE_ONLY])
    assert isinstance(first, RowAdapters)
    # A stack with `b`, which the kept pair lacks.
    fresh = cache.for_rows([adapter_set(manager, "a+b"), adapter_set(manager, "a")])
    assert isinstance(fresh, RowAdapters) and fresh.side_by_side is not first.side_by_side
    # `b` replaced by another revision is another adapter: its columns are not the old ones.
    manager.mount("b", "a", replace=True)
    replaced = cache.for_rows([adapter_set(manager, "b"), adapter_set(manager, "a")])
    assert isinstance(replaced, RowAdapters) and replaced.side_by_side is not fresh.side_by_side
    with activate(replaced):
        batched = logits(model, mx.concatenate([TOKENS, TOKENS]))
    a_alone = solo_logits(model, adapter_set(manager, "a"), TOKENS)
    for i in (0, 1):  # `b` now holds `a`'s weights: both rows compute `a`
        assert mx.abs(batched[i : i + 1] - a_alone).max().item() < 1e-4


def test_a_stack_beside_its_members_adds_no_columns(setup):
    _, sets = setup
    mixed = RowAdapterCache().for_rows([sets["a"], sets["b"], sets["a+b"], sets["a@0.5+b"]])
    assert isinstance(mixed, RowAdapters)
    assert len(mixed.side_by_side.adapters) == 2
    path = next(iter(sets["a"].entries[0].mounted.adapter.weights))
    slot = mixed.side_by_side.slot(path)
    assert slot is not None
    a_cat, _, _ = slot
    rank_a = sets["a"].entries[0].mounted.adapter.weights[path][0].shape[1]
    rank_b = sets["b"].entries[0].mounted.adapter.weights[path][0].shape[1]
    assert a_cat.shape[1] == rank_a + rank_b


def test_sets_stay_apart_when_rows_are_reordered(setup):
    model, sets = setup
    order = ["b", "", "a+b", "a"]
    rows = [sets[spec] for spec in order]
    with activate(RowAdapterCache().for_rows(rows)):
        batched = logits(model, mx.concatenate([TOKENS] * len(rows)))
    for i, spec in enumerate(order):
        alone = solo_logits(model, sets[spec], TOKENS)
        assert mx.abs(batched[i : i + 1] - alone).max().item() < 1e-4


def test_requests_naming_the_same_adapters_share_one_set(manager_and_model):
    manager, _ = manager_and_model
    first = adapter_set(manager, "a@0.5+b")
    assert adapter_set(manager, "a@0.5+b") is first  # its stack is fused once for both
    assert adapter_set(manager, "a@0.5") is not first


def test_equal_sets_share_their_columns(manager_and_model):
    manager, _ = manager_and_model
    first = adapter_set(manager, "a@0.5+b")
    second = AdapterSet(first.entries)  # another object naming the same weights
    assert first is not second and first.key == second.key
    cache = RowAdapterCache()
    assert cache.for_rows([first, second]) is first  # one set's computation for both rows
    mixed = cache.for_rows([first, second, adapter_set(manager, "b")])
    assert isinstance(mixed, RowAdapters)
    assert len(mixed.side_by_side.adapters) == 2


def test_a_decode_step_through_the_batch_kernel_gets_each_rows_residual(tmp_path, monkeypatch):
    """Rows of one token each ([B, 1, in] at every projection) take the batch kernel's fused
    path: the base projection and each row's residual in one call per slot."""
    if (why := extension.unavailable()) is not None:
        pytest.skip(f"batched decode kernel: {why}")
    model, manager = manager_with_a_and_b(tmp_path)  # its own model: install changes its layers
    model.set_dtype(mx.float32)
    # Install points the architecture's attention function elsewhere: as it was afterwards.
    monkeypatch.setattr(llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention)
    state = install_rows_kernels(model, threads=2)
    assert state.enabled, state.reason
    fused = []

    def counted(*args):
        fused.append(args[1])
        return layers.lora_rows(*args)

    monkeypatch.setattr(side_by_side, "lora_rows", counted)
    sets = {spec: adapter_set(manager, spec) for spec in SPECS}
    tokens = mx.array([[7]] * len(SPECS))  # [rows, 1]
    with activate(RowAdapterCache().for_rows([sets[spec] for spec in SPECS])):
        batched = logits(model, tokens)
    slots = [m for _, m in model.named_modules() if isinstance(m, LoRASlot)]
    assert len(fused) == len(slots) > 0  # every slot, in one call each
    for i, spec in enumerate(SPECS):
        alone = solo_logits(model, sets[spec], tokens[:1])  # one row: BLAS, not the kernel
        difference = mx.abs(batched[i : i + 1] - alone).max().item()
        assert difference < 1e-4, f"row {i} ({spec or 'base'}) differs by {difference}"
    assert mx.abs(batched[1] - batched[2]).max().item() > 1e-2


@pytest.mark.parametrize("new_first", [False, True])
def test_a_remount_of_the_same_files_gets_its_own_columns(tmp_path, new_first):
    """A request started before `a` was unmounted and mounted again from the same files holds
    the old mount; a new request holds the new one. Both mounts have one revision (one content
    hash), yet each row of a batch with both must get `a`'s residual."""
    model, manager = manager_with_a_and_b(tmp_path)
    old = adapter_set(manager, "a")
    manager.unmount("a")
    manager.mount("a", "a")
    new = adapter_set(manager, "a")
    assert new.entries[0].mounted is not old.entries[0].mounted
    assert new.key == old.key  # the same id and revision
    rows = [new, BASE_ONLY, old] if new_first else [old, BASE_ONLY, new]
    with activate(RowAdapterCache().for_rows(rows)):
        batched = logits(model, mx.concatenate([TOKENS] * len(rows)))
    a_alone = solo_logits(model, old, TOKENS)
    base_alone = solo_logits(model, BASE_ONLY, TOKENS)
    for i, adapters in enumerate(rows):
        alone = base_alone if adapters is BASE_ONLY else a_alone
        difference = mx.abs(batched[i : i + 1] - alone).max().item()
        assert difference < 1e-4, f"row {i} differs from its set alone by {difference}"


def test_a_replace_away_and_back_gets_its_own_columns(tmp_path):
    """`a` replaced by `b`'s files and back: the first and last mounts share a revision."""
    model, manager = manager_with_a_and_b(tmp_path)
    old = adapter_set(manager, "a")
    manager.mount("a", "b", replace=True)
    away = adapter_set(manager, "a")
    manager.mount("a", "a", replace=True)
    back = adapter_set(manager, "a")
    rows = [old, away, back, BASE_ONLY]
    with activate(RowAdapterCache().for_rows(rows)):
        batched = logits(model, mx.concatenate([TOKENS] * len(rows)))
    for i, adapters in enumerate(rows):
        alone = solo_logits(model, adapters, TOKENS)
        difference = mx.abs(batched[i : i + 1] - alone).max().item()
        assert difference < 1e-4, f"row {i} differs from its set alone by {difference}"
    assert mx.abs(batched[0] - batched[1]).max().item() > 1e-2  # `b`'s files really differ


def test_a_pair_no_batch_uses_is_dropped(setup):
    """Side-by-side copies live while batches use them, not for as long as the server runs."""
    model, sets = setup
    cache = RowAdapterCache()
    mixed = cache.for_rows([sets["a"], sets["b"]])
    assert isinstance(mixed, RowAdapters)
    with activate(mixed):
        logits(model, mx.concatenate([TOKENS] * 2))
    kept = weakref.ref(mixed.side_by_side)
    del mixed
    for _ in range(cache.idle + 1):  # steps whose rows all hold one set
        assert cache.for_rows([sets["a"], sets["a"]]) is sets["a"]
    gc.collect()
    assert kept() is None and cache.kept == ()


def test_a_new_batch_of_more_adapters_replaces_the_pair_of_fewer(setup):
    _, sets = setup
    cache = RowAdapterCache()
    first = cache.for_rows([sets["a"], BASE_ONLY])
    assert isinstance(first, RowAdapters)
    both = cache.for_rows([sets["a"], sets["b"]])  # `b` joins: `a`'s pair would duplicate it
    assert isinstance(both, RowAdapters)
    assert cache.kept == (both.side_by_side,)


def test_a_decode_step_through_the_kernel_copies_each_adapter_once(tmp_path, monkeypatch):
    """Through the batch kernel a slot's pair is built in the kernel's layout alone: the batch
    costs one copy of its adapters, whatever else it computes (a prefill call included)."""
    if (why := extension.unavailable()) is not None:
        pytest.skip(f"batched decode kernel: {why}")
    model, manager = manager_with_a_and_b(tmp_path)
    model.set_dtype(mx.float32)
    monkeypatch.setattr(llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention)
    assert install_rows_kernels(model, threads=2).enabled
    rows = [adapter_set(manager, spec) for spec in SPECS]
    adapter_bytes = sum(info.ram_bytes for info in manager.list())
    mixed = RowAdapterCache().for_rows(rows)
    assert isinstance(mixed, RowAdapters)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    with activate(mixed):
        step = logits(model, mx.array([[7]] * len(rows)))
        prefill = logits(model, mx.concatenate([TOKENS] * len(rows)))
    del step, prefill
    gc.collect()
    held = mx.get_active_memory() - before  # what the batch keeps for its next steps
    assert adapter_bytes * 0.9 < held < adapter_bytes * 1.1, (held, adapter_bytes)


def _mounted(name: str, paths: tuple[str, ...], *, views: bool = False) -> MountedAdapter:
    """An adapter with rank-2 pairs [64, 2], [2, 32] at `paths` alone (scale 2), as mounted;
    `views`: each array a transposed view, as no mount keeps them."""
    weights = {}
    for i, path in enumerate(paths):
        keys = mx.random.split(mx.random.key(len(name) * 10 + ord(name[0]) + i), 2)
        a, b = mx.random.normal((64, 2), key=keys[0]), mx.random.normal((2, 32), key=keys[1])
        weights[path] = (mx.contiguous(a.T).T, mx.contiguous(b.T).T) if views else (a, b)
    mx.eval(weights)
    loaded = LoadedAdapter(
        path=Path(name),
        weight_file=Path(name) / "adapters.safetensors",
        config=AdapterConfig(rank=2, scale=2.0),
        revision=name * 8,
        size_bytes=0,
        weights=weights,
    )
    return MountedAdapter(name, loaded, mounted_at=0)


@pytest.mark.parametrize("views", [False, True])
def test_a_slot_adds_each_rows_adapters_with_weights_there_in_order(views: bool):
    """Through the packed kernel, each row gets its base product plus the residuals of its own
    set's adapters that have weights at the slot, in the set's order, at their scales: an entry
    at weight 0 adds nothing anywhere, nor does an adapter where it has no weights; a row with
    nothing to add gets the base product to the bit, and each row's bits are its bits alone."""
    if (why := extension.unavailable()) is not None:
        pytest.skip(f"packed kernels: {why}")
    assert not isinstance(extension.load(2), str)
    a, b = _mounted("a", ("p", "q"), views=views), _mounted("b", ("p",), views=views)
    c = _mounted("c", ("p", "q"), views=views)
    sets = [
        AdapterSet((AppliedAdapter(a),)),
        AdapterSet((AppliedAdapter(b), AppliedAdapter(a, 0.5))),
        AdapterSet((AppliedAdapter(c, 0.0), AppliedAdapter(b))),
        AdapterSet(()),
    ]
    layer = layers.PackedLinear(64, 32, bias=False, group_size=32, bits=4)
    x = mx.random.normal((4, 1, 64), key=mx.random.key(1))
    base = layer(x)
    gathered = GatheredRows(sets)

    def residual(adapter: MountedAdapter, path: str, row: int, scale: float) -> mx.array:
        first, second = adapter.adapter.weights[path]
        return scale * ((x[row] @ first) @ second)

    want = {
        "p": [
            base[0] + residual(a, "p", 0, 2.0),
            base[1] + residual(b, "p", 1, 2.0) + residual(a, "p", 1, 1.0),
            base[2] + residual(b, "p", 2, 2.0),
            base[3],
        ],
        "q": [
            base[0] + residual(a, "q", 0, 2.0),
            base[1] + residual(a, "q", 1, 1.0),
            base[2],
            base[3],
        ],
        "r": list(base),  # no adapter has weights here
    }
    exact = {"p": {3}, "q": {2, 3}, "r": {0, 1, 2, 3}}  # rows with nothing to add there
    for path, rows in want.items():
        got = gathered.project(path, x, layer)
        assert got is not None
        for row, expected in enumerate(rows):
            assert mx.allclose(got[row], expected, rtol=1e-4, atol=1e-4).item(), (path, row)
            alone = GatheredRows([sets[row]]).project(path, x[row : row + 1], layer)
            assert alone is not None and mx.array_equal(alone[0], got[row]).item(), (path, row)
        for row in exact[path]:
            assert mx.array_equal(got[row], base[row]).item(), (path, row)
    idle = GatheredRows([AdapterSet((AppliedAdapter(c, 0.0),)), AdapterSet(())])
    nothing = idle.project("p", x[:2], layer)  # every entry at weight 0: nothing applies
    assert nothing is not None and mx.array_equal(nothing, base[:2]).item()
