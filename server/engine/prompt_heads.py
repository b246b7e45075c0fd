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
MAX_HEAD = 4096  # prompts are compared this far: a longer opening is cut to it
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
        """The length of the opening `prompt` shares with at least two recent prompts that
        would have saved them the most: of the lengths it shares with each (`MIN_HEAD` tokens
        or more, all but its last token at most), the one times how many recent prompts share
        that much (the shorter on a tie; 0: none, or no heads are kept). Then remembers
        `prompt`.

        The same question asked again, or an earlier turn of the same conversation, shares
        more with one prompt, and the prompt cache serves it; a system prompt shares less with
        many, and that is what a head is for. A chat template's preamble before any system
        prompt shares even less with more prompts, and loses to a system prompt most of them
        share."""
        if self.max_size == 0:
            return 0  # no heads kept: nothing to compare or remember
        tokens = tuple(prompt[:MAX_HEAD])
        shared = sorted(
            (n for n in (shared_prefix(tokens, seen) for seen in self._recent) if n >= MIN_HEAD),
            reverse=True,
        )
        self._recent.append(tokens)
        best, saved = 0, 0
        for at_least, length in enumerate(shared, start=1):  # `at_least` prompts share `length`
            length = min(length, len(prompt) - 1)
            if at_least >= 2 and length >= MIN_HEAD and length * at_least >= saved:
                best, saved = length, length * at_least
        return best

    def fetch(self, key: tuple[str, ...], prompt: Sequence[int]) -> tuple[LayerCaches, int] | None:
        """Fresh caches holding the longest head kept under `key` that opens `prompt` (all but
        its last token at most), and that head's length; None when none does."""
        best: tuple[tuple[str, ...], tuple[int, ...]] | None = None
        for entry in self._heads:
            found_key, head = entry
            if found_key != key or len(head) >= len(prompt) or tuple(prompt[: len(head)]) != head:
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
