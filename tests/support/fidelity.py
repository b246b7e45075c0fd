"""What the packed CPU kernels are held to beside mlx-lm: its float32 reference on the exactly
dequantized weights, logits within a tolerance and greedy text equal but at near-ties."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from hotlora.models.cpu.fidelity import Distance, dequantized_reference, distance

__all__ = [
    "LOGIT_TOLERANCE",
    "NEAR_TIE",
    "Distance",
    "GreedyComparison",
    "compare_greedy",
    "dequantized_reference",
    "distance",
    "greedy",
    "prompt_logits",
    "relative_difference",
]

# Logits may differ from the reference's by this much, relative to the largest reference logit:
# the kernels sum each product in another order than BLAS, nothing else.
LOGIT_TOLERANCE = 1e-4
# Greedy texts may part where the reference's top two logits are closer than this.
NEAR_TIE = 1e-3


def prompt_logits(model: nn.Module, prompt: Sequence[int]) -> mx.array:
    """The logits of every prompt position, one call: [L, vocab]."""
    out = model(mx.array([list(prompt)]), cache=make_prompt_cache(model))[0]
    mx.eval(out)
    return out.astype(mx.float32)


def relative_difference(got: mx.array, reference: mx.array) -> float:
    """The largest difference, relative to the reference's largest magnitude."""
    return (mx.abs(got - reference).max() / mx.abs(reference).max()).item()


@dataclass(frozen=True)
class GreedyComparison:
    """Two greedy continuations side by side: where they part (None: nowhere) and the
    reference's gap between its top two logits there."""

    served: list[int]
    reference: list[int]
    parted_at: int | None
    gap: float | None

    @property
    def acceptable(self) -> bool:
        return self.parted_at is None or (self.gap is not None and self.gap < NEAR_TIE)


def greedy(
    model: nn.Module, prompt: Sequence[int], tokens: int
) -> tuple[list[int], list[mx.array]]:
    """`tokens` greedy tokens after the prompt, with the logits each was chosen from."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([list(prompt)]), cache=cache)[0, -1]
    chosen, seen = [], []
    for _ in range(tokens):
        mx.eval(logits)
        seen.append(logits.astype(mx.float32))
        token = int(mx.argmax(logits).item())
        chosen.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return chosen, seen


def compare_greedy(
    served: nn.Module, reference: nn.Module, prompt: Sequence[int], tokens: int
) -> GreedyComparison:
    """Both models' greedy continuations of `prompt`, and where they part."""
    got, _ = greedy(served, prompt, tokens)
    expected, logits = greedy(reference, prompt, tokens)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            top = mx.sort(logits[i])[-2:]
            return GreedyComparison(got, expected, i, (top[1] - top[0]).item())
    return GreedyComparison(got, expected, None, None)
