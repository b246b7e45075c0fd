"""Request fields of chat and text completions as vLLM, llama.cpp and OpenAI define them: which
this server honours, which it refuses, and what happens to a field no server defines; and the
fields /v1/responses and vLLM's embeddings and token routes refuse.

No field is silently ignored. A field the request model declares is honoured (`HONOURED` says
how); sent to the other endpoint (`messages` to completions, `prompt` to chat), it is refused.
A field another server defines that this one does not implement (`REFUSED`) gets a 400
naming it, unless its value asks for nothing (vLLM's `use_beam_search: false`, `length_penalty:
1`): scripts written for those servers send their defaults. A field no server defines (a
client's own metadata) passes, with a WARNING the first time each name is seen.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from hotlora.config.errors import InvalidRequest
from hotlora.config.log_text import printable

log = logging.getLogger("hotlora")


@dataclass(frozen=True)
class Refused:
    """Why a field is not implemented; values in `neutral` ask for nothing and are accepted."""

    why: str
    neutral: tuple[Any, ...] = (None,)
    # Honoured fields that, asking for something, make the neutral values ask for something
    # too (a penalty's window, sent beside a penalty).
    unless: tuple[str, ...] = ()


_OFF: tuple[Any, ...] = (None, False)
_EMPTY: tuple[Any, ...] = (None, [], {})
_NO_MULTIMODAL = Refused("this server reads text only", _EMPTY)

# llama.cpp's default sampler chain, as its server reports it; its README lists the chain
# without "penalties" and "top_n_sigma". Either, sent, asks for nothing.
LLAMA_CPP_SAMPLERS = [
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
]
_NEWER_SAMPLERS = ("penalties", "top_n_sigma")

REFUSED: dict[str, Refused] = {
    # vLLM's sampling and extra parameters.
    "use_beam_search": Refused("beam search is not implemented; sample n choices instead", _OFF),
    "length_penalty": Refused("it applies to beam search, which is not implemented", (None, 1)),
    "best_of": Refused("best_of above 1 is not implemented; ask for n choices", (None, 1)),
    "suffix": Refused("insertion (fill in the middle) is not implemented", (None, "")),
    "bad_words": Refused("not implemented; use logit_bias with the words' token ids", _EMPTY),
    "spaces_between_special_tokens": Refused(
        "special tokens are decoded as the tokenizer writes them", (None, True)
    ),
    "prompt_embeds": Refused("prompts are text or token ids here"),
    "mm_processor_kwargs": _NO_MULTIMODAL,
    "media_io_kwargs": _NO_MULTIMODAL,
    "chat_template": Refused(
        "a request may not bring its own template: templates run in the server, and the "
        "model's own template is the one its tool and stop handling are read from"
    ),
    "structural_tag": Refused("structural tags are not implemented"),
    "guided_whitespace_pattern": Refused("JSON is always written compact here"),
    "guided_decoding_backend": Refused(
        "the one grammar engine here is llguidance ('guidance')",
        (None, "auto", "guidance", "llguidance"),
    ),
    "logits_processors": Refused("custom logits processors cannot be loaded", _EMPTY),
    "priority": Refused("requests are served first come, first served", (None, 0)),
    "return_tokens_as_token_ids": Refused("not implemented", _OFF),
    "return_token_ids": Refused("not implemented", _OFF),
    "kv_transfer_params": Refused("disaggregated serving is not implemented", _EMPTY),
    "vllm_xargs": Refused("there are no extensions to pass arguments to", _EMPTY),
    "repetition_detection": Refused("not implemented", _EMPTY),
    "max_repetition_pattern_size": Refused("not implemented", (None, 0)),
    "min_repetition_pattern_size": Refused("not implemented", (None, 0)),
    "repetition_min_count": Refused("not implemented", (None, 0)),
    # llama.cpp's server.
    "n_predict": Refused("send max_tokens", (None, -1)),
    "typical_p": Refused("typical sampling is not implemented", (None, 1)),
    "repeat_penalty": Refused("send repetition_penalty", (None, 1)),
    # Its default (and -1, the whole context) ask for nothing while no penalty is on.
    "repeat_last_n": Refused(
        "the penalties have no window here: the repetition penalty looks at the prompt and the "
        "tokens generated, the presence and frequency penalties at the tokens generated (vLLM's "
        "and OpenAI's rules); send no repeat_last_n",
        (None, 64, -1),
        unless=("frequency_penalty", "presence_penalty", "repetition_penalty"),
    ),
    "penalize_nl": Refused("not implemented", _OFF),
    "mirostat": Refused("mirostat sampling is not implemented", (None, 0)),
    # Settings of a refused sampler take effect only with it: llama.cpp's defaults pass.
    "mirostat_tau": Refused("mirostat sampling is not implemented", (None, 5)),
    "mirostat_eta": Refused("mirostat sampling is not implemented", (None, 0.1)),
    "dynatemp_range": Refused("dynamic temperature is not implemented", (None, 0)),
    "dynatemp_exponent": Refused("dynamic temperature is not implemented", (None, 1)),
    "xtc_probability": Refused("XTC sampling is not implemented", (None, 0)),
    "xtc_threshold": Refused("XTC sampling is not implemented", (None, 0.1)),
    "dry_multiplier": Refused("DRY sampling is not implemented", (None, 0)),
    "dry_base": Refused("DRY sampling is not implemented", (None, 1.75)),
    "dry_allowed_length": Refused("DRY sampling is not implemented", (None, 2)),
    "dry_penalty_last_n": Refused("DRY sampling is not implemented", (None, -1)),
    "dry_sequence_breakers": Refused(
        "DRY sampling is not implemented", (None, ["\n", ":", '"', "*"])
    ),
    "top_n_sigma": Refused("top-n-sigma sampling is not implemented", (None, -1)),
    "min_keep": Refused("not implemented", (None, 0)),
    "samplers": Refused(
        "the sampler order is fixed: top-p, min-p, top-k",
        (None, LLAMA_CPP_SAMPLERS, [s for s in LLAMA_CPP_SAMPLERS if s not in _NEWER_SAMPLERS]),
    ),
    "n_probs": Refused("send logprobs / top_logprobs", (None, 0)),
    "n_keep": Refused("send truncate_prompt_tokens", (None, 0)),
    "cache_prompt": Refused("prompts are always cached", (None, True)),
    "id_slot": Refused("there are no slots to pick", (None, -1)),
    "t_max_predict_ms": Refused("not implemented", (None, 0)),
    "timings_per_token": Refused("not implemented", _OFF),
    "post_sampling_probs": Refused("not implemented", _OFF),
    "return_tokens": Refused("not implemented", _OFF),
    "lora": Refused("send adapter", _EMPTY),
    "image_data": _NO_MULTIMODAL,
    "n_cmpl": Refused("send n", (None, 1)),
    "n_indent": Refused("not implemented", (None, 0)),
    "n_discard": Refused("the context is never shifted: a prompt past it is refused", (None, 0)),
    "n_cache_reuse": Refused("the prompt cache reuses whole prefixes only", (None, 0)),
    "t_max_prompt_ms": Refused("not implemented", (None, -1)),
    "response_fields": Refused("the answer's fields are OpenAI's", _EMPTY),
    "return_progress": Refused("prompt processing progress is not streamed", _OFF),
    "sse_ping_interval": Refused("streams are pinged every 15 seconds", (None, 15)),
    "verbose": Refused("not implemented", _OFF),
    "backend_sampling": Refused("not implemented", _OFF),
    "adaptive_target": Refused("adaptive sampling is not implemented", (None, -1)),
    "adaptive_decay": Refused("adaptive sampling is not implemented", (None, 0.9)),
    "reasoning_format": Refused(
        "a thinking model's reasoning is always split out as reasoning_content (llama.cpp's "
        "'deepseek'); send include_reasoning false to leave it out",
        (None, "auto", "deepseek"),
    ),
    "reasoning_control": Refused("not implemented", _OFF),
    "reasoning_budget_tokens": Refused("reasoning budgets are not implemented", (None, -1)),
    "reasoning_budget_message": Refused("reasoning budgets are not implemented", (None, "")),
    "reasoning_budget_start_tag": Refused("reasoning budgets are not implemented", (None, "")),
    "reasoning_budget_end_tags": Refused("reasoning budgets are not implemented", _EMPTY),
    "parse_tool_calls": Refused("tool calls are always parsed when tools are sent", (None, True)),
    "parse_special": Refused("special tokens in the text are always read as such", (None, True)),
    "with_pieces": Refused("send return_token_strs", _OFF),
    "add_special": Refused("send add_special_tokens"),
    "generation_prompt": Refused("send add_generation_prompt or continue_final_message"),
    "chat_format": Refused("the chat template decides the format"),
    "chat_parser": Refused("the chat template decides the format"),
    "grammar_lazy": Refused("send tools and tool_choice", _OFF),
    "grammar_triggers": Refused("send tools and tool_choice", _EMPTY),
    "preserved_tokens": Refused("not implemented", _EMPTY),
    "embd_normalize": Refused("embeddings are always L2-normalised", (None, 2)),
    # OpenAI's, for what this server cannot do.
    "functions": Refused("send tools", _EMPTY),
    "function_call": Refused("send tool_choice", (None, "none")),
    "audio": Refused("audio output is not supported"),
    "modalities": Refused("the answer is text", (None, ["text"])),
    "prediction": Refused("predicted outputs are not implemented"),
    "web_search_options": Refused("web search is not available"),
    "store": Refused("completions are not stored", _OFF),
    "service_tier": Refused("there is one tier", (None, "auto", "default")),
    "verbosity": Refused("not implemented", (None, "medium")),
}

# Fields about the request, not its answer: accepted as OpenAI accepts them, with no effect.
METADATA: dict[str, str] = {
    "user": "an end-user id, for the client's own records",
    "metadata": "tags for stored completions; nothing is stored",
    "safety_identifier": "an end-user id, for the client's own records",
    "prompt_cache_key": "a cache routing hint; the prompt cache is keyed by the prompt itself",
}

# What each declared field of the chat and completion requests does.
HONOURED: dict[str, str] = {
    "model": "the base model or a mounted adapter",
    "messages": "chat: the conversation, rendered by the model's chat template",
    "prompt": "completions: text, a list of texts, or token ids",
    "echo": "completions: the prompt before the completion, with its scores when asked; chat: "
    "the last message's content before the answer when it is the assistant's",
    "frequency_penalty": "as OpenAI's: over the tokens generated so far",
    "presence_penalty": "as OpenAI's: over the tokens generated so far",
    "repetition_penalty": "vLLM's multiplicative penalty, over the prompt and the tokens generated",
    "logit_bias": "as OpenAI's",
    "logprobs": "chat: true/false; completions: how many alternatives, up to 20",
    "top_logprobs": "chat: alternatives per token, up to 20",
    "max_tokens": "as OpenAI's",
    "max_completion_tokens": "as OpenAI's",
    "n": "choices per prompt",
    "seed": "reproducible sampling",
    "stop": "stop strings, never in the output unless include_stop_str_in_output",
    "stream": "server-sent events",
    "stream_options": "include_usage; continuous_usage_stats: usage on every chunk",
    "temperature": "as OpenAI's",
    "top_p": "as OpenAI's",
    "top_k": "the k most likely tokens; 0 or -1 is off",
    "min_p": "as vLLM's",
    "tools": "chat: shown by the chat template, or in the generic format when it cannot show "
    "them; calls parsed from the answer",
    "tool_choice": "chat: none, auto, required or a named function (enforced by grammar)",
    "parallel_tool_calls": "chat: as OpenAI's",
    "response_format": "text, json_object or json_schema, enforced while decoding",
    "adapter": "the LoRA adapters to apply",
    "min_tokens": "EOS and stop_token_ids are held off (and stop strings not checked) until then",
    "ignore_eos": "EOS does not end the answer",
    "stop_token_ids": "token ids that end the answer",
    "include_stop_str_in_output": "the stop string or stop token that ended the answer is kept",
    "skip_special_tokens": "false writes control tokens into the text",
    "allowed_token_ids": "only these token ids may be generated",
    "truncate_prompt_tokens": "keep only the last N prompt tokens (-1: the context length)",
    "prompt_logprobs": "vLLM's per-prompt-token log-probabilities (not when streaming)",
    "add_special_tokens": "add the tokenizer's special tokens (BOS) when encoding the prompt",
    "add_generation_prompt": "chat: end the prompt with the assistant's turn opening",
    "continue_final_message": "chat: continue the last (assistant) message, no end of turn",
    "chat_template_kwargs": "chat: passed to the chat template; a name it does not read is a 400",
    "documents": "chat: passed to the chat template; a 400 when it does not read them",
    "guided_json": "JSON valid under this schema, enforced while decoding",
    "guided_regex": "text matching this regular expression",
    "guided_choice": "exactly one of these strings",
    "guided_grammar": "text following this Lark or GBNF grammar",
    "structured_outputs": "vLLM's json / regex / choice / grammar / json_object",
    "json_schema": "llama.cpp: JSON valid under this schema",
    "grammar": "llama.cpp: text following this GBNF (or Lark) grammar",
    "reasoning_effort": "passed to a chat template that reads it; a 400 for one that does not",
    "include_reasoning": "false: a thinking model's reasoning is left out of the answer",
    "request_id": "vLLM's: the answer's id is chatcmpl-<request_id> (cmpl- on completions)",
    "cache_salt": "vLLM's: only requests of the same salt (and tenant) share cached prompts",
}

# The values at which an honoured field asks for nothing. Sent to an endpoint that does not take
# the field (vLLM's `continue_final_message: false` to /tokenize, `n: 1` to /v1/responses) it
# passes, as a refused field's default does; any other value there is a 400 naming it.
NO_OP: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "n": (1,),
    "stop": ([],),
    "stream": (False,),
    "top_p": (1,),
    "top_k": (0, -1),
    "min_p": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "stop_token_ids": ([],),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "continue_final_message": (False,),
    "chat_template_kwargs": ({},),
    "include_reasoning": (True,),
    "echo": (False,),
}

# Fields of OpenAI's Responses API that /v1/responses does not implement; a field of chat or
# text completions sent there (`max_tokens`, `top_k`) is refused as on the other endpoints.
RESPONSES_REFUSED: dict[str, Refused] = {
    **REFUSED,
    "include": Refused("no extra output (encrypted reasoning, logprobs) is added", _EMPTY),
    "max_tool_calls": Refused("there are no built-in tools whose calls it would bound"),
    "reasoning": Refused(
        "send the reasoning effort as a chat completion's reasoning_effort", (None, {})
    ),
    "stream_options": Refused(
        "stream obfuscation padding is not implemented",
        (*_EMPTY, {"include_obfuscation": False}),
    ),
    "top_logprobs": Refused("log-probabilities are served on chat completions", (None, 0)),
}

# Fields of vLLM's /v1/embeddings, /tokenize and /detokenize these routes do not implement.
TOKEN_ROUTES_REFUSED: dict[str, Refused] = {
    **REFUSED,
    "normalize": Refused("embeddings are always L2-normalised", (None, True)),
    "embed_dtype": Refused("embeddings are float32", (None, "float32")),
    "additional_data": Refused("not implemented"),
    "truncate_prompt_tokens": Refused("an input longer than the context is refused instead"),
}

_warned: set[str] = set()


def declared_names(model: type[BaseModel]) -> set[str]:
    """A request model's field names and their aliases: what `check_fields` lets through."""
    fields = model.model_fields.values()
    return set(model.model_fields) | {f.alias for f in fields if f.alias}


def _same(value: Any, neutral: Any) -> bool:
    """Equal as JSON values: 1 and 1.0 alike, but never true and 1; an object's null members
    are left out (`{"effort": null}` asks for what `{}` does)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, dict) and isinstance(neutral, dict):
        value = {k: v for k, v in value.items() if v is not None}
        return value.keys() == neutral.keys() and all(_same(value[k], neutral[k]) for k in value)
    if isinstance(value, int | float) and isinstance(neutral, int | float):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def _taken_by(name: str) -> str:
    """Which of the completion endpoints take the honoured field `name`, in words."""
    from hotlora.server.api.completion_requests import ChatCompletionRequest, CompletionRequest

    chat = name in declared_names(ChatCompletionRequest)
    text = name in declared_names(CompletionRequest)
    if chat and not text:
        return "chat completions (/v1/chat/completions)"
    if text and not chat:
        return "text completions (/v1/completions)"
    return "chat and text completions"


def _asks(name: str, value: Any) -> bool:
    """Whether the honoured field `name` set to `value` asks for something."""
    return value is not None and not any(_same(value, v) for v in NO_OP.get(name, ()))


def check_fields(
    data: Any, declared: Iterable[str], refusing: dict[str, Refused] = REFUSED
) -> None:
    """Refuse a field other servers define and this endpoint does not implement; warn once about
    a field no server defines. `declared`: the request model's own field names and aliases;
    `refusing`: the endpoint's refused fields."""
    if not isinstance(data, dict):
        return
    known = set(declared)
    for name, value in data.items():
        if name in known or name in METADATA:
            continue
        if name in HONOURED and name not in refusing:
            if _asks(name, value):
                raise InvalidRequest(
                    f"'{name}' is not taken by this endpoint: it is a field of {_taken_by(name)}.",
                    param=name,
                    code="unsupported_parameter",
                )
            continue
        refused = refusing.get(name)
        if refused is not None:
            asked = [other for other in refused.unless if _asks(other, data.get(other))]
            if value is not None and asked or not any(_same(value, v) for v in refused.neutral):
                raise InvalidRequest(
                    f"'{name}' is not supported by this server: {refused.why}.",
                    param=name,
                    code="unsupported_parameter",
                )
        elif name not in _warned:
            _warned.add(name)
            log.warning(
                "request field %r is not one this server or any it follows defines; it has no "
                "effect (logged once per field name)",
                printable(name),
            )
