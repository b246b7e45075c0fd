"""vLLM's and llama.cpp's request fields over HTTP on the embedded model, greedy and short: each
one's effect, or the 400 that names it.

The embedded model answers "What is the capital of France? Answer in one sentence." with "The
capital of France is Paris." and then its end of turn: enough to see where an answer ends, what
a stop keeps, and what a constraint allows.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hotlora.config.settings import Settings
from hotlora.server.api.completion_requests import ChatCompletionRequest
from hotlora.server.api.field_support import LLAMA_CPP_SAMPLERS
from hotlora.server.app import create_app

from tests.support.server_process import LOCALHOST
from tests.support.sse import sse_events

MODEL = "smol"
PARIS = "What is the capital of France? Answer in one sentence."
ANSWER = "The capital of France is Paris."
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol(
    embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    settings = Settings(
        home=tmp_path_factory.mktemp("home"),
        model=embedded_model_dir,
        served_model_name=MODEL,
        cpu_vector_jit=False,
    )
    with TestClient(create_app(settings), base_url=LOCALHOST) as client:
        deadline = time.monotonic() + 600
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").json()
            time.sleep(0.1)
        yield client


def tokenizer(client: TestClient):
    return client.app.state.runtime.worker.engine.tokenizer


def token_id(client: TestClient, text: str) -> int:
    [token] = tokenizer(client).encode(text, add_special_tokens=False)
    return token


def post(client: TestClient, path: str, status: int = 200, **fields) -> dict:
    response = client.post(path, json={"model": MODEL, "temperature": 0, **fields})
    assert response.status_code == status, response.text
    return response.json()


def chat(client: TestClient, content: str = PARIS, status: int = 200, **fields) -> dict:
    messages = fields.pop("messages", [{"role": "user", "content": content}])
    fields.setdefault("max_tokens", 16)
    return post(client, "/v1/chat/completions", status, messages=messages, **fields)


def complete(client: TestClient, prompt: object = PROMPT, status: int = 200, **fields) -> dict:
    fields.setdefault("max_tokens", 8)
    return post(client, "/v1/completions", status, prompt=prompt, **fields)


def answer(body: dict) -> tuple[str, str, int]:
    """The first choice's text, finish reason and completion tokens."""
    [choice] = body["choices"]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"], body["usage"]["completion_tokens"]


def refused(body: dict, param: str) -> None:
    assert body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error"
    assert param.split(".")[0] in body["error"]["message"], body


@pytest.fixture(scope="module")
def base(smol: TestClient) -> tuple[str, str, int]:
    text, finish, tokens = answer(chat(smol, max_tokens=24))
    assert (text, finish) == (ANSWER, "stop")
    return text, finish, tokens


# Where the answer ends.


def test_min_tokens_holds_off_the_end_of_turn(smol, base):
    text, _, tokens = base
    held = answer(chat(smol, min_tokens=tokens + 3, max_tokens=tokens + 3))
    assert held[1:] == ("length", tokens + 3)
    assert held[0].startswith(text)
    # Reached, it lets the answer end as before.
    assert answer(chat(smol, min_tokens=2, max_tokens=24)) == base


def test_ignore_eos_writes_past_the_end_of_turn(smol, base):
    text, _, tokens = base
    past = answer(chat(smol, ignore_eos=True, max_tokens=tokens + 4))
    assert past[1:] == ("length", tokens + 4)
    assert past[0].startswith(text)


def test_skip_special_tokens_false_writes_control_tokens(smol, base):
    tokens = base[2]
    eos = tokenizer(smol).eos_token
    skipped = answer(chat(smol, ignore_eos=True, max_tokens=tokens + 2))[0]
    written = answer(chat(smol, ignore_eos=True, skip_special_tokens=False, max_tokens=tokens + 2))[
        0
    ]
    assert eos not in skipped
    assert written.startswith(ANSWER + eos)


def test_stop_token_ids_end_the_answer_and_include_keeps_the_token(smol):
    paris = token_id(smol, " Paris")
    assert answer(chat(smol, stop_token_ids=[paris]))[:2] == ("The capital of France is", "stop")
    kept = answer(chat(smol, stop_token_ids=[paris], include_stop_str_in_output=True))
    assert kept[:2] == ("The capital of France is Paris", "stop")
    too_big = chat(smol, status=400, stop_token_ids=[10**7])
    refused(too_big, "stop_token_ids")


def test_include_stop_str_in_output_keeps_the_stop_string(smol):
    assert answer(chat(smol, stop=["France"]))[0] == "The capital of "
    kept = answer(chat(smol, stop=["France"], include_stop_str_in_output=True))
    assert kept[:2] == ("The capital of France", "stop")


def test_include_stop_str_in_output_streams_the_same(smol):
    body = {"stop": ["France"], "include_stop_str_in_output": True, "stream": True}
    response = smol.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": PARIS}], **body,
              "temperature": 0, "max_tokens": 16},
    )  # fmt: skip
    chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "The capital of France"


def test_allowed_token_ids_are_the_only_ones_generated(smol):
    allowed = [token_id(smol, " Paris"), token_id(smol, ".")]
    text, _, tokens = answer(chat(smol, allowed_token_ids=allowed, max_tokens=5))
    assert tokens == 5
    assert re.fullmatch(r"( Paris|\.)+", text), text  # the first one's space kept too


# The prompt.


def test_truncate_prompt_tokens_keeps_the_prompt_end(smol):
    long = "Here is a long preamble that the model should never see. " + PROMPT
    ids = tokenizer(smol).encode(long)
    cut = complete(smol, long, truncate_prompt_tokens=6)
    assert cut["usage"]["prompt_tokens"] == 6
    assert answer(cut)[0] == answer(complete(smol, ids[-6:]))[0]
    assert complete(smol, long, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == len(ids)


def test_add_generation_prompt_false_leaves_the_turn_unopened(smol):
    opened = chat(smol, max_tokens=1)["usage"]["prompt_tokens"]
    unopened = chat(smol, max_tokens=1, add_generation_prompt=False)["usage"]["prompt_tokens"]
    opening = tokenizer(smol).encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert opened - unopened == len(opening)


def test_continue_final_message_continues_the_assistant_prefill(smol):
    messages = [
        {"role": "user", "content": PARIS},
        {"role": "assistant", "content": PROMPT},
    ]
    text = answer(chat(smol, messages=messages, continue_final_message=True))[0]
    assert text.startswith(" Paris"), text  # the space before the answer's first word its own
    echoed = chat(smol, messages=messages, continue_final_message=True, echo=True)
    assert answer(echoed)[0] == PROMPT + text
    both = chat(
        smol,
        status=400,
        messages=messages,
        continue_final_message=True,
        add_generation_prompt=True,
    )
    refused(both, "continue_final_message")


def test_a_completion_keeps_the_space_its_first_token_opens_with(smol):
    """A completion continues its prompt: " Paris", not "Paris", at the offsets its logprobs
    give, streamed or not, and after the prompt where it is echoed."""
    body = complete(smol, max_tokens=3, logprobs=1)
    [choice] = body["choices"]
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert tokens[0] == " Paris" and choice["text"] == "".join(tokens)
    assert all(choice["text"][at:].startswith(t) for t, at in zip(tokens, offsets, strict=True))
    echoed = complete(smol, max_tokens=3, logprobs=1, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + choice["text"]
    response = smol.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True},
    )
    chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_template_variables_the_template_does_not_read_are_refused(smol):
    on = chat(smol, status=400, chat_template_kwargs={"enable_thinking": True})
    refused(on, "chat_template_kwargs.enable_thinking")
    # Thinking switched off on a model that never thinks: already so, and the prompt is as
    # without the variable.
    off = chat(smol, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    plain = chat(smol, max_tokens=1)
    assert off["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    refused(chat(smol, status=400, reasoning_effort="low"), "reasoning_effort")
    refused(chat(smol, status=400, documents=[{"title": "a", "text": "b"}]), "documents")
    reserved = chat(smol, status=400, chat_template_kwargs={"tokenize": True})
    refused(reserved, "chat_template_kwargs.tokenize")


def test_a_request_chat_template_is_refused(smol):
    refused(chat(smol, status=400, chat_template="{{ messages }}"), "chat_template")


# What the answer reports.


def test_continuous_usage_stats_put_usage_on_every_chunk(smol, base):
    response = smol.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": PARIS}],
            "temperature": 0,
            "max_tokens": 24,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts)
    assert counts[-1] == base[2]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed == ANSWER


def test_prompt_logprobs_in_vllms_shape(smol):
    ids = tokenizer(smol).encode(PROMPT + " Paris")
    paris = token_id(smol, " Paris")
    assert ids[-1] == paris
    after = complete(smol, ids[:-1], max_tokens=1, logprobs=1)["choices"][0]["logprobs"]
    assert after["tokens"] == [" Paris"]
    body = complete(smol, ids, max_tokens=1, prompt_logprobs=2)
    [choice] = body["choices"]
    reported = choice["prompt_logprobs"]
    assert len(reported) == len(ids) == body["usage"]["prompt_tokens"]
    assert reported[0] is None
    for token, entry in zip(ids[1:], reported[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert {e["rank"] for e in entry.values()} >= {1, 2}
    last = reported[-1][str(paris)]
    assert last["rank"] == 1 and last["decoded_token"] == " Paris"
    assert last["logprob"] == pytest.approx(after["token_logprobs"][0], abs=1e-2)
    on_chat = chat(smol, max_tokens=1, prompt_logprobs=0)["prompt_logprobs"]
    assert on_chat[0] is None and all(len(e) == 1 for e in on_chat[1:])
    refused(chat(smol, status=400, stream=True, prompt_logprobs=1), "prompt_logprobs")


def test_streamed_offsets_are_the_whole_answers_where_a_stop_string_holds_text_back(
    smol: TestClient,
):
    # A stop string that starts with a token's last character holds that character back
    # until the next token rules the stop out: the chunk that sends it starts mid-token.
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1}
    tokens = smol.post("/v1/completions", json=req).json()["choices"][0]["logprobs"]["tokens"]
    k = next(i for i, token in enumerate(tokens[:-1]) if len(token) >= 2)
    req["stop"] = tokens[k][-1] + "\x07"  # a character the model never writes: never found
    whole = smol.post("/v1/completions", json=req).json()["choices"][0]
    assert whole["logprobs"]["tokens"] == tokens and whole["finish_reason"] == "length"
    streamed = smol.post("/v1/completions", json={**req, "stream": True})
    chunks = [json.loads(e)["choices"][0] for e in sse_events(streamed)[:-1]]
    logprobs = [c["logprobs"] for c in chunks if c["logprobs"]]
    assert [t for lp in logprobs for t in lp["tokens"]] == tokens
    assert [o for lp in logprobs for o in lp["text_offset"]] == whole["logprobs"]["text_offset"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


@pytest.mark.parametrize("tokens", [1, 2])
def test_an_answer_cut_inside_a_character_ends_before_it(smol: TestClient, tokens: int):
    """The first of 😀's byte tokens forced (logit_bias), the answer cut after it: no U+FFFD
    for the unfinished character, and its logprobs name the token by its bytes, as OpenAI's
    do (legacy completions: `bytes:\\xf0\\x9f`; chat: the escaped bytes and `bytes`). Twice
    (the first sequence left unfinished by the second, so written U+FFFD), offsets still count
    the text's characters."""
    first = tokenizer(smol).encode("😀", add_special_tokens=False)[0]
    data = smol.app.state.runtime.worker.engine.pieces(first).bytes
    assert data.startswith(b"\xf0")
    escaped = "".join(f"\\x{byte:02x}" for byte in data)
    bias = {"logit_bias": {str(first): 100}, "max_tokens": tokens, "logprobs": 1}
    body = complete(smol, **bias)
    [choice] = body["choices"]
    text = "" if tokens == 1 else "\ufffd"  # the first unfinished, then cut inside the second
    assert (choice["text"], choice["finish_reason"]) == (text, "length")
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"bytes:{escaped}"] * tokens
    assert logprobs["text_offset"] == [0] * tokens
    assert all(f"bytes:{escaped}" in top for top in logprobs["top_logprobs"])
    sent = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "stream": True, **bias}
    streamed = smol.post("/v1/completions", json=sent)
    assert streamed.status_code == 200, streamed.text
    chunks = [json.loads(e)["choices"][0] for e in sse_events(streamed)[:-1]]
    assert "".join(c["text"] for c in chunks) == text
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == tokens * [
        f"bytes:{escaped}"
    ]
    said = chat(smol, **{**bias, "logprobs": True, "top_logprobs": 1})["choices"][0]
    assert said["message"]["content"] == text
    entries = said["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in entries] == [(escaped, list(data))] * tokens
    # Without logprobs asked for, the same text.
    plain = {"logit_bias": bias["logit_bias"], "max_tokens": tokens}
    assert complete(smol, **plain)["choices"][0]["text"] == text
    assert chat(smol, **plain)["choices"][0]["message"]["content"] == text


def test_the_token_that_ends_an_answer_is_scored_as_lm_eval_reads_it(smol: TestClient):
    """lm-evaluation-harness scores a continuation as `sum(token_logprobs[ctxlen:-1])` of an
    echoed `max_tokens: 1` answer, the last entry taken for the generated token: one that ends
    the answer (EOS here, forced) is listed last, adding no text, so the continuation's last
    token is scored too. Chat lists it not, and no route counts it."""
    end = token_id(smol, "<|im_end|>")
    prompt = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nHello! How are you?"
    fields = {"echo": True, "logprobs": 1, "logit_bias": {str(end): 100}}
    scored = complete(smol, prompt, max_tokens=0, **fields)["choices"][0]["logprobs"]
    body = complete(smol, prompt, max_tokens=1, **fields)
    [choice] = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == (prompt, "stop")
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [*scored["tokens"], "<|im_end|>"]
    assert logprobs["token_logprobs"][:-1] == scored["token_logprobs"]
    assert logprobs["text_offset"] == [*scored["text_offset"], len(prompt)]
    assert "<|im_end|>" in logprobs["top_logprobs"][-1]
    assert body["usage"]["completion_tokens"] == 0
    sent = {"model": MODEL, "prompt": prompt, "temperature": 0, "stream": True, **fields}
    streamed = smol.post("/v1/completions", json={**sent, "max_tokens": 1})
    chunks = [json.loads(e)["choices"][0] for e in sse_events(streamed)[:-1]]
    listed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert listed == logprobs["tokens"] and "".join(c["text"] for c in chunks) == prompt
    said = chat(smol, logprobs=True, logit_bias={str(end): 100}, max_tokens=4)
    [answer] = said["choices"]
    assert (answer["message"]["content"], answer["logprobs"]["content"]) == ("", [])
    assert said["usage"]["completion_tokens"] == 0


def test_echo_names_tokens_inside_a_character_apart(smol: TestClient):
    """Byte tokens of characters split over tokens are named by their bytes (`bytes:\\xe6`),
    so that no two alternatives share a key and each position's own token reads its own
    value from `top_logprobs`, as lm-evaluation-harness's greedy check does."""
    prompt = "日本の首都は東京です。🍣 is sushi 👍🏽"
    body = complete(smol, prompt, echo=True, logprobs=5, max_tokens=0)
    logprobs = body["choices"][0]["logprobs"]
    tokens = logprobs["tokens"]
    split = [token for token in tokens if token.startswith("bytes:\\x")]
    assert split and "\ufffd" not in "".join(tokens)
    for token, value, top in zip(
        tokens[1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True
    ):
        assert top[token] == value and 5 <= len(top) <= 6, (token, top)
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(prompt)
    assert offsets[tokens.index(split[0])] == prompt.index("日")


def test_completion_logprobs_go_up_to_20(smol):
    body = complete(smol, max_tokens=2, logprobs=20)
    tops = body["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == 2 and all(10 < len(top) <= 21 for top in tops)  # the sampled one too
    refused(complete(smol, status=400, logprobs=21), "logprobs")


def test_top_k_minus_one_is_off(smol):
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 12}
    assert chat(smol, top_k=-1, **sampled)["choices"] == chat(smol, top_k=0, **sampled)["choices"]
    refused(chat(smol, status=400, top_k=-2), "top_k")


# Constraints on the answer.


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}}


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"guided_choice": ["Lyon", "Paris"]}, lambda t: t in ("Lyon", "Paris")),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_json": CITY}, lambda t: set(json.loads(t)) <= {"city"}),
        ({"guided_json": json.dumps(CITY)}, lambda t: set(json.loads(t)) <= {"city"}),
        ({"guided_grammar": 'start: "Lyon" | "Paris"'}, lambda t: t in ("Lyon", "Paris")),
        ({"guided_grammar": 'root ::= "Lyon" | "Nice"'}, lambda t: t in ("Lyon", "Nice")),
        ({"grammar": 'root ::= city\ncity ::= "Lyon" | "Paris"'}, lambda t: t in ("Lyon", "Paris")),
        ({"json_schema": CITY}, lambda t: set(json.loads(t)) <= {"city"}),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": "[A-Z]{4}"}}, lambda t: re.fullmatch("[A-Z]{4}", t)),
        ({"structured_outputs": {"json": CITY}}, lambda t: set(json.loads(t)) <= {"city"}),
        ({"structured_outputs": {"grammar": 'root ::= "ok"'}}, lambda t: t == "ok"),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_constraints_hold_the_answer(smol, route, fields, check):
    call = chat if route == "chat" else complete
    text, finish, _ = answer(call(smol, max_tokens=24, **fields))
    assert finish == "stop" and check(text), text


def test_completions_honour_response_format(smol):
    text, finish, _ = answer(complete(smol, max_tokens=40, response_format={"type": "json_object"}))
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_bad_constraints_are_refused_by_field(smol):
    refused(chat(smol, status=400, guided_regex="(unclosed"), "guided_regex")
    refused(complete(smol, status=400, grammar="root ::= ("), "grammar")
    refused(chat(smol, status=400, guided_choice=[]), "guided_choice")
    two = chat(smol, status=400, response_format={"type": "json_object"}, guided_regex="a+")
    refused(two, "guided_regex")
    tag = chat(smol, status=400, structured_outputs={"structural_tag": "{}"})
    refused(tag, "structured_outputs.structural_tag")
    with_min = chat(smol, status=400, guided_choice=["a"], min_tokens=2)
    refused(with_min, "min_tokens")


# Refused, or parsed for later.


@pytest.mark.parametrize(
    ("field", "refused_value", "neutral"),
    [
        ("use_beam_search", True, False),
        ("length_penalty", 0.5, 1.0),
        ("best_of", 2, 1),
        ("bad_words", ["Paris"], []),
        ("priority", 3, 0),
        ("guided_decoding_backend", "xgrammar", "guidance"),
        ("repeat_penalty", 1.3, 1),
        ("mirostat", 2, 0),
        ("repeat_last_n", 20, 64),  # llama.cpp's default
        ("repeat_last_n", 0, -1),  # the whole sequence: this server's window
        ("samplers", ["top_k", "temperature"], LLAMA_CPP_SAMPLERS),
        ("samplers", ["min_p"], [s for s in LLAMA_CPP_SAMPLERS if s != "top_n_sigma"][1:]),
        ("n_cmpl", 2, 1),
        ("n_indent", 4, 0),
        ("response_fields", ["content"], []),
        ("reasoning_format", "none", "deepseek"),
        ("parse_tool_calls", False, True),
        ("sse_ping_interval", 1, 15),
    ],
)
def test_unimplemented_fields_are_refused_unless_they_ask_nothing(
    smol, field, refused_value, neutral
):
    refused(chat(smol, status=400, max_tokens=2, **{field: refused_value}), field)
    assert chat(smol, max_tokens=2, **{field: neutral})["choices"]


def test_a_penalty_s_window_passes_only_while_no_penalty_is_on(smol):
    for penalty in ({"frequency_penalty": 0.5}, {"presence_penalty": 0.2}):
        refused(chat(smol, status=400, max_tokens=2, repeat_last_n=64, **penalty), "repeat_last_n")
    off = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1}
    assert chat(smol, max_tokens=2, repeat_last_n=64, **off)["choices"]
    assert chat(smol, max_tokens=2, repeat_last_n=None, frequency_penalty=0.5)["choices"]


def test_reasoning_fields_are_parsed_not_refused(smol):
    # A model that does not think: nothing to leave out.
    kept = chat(smol, max_tokens=2, include_reasoning=False)["choices"][0]["message"]
    assert kept["content"] and kept.get("reasoning_content") is None
    parsed = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "reasoning_effort": "high",
        }
    )
    assert (parsed.reasoning_effort, parsed.include_reasoning) == ("high", None)
    refused(chat(smol, status=400, reasoning_effort="extreme"), "reasoning_effort")


def test_a_field_no_server_defines_passes_with_one_warning(smol, caplog):
    caplog.set_level(logging.WARNING, logger="hotlora")
    for _ in range(2):
        chat(smol, max_tokens=1, my_trace_tag="abc")
    warned = [r for r in caplog.records if "my_trace_tag" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


# Schemas are closed by default: what each route answers under an object schema that lists
# one key and says nothing of `additionalProperties`. Left open (vLLM's
# `disable_additional_properties: false`), the model writes keys of its own, so the
# closed answers' keys show the default.

DESCRIBE = "Describe France as a JSON object."
ONE_KEY = {"type": "object", "properties": {"zq": {"type": "integer", "maximum": 9}}}


def _keys(text: str) -> set[str]:
    value = json.loads(text)
    assert isinstance(value, dict), text
    return set(value)


def test_an_open_schema_lets_the_model_write_its_own_keys(smol):
    open_ = {"json": ONE_KEY, "disable_additional_properties": False}
    text, _, _ = answer(chat(smol, DESCRIBE, max_tokens=40, structured_outputs=open_))
    first = re.match(r'\{\s*"(\w+)"', text)
    assert first and first.group(1) != "zq", text


def test_schemas_are_closed_on_chat_and_responses(smol):
    fmt = {"type": "json_schema", "json_schema": {"name": "one", "schema": ONE_KEY}}
    text, finish, _ = answer(chat(smol, DESCRIBE, max_tokens=40, response_format=fmt))
    assert finish == "stop" and _keys(text) <= {"zq"}, text
    text, _, _ = answer(chat(smol, DESCRIBE, max_tokens=40, guided_json=ONE_KEY))
    assert _keys(text) <= {"zq"}, text
    body = post(
        smol,
        "/v1/responses",
        input=DESCRIBE,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "one", "schema": ONE_KEY}},
    )
    assert body["status"] == "completed", body
    [message] = [item for item in body["output"] if item["type"] == "message"]
    text = message["content"][0]["text"]
    assert _keys(text) <= {"zq"}, text


def test_completions_stream_a_closed_schema_with_usage_on_every_chunk(smol):
    """`response_format` on /v1/completions, streamed, with vLLM's continuous usage stats."""
    fields = {
        "prompt": "France as a JSON object:",
        "max_tokens": 40,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "one", "schema": ONE_KEY},
        },
    }
    whole = complete(smol, **fields)
    text, finish, tokens = answer(whole)
    assert finish == "stop" and _keys(text) <= {"zq"}, text
    response = smol.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "temperature": 0,
            **fields,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == tokens
    assert len(set(counts)) > 2
