"""Prompt heads: the opening that a prompt shares with other recent prompts (a system prompt,
the chat template's first turn), its KV kept per adapter set.

The prompt cache keeps whole conversations, a few at a time. That serves base-only traffic,
whose requests all find their shared opening in any kept conversation, and follow-up turns.
Traffic spread over many adapter sets seldom finds a kept conversation of its own set (an
adapter on any layer changes the KV of every layer after it), so each request prefilled its
shared opening again: the prompt tokens that cost the most beside base-only traffic. A head is
that opening alone, cut from a finished request's cache when the request did not find it
cached: a few KV positions for each of many adapter sets.

Heads of one set where one opens the other (a system prompt, and a longer opening a burst of
its prompts shared) hold their common positions once: the shorter reads the longer's buffer.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from hotlora.server.engine.kv_caches import LayerCaches, caches_from, in_one_buffer

MIN_HEAD = 8  # a shorter shared opening is not worth an entry
MAX_HEAD = 4096  # prompts are compared this far: a longer opening is cut to it
RECENT = 16  # prompts remembered, whatever their adapters, to find the shared opening


@dataclass(eq=False)
class Buffer:
    """The memory a head copied its positions into, and how many heads read it."""

    nbytes: int
    heads: int = 0


@dataclass(frozen=True)
class Head:
    keys: tuple[mx.array, ...]  # per layer [1, kv_heads, n, head_dim]
    values: tuple[mx.array, ...]
    buffer: Buffer

    def cut(self, n: int) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """Its first `n` positions: views, no copy (evaluated)."""
        keys = tuple(a[:, :, :n, :] for a in self.keys)
        values = tuple(a[:, :, :n, :] for a in self.values)
        mx.eval(keys, values)
        return keys, values


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
    `max_size` entries and `max_bytes` (their buffers', each counted once). Used by the
    generation thread alone."""

    def __init__(self, max_size: int, max_bytes: int):
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.nbytes = 0  # the buffers the kept heads read
        self._heads: OrderedDict[tuple[tuple[str, ...], tuple[int, ...]], Head] = OrderedDict()
        # Recent prompts' openings, each with its job's cache scope.
        self._recent: deque[tuple[tuple[str, ...], tuple[int, ...]]] = deque(maxlen=RECENT)

    def __len__(self) -> int:
        return len(self._heads)

    def opening(self, prompt: Sequence[int], scope: tuple[str, ...] = ()) -> int:
        """The length of the opening `prompt` shares with at least two recent prompts of its
        cache `scope` (another tenant's say nothing of what this one's have in common) that
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
        alike = (shared_prefix(tokens, seen) for of, seen in self._recent if of == scope)
        shared = sorted((n for n in alike if n >= MIN_HEAD), reverse=True)
        self._recent.append((scope, tokens))
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
        return caches_from(kept.keys, kept.values), len(best[1])

    def keep(self, key: tuple[str, ...], head: Sequence[int], caches: LayerCaches) -> None:
        """Keep the first `len(head)` positions of a single row's `caches` (which hold at least
        that many) under `key`. Caches other than mlx-lm's plain `KVCache` (sliding windows,
        quantized, ...) are not cut: nothing is kept for them.

        A head of the same key that `head` opens already holds these positions: the new head
        reads them there. Else they are copied into a buffer of their own, and the heads of the
        key that open `head` read them there from then on (their own buffers go once no head
        reads them)."""
        entry = (key, tuple(head))
        if entry in self._heads or not head or self.max_size == 0:
            return
        if not all(type(c) is KVCache and c.offset >= len(head) for c in caches):
            return
        n = len(head)
        host = next(
            (
                kept
                for (found, tokens), kept in self._heads.items()
                if found == key and len(tokens) > n and tokens[:n] == entry[1]
            ),
            None,
        )
        if host is not None:
            keys, values = host.cut(n)
            self._add(entry, Head(keys, values, host.buffer))
            return
        # Copies: the row's arrays go.
        arrays = in_one_buffer(
            [c.keys[:, :, :n, :] for c in caches] + [c.values[:, :, :n, :] for c in caches]
        )
        buffer = Buffer(sum(a.nbytes for a in arrays))
        if buffer.nbytes > self.max_bytes:
            return
        kept = Head(tuple(arrays[: len(caches)]), tuple(arrays[len(caches) :]), buffer)
        for (found, tokens), shorter in list(self._heads.items()):
            if found == key and tokens == entry[1][: len(tokens)]:
                keys, values = kept.cut(len(tokens))
                self._release(shorter.buffer)
                buffer.heads += 1
                self._heads[(found, tokens)] = Head(keys, values, buffer)  # keeps its place
        self.nbytes += buffer.nbytes
        self._add(entry, kept)

    def _add(self, entry: tuple[tuple[str, ...], tuple[int, ...]], head: Head) -> None:
        head.buffer.heads += 1
        self._heads[entry] = head
        while len(self._heads) > self.max_size or self.nbytes > self.max_bytes:
            _, dropped = self._heads.popitem(last=False)
            self._release(dropped.buffer)

    def _release(self, buffer: Buffer) -> None:
        buffer.heads -= 1
        if buffer.heads == 0:
            self.nbytes -= buffer.nbytes
