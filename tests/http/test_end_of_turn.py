"""GGUFs without a chat template, served through the chat routes: each family's model is chatted
with through its family's template and stops where it ends its turn (a token other than eos),
`ignore_eos` goes on past it, `/v1/models` shows the set; a family with no built-in answers 400
naming `--chat-template`, which then serves it with a file or a built-in."""

from __future__ import annotations

import codecs
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hotlora.config.settings import Settings
from hotlora.server.app import create_app
from hotlora.server.render.chat_templates import BUILTINS

from tests.http.conftest import wait_ready
from tests.support.server_process import LOCALHOST
from tests.support.turn_models import (
    CONVERSATION,
    NO_MARKERS,
    RENDERED,
    TURN_FAMILIES,
    TurnFamily,
    write_turn_gguf,
)

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("turn-ggufs")
    turns = {**TURN_FAMILIES, "none": NO_MARKERS}
    return {name: write_turn_gguf(root / f"{name}.gguf", turn) for name, turn in turns.items()}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One home for the module: each GGUF is imported once, for every app that serves it."""
    return tmp_path_factory.mktemp("home")


@contextmanager
def serving(gguf: Path, home: Path, **settings: Any) -> Iterator[TestClient]:
    fields = {"cpu_vector_jit": False, "warmup": False, "max_batch": 1, **settings}
    app = create_app(Settings(home=home, model=gguf, served_model_name="tiny", **fields))
    with TestClient(app, base_url=LOCALHOST) as client:
        wait_ready(client)
        yield client


@pytest.fixture(scope="module", params=list(TURN_FAMILIES))
def family(
    request: pytest.FixtureRequest, ggufs: dict[str, Path], home: Path
) -> Iterator[tuple[TurnFamily, TestClient, int]]:
    """(the family, its app, the id of its end-of-turn token)."""
    turn = TURN_FAMILIES[request.param]
    with serving(ggufs[request.param], home) as client:
        body = {"prompt": turn.end_of_turn, "add_special_tokens": False}
        ended = client.post("/tokenize", json=body).json()["tokens"]
        assert len(ended) == 1, ended
        yield turn, client, ended[0]


def chat(client: TestClient, **fields: Any) -> Any:
    body = {"model": "tiny", "messages": CONVERSATION, "max_tokens": MAX_TOKENS, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def ending_turn(end: int) -> dict[str, Any]:
    """Fields that make the model write two tokens, then end its turn: the end-of-turn token
    is all but certain, and held off for the first two."""
    return {"temperature": 0, "logit_bias": {str(end): 100}, "min_tokens": 2}


def test_models_show_the_end_of_turn_beside_eos(family):
    turn, client, end = family
    (card,) = client.get("/v1/models").json()["data"]
    ends = {entry["token"]: entry for entry in card["end_of_generation"]}
    assert ends[turn.end_of_turn] == {
        "id": end,
        "token": turn.end_of_turn,
        "sources": ["end-of-turn name", "chat template"],
    }
    assert ends[turn.eos or "</s>"]["sources"][:2] == ["eos", "generation_config"]
    assert client.get("/v1/models/tiny").json()["end_of_generation"] == card["end_of_generation"]


def test_the_prompt_is_the_familys_template(family):
    turn, client, _ = family
    assert turn.template is not None
    rendered = client.post("/tokenize", json={"messages": CONVERSATION}).json()["tokens"]
    expected = {"prompt": RENDERED[turn.template], "add_special_tokens": False}
    assert rendered == client.post("/tokenize", json=expected).json()["tokens"]


def test_the_answer_stops_where_the_model_ends_its_turn(family):
    turn, client, end = family
    answer = chat(client, **ending_turn(end), logprobs=True)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 2
    # The answer is the two tokens before the end of the turn, and nothing after them.
    tokens = choice["logprobs"]["content"]
    assert len(tokens) == 2
    # Their bytes as text (a random model's may not be whole characters: an invalid byte is
    # U+FFFD, a character the end of the turn cut is left out).
    spelled = b"".join(bytes(token["bytes"]) for token in tokens)
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(spelled)
    assert choice["message"]["content"] == text
    assert turn.end_of_turn not in choice["message"]["content"]


def test_the_end_of_turn_ends_a_stream_too(family):
    _, client, end = family
    body = {"model": "tiny", "messages": CONVERSATION, "max_tokens": MAX_TOKENS, "stream": True}
    body |= {**ending_turn(end), "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    reasons = [event for event in events if '"finish_reason":"stop"' in event]
    assert len(reasons) == 1
    assert '"completion_tokens":2' in events[-1]


def test_ignore_eos_goes_on_past_the_end_of_turn(family):
    _, client, end = family
    answer = chat(client, **ending_turn(end), ignore_eos=True)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS


def test_stop_token_ids_end_it_even_with_ignore_eos(family):
    _, client, end = family
    answer = chat(client, **ending_turn(end), ignore_eos=True, stop_token_ids=[end])
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 2


# --- no template, no built-in -----------------------------------------------------------------


def test_a_family_without_a_builtin_answers_400_naming_the_flag(ggufs, home):
    with serving(ggufs["none"], home) as client:
        body = {"model": "tiny", "messages": CONVERSATION, "max_tokens": 2}
        for route in ("/v1/chat/completions", "/tokenize"):
            response = client.post(
                route, json=body if "chat" in route else {"messages": CONVERSATION}
            )
            assert response.status_code == 400, route
            message = response.json()["error"]["message"]
            assert "--chat-template NAME|FILE" in message, message
        completion = {"model": "tiny", "prompt": "the world", "max_tokens": 2}
        assert client.post("/v1/completions", json=completion).status_code == 200


def test_a_template_file_serves_it(ggufs, home, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hotlora")
    path = tmp_path / "turns.jinja"
    path.write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '</s>' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with serving(ggufs["none"], home, chat_template=str(path)) as client:
        rendered = client.post("/tokenize", json={"messages": CONVERSATION[1:2]}).json()
        expected = {"prompt": "user: Hi</s>assistant: ", "add_special_tokens": False}
        assert rendered["tokens"] == client.post("/tokenize", json=expected).json()["tokens"]
        assert chat(client, temperature=0)["choices"][0]["finish_reason"] in ("stop", "length")
    said = [r.getMessage() for r in caplog.records if r.name == "hotlora"]
    assert f"chat template: '{path}' (--chat-template)" in said
    ends = [line for line in said if line.startswith("end of generation: ")]
    assert ends == [
        "end of generation: '</s>' (2: eos, generation_config, end-of-turn name, chat template)"
    ]


@pytest.mark.parametrize("name", BUILTINS)
def test_each_builtin_serves_it(name: str, ggufs, home):
    with serving(ggufs["none"], home, chat_template=name) as client:
        rendered = client.post("/tokenize", json={"messages": CONVERSATION}).json()["tokens"]
        expected = {"prompt": RENDERED[name], "add_special_tokens": False}
        assert rendered == client.post("/tokenize", json=expected).json()["tokens"]
