"""What picks a row's next token: its logits processors, filters, temperature and PRNG key.

Randomness is per row. Each row carries an explicit key, seeded from the request's `seed` (or
from the OS when there is none), and splits it once per sampled token: a seeded request draws
the same tokens alone or batched with anything, and no request touches MLX's global generator.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

LogitsFilter = Callable[[mx.array], mx.array]  # logprobs [1, vocab] -> logprobs [1, vocab]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # (tokens so far, logits) -> logits
SEED_RANGE = 2**64  # MLX keys take an unsigned 64-bit seed
GREEDY_BELOW = 1e-5  # temperatures this low sample as greedy (vLLM's threshold too)


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


class RowSampler:
    """One row's sampling: its processors, the filter chain, and the key it splits per token."""

    def __init__(self, params: SamplingParams):
        # Below this, 1/temperature overflows the scaled log-probabilities: it is argmax anyway.
        self.greedy = params.temperature < GREEDY_BELOW
        self.temperature = params.temperature
        self.processors: list[LogitsProcessor] = make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )
        self.filters = _filters(params)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.key = mx.random.key(seed % SEED_RANGE)

    def process(self, context: mx.array, logits: mx.array) -> mx.array:
        """Apply the logits processors; `context`: every token so far, `logits`: [1, vocab]."""
        for processor in self.processors:
            logits = processor(context, logits)
        return logits

    def sample(self, logprobs: mx.array) -> mx.array:
        """The next token, shape [1], from log-probabilities [1, vocab]; splits the key."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        for keep in self.filters:
            logprobs = keep(logprobs)
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return mx.random.categorical(logprobs * (1 / self.temperature), key=keys[1])


def _filters(params: SamplingParams) -> list[LogitsFilter]:
    """mlx-lm's sampling filters, in its order: top-p, then min-p, then top-k."""
    filters: list[LogitsFilter] = []
    if 0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    return filters
