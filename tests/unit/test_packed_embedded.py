"""The embedded model served packed: a request's logits the same bits alone, in a batch and in
any prefill chunking; mlx-lm's float32 logits on the dequantized weights within the tolerance,
and its greedy text but where it parts at a near-tie."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from hotlora.models.cpu import extension, install_packed_kernels
from hotlora.models.cpu.attention import parts_of
from hotlora.models.loader import LoadedModel, load_model_dir

from tests.support.fidelity import (
    LOGIT_TOLERANCE,
    compare_greedy,
    dequantized_reference,
    prompt_logits,
    relative_difference,
)

if (_why := extension.unavailable()) is not None:
    pytest.skip(f"packed kernels: {_why}", allow_module_level=True)

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn.",
    "List three primary colors.",
    "What is 12 times 7?",
]


@pytest.fixture(scope="module")
def served(embedded_model_dir: Path):
    """The embedded model with the packed kernels installed, and mlx-lm's float32 reference;
    mlx-lm's attention global as it was afterwards."""
    original = llama.scaled_dot_product_attention
    llama.scaled_dot_product_attention = mlx_lm_base.scaled_dot_product_attention
    loaded = load_model_dir(embedded_model_dir)
    reference = dequantized_reference(load_model_dir(embedded_model_dir).model)
    state = install_packed_kernels(loaded.model, threads=2)
    assert state.enabled, state.reason
    yield loaded, reference
    llama.scaled_dot_product_attention = original


def chat(loaded: LoadedModel, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_a_requests_logits_are_the_same_bits_alone_chunked_and_in_a_batch(served):
    loaded, _ = served
    model = loaded.model
    prompts = [chat(loaded, q) for q in QUESTIONS[:3]]
    prompt, steps = prompts[0], [504, 314, 1155]

    def alone(chunks: list[int]) -> list[mx.array]:
        cache, at, out = make_prompt_cache(model), 0, []
        for size in chunks:
            out.append(model(mx.array([prompt[at : at + size]]), cache=cache)[0, -1])
            at += size
        for token in steps:
            out.append(model(mx.array([[token]]), cache=cache)[0, -1])
        mx.eval(out)
        return [out[-len(steps) - 1], *out[-len(steps) :]]

    whole = alone([len(prompt)])
    for chunks in ([7, 13, len(prompt) - 20], [1] * 5 + [len(prompt) - 5]):
        got = alone(chunks)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, whole, strict=True)), chunks
    # Beside two other requests of other lengths, left-padded, decoding other tokens.
    longest = max(map(len, prompts))
    pads = [longest - len(p) for p in prompts]
    cache = [BatchKVCache(pads) for _ in model.layers]
    tokens = mx.array([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])
    together = [model(tokens, cache=cache)[0, -1]]
    for token in steps:
        column = mx.array([[token], [77], [1234]])
        together.append(model(column, cache=cache)[0, -1])
    mx.eval(together)
    assert all(mx.array_equal(a, b).item() for a, b in zip(together, whole, strict=True))


def test_logits_are_mlx_lms_float32_within_the_tolerance(served):
    loaded, reference = served
    for question in QUESTIONS:
        prompt = chat(loaded, question)
        got, expected = prompt_logits(loaded.model, prompt), prompt_logits(reference, prompt)
        difference = relative_difference(got, expected)
        assert difference < LOGIT_TOLERANCE, (question, difference)


def test_greedy_text_is_mlx_lms_but_at_a_near_tie(served, capsys):
    loaded, reference = served
    parted = []
    for question in QUESTIONS:
        comparison = compare_greedy(loaded.model, reference, chat(loaded, question), 32)
        assert comparison.acceptable, (question, comparison)
        if comparison.parted_at is not None:
            parted.append((question, comparison.parted_at, comparison.gap))
    with capsys.disabled():
        for question, at, gap in parted:
            print(f"\n{question!r}: parts from mlx-lm at token {at}, a near-tie (gap {gap:.2e})")


def test_the_body_within_parts_of_runs_as_the_whole_model(served):
    """The model's body (as embeddings run it, without the head) called within `parts_of` takes
    the attention the whole model's call takes: its states through the (tied) head are the
    model's logits, to the bit; called bare it takes MLX's attention, which parts from them."""
    loaded, _ = served
    model = loaded.model
    tokens = mx.array([chat(loaded, QUESTIONS[1])])

    def through_head(hidden: mx.array) -> mx.array:
        return model.model.embed_tokens.as_linear(hidden)

    whole = model(tokens, cache=make_prompt_cache(model))
    with parts_of(model):
        within = through_head(model.model(tokens, cache=make_prompt_cache(model)))
    bare = through_head(model.model(tokens, cache=make_prompt_cache(model)))
    assert mx.array_equal(within, whole).item()
    assert not mx.array_equal(bare, whole).item()
