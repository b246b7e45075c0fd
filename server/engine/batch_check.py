"""Whether a model's batched decode step gives each row what the row alone gets.

The scheduler batches rows of different prompt lengths in one call (left-padded, a per-row
mask); an architecture whose attention mishandles that mask answers wrongly or fails once two
requests overlap. `check_batching` finds out at start-up, on the model as it will be served (its
CPU kernels installed), with a few tokens: rows of different lengths are run alone, then
their caches (the prompt but its last token) are merged into one batch cache the way the
scheduler merges them and decoded in one call; each row's logits must match its own. Its
caches are its own: nothing is left behind.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from hotlora.server.engine.kv_caches import new_caches, stepped

# Three rows, each of another length: a batch that is not the KV head count of common models
# and pads every row but the longest. Small ids exist in every vocabulary.
PROMPTS = ((1, 2, 3, 4, 5, 6, 7), (8, 9, 10), (11, 12, 13, 14, 15))
# Batched and single-row steps differ by rounding (other BLAS kernels for other row counts);
# a mishandled mask changes the logits by far more.
RELATIVE_TOLERANCE = 1e-2


def check_batching(model: nn.Module) -> str | None:
    """None when one batched decode step of rows of different lengths gives every row the
    logits it gets alone, within `RELATIVE_TOLERANCE` of their largest magnitude (greedy
    tokens are not compared: a near tie may flip on rounding alone); else why not (an error the
    batched call raised counts)."""
    try:
        alone, prefilled = zip(*(_alone(model, prompt) for prompt in PROMPTS), strict=True)
        batched = _decode(model, list(prefilled), [prompt[-1] for prompt in PROMPTS])
    except Exception as exc:  # noqa: BLE001 - any failure means the model is not batched
        return f"a batched step failed: {exc}"
    for i, logits in enumerate(alone):
        row = batched[i : i + 1]  # [1, vocab]
        scale = mx.maximum(mx.max(mx.abs(logits)), 1e-6)
        error = cast(float, (mx.max(mx.abs(row - logits)) / scale).item())
        if error > RELATIVE_TOLERANCE:
            return (
                f"row {i} of {len(PROMPTS)} batched differs from the row alone "
                f"(logits off by {error:.2g} of their scale)"
            )
    return None


def _alone(model: nn.Module, prompt: tuple[int, ...]) -> tuple[mx.array, list[Any]]:
    """The row alone: its last token's logits [1, vocab], and a single-row cache holding
    `prompt[:-1]`, as the scheduler prefills a group."""
    cache = new_caches(model)
    if can_trim_prompt_cache(cache):
        # The whole prompt in one call gives the logits; stepping back one token leaves the
        # cache the batched step starts from.
        logits = model(mx.array([prompt]), cache=cache)[:, -1, :].astype(mx.float32)
        trim_prompt_cache(cache, 1)
        mx.eval(logits, [c.state for c in cache])
        return logits, cache
    model(mx.array([prompt[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    return _decode(model, [cache], [prompt[-1]]), cache


def _decode(model: nn.Module, caches: list[list[Any]], tokens: list[int]) -> mx.array:
    """One decode step of the rows whose caches are given, merged as the scheduler merges a
    prefilled group into the batch (each layer's cache type merges its own kind)."""
    merged = stepped([layer[0].merge(list(layer)) for layer in zip(*caches, strict=True)])
    logits = model(mx.array([[t] for t in tokens]), cache=merged)[:, -1, :]  # [rows, vocab]
    logits = logits.astype(mx.float32)
    mx.eval(logits)
    return logits
