"""Thinking models in-process: tiny models whose chat templates think as Qwen3's (the model
opens `<think>` itself) and DeepSeek-R1's (the prompt opens it), their output steered; the
thinking comes back as `reasoning_content`, whole and streamed, never inside `content`."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hotlora.server.render.reasoning import Reasoning, ThinkTags

from tests.http.test_tools import steer
from tests.support.sse import sse_events
from tests.support.tiny import write_tiny_llama

_MESSAGES = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ (message.content or '').split('</think>')[-1] }}<|im_end|>\n{% endfor %}"
)
# Qwen3's shape: the model writes `<think>...</think>` itself, unless thinking is turned off,
# when the template writes an empty block into the prompt.
QWEN_THINKING = (
    _MESSAGES + "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1's distills: the prompt ends inside `<think>`; the model closes it.
R1_THINKING = (
    _MESSAGES + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Thinking turned off in the template: the prompt closes an empty block.
NOT_THINKING = (
    _MESSAGES + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{% endif %}"
)
ASK = [{"role": "user", "content": "capital of france?"}]


def served(make_client, tmp_path_factory: pytest.TempPathFactory, template: str) -> TestClient:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-think"), chat_template=template)
    return make_client(model=model)


def chat(client: TestClient, **fields: object) -> dict:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 200, "temperature": 0, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(client: TestClient, **fields: object) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) from a streamed chat."""
    body = {
        "model": "tiny",
        "messages": ASK,
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        **fields,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reasoning, content, finish = "", "", None
    for event in sse_events(response)[:-1]:
        choice = json.loads(event)["choices"][0]
        reasoning += choice["delta"].get("reasoning_content") or ""
        content += choice["delta"].get("content") or ""
        finish = choice["finish_reason"] or finish
    return reasoning, content, finish


def test_the_model_thinking_first_is_reasoning_content(make_client, tmp_path_factory):
    client = served(make_client, tmp_path_factory, QWEN_THINKING)
    steer(client, "<think>\nFrance... its capital is Paris.\n</think>\n\nParis.")
    message = chat(client)["choices"][0]["message"]
    assert message["reasoning_content"] == "\nFrance... its capital is Paris.\n"
    assert message["content"] == "Paris."
    steer(client, "<think>\nFrance... its capital is Paris.\n</think>\n\nParis.")
    assert streamed(client) == ("\nFrance... its capital is Paris.\n", "Paris.", "stop")


def test_include_reasoning_false_leaves_the_reasoning_out(make_client, tmp_path_factory):
    client = served(make_client, tmp_path_factory, QWEN_THINKING)
    thought = "<think>\nFrance... its capital is Paris.\n</think>\n\nParis."
    steer(client, thought)
    message = chat(client, include_reasoning=False)["choices"][0]["message"]
    assert (message.get("reasoning_content"), message["content"]) == (None, "Paris.")
    steer(client, thought)
    assert streamed(client, include_reasoning=False) == ("", "Paris.", "stop")


def test_reasoning_effort_reaches_a_template_that_reads_it(make_client, tmp_path_factory):
    # gpt-oss's shape: the effort written into the system turn.
    template = "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    client = served(make_client, tmp_path_factory, template + NOT_THINKING)
    plain = chat(client, max_tokens=1)["usage"]["prompt_tokens"]
    effort = chat(client, max_tokens=1, reasoning_effort="high")["usage"]["prompt_tokens"]
    assert effort > plain


def test_a_prompt_that_opens_the_block_starts_in_reasoning(make_client, tmp_path_factory):
    client = served(make_client, tmp_path_factory, R1_THINKING)
    steer(client, "Hmm, Paris.</think>The capital is Paris.")
    message = chat(client)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (
        "Hmm, Paris.",
        "The capital is Paris.",
    )
    steer(client, "Hmm, Paris.</think>The capital is Paris.")
    assert streamed(client) == ("Hmm, Paris.", "The capital is Paris.", "stop")
    # Cut short while thinking: all of it is reasoning.
    steer(client, "Hmm, Paris.</think>The capital is Paris.")
    cut = chat(client, max_tokens=5)["choices"][0]
    assert cut["finish_reason"] == "length"
    assert (cut["message"]["reasoning_content"], cut["message"]["content"]) == ("Hmm, ", "")


def test_thinking_turned_off_in_the_prompt_is_all_answer(make_client, tmp_path_factory):
    client = served(make_client, tmp_path_factory, NOT_THINKING)
    steer(client, "Paris.")
    message = chat(client)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "Paris.")


def test_a_model_that_does_not_think_keeps_its_text(client: TestClient):
    steer(client, "<think>x</think>y")
    message = chat(client)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "<think>x</think>y")


def test_tags_after_the_answer_began_are_text(make_client, tmp_path_factory):
    client = served(make_client, tmp_path_factory, QWEN_THINKING)
    steer(client, "Use <think> tags.")
    message = chat(client)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "Use <think> tags.")


def test_the_tags_are_found_in_the_template(make_client, tmp_path_factory):
    client = served(make_client, tmp_path_factory, QWEN_THINKING)
    assert client.app.state.runtime.inference.think_tags == ThinkTags("<think>", "</think>")
    plain = served(make_client, tmp_path_factory, _MESSAGES)
    assert plain.app.state.runtime.inference.think_tags is None


SPLITS = [
    # (starts inside, text, reasoning, answer)
    (False, "<think>a</think>b", "a", "b"),
    (False, "  \n<think>a</think>\n\nb <think>c</think>", "a", "b <think>c</think>"),
    (False, "no tags", "", "no tags"),
    (True, "a</think>b", "a", "b"),
    (True, "a</thin", "a</thin", ""),
    (False, "<think>a</think><think>b</think>c", "ab", "c"),
]


@pytest.mark.parametrize(("inside", "text", "reasoning", "answer"), SPLITS)
def test_split_whole_and_piece_by_piece(inside: bool, text: str, reasoning: str, answer: str):
    split = Reasoning(ThinkTags("<think>", "</think>"), inside)
    assert split.split(text) == (reasoning, answer)
    stream = split.stream()
    pieces = [stream.feed(char) for char in text] + [stream.flush()]
    assert "".join(p[0] for p in pieces) == reasoning
    assert "".join(p[1] for p in pieces) == answer
