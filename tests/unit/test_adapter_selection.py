"""Selection: a request's `model` and `adapter` fields to a leased adapter set, as data tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from hotlora.adapters import (
    AdapterManager,
    AdapterNotFound,
    InvalidAdapter,
    parse_adapter_spec,
)
from hotlora.config.errors import HotloraError, InvalidRequest, ModelNotFound

from tests.support.adapter_builders import (
    BASE_ID,
    manager_with_a_and_b,
)


@pytest.fixture
def manager(tmp_path: Path) -> AdapterManager:
    _, manager = manager_with_a_and_b(tmp_path)
    return manager


SELECTED = [
    # (model, adapter field, the response's model, the set's (id, weight) in order)
    (BASE_ID, None, BASE_ID, []),
    (BASE_ID, "none", BASE_ID, []),
    (BASE_ID, "a", f"{BASE_ID}:a", [("a", 1.0)]),
    (BASE_ID, "a@0.5+b", f"{BASE_ID}:a@0.5+b", [("a", 0.5), ("b", 1.0)]),
    (BASE_ID, [{"id": "b"}, {"id": "a", "scale": 2}], f"{BASE_ID}:b+a@2", [("b", 1.0), ("a", 2.0)]),
    ("a", None, "a", [("a", 1.0)]),
    (f"{BASE_ID}:b,a", None, f"{BASE_ID}:b,a", [("b", 1.0), ("a", 1.0)]),
]


@pytest.mark.parametrize(("model", "field", "served", "entries"), SELECTED)
def test_selection_spellings(manager: AdapterManager, model, field, served, entries):
    lease = manager.select(model, parse_adapter_spec(field))
    assert lease.model == served
    assert [(e.mounted.id, e.weight) for e in lease.adapters.entries] == entries
    in_use = {info.id: info.in_use for info in manager.list()}
    assert in_use == {name: sum(n == name for n, _ in entries) for name in ("a", "b")}
    lease.release()
    assert [info.in_use for info in manager.list()] == [0, 0]


REFUSED = [
    # (model, adapter field, exception, param, words in the message)
    ("zzz", None, ModelNotFound, "model", f"Available models: {BASE_ID}, a, b."),
    ("a", "b", InvalidRequest, "adapter", "already selects adapters"),
    (f"{BASE_ID}:a", "b", InvalidRequest, "adapter", "already selects adapters"),
    (f"{BASE_ID}:a@x", None, InvalidRequest, "model", "not a number"),
    (BASE_ID, "zzz", AdapterNotFound, "adapter", "Mounted adapters: a, b."),
    (f"{BASE_ID}:a+zzz", None, AdapterNotFound, "adapter", "'zzz'"),
]


@pytest.mark.parametrize(("model", "field", "error", "param", "words"), REFUSED)
def test_refused_selection_holds_nothing(
    manager: AdapterManager, model, field, error: type[HotloraError], param, words
):
    with pytest.raises(error) as caught:
        manager.select(model, parse_adapter_spec(field))
    assert type(caught.value) is error
    assert caught.value.param == param and words in caught.value.message
    assert [info.in_use for info in manager.list()] == [0, 0]


def test_the_base_id_cannot_be_an_adapter_id(manager: AdapterManager):
    with pytest.raises(InvalidAdapter, match="base model's id") as caught:
        manager.mount(BASE_ID, "a")
    assert caught.value.param == "id"
