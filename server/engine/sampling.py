"""What picks the next token: the sampler and logits processors a job's `SamplingParams` ask for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

Sampler = Callable[[mx.array], mx.array]  # logprobs [1, vocab] -> token [1]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # (tokens so far, logits) -> logits


@dataclass(frozen=True)
class SamplingParams:
    """What decides the next token and when to stop; validated by the caller."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


def build_sampler(params: SamplingParams) -> Sampler:
    """mlx-lm's sampler for the temperature and the top-p / top-k / min-p filters."""
    return make_sampler(
        temp=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        top_k=params.top_k,
    )


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """mlx-lm's processors for the logit bias and the three penalties; none when unset."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
