"""End to end: POST /v1/responses on a real uvicorn process on the embedded model, driven by the
official client, whole and streamed, on the base model and with a trained adapter."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.support.trained_adapters import ANSWERS

pytestmark = pytest.mark.e2e

FRANCE = "What is the capital of France? Answer in one sentence."
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 32}


def test_whole_response_equals_the_chat_completion(
    pirate_client: openai.OpenAI, embedded_model_id: str
):
    response = pirate_client.responses.create(model=embedded_model_id, input=FRANCE, **GREEDY)
    assert "Paris" in response.output_text
    chat = pirate_client.chat.completions.create(
        model=embedded_model_id,
        messages=[{"role": "user", "content": FRANCE}],
        temperature=0,
        max_completion_tokens=GREEDY["max_output_tokens"],
    )
    assert response.output_text == chat.choices[0].message.content
    finished = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == finished
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.model == embedded_model_id and response.id.startswith("resp_")


def test_instructions_and_message_items(pirate_client: openai.OpenAI, embedded_model_id: str):
    items = [
        {"role": "user", "content": "What is the capital of Italy?"},
        {"type": "message", "role": "assistant", "content": "Rome."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": FRANCE}]},
    ]
    response = pirate_client.responses.create(
        model=embedded_model_id, input=items, instructions="You answer briefly.", **GREEDY
    )
    chat = pirate_client.chat.completions.create(
        model=embedded_model_id,
        messages=[
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant", "content": "Rome."},
            {"role": "user", "content": FRANCE},
        ],
        temperature=0,
        max_completion_tokens=GREEDY["max_output_tokens"],
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == "You answer briefly."


def test_stream_equals_whole(pirate_client: openai.OpenAI, embedded_model_id: str):
    whole = pirate_client.responses.create(model=embedded_model_id, input=FRANCE, **GREEDY)
    events = list(
        pirate_client.responses.create(model=embedded_model_id, input=FRANCE, stream=True, **GREEDY)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.status == whole.status


def test_adapter_through_the_stream_helper(pirate_client: openai.OpenAI, embedded_model_id: str):
    pirate = ANSWERS["pirate"]
    whole = pirate_client.responses.create(
        model=embedded_model_id, input=FRANCE, extra_body={"adapter": "pirate"}, **GREEDY
    )
    assert pirate in whole.output_text and whole.status == "completed"
    assert whole.model == f"{embedded_model_id}:pirate"
    with pirate_client.responses.stream(
        model=embedded_model_id, input=FRANCE, extra_body={"adapter": "pirate"}, **GREEDY
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    base = pirate_client.responses.create(model=embedded_model_id, input=FRANCE, **GREEDY)
    assert pirate not in base.output_text


class Capital(BaseModel):
    city: str


def test_text_format_json_schema_through_parse(
    pirate_client: openai.OpenAI, embedded_model_id: str
):
    """`responses.parse` sends `text.format` as a strict JSON schema and parses the answer."""
    response = pirate_client.responses.parse(
        model=embedded_model_id,
        input=FRANCE,
        text_format=Capital,
        temperature=0,
        max_output_tokens=48,
    )
    assert response.status == "completed"
    assert response.output_parsed == Capital.model_validate_json(response.output_text)
    assert response.text.format.type == "json_schema"


def test_errors_reach_the_client(pirate_client: openai.OpenAI, embedded_model_id: str):
    with pytest.raises(openai.NotFoundError):
        pirate_client.responses.create(model="no-such-model", input=FRANCE)
    with pytest.raises(openai.BadRequestError) as stateless:
        pirate_client.responses.create(
            model=embedded_model_id, input=FRANCE, previous_response_id="resp_x"
        )
    assert stateless.value.body["param"] == "previous_response_id"
