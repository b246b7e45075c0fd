"""Selection: a request's `model` and `adapter` fields to a leased adapter set, as data tables;
the manager and the Ray ingress read them by the same rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hotlora.adapters import (
    AdapterManager,
    AdapterNotFound,
    AdapterRef,
    InvalidAdapter,
    InvalidAdapterSpec,
    parse_adapter_spec,
    parse_selection,
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
    (f"{BASE_ID}:a+zzz", None, AdapterNotFound, "model", "'zzz'"),  # the field that named it
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


R = AdapterRef
MOUNTED = ("a", "b")

RULE = [
    # (model, adapter field, the refs selected or (exception, param)), with a and b mounted
    (BASE_ID, None, ()),
    (BASE_ID, "a@0.5+b", (R("a", 0.5), R("b"))),
    (BASE_ID, [{"id": "b"}, {"id": "a", "scale": 2}], (R("b"), R("a", 2.0))),
    (BASE_ID, "zzz", (R("zzz"),)),  # selected; whether it is mounted is checked after
    ("a", None, (R("a"),)),
    ("a", "none", (R("a"),)),
    (f"{BASE_ID}:b,a@2", None, (R("b"), R("a", 2.0))),
    (f"{BASE_ID}:zzz", None, (R("zzz"),)),
    (f"{BASE_ID}:none", None, ()),
    (BASE_ID, "a++b", (InvalidAdapterSpec, "adapter")),
    ("zzz", None, (ModelNotFound, "model")),
    ("other:a", None, (ModelNotFound, "model")),  # a spec after another model's id
    ("a:b", None, (ModelNotFound, "model")),
    (BASE_ID.upper(), None, (ModelNotFound, "model")),
    ("a", "b", (InvalidRequest, "adapter")),
    (f"{BASE_ID}:a", "b", (InvalidRequest, "adapter")),
    (f"{BASE_ID}:a@x", None, (InvalidRequest, "model")),
    (f"{BASE_ID}:a+a", None, (InvalidRequest, "model")),
]
RULE_IDS = [f"{model}|{field}" for model, field, _ in RULE]


def refused(expected: tuple[object, ...]) -> bool:
    return bool(expected) and isinstance(expected[0], type)


def selected(model: str, field: object) -> tuple[AdapterRef, ...]:
    return parse_selection(BASE_ID, model, parse_adapter_spec(field), MOUNTED)  # type: ignore[arg-type]


@pytest.mark.parametrize(("model", "field", "expected"), RULE, ids=RULE_IDS)
def test_the_selection_rule(model, field, expected):
    if refused(expected):
        error, param = expected
        with pytest.raises(error) as caught:
            selected(model, field)
        assert type(caught.value) is error and caught.value.param == param
    else:
        assert selected(model, field) == expected


@pytest.mark.parametrize(("model", "field", "expected"), RULE, ids=RULE_IDS)
def test_the_manager_selects_by_the_rule(manager: AdapterManager, model, field, expected):
    if refused(expected) or any(ref.id not in MOUNTED for ref in expected):
        if refused(expected):
            error, param = expected
        else:  # not mounted: the field that named it
            error, param = AdapterNotFound, "adapter" if parse_adapter_spec(field) else "model"
        with pytest.raises(error) as caught:
            manager.select(model, parse_adapter_spec(field))
        assert type(caught.value) is error and caught.value.param == param
        return
    lease = manager.select(model, parse_adapter_spec(field))
    assert [(e.mounted.id, e.weight) for e in lease.adapters.entries] == [
        (ref.id, ref.weight) for ref in expected
    ]
    lease.release()


@pytest.mark.parametrize(("model", "field", "expected"), RULE, ids=RULE_IDS)
def test_the_ray_ingress_routes_by_the_rule(model, field, expected):
    pytest.importorskip("ray")
    from hotlora.server.ray.relay import RelayedRequest
    from hotlora.server.ray.serve_app import wanted_adapters

    body = json.dumps({"model": model, "adapter": field, "messages": []}).encode()
    request = RelayedRequest("POST", "/v1/chat/completions", b"", b"", [], body)
    wanted = wanted_adapters(request, BASE_ID, frozenset(MOUNTED))
    # What the app refuses names no adapter: any replica answers it with the same error.
    assert wanted == ([] if refused(expected) else sorted({ref.id for ref in expected}))
