"""Scored openings: the KV and the prompt log-probabilities of an opening that scoring requests
share, kept per adapter set, so the next prompt that opens with it prefills only the rest.

An evaluation scores each choice of a question as its own prompt, the question (its context)
then the choice: four prompts that open alike. Prompt log-probabilities need the logits of
every position, which a kept KV cache alone cannot give; a scored opening keeps both, the KV of
its tokens but the last and the log-probability entries of its tokens after the first. A
prompt that opens with it starts from that KV and prefills from the opening's last token on:
the logits of that token score the prompt's first token past the opening. On the packed CPU
path a row's logits are the same bits in any batch and any chunking of its prompt, so a prompt
scored from a kept opening scores bit for bit as it does alone from its first token.

Scoring prompts of one adapter set and alternatives count that arrive together wait for the
first of them to be prefilled (`waits`): it then keeps the opening they share with it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from hotlora.server.engine.generate import GenerationJob, RankedLogprob, prompt_cache_key
from hotlora.server.engine.kv_caches import LayerCaches, caches_from, in_one_buffer, stepped
from hotlora.server.engine.prompt_heads import MIN_HEAD, shared_prefix
from hotlora.server.engine.sequences import Group

MAX_OPENINGS = 32  # kept openings, least recently used out first
MAX_BYTES = 64 << 20  # their KV buffers together
RECENT = 128  # scoring prompts remembered (from their arrival) to find the openings they share

# The prompt cache key (base model, adapter revisions) and the alternatives per prompt token.
ScoringKey = tuple[tuple[str, ...], int]


def job_scoring_key(base_id: str, job: GenerationJob) -> ScoringKey | None:
    """What a job's prompt scores are kept under; None when it asks for none."""
    k = job.params.prompt_logprobs
    return None if k is None else (prompt_cache_key(base_id, job), k)


def scoring_key(base_id: str, group: Group) -> ScoringKey | None:
    """What a group's prompt scores are kept under; None when it asks for none."""
    return job_scoring_key(base_id, group.job)


@dataclass(frozen=True)
class Opening:
    """A kept opening: KV of its tokens but the last, log-probabilities of all but the first."""

    keys: tuple[mx.array, ...]  # per layer [1, kv_heads, len(tokens) - 1, head_dim]
    values: tuple[mx.array, ...]
    scores: tuple[tuple[RankedLogprob, ...], ...]  # len(tokens) - 1 entries: tokens 1.. on
    nbytes: int


class ScoredOpenings:
    """Scored openings by (scoring key, tokens), within `max_size` entries and `max_bytes`;
    `max_size` 0 keeps none. Used by the generation thread alone."""

    def __init__(self, max_size: int = MAX_OPENINGS, max_bytes: int = MAX_BYTES):
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._kept: OrderedDict[tuple[ScoringKey, tuple[int, ...]], Opening] = OrderedDict()
        self._recent: deque[tuple[ScoringKey, tuple[int, ...], int]] = deque(maxlen=RECENT)

    def __len__(self) -> int:
        return len(self._kept)

    def note(self, key: ScoringKey, prompt: Sequence[int], owner: int) -> None:
        """Remember a scoring prompt (`owner`: the id of its first job) until the one it shares
        an opening with keeps that opening."""
        if self.max_size and not any(o == owner for _, _, o in self._recent):
            self._recent.append((key, tuple(prompt), owner))

    def shared(self, key: ScoringKey, prompt: Sequence[int], owner: int) -> int:
        """The longest opening `prompt` shares with another remembered prompt of `key`
        (`MIN_HEAD` tokens at least; 0: none)."""
        tokens = tuple(prompt)
        best = max(
            (shared_prefix(tokens, seen) for k, seen, o in self._recent if k == key and o != owner),
            default=0,
        )
        return best if best >= MIN_HEAD else 0

    def waits(
        self, key: ScoringKey, prompt: Sequence[int], leaders: Iterable[Sequence[int]]
    ) -> bool:
        """Whether a scoring prompt should wait for one of `leaders` (prompts of `key` being
        prefilled) to keep the opening they share: one of them shares more than is kept, and
        at least half the prompt (a question's choices do; questions that share a preamble
        only do not wait for each other)."""
        if not self.max_size:
            return False
        kept = max(self._longest(key, prompt), MIN_HEAD - 1)
        for lead in leaders:
            shared = shared_prefix(prompt, lead)
            if shared > kept and 2 * shared >= len(prompt):
                return True
        return False

    def fetch(
        self, key: ScoringKey, prompt: Sequence[int]
    ) -> tuple[LayerCaches, list[tuple[RankedLogprob, ...]], int] | None:
        """The longest kept opening of `prompt` under `key`: fresh caches holding its KV (all
        its tokens but the last), its tokens' entries, and its length; None when none is kept."""
        n = self._longest(key, prompt)
        if not n:
            return None
        entry = (key, tuple(prompt[:n]))
        self._kept.move_to_end(entry)
        opening = self._kept[entry]
        return stepped(caches_from(opening.keys, opening.values)), list(opening.scores), n

    def keep(
        self,
        key: ScoringKey,
        tokens: Sequence[int],
        caches: LayerCaches,
        scores: Sequence[tuple[RankedLogprob, ...]],
    ) -> None:
        """Keep the opening `tokens` from a prefilled prompt's `caches` (holding at least
        `len(tokens) - 1` positions) and its entries (`scores`, one per token after the
        first). Caches other than mlx-lm's plain `KVCache` are not cut: nothing is kept."""
        n = len(tokens) - 1
        entry = (key, tuple(tokens))
        if not self.max_size or n < 1 or entry in self._kept or len(scores) < n:
            return
        if not all(type(c) is KVCache and c.offset >= n for c in caches):
            return
        arrays = in_one_buffer(
            [c.keys[:, :, :n, :] for c in caches] + [c.values[:, :, :n, :] for c in caches]
        )
        nbytes = sum(a.nbytes for a in arrays)
        if nbytes > self.max_bytes:
            return
        layers = len(caches)
        opening = Opening(tuple(arrays[:layers]), tuple(arrays[layers:]), tuple(scores[:n]), nbytes)
        self._kept[entry] = opening
        self.nbytes += nbytes
        while len(self._kept) > self.max_size or self.nbytes > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def _longest(self, key: ScoringKey, prompt: Sequence[int]) -> int:
        """The length of the longest kept opening of `prompt` under `key` (0: none)."""
        best = 0
        for found, tokens in self._kept:
            n = len(tokens)
            if found == key and best < n <= len(prompt) and tuple(prompt[:n]) == tokens:
                best = n
        return best
