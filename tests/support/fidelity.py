"""What the packed CPU kernels are held to beside mlx-lm: its float32 reference on the exactly
dequantized weights, logits within a tolerance and greedy text equal but at near-ties."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

# Logits may differ from the reference's by this much, relative to the largest reference logit:
# the kernels sum each product in another order than BLAS, nothing else.
LOGIT_TOLERANCE = 1e-4
# Greedy texts may part where the reference's top two logits are closer than this.
NEAR_TIE = 1e-3


def dequantized_reference(model: nn.Module) -> nn.Module:
    """`model` with every quantized layer dequantized in float32 (scale * value + bias, the
    values the packed kernels multiply by) and every parameter float32, in place; returns it."""
    plain_layers = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            continue
        assert module.biases is not None
        weight = mx.dequantize(
            module.weight,
            module.scales.astype(mx.float32),
            module.biases.astype(mx.float32),
            group_size=module.group_size,
            bits=module.bits,
        )
        if isinstance(module, nn.QuantizedEmbedding):
            plain: nn.Module = nn.Embedding(*weight.shape)
        else:
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                plain.bias = module.bias
        plain.weight = weight
        plain_layers.append((name, plain))
    model.update_modules(tree_unflatten(plain_layers))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


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


@dataclass(frozen=True)
class Distance:
    """How far a run's logits are from the float32 reference's over teacher-forced positions:
    max |difference| / max |reference logit| per position (median, 99th percentile, largest),
    the mean and largest KL divergence of its next-token distribution from the reference's,
    and the share of positions whose top token is the reference's."""

    median: float
    p99: float
    largest: float
    kl_mean: float
    kl_max: float
    top1: float

    def within(self, other: Distance) -> bool:
        """No further from the reference than `other` on any figure, and no lower top-1."""
        return (
            self.median <= other.median
            and self.p99 <= other.p99
            and self.largest <= other.largest
            and self.kl_mean <= other.kl_mean
            and self.kl_max <= other.kl_max
            and self.top1 >= other.top1
        )

    def __str__(self) -> str:
        return (
            f"relative max |d| median {self.median:.4f} p99 {self.p99:.4f} max {self.largest:.4f}"
            f", KL mean {self.kl_mean:.2e} max {self.kl_max:.2e}, top-1 {self.top1:.3f}"
        )


def distance(got: mx.array, reference: mx.array) -> Distance:
    """`Distance` of logits [..., vocab] from the reference's, position by position."""
    got = got.astype(mx.float32).reshape(-1, got.shape[-1])
    reference = reference.astype(mx.float32).reshape(-1, reference.shape[-1])
    relative = mx.abs(got - reference).max(axis=-1) / mx.abs(reference).max(axis=-1)
    log_p = reference - mx.logsumexp(reference, axis=-1, keepdims=True)
    log_q = got - mx.logsumexp(got, axis=-1, keepdims=True)
    kl = (mx.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    top1 = (mx.argmax(got, axis=-1) == mx.argmax(reference, axis=-1)).astype(mx.float32).mean()
    ordered = mx.sort(relative)
    n = ordered.size
    return Distance(
        median=ordered[(n - 1) // 2].item(),
        p99=ordered[min(n - 1, round(0.99 * (n - 1)))].item(),
        largest=ordered[-1].item(),
        kl_mean=kl.mean().item(),
        kl_max=kl.max().item(),
        top1=top1.item(),
    )
