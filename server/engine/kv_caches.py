"""The engine's KV caches: mlx-lm's, grown `KV_STEP` positions at a time instead of 256.

A cache that is full takes a whole step of new positions for every row at once, whatever the
rows still need. At mlx-lm's 256, a batch of short answers holds up to 255 unused positions a
row in every layer, often more than the answers themselves; a step of 64 wastes a quarter of
that, and the copy each growth costs comes once every 64 tokens. A decode step whose rows can
write fewer positions than that before their `max_tokens` grows by those alone
(`decode_step_size`). A prompt being prefilled grows
by its whole length at once (`prefill_step`): in steps of 64 each chunk of a long prompt would
copy the whole cache into a new, freshly paged buffer, a cost that grows with the square of
the prompt (an 8,000-token prompt: tens of GB copied over its chunks).

What is kept beyond a request (a finished row's cache, a prompt head) is copied into one buffer
(`in_one_buffer`): one allocation, large enough that the allocator maps it of its own and
returns it whole when it is dropped, instead of a buffer a layer (each under malloc's 128 KiB
for a short conversation) left in its heap among those of the steps around it. A row of a
running batch is copied so straight from views of the batch's buffers (`row_caches`): once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

KV_STEP = 64
# One cache per layer (mlx-lm's KVCache, RotatingKVCache, ...), as `make_prompt_cache` builds.
LayerCaches = list[Any]


def new_caches(model: nn.Module) -> list[Any]:
    """An empty cache per layer of `model`, each growing `KV_STEP` positions at a time."""
    return stepped(make_prompt_cache(model))


def stepped(caches: list[Any], step: int = KV_STEP) -> list[Any]:
    """Make these caches (a merged batch cache, one fetched from the prompt cache) grow `step`
    positions at a time from now on; returns them."""
    for cache in caches:
        if hasattr(cache, "step"):
            cache.step = step  # an instance attribute over the class's 256
        stepped(getattr(cache, "caches", []), step)  # a CacheList's own caches
    return caches


def decode_step_size(positions: int) -> int:
    """The step of a decode step's caches whose rows can write at most `positions` more
    positions: `KV_STEP`, or fewer where no row can use them all (a batch of answers near their
    `max_tokens` grows by what they can still write, not a whole step a row)."""
    return max(1, min(KV_STEP, positions))


def prefill_step(tokens: int) -> int:
    """The step of a cache that has `tokens` prompt tokens to prefill: all of them at the first
    growth, in whole `KV_STEP`s (decoding then grows it `KV_STEP` at a time again)."""
    return max(KV_STEP, -(-tokens // KV_STEP) * KV_STEP)


def in_one_buffer(arrays: Sequence[mx.array]) -> list[mx.array]:
    """Copies of `arrays` ([1, ...] each), evaluated: views of one buffer where all have one
    shape and dtype, else a copy each."""
    if len({(a.shape, a.dtype) for a in arrays}) == 1 and arrays[0].shape[0] == 1:
        buffer = mx.concatenate(list(arrays), axis=0)
        copies = [buffer[i : i + 1] for i in range(len(arrays))]  # views: slices copy nothing
    else:
        copies = [mx.contiguous(a) for a in arrays]
    mx.eval(copies)
    return copies


def row_caches(batch: LayerCaches, index: int) -> LayerCaches:
    """Row `index` of a batch's caches, to be kept (`kept_caches`): where every layer is a
    `BatchKVCache`, views of the row's keys and values in the batch's buffers, which the copy
    into one buffer then reads once; else each layer's own `extract` (a copy). mlx-lm's
    `BatchKVCache.extract` copies each layer first: a kept row then took twice its bytes beside
    the batch's for a moment (a 1,250-token row of the ~0.8B llama: ~80 MB), the views once."""
    if not batch or not all(type(c) is BatchKVCache and c.keys is not None for c in batch):
        return [c.extract(index) for c in batch]
    rows = []
    paddings = mx.stack([cache.left_padding[index] for cache in batch]).tolist()  # one read
    for cache, padding in zip(batch, cast(list[int], paddings), strict=True):
        one = KVCache()
        one.keys = cache.keys[index : index + 1, :, padding : cache._idx]
        one.values = cache.values[index : index + 1, :, padding : cache._idx]
        one.offset = one.keys.shape[2]
        rows.append(one)
    return rows


def kept_caches(caches: LayerCaches) -> LayerCaches:
    """A finished row's caches as kept for reuse: plain `KVCache`s in one buffer
    (`in_one_buffer`); other kinds (sliding windows, quantized, ...) as they are, evaluated."""
    if not caches or not all(type(c) is KVCache and c.keys is not None for c in caches):
        mx.eval([c.state for c in caches])
        return caches
    arrays = in_one_buffer([c.keys for c in caches] + [c.values for c in caches])
    kept = []
    for cache, keys, values in zip(caches, arrays, arrays[len(caches) :], strict=False):
        one = KVCache()
        one.keys, one.values, one.offset = keys, values, cache.offset
        kept.append(one)
    return stepped(kept)


def caches_from(keys: Sequence[mx.array], values: Sequence[mx.array]) -> list[KVCache]:
    """Fresh caches holding kept keys and values [B, heads, S, D], a layer each. Arrays are
    values: the first write past them makes the cache new arrays, the kept ones untouched."""
    caches = []
    for layer_keys, layer_values in zip(keys, values, strict=True):
        cache = KVCache()
        cache.keys, cache.values, cache.offset = layer_keys, layer_values, layer_keys.shape[2]
        caches.append(cache)
    return caches
