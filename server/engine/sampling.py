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
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

LogitsFilter = Callable[[mx.array], mx.array]  # logprobs [1, vocab] -> logprobs [1, vocab]
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
    # The token that ends the answer quietly (EOS, a stop token not kept) listed in the logprobs
    # too, as the legacy completions of vLLM list it: lm-evaluation-harness reads the last entry
    # as the one generated token, so a continuation that the model would end there scores whole.
    logprobs_of_end: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS and stop_token_ids are held off until this many are generated
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop: bool = False  # the stop string or stop token that ends the answer is kept
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] = ()  # empty: any token
    prompt_logprobs: int | None = None  # alternatives per prompt token; None: none reported


class RowSampler:
    """One row's sampling: its `logit_bias`, its processors, the filter chain, its token masks
    and the key it splits per token. `eos`: the tokens that end the answer (EOS unless ignored,
    stop ids)."""

    def __init__(self, params: SamplingParams, eos: frozenset[int] = frozenset()):
        # Below this, 1/temperature overflows the scaled log-probabilities: it is argmax anyway.
        self.greedy = params.temperature < GREEDY_BELOW
        self.temperature = params.temperature
        # (token, value) pairs added to the logits before the processors, as mlx-lm's first
        # processor adds them; unlike the penalties it needs none of the tokens so far.
        # Ids given twice ("5" and "05") keep the last value, as a dict of them does.
        self.bias = tuple(dict(params.logit_bias).items())
        self.penalties = Penalties.of(params)
        self.filters = _filters(params)
        self.min_tokens = params.min_tokens
        self._enders = sorted(eos)
        self._allowed = sorted(set(params.allowed_token_ids))
        self._masks: dict[tuple[int, bool], mx.array] = {}
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.key = mx.random.key(seed % SEED_RANGE)

    def process(self, tokens: list[int], prompt_length: int, logits: mx.array) -> mx.array:
        """The penalties applied; `tokens`: the prompt's `prompt_length` and every token generated
        since, `logits`: [1, vocab]."""
        if self.penalties is None:
            return logits
        return self.penalties.apply(tokens, prompt_length, logits)

    @property
    def masks_tokens(self) -> bool:
        """Whether `mask` may ever hold a token off (min_tokens, allowed_token_ids)."""
        return bool(self._allowed) or (self.min_tokens > 0 and bool(self._enders))

    def mask(self, generated: int, vocab: int) -> mx.array | None:
        """An additive mask [vocab] (0 or -inf) for the next token once `generated` tokens are
        out: the tokens outside `allowed_token_ids`, and the tokens that end the answer while
        fewer than `min_tokens` are out; None when nothing is held off."""
        hold_enders = generated < self.min_tokens and bool(self._enders)
        if not (self._allowed or hold_enders):
            return None
        key = (vocab, hold_enders)
        mask = self._masks.get(key)
        if mask is None:
            row = np.zeros(vocab, dtype=np.float32)  # [vocab]
            if self._allowed:
                row[:] = -np.inf
                row[[t for t in self._allowed if t < vocab]] = 0.0
            if hold_enders:
                row[[t for t in self._enders if t < vocab]] = -np.inf
            mask = self._masks[key] = mx.array(row)
        return mask

    def sample(self, logprobs: mx.array) -> mx.array:
        """The next token, shape [1], from log-probabilities [1, vocab]; splits the key."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        for keep in self.filters:
            logprobs = keep(logprobs)
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return mx.random.categorical(logprobs * (1 / self.temperature), key=keys[1])


class Penalties:
    """vLLM's `repetition_penalty` over the prompt and the tokens generated so far (a seen
    token's logit divided by it when positive, multiplied when not), then OpenAI's
    `frequency_penalty` and `presence_penalty` over the generated tokens alone (each token's
    logit less `frequency` x its count, and `presence` once it has appeared): the whole sequence,
    as vLLM; no window. What was seen and how often is kept per vocabulary entry as the tokens
    come, so a step costs the same whatever the sequence's length."""

    def __init__(self, repetition: float, frequency: float, presence: float):
        self.repetition, self.frequency, self.presence = repetition, frequency, presence
        self._seen: mx.array | None = None  # [vocab] bool: in the prompt or generated
        self._counts: mx.array | None = None  # [vocab] float32: times generated
        self._read = 0  # tokens of the sequence counted

    @classmethod
    def of(cls, params: SamplingParams) -> Penalties | None:
        """The request's penalties, or None when none takes effect."""
        repetition = params.repetition_penalty or 1.0
        frequency = params.frequency_penalty or 0.0
        presence = params.presence_penalty or 0.0
        if repetition == 1.0 and frequency == 0.0 and presence == 0.0:
            return None
        return cls(repetition, frequency, presence)

    def apply(self, tokens: list[int], prompt_length: int, logits: mx.array) -> mx.array:
        seen, counts = self._count(tokens, prompt_length, logits.shape[-1])
        if self.repetition != 1.0:
            penalty = self.repetition
            scaled = mx.where(logits < 0, logits * penalty, logits / penalty)
            logits = mx.where(seen, scaled, logits)
        if self.frequency or self.presence:
            less = self.frequency * counts + self.presence * (counts > 0)
            logits = logits - less.astype(logits.dtype)  # 0 for a token not generated
        return logits

    def _count(
        self, tokens: list[int], prompt_length: int, vocab: int
    ) -> tuple[mx.array, mx.array]:
        if self._seen is None or self._counts is None or len(tokens) < self._read:
            # The first step, or not the sequence counted so far: count it afresh.
            self._seen = mx.zeros((vocab,), dtype=mx.bool_)
            self._counts = mx.zeros((vocab,), dtype=mx.float32)
            self._read = 0
        # Only the arrays a penalty reads are kept up: one never read would grow a lazy graph
        # a step at a time. Ids past the logits' width (none a working model makes) are left
        # out: a scatter does not check its indices.
        new = [token for token in tokens[self._read :] if token < vocab]
        if new and self.repetition != 1.0:
            self._seen[mx.array(new)] = True
        generated = [token for token in tokens[max(self._read, prompt_length) :] if token < vocab]
        if generated and (self.frequency or self.presence):
            self._counts = self._counts.at[mx.array(generated)].add(1.0)
        self._read = len(tokens)
        return self._seen, self._counts


def _filters(params: SamplingParams) -> list[LogitsFilter]:
    """mlx-lm's sampling filters, in its order: top-p, then min-p, then top-k."""
    filters: list[LogitsFilter] = []
    if params.top_p == 0:  # the smallest set holding p of the mass: the top token
        filters.append(lambda x: apply_top_k(x, 1))
    elif params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    return filters
