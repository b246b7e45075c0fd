"""The penalties as OpenAI and vLLM define them: presence and frequency over the tokens generated
so far (none before the first), the repetition penalty over the prompt and them, with no window."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from hotlora.server.engine.sampling import RowSampler, SamplingParams

VOCAB = 16


def penalised(tokens: list[int], prompt_length: int, **penalties: float) -> np.ndarray:
    sampler = RowSampler(SamplingParams(max_tokens=8, **penalties))
    logits = mx.array(np.linspace(-2.0, 2.0, VOCAB, dtype=np.float32))[None]
    return np.array(sampler.process(tokens, prompt_length, logits))[0]


BASE = np.linspace(-2.0, 2.0, VOCAB, dtype=np.float32)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_leave_the_prompt_alone(field: str):
    prompt = [3, 3, 5, 9]
    assert np.array_equal(penalised(prompt, len(prompt), **{field: 2.0}), BASE)


def test_frequency_counts_every_generated_token_and_presence_each_once():
    prompt = [1, 2]
    generated = [7] * 25 + [4]  # a repeat farther back than mlx-lm's window of 20 tokens
    got = penalised(prompt + generated, len(prompt), frequency_penalty=0.5, presence_penalty=0.25)
    want = BASE.copy()
    want[7] -= 0.5 * 25 + 0.25
    want[4] -= 0.5 + 0.25
    assert np.allclose(got, want, rtol=0, atol=1e-6)


def test_repetition_scales_the_whole_sequence_s_tokens():
    prompt = [0, 15] + [8] * 30  # 0 and 15 lie more than 20 tokens back
    got = penalised([*prompt, 6], len(prompt), repetition_penalty=2.0)
    want = BASE.copy()
    for token in (0, 15, 8, 6):
        want[token] = want[token] * 2 if want[token] < 0 else want[token] / 2
    assert np.array_equal(got, want)


def test_counts_follow_the_sequence_as_it_grows():
    sampler = RowSampler(SamplingParams(max_tokens=8, frequency_penalty=1.0))
    zeros = mx.zeros((1, VOCAB))
    tokens = [1]
    for token in (5, 5, 9):
        tokens.append(token)
        last = np.array(sampler.process(tokens, 1, zeros))[0]
    assert last[5] == -2.0 and last[9] == -1.0 and last[1] == 0.0
    # A shorter sequence than the one counted is counted afresh.
    assert np.array(sampler.process([1, 9], 1, zeros))[0][5] == 0.0


def test_no_penalty_asks_for_nothing():
    assert RowSampler(SamplingParams(max_tokens=8)).penalties is None
    neutral = SamplingParams(
        max_tokens=8, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0
    )
    assert RowSampler(neutral).penalties is None


def test_an_id_past_the_logits_width_is_left_out():
    """A scatter does not check its indices: an id no logit stands for is not counted."""
    got = penalised([1, VOCAB + 3, 5, VOCAB], 1, repetition_penalty=2.0, frequency_penalty=1.0)
    want = BASE.copy()
    for token in (1, 5):
        want[token] = want[token] * 2 if want[token] < 0 else want[token] / 2
    want[5] -= 1.0
    assert np.allclose(got, want, rtol=0, atol=1e-6)
