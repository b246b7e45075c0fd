"""From a request's sampling fields to the engine's `SamplingParams`: defaults applied, token ids
checked against the vocabulary, and token masks that a grammar would contradict refused."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hotlora.config.errors import InvalidRequest
from hotlora.config.log_text import clipped
from hotlora.server.api.completion_requests import SamplingFields
from hotlora.server.engine import SamplingParams
from hotlora.server.engine.grammar import Grammar

_TOKEN_ID = re.compile(r"-?[0-9]+")


# llama.cpp's (and KoboldCpp's) seed for "a random one": clients written for them send it to
# have each answer differ.
NO_SEED = -1


def sampling_params(
    request: SamplingFields,
    *,
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
    defaults: Mapping[str, float],
    vocab_size: int,
    eos_ids: frozenset[int],
    grammar: Grammar | None,
) -> SamplingParams:
    """The request's sampling, its unset fields from `defaults` (the operator's settings, then
    the model's generation config), else OpenAI's and vLLM's defaults."""
    top_k = _pick(request.top_k, defaults.get("top_k"), 0)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_pick(request.temperature, defaults.get("temperature"), 1.0),
        top_p=_pick(request.top_p, defaults.get("top_p"), 1.0),
        # A top_k covering the whole vocabulary filters nothing (and mlx-lm refuses it); -1 is
        # vLLM's spelling of off.
        top_k=top_k if 0 < top_k < vocab_size else 0,
        min_p=_pick(request.min_p, None, 0.0),
        seed=None if request.seed == NO_SEED else request.seed,
        stop=tuple(request.stop_list),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=_logit_bias(request.logit_bias, vocab_size),
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=_token_ids(request.stop_token_ids, "stop_token_ids", vocab_size),
        include_stop=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        allowed_token_ids=_token_ids(request.allowed_token_ids, "allowed_token_ids", vocab_size),
        prompt_logprobs=request.prompt_logprobs,
    )
    _check_masks(params, grammar, eos_ids)
    return params


def _token_ids(ids: list[int] | None, param: str, vocab: int) -> tuple[int, ...]:
    bad = [t for t in ids or () if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"{param} holds {bad[0]}, outside the vocabulary (0..{vocab - 1}).", param=param
        )
    return tuple(ids or ())


def _check_masks(params: SamplingParams, grammar: Grammar | None, eos_ids: frozenset[int]) -> None:
    """Refuse token masks that a grammar's own would contradict, or that leave no token."""
    masks = {"min_tokens": params.min_tokens > 0, "allowed_token_ids": params.allowed_token_ids}
    for param, used in masks.items():
        if used and grammar is not None:
            raise InvalidRequest(
                f"{param} cannot be combined with a constraint on the answer (a grammar, schema, "
                "regex or choice, or a required tool call): the grammar decides which tokens may "
                "come and where the answer ends.",
                param=param,
            )
    enders = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    allowed = set(params.allowed_token_ids)
    if params.min_tokens and allowed and allowed <= enders:
        raise InvalidRequest(
            "allowed_token_ids holds only tokens that end the answer, which min_tokens holds "
            "off: no token is left to generate.",
            param="allowed_token_ids",
        )


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        # ASCII digits only: `str.isdigit` also takes "²" and "١". No more of them than the
        # vocabulary's size has: Python refuses to read over 4,300 digits as an int.
        too_long = len(key) > len(str(vocab))
        if too_long or not _TOKEN_ID.fullmatch(key) or not 0 <= int(key) < vocab:
            raise InvalidRequest(
                f"logit_bias keys must be token ids in 0..{vocab - 1}; got {clipped(key, 16)!r}.",
                param="logit_bias",
            )
        out.append((int(key), value))
    return tuple(out)


def _pick(value: Any, default: Any, fallback: Any) -> Any:
    if value is not None:
        return value
    return default if default is not None else fallback
