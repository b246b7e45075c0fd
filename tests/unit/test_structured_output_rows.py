"""Structured output on the tiny model: rows under a JSON-schema grammar write JSON that
validates, alone or batched with free rows and other adapters, each choice on its own matcher.

The tiny model's weights are random, so only the grammar makes its output JSON. Every schema
here bounds its strings, numbers and arrays, so the JSON completes well within `max_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from hotlora.adapters import AdapterManager, AdapterSet, parse_adapter_spec
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import (
    Engine,
    GenerationJob,
    SamplingParams,
    Scheduler,
    grammar,
    next_tokens,
)
from hotlora.server.engine.generate import IMPOSSIBLE_LOGPROB
from hotlora.server.engine.grammar import Grammar, GrammarFailed, UnsupportedSchema

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.scheduling import Recorder, run
from tests.support.tiny import UNK_ID

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]
MAX_TOKENS = 160  # the longest answer to PERSON takes ~110 of the tiny model's character tokens
MAX_STEPS = 1000

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "floor": {"type": "integer", "minimum": -2, "maximum": 40},
            },
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "home"],
    "additionalProperties": False,
}
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["x", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    loaded = load_model_dir(tiny_model_dir)
    root = tmp_path_factory.mktemp("adapters")
    reference = tiny_model()
    for seed, name in enumerate(("a", "b")):
        write_mlx_adapter(root / name, random_pairs(reference, seed=20 + seed, rank=4), rank=4)
    manager = AdapterManager(loaded.model, base_id="tiny", adapter_root=root, max_rank=64)
    for name in ("a", "b"):
        manager.mount(name, name)
    engine = Engine(loaded, base_id="tiny", prompt_cache_size=0)
    return engine, manager


def adapters(manager: AdapterManager, spec: str) -> AdapterSet:
    return manager.resolve(parse_adapter_spec(spec))


def job(
    prompt: list[int],
    grammar: Grammar | None = None,
    adapter: AdapterSet | None = None,
    max_tokens: int = MAX_TOKENS,
    **params,
) -> GenerationJob:
    sampling = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **params})
    extra = {} if adapter is None else {"adapters": adapter}
    return GenerationJob(prompt, sampling, grammar=grammar, **extra)


def solo(engine: Engine, one: GenerationJob) -> Recorder:
    fresh = GenerationJob(one.prompt, one.params, one.adapters, grammar=one.grammar)
    return run(Scheduler(engine, max_batch=1), [[fresh]], MAX_STEPS)[0]


def assert_valid(sink: Recorder, schema: dict, position: int = 0) -> dict:
    """The answer is complete JSON that validates; the grammar, not max_tokens, ended it."""
    assert sink.errors == []
    assert sink.finished(position).finish_reason == "stop", sink.text(position)
    value = json.loads(sink.text(position))
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_constrained_row_writes_json_that_validates(setup, prompt, temperature):
    engine, _ = setup
    grammar = engine.grammars.json_schema(PERSON)
    sink = solo(engine, job(prompt, grammar, temperature=temperature, seed=11))
    value = assert_valid(sink, PERSON)
    assert list(value) == list(PERSON["properties"])  # keys in the schema's order
    # It stops at the closing brace: no end-of-text token is sampled or counted.
    assert sink.text().endswith("}}")
    assert sink.finished().completion_tokens < MAX_TOKENS


def test_any_json_object(setup):
    engine, _ = setup
    grammar = engine.grammars.json_schema({"type": "object"})
    for prompt in PROMPTS:
        sink = solo(engine, job(prompt, grammar, temperature=1.0, seed=3))
        assert isinstance(json.loads(sink.text()), dict)


def test_constrained_and_free_rows_batched_together_match_their_solo_answers(setup):
    engine, manager = setup
    person = engine.grammars.json_schema(PERSON)
    point = engine.grammars.json_schema(POINT)
    free = {"ignore_eos": True}  # free rows run to max_tokens, past <|endoftext|> too
    requests = [
        [job(PROMPTS[0], **free)],
        [job(PROMPTS[1], person)],
        [job(PROMPTS[2], adapter=adapters(manager, "a"), max_tokens=24, **free)],
        [job(PROMPTS[3], point, adapter=adapters(manager, "b"))],
        [job(PROMPTS[1], adapter=adapters(manager, "a+b@0.5"), max_tokens=40, **free)],
        [job(PROMPTS[2], person, adapter=adapters(manager, "a"), temperature=0.8, seed=5)],
        [job(PROMPTS[3], max_tokens=30, **free)],
    ]
    batched = run(Scheduler(engine, max_batch=8), requests, MAX_STEPS)
    for [one], sink in zip(requests, batched, strict=True):
        assert sink.text() == solo(engine, one).text()
        assert sink.finished() == solo(engine, one).finished()
        if one.grammar is person:
            assert_valid(sink, PERSON)
        elif one.grammar is point:
            assert_valid(sink, POINT)
        else:
            assert sink.finished().finish_reason == "length"
    # The free rows are not JSON: the grammar is what makes the others so.
    assert not batched[0].text().startswith("{")


def test_n_choices_each_follow_their_own_matcher(setup):
    engine, _ = setup
    grammar = engine.grammars.json_schema(PERSON)
    prompt = PROMPTS[1]
    choices = [job(prompt, grammar, temperature=1.0, seed=s) for s in (1, 2, 3)]
    [sink] = run(Scheduler(engine, max_batch=8), [choices], MAX_STEPS)
    values = [assert_valid(sink, PERSON, i) for i in range(3)]
    assert len({json.dumps(v) for v in values}) > 1  # their own seeds, their own JSON


def test_logprobs_are_those_of_the_constrained_distribution(setup):
    engine, _ = setup
    grammar = engine.grammars.json_schema({"enum": ["yes", "no"]})
    sink = solo(engine, job(PROMPTS[0], grammar, logprobs=True, top_logprobs=3))
    assert sink.text() in ('"yes"', '"no"')
    first = sink.logprobs()[0]
    # Only a quote may open a JSON string: it takes all the probability, others none.
    assert first.token.text == '"' and first.logprob == 0.0
    assert [lp for _, lp in first.top[1:]] == [IMPOSSIBLE_LOGPROB] * 2
    free = solo(engine, job(PROMPTS[0], logprobs=True, max_tokens=1)).logprobs()[0]
    assert free.logprob < 0.0


def test_free_batches_never_compute_a_mask(setup, monkeypatch):
    engine, _ = setup

    def forbidden(*args, **kwargs):
        raise AssertionError("a mask was computed for a batch without grammars")

    monkeypatch.setattr(next_tokens, "constrain", forbidden)
    [sink] = run(Scheduler(engine, max_batch=4), [[job(PROMPTS[0], max_tokens=6)]], MAX_STEPS)
    assert sink.finished().completion_tokens == 6


def test_a_row_whose_matcher_fails_stops_alone(setup):
    engine, _ = setup
    grammar = engine.grammars.json_schema(POINT)
    scheduler = Scheduler(engine, max_batch=4)
    broken, free = Recorder(), Recorder()
    scheduler.add([job(PROMPTS[0], grammar)], broken)
    scheduler.add([job(PROMPTS[1], max_tokens=12)], free)
    scheduler.step()
    [row] = [r for r in scheduler.running if r.constraint is not None]
    row.constraint.consume(PROMPTS[0][0])  # a token the grammar never allows here
    while not scheduler.idle:
        scheduler.step()
    # A token the mask allowed and the matcher refused is the server's fault, not the request's.
    [error] = broken.errors
    assert type(error) is RuntimeError and "left the answer's grammar" in str(error)
    assert free.errors == [] and free.finished().completion_tokens == 12


def test_compiled_grammars_are_cached_by_schema_text(setup):
    engine, _ = setup
    assert engine.grammars.json_schema(POINT) is engine.grammars.json_schema(dict(POINT))
    reordered = {**POINT, "properties": dict(reversed(POINT["properties"].items()))}
    assert engine.grammars.json_schema(reordered) is not engine.grammars.json_schema(POINT)


UNSUPPORTED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "strin"}, "strin"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "string", "format": "colour"}, "colour"),
    ({"type": "number", "minimum": float("nan")}, "NaN"),
]


@pytest.mark.parametrize(("schema", "named"), UNSUPPORTED)
def test_a_schema_the_engine_cannot_enforce_is_refused_by_name(setup, schema, named):
    engine, _ = setup
    with pytest.raises(UnsupportedSchema) as refused:
        engine.grammars.json_schema(schema)
    assert named in refused.value.message
    assert refused.value.param == "response_format"


@pytest.mark.parametrize("pattern", ["é", "ab¶", "a[^\\x00-\\U0010FFFF]"])
def test_text_the_vocabulary_cannot_write_is_refused_in_words(setup, pattern):
    """The tiny vocabulary spells printable ASCII alone (its unknown token stands for the
    rest): a pattern needing other characters, or matching nothing, is the request's 400, in
    words, where it was a 500 once a row sampled the unknown token the engine allowed."""
    engine, _ = setup
    with pytest.raises(UnsupportedSchema) as refused:
        engine.grammars.regex(pattern, param="guided_regex")
    assert "admits no text this model's vocabulary can write" in refused.value.message
    assert "NoExtensionBias" not in refused.value.message
    assert refused.value.param == "guided_regex"


@pytest.mark.parametrize("pattern", ["<unk>", "say <unk> now", "a<\\|im_end\\|>"])
def test_text_spelling_a_special_token_is_written_letter_by_letter(setup, pattern):
    """The unknown token's own name, or another special token's, is text the vocabulary spells:
    it compiles, and the grammar's first token is its first letter."""
    engine, _ = setup
    constraint = engine.grammars.regex(pattern, param="guided_regex").start()
    row = np.zeros(4, dtype=np.int32)
    constraint.fill(row)
    allowed = np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0]
    [first] = engine.tokenizer.encode(pattern[0], add_special_tokens=False)
    assert first in allowed and UNK_ID not in allowed


def test_a_huge_schema_is_refused_before_it_is_compiled(setup):
    engine, _ = setup
    with pytest.raises(UnsupportedSchema) as refused:
        engine.grammars.json_schema({"const": "a" * 600_000})
    assert "bytes" in refused.value.message and refused.value.param == "response_format"
    call = {"type": "object", "properties": {"name": {"const": "b" * 600_000}}}
    with pytest.raises(UnsupportedSchema) as refused:
        engine.grammars.tool_lark(engine.grammars.tagged_call_lark("<call>", "</call>", call))
    assert refused.value.param == "tools"


def test_a_grammar_error_does_not_quote_the_grammar(setup):
    engine, _ = setup
    motto = "quiet waters run deep " * 200
    constraint = engine.grammars.json_schema({"const": motto}).start()
    [wrong] = engine.tokenizer.encode("x", add_special_tokens=False)
    constraint.consume(wrong)  # the grammar forces a quote first
    assert constraint.error and len(constraint.error) < 200
    assert "quiet" not in constraint.error


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ("lexer error: too many expressions constructed\n<non-verbose/>", GrammarFailed),
        ("parser error: Too many items (limit 50000; ff_tokens)", GrammarFailed),
        ("token 42 is not allowed here", RuntimeError),
        # A word of the grammar it quotes (a property named "limit") is not the engine's.
        ("token 42 is not allowed here\n   4 | limit: %json {}", RuntimeError),
    ],
)
def test_a_grammar_past_its_limits_is_the_requests_and_a_refused_token_the_servers(
    error: str, kind: type[Exception]
):
    failure = grammar._failure(error)
    said = error.removesuffix("\n<non-verbose/>")  # one line, without llguidance's markup
    assert type(failure) is kind and said in str(failure)
    if kind is GrammarFailed:  # the client's: one line
        assert "\n" not in str(failure) and "<" not in str(failure)
