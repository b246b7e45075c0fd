"""Prompt heads: the opening that a prompt shares with other recent prompts (a system prompt,
the chat template's first turn), its KV kept per adapter set.

The prompt cache keeps whole conversations, a few at a time. That serves base-only traffic,
whose requests all find their shared opening in any kept conversation, and follow-up turns.
Traffic spread over many adapter sets seldom finds a kept conversation of its own set (an
adapter on any layer changes the KV of every layer after it), so each request prefilled its
shared opening again: the prompt tokens that cost the most beside base-only traffic. A head is
that opening alone, cut from a finished request's cache when the request did not find it
cached: a few KV positions for each of many adapter sets.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from hotlora.server.engine.kv_caches import LayerCaches

MIN_HEAD = 8  # a shorter shared opening is not worth an entry
RECENT = 16  # prompts remembered, whatever their adapters, to find the shared opening


@dataclass(frozen=True)
class Head:
    keys: tuple[mx.array, ...]  # per layer [1, kv_heads, n, head_dim]
    values: tuple[mx.array, ...]
    nbytes: int


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common (compared a slice at a time)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class PromptHeads:
    """Heads kept by (prompt cache key, head tokens), least recently used out first, within
    `max_size` entries and `max_bytes`. Used by the generation thread alone."""

    def __init__(self, max_size: int, max_bytes: int):
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._heads: OrderedDict[tuple[tuple[str, ...], tuple[int, ...]], Head] = OrderedDict()
        self._recent: deque[tuple[int, ...]] = deque(maxlen=RECENT)

    def __len__(self) -> int:
        return len(self._heads)

    def opening(self, prompt: Sequence[int]) -> int:
        """The length of the shortest opening of at least `MIN_HEAD` tokens that `prompt`
        shares with a recent prompt, at most all but its last token (0: none); then remembers
        `prompt`. The shortest: an earlier turn of the same conversation, or the same question
        asked again, shares more than the system prompt, which is what other requests share."""
        tokens = tuple(prompt)
        shared = [shared_prefix(tokens, seen) for seen in self._recent]
        self._recent.append(tokens)
        shortest = min((n for n in shared if n >= MIN_HEAD), default=0)
        shortest = min(shortest, len(tokens) - 1)
        return shortest if shortest >= MIN_HEAD and self.max_size > 0 else 0

    def fetch(self, key: tuple[str, ...], prompt: Sequence[int]) -> tuple[LayerCaches, int] | None:
        """Fresh caches holding the longest head kept under `key` that opens `prompt` (all but
        its last token at most), and that head's length; None when none does."""
        tokens = tuple(prompt)
        best: tuple[tuple[str, ...], tuple[int, ...]] | None = None
        for entry in self._heads:
            found_key, head = entry
            if found_key != key or len(head) >= len(tokens) or tokens[: len(head)] != head:
                continue
            if best is None or len(head) > len(best[1]):
                best = entry
        if best is None:
            return None
        self._heads.move_to_end(best)
        kept = self._heads[best]
        caches = []
        for keys, values in zip(kept.keys, kept.values, strict=True):
            cache = KVCache()
            # Arrays are values: the first write past the head makes the cache new arrays.
            cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
            caches.append(cache)
        return caches, len(best[1])

    def keep(self, key: tuple[str, ...], head: Sequence[int], caches: LayerCaches) -> None:
        """Keep the first `len(head)` positions of a single row's `caches` (which hold at least
        that many) under `key`. Caches other than mlx-lm's plain `KVCache` (sliding windows,
        quantized, ...) are not cut: nothing is kept for them."""
        entry = (key, tuple(head))
        if entry in self._heads or not head or self.max_size == 0:
            return
        if not all(type(c) is KVCache and c.offset >= len(head) for c in caches):
            return
        n = len(head)
        keys = tuple(mx.contiguous(c.keys[:, :, :n, :]) for c in caches)  # copies: the row's
        values = tuple(mx.contiguous(c.values[:, :, :n, :]) for c in caches)  # arrays go
        mx.eval(keys, values)
        nbytes = sum(a.nbytes for a in keys + values)
        if nbytes > self.max_bytes:
            return
        self._heads[entry] = Head(keys, values, nbytes)
        self.nbytes += nbytes
        while len(self._heads) > self.max_size or self.nbytes > self.max_bytes:
            _, dropped = self._heads.popitem(last=False)
            self.nbytes -= dropped.nbytes
