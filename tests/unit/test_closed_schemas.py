"""JSON schemas are closed by default: an object that lists `properties` and says nothing of
`additionalProperties` takes no other keys, as in OpenAI's strict mode and vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from hotlora.models.loader import load_model_dir
from hotlora.server.engine import Engine
from hotlora.server.engine.grammar import Grammar, close_objects

OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(load_model_dir(tiny_model_dir), base_id="tiny", prompt_cache_size=0)


def follows(engine: Engine, grammar: Grammar, text: str) -> bool:
    """Whether the grammar takes `text`, token by token, without an error."""
    constraint = grammar.start()
    for token in engine.tokenizer.encode(text, add_special_tokens=False):
        constraint.consume(token)
        if constraint.error:
            return False
    return True


def test_an_object_without_additional_properties_takes_only_its_keys(engine: Engine):
    closed = engine.grammars.json_schema(OPEN)
    assert follows(engine, closed, '{"a": 1}')
    assert not follows(engine, closed, '{"a": 1, "b": 2}')
    assert not follows(engine, closed, '{"b": 2}')


def test_closing_can_be_declined_and_additional_properties_said_is_kept(engine: Engine):
    as_written = engine.grammars.json_schema(OPEN, closed=False)
    assert follows(engine, as_written, '{"a": 1, "b": 2}')
    said = engine.grammars.json_schema({**OPEN, "additionalProperties": {"type": "integer"}})
    assert follows(engine, said, '{"a": 1, "b": 2}')


def test_close_objects_reaches_nested_schemas_but_not_all_of():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "either": {"anyOf": [{"properties": {"z": {}}}, {"type": "string"}]},
            "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
        },
        "$defs": {"D": {"properties": {"d": {}}}},
    }
    closed = close_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["inner"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["both"] == schema["properties"]["both"]  # composed branches stay open
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert close_objects({"type": "object"}) == {"type": "object"}  # any object stays any
    assert "additionalProperties" not in schema  # the request's own schema is not changed
