"""End to end: structured output from a real uvicorn process on the embedded model, through the
official openai client, on the base model and under a really trained adapter."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.e2e

MESSAGES = [
    {
        "role": "user",
        "content": "Invent a person who lives in Paris. Answer in JSON with their name, age, "
        "languages and address.",
    }
]
MAX_TOKENS = 120  # the bounded schemas below fit in well under 100 tokens


class Address(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    languages: list[Literal["English", "French", "Spanish", "German"]] = Field(max_length=2)
    address: Address


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {
            "type": "array",
            "items": {"enum": ["English", "French", "Spanish", "German"]},
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "country": {"type": "string", "maxLength": 16},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "languages", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def held(pirate_client, embedded_model_id) -> dict[str | None, openai.types.chat.ChatCompletion]:
    """The greedy answer held to PERSON, per adapter (None: the base), asked once."""
    answers = {}
    for adapter in (None, "pirate"):
        answers[adapter] = pirate_client.chat.completions.create(
            model=embedded_model_id,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            extra_body={} if adapter is None else {"adapter": adapter},
        )
    return answers


@pytest.mark.parametrize("adapter", [None, "pirate"])
def test_a_nested_schema_answer_validates(held, adapter):
    [choice] = held[adapter].choices
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_the_adapter_still_shapes_the_answer_inside_the_schema(
    pirate_client, embedded_model_id, held
):
    """Free, the pirate adapter answers in pirate speech; held to the schema, it answers
    JSON, and not the base model's JSON."""
    free = pirate_client.chat.completions.create(
        model=embedded_model_id,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"adapter": "pirate"},
    )
    assert free.choices[0].message.content.startswith("Arrr")
    assert held["pirate"].choices[0].message.content != held[None].choices[0].message.content


@pytest.mark.parametrize("adapter", [None, "pirate"])
def test_the_client_parses_its_pydantic_model(pirate_client, embedded_model_id, adapter):
    # `parse` left `beta` in openai 1.92.
    chat = (
        pirate_client.chat
        if hasattr(pirate_client.chat.completions, "parse")
        else pirate_client.beta.chat
    )
    completion = chat.completions.parse(
        model=embedded_model_id,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=Person,
        extra_body={} if adapter is None else {"adapter": adapter},
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person), message.content
    assert message.parsed.address.city


CITIES = ("Paris", "Lyon", "Marseille")
# GBNF, llama.cpp's grammar format, with a rule beyond the root.
GBNF = 'root ::= "The capital is " city "."\ncity ::= "Paris" | "Lyon" | "Marseille"'


@pytest.mark.parametrize("adapter", [None, "pirate"])
def test_a_gbnf_grammar_holds_chat_and_completions(pirate_client, embedded_model_id, adapter):
    """vLLM's `guided_grammar` on chat and llama.cpp's `grammar` on completions, sent as those
    servers' clients send them (extra body fields), hold the answer to the grammar."""
    extra = {} if adapter is None else {"adapter": adapter}
    chat = pirate_client.chat.completions.create(
        model=embedded_model_id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
        extra_body={**extra, "guided_grammar": GBNF},
    )
    [choice] = chat.choices
    assert choice.finish_reason == "stop"
    assert choice.message.content in {f"The capital is {city}." for city in CITIES}
    text = pirate_client.completions.create(
        model=embedded_model_id,
        prompt="France, its capital, in one line:",
        max_tokens=24,
        temperature=0,
        extra_body={**extra, "grammar": GBNF},
    )
    [choice] = text.choices
    assert choice.finish_reason == "stop"
    assert choice.text in {f"The capital is {city}." for city in CITIES}
