"""The engine's KV caches: mlx-lm's, grown `KV_STEP` positions at a time instead of 256.

A cache that is full takes a whole step of new positions for every row at once, whatever the
rows still need. At mlx-lm's 256, a batch of short answers holds up to 255 unused positions a
row in every layer, often more than the answers themselves; a step of 64 wastes a quarter of
that, and the copy each growth costs comes once every 64 tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

KV_STEP = 64
# One cache per layer (mlx-lm's KVCache, RotatingKVCache, ...), as `make_prompt_cache` builds.
LayerCaches = list[Any]


def new_caches(model: nn.Module) -> list[Any]:
    """An empty cache per layer of `model`, each growing `KV_STEP` positions at a time."""
    return stepped(make_prompt_cache(model))


def stepped(caches: list[Any]) -> list[Any]:
    """Make these caches (a merged batch cache, one fetched from the prompt cache) grow
    `KV_STEP` positions at a time from now on; returns them."""
    for cache in caches:
        if hasattr(cache, "step"):
            cache.step = KV_STEP  # an instance attribute over the class's 256
        stepped(getattr(cache, "caches", []))  # a CacheList's own caches
    return caches
