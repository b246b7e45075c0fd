"""The `adapter` field's syntax, as data tables."""

from __future__ import annotations

import pytest

from hotlora.adapters import AdapterRef, InvalidAdapterSpec, parse_adapter_spec

R = AdapterRef

GOOD = [
    (None, ()),
    ("", ()),
    ("  ", ()),
    ("none", ()),
    ("NONE", ()),
    ([], ()),
    ("sft", (R("sft"),)),
    ("sft+dpo", (R("sft"), R("dpo"))),
    ("sft,dpo", (R("sft"), R("dpo"))),
    (" sft + dpo ", (R("sft"), R("dpo"))),
    ("sft@0.5+dpo", (R("sft", 0.5), R("dpo"))),
    ("sft@-1", (R("sft", -1.0),)),
    ("sft@0", (R("sft", 0.0),)),
    ("sft@.5+x@1e-1+y@ 3 ", (R("sft", 0.5), R("x", 0.1), R("y", 3.0))),
    ("v1.2_x-y", (R("v1.2_x-y"),)),
    ([{"id": "sft", "scale": 0.5}, {"id": "dpo"}], (R("sft", 0.5), R("dpo"))),
    (["sft@2", "dpo"], (R("sft", 2.0), R("dpo"))),
    ("+".join(f"a{i}" for i in range(16)), tuple(R(f"a{i}") for i in range(16))),
]

BAD = [
    ("sft++dpo", "empty entry"),
    ("sft+", "empty entry"),
    ("sft@", "not a number"),
    ("sft@half", "not a number"),
    ("sft@nan", "not a number"),
    ("sft@inf", "not a number"),
    ("sft@1e309", "finite"),  # a number, past float's range
    ("sft@1_0", "not a number"),  # Python's float() reads these two; JSON and vLLM's clients do not
    ("sft@\u0660.\u0665", "not a number"),
    ("sft@0x1", "not a number"),
    ("sft+none", "reserved"),
    ("s ft", "may only contain"),
    ("sft/../x", "may only contain"),
    ("sft+sft", "named twice"),
    ("sft@0.5,sft", "named twice"),
    ("+".join(f"a{i}" for i in range(17)), "at most 16"),
    ("x" * 65, "longer than 64"),
    (3, "must be a string"),
    ({"id": "sft"}, "must be a string"),
    ([3], "must be an object"),
    ([{"scale": 1}], "missing its 'id'"),
    ([{"id": "sft", "weight": 1}], "unknown adapter entry field"),
    ([{"id": "sft", "scale": True}], "not a number"),
    ([{"id": "sft", "scale": "0.5"}], "not a number"),
    ([{"id": 7}], "must be a string"),
    ([{"id": "sft", "scale": float("nan")}], "finite"),
]


@pytest.mark.parametrize(("value", "expected"), GOOD, ids=[repr(v)[:30] for v, _ in GOOD])
def test_parses(value, expected):
    assert parse_adapter_spec(value) == expected


@pytest.mark.parametrize(("value", "words"), BAD, ids=[repr(v)[:30] for v, _ in BAD])
def test_refuses(value, words):
    with pytest.raises(InvalidAdapterSpec) as caught:
        parse_adapter_spec(value)
    assert words in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert (caught.value.code, caught.value.param) == ("invalid_adapter_spec", "adapter")
