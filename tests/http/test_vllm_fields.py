"""Every field of vLLM's chat and completion requests, each sent alone with a value that asks for
something: honoured (listed in `field_support.HONOURED`) or refused with a 400 naming it, never
accepted and ignored. On the tiny model, with a chat template that reads `enable_thinking` and
`documents`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, processors

from hotlora.server.api.completion_requests import ChatCompletionRequest, CompletionRequest
from hotlora.server.api.field_support import HONOURED, METADATA, NO_OP, REFUSED, declared_names
from hotlora.server.api.responses_request import ResponsesRequest
from hotlora.server.api.token_requests import DetokenizeRequest, EmbeddingRequest, TokenizeRequest

from tests.support.sse import sse_events
from tests.support.tiny import CHAT_TEMPLATE, ENDOFTEXT_ID, SPECIAL_TOKENS, write_tiny_llama

# CHAT_TEMPLATE, with documents and the reasoning effort shown first and `enable_thinking: true`
# opening a thinking block after the assistant's opening (mlx-lm passes false to a model
# without thinking tokens).
THINKING_TEMPLATE = (
    "{% if reasoning_effort %}<|im_start|>system\neffort: {{ reasoning_effort }}<|im_end|>\n"
    "{% endif %}"
    "{% if documents %}<|im_start|>system\n"
    "{% for d in documents %}{{ d.text }}\n{% endfor %}<|im_end|>\n{% endif %}"
    + CHAT_TEMPLATE.replace(
        "{{ '<|im_start|>assistant\\n' }}",
        "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking %}<think>\n{% endif %}",
    )
)
MESSAGES = [{"role": "user", "content": "the cat"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
STREAMING = {
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}

# vLLM's ChatCompletionRequest (vllm/entrypoints/openai/protocol.py), in its order, with the
# guided_* fields of the releases before `structured_outputs` replaced them: each field with a
# value other than vLLM's default (and what else it needs to be valid).
VLLM_CHAT: dict[str, dict[str, Any]] = {
    "messages": {"messages": MESSAGES},
    "model": {"model": "tiny"},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 2.0}},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "max_tokens": {"max_tokens": 2},
    "max_completion_tokens": {"max_completion_tokens": 2},
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 0.5},
    "response_format": {"response_format": {"type": "json_object"}},
    "seed": {"seed": 4},
    "stop": {"stop": ["zz"]},
    "stream": {"stream": True},
    "stream_options": STREAMING,
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.9},
    "tools": {"tools": TOOLS},
    "tool_choice": {"tools": TOOLS, "tool_choice": "auto"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "include_reasoning": {"include_reasoning": False},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "user": {"user": "someone"},
    "best_of": {"best_of": 2},
    "use_beam_search": {"use_beam_search": True},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "length_penalty": {"length_penalty": 0.5},
    "stop_token_ids": {"stop_token_ids": [5]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 2},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 8},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "allowed_token_ids": {"allowed_token_ids": [5, 6, 7]},
    "bad_words": {"bad_words": ["cat"]},
    "echo": {"echo": True},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"continue_final_message": True},
    "add_special_tokens": {"add_special_tokens": True},
    "documents": {"documents": [{"title": "t", "text": "a document"}]},
    "chat_template": {"chat_template": "{{ messages }}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "mm_processor_kwargs": {"mm_processor_kwargs": {"size": 2}},
    "media_io_kwargs": {"media_io_kwargs": {"image": {"mode": "RGB"}}},
    "guided_json": {"guided_json": SCHEMA},
    "guided_regex": {"guided_regex": "[a-z]{2}"},
    "guided_choice": {"guided_choice": ["yes", "no"]},
    "guided_grammar": {"guided_grammar": 'start: "yes" | "no"'},
    "structural_tag": {"structural_tag": "{}"},
    "guided_decoding_backend": {"guided_decoding_backend": "xgrammar"},
    "guided_whitespace_pattern": {"guided_whitespace_pattern": " *"},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "priority": {"priority": 1},
    "request_id": {"request_id": "mine-1"},
    "logits_processors": {"logits_processors": ["my.module.Processor"]},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "return_token_ids": {"return_token_ids": True},
    "cache_salt": {"cache_salt": "a-salt"},
    "kv_transfer_params": {"kv_transfer_params": {"do_remote_decode": True}},
    "vllm_xargs": {"vllm_xargs": {"k": 1}},
    "max_repetition_pattern_size": {"max_repetition_pattern_size": 4},
    "min_repetition_pattern_size": {"min_repetition_pattern_size": 2},
    "repetition_min_count": {"repetition_min_count": 3},
    "repetition_detection": {"repetition_detection": {"max_pattern_size": 4}},
}

# vLLM's CompletionRequest, likewise.
VLLM_COMPLETION: dict[str, dict[str, Any]] = {
    "model": {"model": "tiny"},
    "prompt": {"prompt": "the cat"},
    "prompt_embeds": {"prompt_embeds": "AAAA"},
    "best_of": {"best_of": 2},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 2.0}},
    "logprobs": {"logprobs": 3},
    "max_tokens": {"max_tokens": 2},
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 0.5},
    "seed": {"seed": 4},
    "stop": {"stop": ["zz"]},
    "stream": {"stream": True},
    "stream_options": STREAMING,
    "suffix": {"suffix": "the end"},
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.9},
    "user": {"user": "someone"},
    "use_beam_search": {"use_beam_search": True},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "length_penalty": {"length_penalty": 0.5},
    "stop_token_ids": {"stop_token_ids": [5]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 2},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 3},
    "allowed_token_ids": {"allowed_token_ids": [5, 6, 7]},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "add_special_tokens": {"add_special_tokens": False},
    "response_format": {"response_format": {"type": "json_object"}},
    "guided_json": {"guided_json": SCHEMA},
    "guided_regex": {"guided_regex": "[a-z]{2}"},
    "guided_choice": {"guided_choice": ["yes", "no"]},
    "guided_grammar": {"guided_grammar": 'start: "yes" | "no"'},
    "guided_decoding_backend": {"guided_decoding_backend": "xgrammar"},
    "guided_whitespace_pattern": {"guided_whitespace_pattern": " *"},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "priority": {"priority": 1},
    "request_id": {"request_id": "mine-1"},
    "logits_processors": {"logits_processors": ["my.module.Processor"]},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "return_token_ids": {"return_token_ids": True},
    "cache_salt": {"cache_salt": "a-salt"},
    "kv_transfer_params": {"kv_transfer_params": {"do_remote_decode": True}},
    "vllm_xargs": {"vllm_xargs": {"k": 1}},
    "repetition_detection": {"repetition_detection": {"max_pattern_size": 4}},
}


@pytest.fixture
def thinking_client(make_client: Callable[..., TestClient], tmp_path: Path) -> TestClient:
    model = write_tiny_llama(tmp_path / "thinking", quantize=True, chat_template=THINKING_TEMPLATE)
    return make_client(model=model)


def _outcome(client: TestClient, path: str, body: dict[str, Any]) -> tuple[int, str | None]:
    response = client.post(path, json=body)
    if response.status_code == 200:
        if body.get("stream"):
            assert response.text.rstrip().endswith("data: [DONE]"), response.text
            assert '"error"' not in response.text, response.text
        return 200, None
    error = response.json()["error"]
    return response.status_code, error["param"]


@pytest.mark.parametrize(
    ("path", "fields", "base"),
    [
        ("/v1/chat/completions", VLLM_CHAT, {"model": "tiny", "messages": MESSAGES}),
        ("/v1/completions", VLLM_COMPLETION, {"model": "tiny", "prompt": "the cat"}),
    ],
    ids=["chat", "completions"],
)
def test_every_vllm_field_is_honoured_or_refused_by_name(thinking_client, path, fields, base):
    ignored = []
    for name, sample in fields.items():
        body = {**base, "max_tokens": 3, "temperature": 0, **sample}
        status, param = _outcome(thinking_client, path, body)
        if name in HONOURED or name in METADATA:
            assert status == 200, (name, status, param)
        elif status != 400 or not (param == name or (param or "").startswith(f"{name}.")):
            ignored.append((name, status, param))
    assert ignored == [], "accepted but not honoured, or refused under another name"


def test_chat_template_kwargs_and_documents_reach_the_template(thinking_client):
    def prompt_tokens(**fields: Any) -> int:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **fields}
        response = thinking_client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    tokenizer = thinking_client.app.state.runtime.worker.engine.tokenizer
    plain = prompt_tokens()
    thinking = prompt_tokens(chat_template_kwargs={"enable_thinking": True})
    assert thinking - plain == len(tokenizer.encode("<think>\n", add_special_tokens=False))
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == plain
    shown = prompt_tokens(documents=[{"title": "t", "text": "a document"}])
    assert shown > plain + len("a document") // 2
    unread = {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": {"other": 1}}
    error = thinking_client.post("/v1/chat/completions", json=unread).json()["error"]
    assert error["param"] == "chat_template_kwargs.other"


def test_add_special_tokens_reaches_the_tokenizer(make_client, tmp_path: Path):
    """On a tokenizer that starts every encoding with a BOS: completions add it unless told not
    to, chat (whose template writes its own) adds it only when told to."""
    model = write_tiny_llama(tmp_path / "bos", quantize=True)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos = SPECIAL_TOKENS[ENDOFTEXT_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, ENDOFTEXT_ID)]
    )
    tokenizer.save(str(model / "tokenizer.json"))
    client = make_client(model=model)

    def prompt_tokens(path: str, **fields: Any) -> int:
        response = client.post(path, json={"model": "tiny", "max_tokens": 1, **fields})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    text = "the cat"
    plain = len(
        client.app.state.runtime.worker.engine.tokenizer.encode(text, add_special_tokens=False)
    )
    assert prompt_tokens("/v1/completions", prompt=text) == plain + 1
    assert prompt_tokens("/v1/completions", prompt=text, add_special_tokens=False) == plain
    chat = prompt_tokens("/v1/chat/completions", messages=MESSAGES)
    assert (
        prompt_tokens("/v1/chat/completions", messages=MESSAGES, add_special_tokens=True)
        == chat + 1
    )


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "max_completion_tokens", 2),
        ("/v1/completions", "top_logprobs", 2),
        ("/v1/completions", "add_generation_prompt", False),
        ("/v1/chat/completions", "prompt", "the cat"),
    ],
)
def test_the_other_endpoints_fields_are_refused(client: TestClient, path, field, value):
    own = {"prompt": "the cat"} if path == "/v1/completions" else {"messages": MESSAGES}
    body = {"model": "tiny", "max_tokens": 2, **own, field: value}
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_the_tables_cover_the_request_models():
    """Each declared field says what it does; none is both honoured and refused."""
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert declared == set(HONOURED) | set(METADATA)  # the metadata typed, with no effect
    assert not set(HONOURED) & set(REFUSED)
    assert not set(METADATA) & (set(HONOURED) | set(REFUSED))


def test_neutral_values_of_refused_fields_pass(client: TestClient):
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 2,
        "use_beam_search": False,
        "length_penalty": 1,
        "best_of": 1,
        "echo": False,
        "bad_words": [],
        "priority": 0,
        "cache_prompt": True,
        "modalities": ["text"],
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


# Each endpoint with a body it serves; the fields it does not declare are checked by name.
ENDPOINTS = {
    "/tokenize": {"model": "tiny", "messages": MESSAGES},
    "/detokenize": {"model": "tiny", "tokens": [5, 6]},
    "/v1/embeddings": {"model": "tiny", "input": "the cat"},
    "/v1/responses": {"model": "tiny", "input": "the cat", "max_output_tokens": 2},
    "/v1/completions": {"model": "tiny", "prompt": "the cat", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
}
REQUESTS = {
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_honoured_fields_at_their_no_op_values_pass_everywhere(client: TestClient, path: str):
    """A script written for vLLM sends its defaults (`continue_final_message: false` to
    /tokenize): at a value that asks for nothing, a field passes where it is not taken."""
    declared = declared_names(REQUESTS[path])
    for field, values in sorted(NO_OP.items()):
        for value in values if field not in declared else ():
            response = client.post(path, json={**ENDPOINTS[path], field: value})
            assert response.status_code == 200, (field, value, response.text)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/tokenize", "continue_final_message", True),
        ("/tokenize", "chat_template_kwargs", {"enable_thinking": True}),
        ("/v1/embeddings", "n", 2),
        ("/v1/responses", "logprobs", True),
        ("/v1/completions", "continue_final_message", True),
    ],
)
def test_honoured_fields_asking_for_something_are_refused_where_not_taken(
    client: TestClient, path: str, field: str, value: Any
):
    response = client.post(path, json={**ENDPOINTS[path], field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_tokenize_messages_with_vllm_s_defaults_counts_as_without(client: TestClient):
    plain = client.post("/tokenize", json=ENDPOINTS["/tokenize"]).json()
    defaults = {"add_generation_prompt": True, "continue_final_message": False}
    sent = client.post("/tokenize", json={**ENDPOINTS["/tokenize"], **defaults})
    assert sent.status_code == 200, sent.text
    assert sent.json()["tokens"] == plain["tokens"]


def test_no_op_values_are_of_honoured_fields():
    assert set(NO_OP) <= set(HONOURED)


@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_counts_no_token_on_the_role_chunk_then_each_token(
    client: TestClient, n: int
):
    body = {**ENDPOINTS["/v1/chat/completions"], **STREAMING, "max_tokens": 6, "n": n}
    response = client.post("/v1/chat/completions", json={**body, "logprobs": True, "seed": 3})
    assert response.status_code == 200, response.text
    chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    seen = 0  # tokens streamed so far, over every choice
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        if choice["delta"].get("role"):
            assert choice["delta"]["content"] == ""
        seen += len((choice.get("logprobs") or {}).get("content") or [])
        assert chunk["usage"]["completion_tokens"] == seen, chunks
    roles = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert len(roles) == n and roles[0]["usage"]["completion_tokens"] == 0
    assert chunks[-1]["usage"]["completion_tokens"] == seen == 6 * n
