"""What generation works with: the loaded model and its prompt cache, jobs, and their events.

A job goes in (prompt, sampling parameters, the request's adapter set); text deltas and one
`Finished` come out. The scheduler runs jobs in batches on the generation worker's thread.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from hotlora.adapters import BASE_ONLY, AdapterSet
from hotlora.config.errors import HotloraError
from hotlora.models.loader import LoadedModel
from hotlora.server.engine.grammar import Grammar, Grammars
from hotlora.server.engine.kv_caches import new_caches
from hotlora.server.engine.prompt_heads import PromptHeads
from hotlora.server.engine.sampling import SamplingParams
from hotlora.server.engine.tokens import RowDetokenizers, TokenPiece, TokenPieces


class NonFiniteLogits(HotloraError):
    """The model computed NaN or infinite logits for a row; it stops, the others go on."""

    code = "non_finite_logits"

    def __init__(self) -> None:
        super().__init__(
            "The model produced non-finite values (NaN or infinity) for this request; "
            "generation was stopped."
        )


@dataclass
class GenerationJob:
    """One sequence to generate, with the request's own adapter set (empty: the base alone)."""

    prompt: list[int]
    params: SamplingParams
    adapters: AdapterSet = BASE_ONLY
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set while its reader takes none of its tokens: its row waits out of the batch.
    paused: threading.Event = field(default_factory=threading.Event)
    grammar: Grammar | None = None  # what the answer must follow (`response_format`); None: free
    # Who may share its cached prompt: its tenant's and its request's salt (`cache_scope`).
    cache_scope: tuple[str, ...] = ()


@dataclass(frozen=True)
class SampledToken:
    """A generated token with its log-probability and the `top` most likely alternatives."""

    token: TokenPiece
    logprob: float
    top: tuple[tuple[TokenPiece, float], ...]
    # What it adds to the answer's text, in characters, which its row counts: those its bytes
    # complete after the tokens before it (0 for the first part of a character split over
    # tokens, which its last part adds; 0 for a control token that adds no text).
    width: int = 0


@dataclass(frozen=True)
class RankedLogprob:
    """A token's log-probability at one prompt position, and its rank there (1: most likely)."""

    token_id: int
    logprob: float
    rank: int
    text: str
    label: str  # as OpenAI's legacy completions name it (`TokenPiece.legacy_label`)


# One entry per prompt token: the token itself, then the most likely alternatives; the first
# token has none (nothing predicts it).
PromptLogprobs = tuple[tuple[RankedLogprob, ...] | None, ...]


@dataclass(frozen=True)
class Delta:
    """Text that is safe to show, with the tokens that produced it."""

    text: str
    logprobs: tuple[SampledToken, ...] = ()
    generated: int = 0  # the choice's tokens so far, this delta's included
    # Once, before its first token, for a job that asked for them: its prompt's log-probabilities.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class Finished:
    """The end of a job: why it stopped, and its token counts."""

    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_logprobs: PromptLogprobs | None = None


Event = Delta | Finished


def prompt_cache_key(base_id: str, job: GenerationJob) -> tuple[str, ...]:
    """The namespace of a cached prompt: the base model, the ordered adapter revisions, then the
    job's cache scope (no revision reads as one of its `tenant:` or `salt:` parts)."""
    return (base_id, *job.adapters.key, *job.cache_scope)


def cache_scope(tenant: str | None, salt: str | None) -> tuple[str, ...]:
    """A job's cache scope: its tenant's (None: a server without keys, one tenant) and its
    request's `cache_salt`. Jobs of other scopes never read each other's cached prompts, so
    neither a tenant nor a request of another salt learns what they held from `cached_tokens`
    or a first token's time."""
    return (*((f"tenant:{tenant}",) if tenant else ()), *((f"salt:{salt}",) if salt else ()))


def cached_length(cache: LRUPromptCache, key: tuple[str, ...], prompt: list[int]) -> int:
    """How many of `prompt`'s tokens `cache.fetch_nearest_cache` would give under `key`, by a
    look that copies nothing (the search of the trie it fetches from)."""
    trie = getattr(cache, "_trie", None)
    if trie is None:  # an mlx-lm without it: nothing known in advance
        return 0

    def trimmable(tokens: list[int]) -> bool:  # a cache it must cut back
        return bool(can_trim_prompt_cache(trie.get(found.model, tokens).prompt_cache))

    found = trie.search(key, prompt)
    if found.exact is not None:
        return len(prompt) if trimmable(found.exact) else 0
    shorter = len(found.shorter) if found.shorter is not None else 0
    longer = 0
    if found.longer is not None and found.common_prefix > shorter and trimmable(found.longer):
        longer = min(len(prompt) - 1, found.common_prefix)
    return max(shorter, longer)


class Engine:
    """Owns the model, its tokenizer, the prompt cache and the prompt heads (both kept per base
    + adapter revisions)."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        base_id: str,
        prompt_cache_size: int = 8,
        prompt_cache_bytes: int = 1 << 30,
        prompt_heads: int = 64,
        prompt_heads_bytes: int = 256 << 20,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.base_id = base_id
        self.pieces = TokenPieces(self.tokenizer)
        self.detokenizers = RowDetokenizers(self.tokenizer)
        self.prompt_cache = LRUPromptCache(max_size=prompt_cache_size, max_bytes=prompt_cache_bytes)
        # No prompt cache, no heads either: `prompt_cache_size=0` turns prompt caching off.
        heads = prompt_heads if prompt_cache_size else 0
        self.prompt_heads = PromptHeads(heads, prompt_heads_bytes)
        self.kv_bytes_per_token = _kv_bytes_per_token(self.model)
        self.special_ids = _special_ids(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.pieces, self.special_ids)

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.config.get("vocab_size") or len(self.tokenizer))

    def logprob(self, token: int, logprobs: mx.array, k: int) -> SampledToken:
        """`token`'s log-probability and the `k` most likely alternatives; `logprobs`: [vocab]."""
        top: tuple[tuple[TokenPiece, float], ...] = ()
        if k > 0:
            ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            id_list = cast(list[int], ids.tolist())
            values = cast(list[float], logprobs[ids].tolist())
            pairs = sorted(zip(id_list, values, strict=True), key=lambda p: -p[1])
            top = tuple((self.pieces(i), _finite(v)) for i, v in pairs)
        chosen = cast(float, logprobs[token].item())
        return SampledToken(self.pieces(token), _finite(chosen), top)

    def prompt_logprobs(
        self, targets: list[int], logits: mx.array, k: int
    ) -> list[tuple[RankedLogprob, ...]]:
        """Each target token's log-probability, rank and the `k` most likely alternatives, from
        the logits [len(targets), vocab] of the positions before them."""
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)  # [n, vocab]
        chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)  # [n, 1]
        ranks = (logprobs > chosen).sum(axis=-1) + 1  # [n]
        top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k] if k > 0 else None  # [n, k]
        values = mx.take_along_axis(logprobs, top, axis=-1) if top is not None else None
        mx.eval(chosen, ranks, *(a for a in (top, values) if a is not None))
        chosen_list = cast(list[list[float]], chosen.tolist())
        rank_list = cast(list[int], ranks.tolist())
        top_ids = cast(list[list[int]], top.tolist()) if top is not None else [[]] * len(targets)
        top_lps = cast(list[list[float]], values.tolist()) if values is not None else top_ids
        out = []
        for i, token in enumerate(targets):
            entry = {token: (_finite(chosen_list[i][0]), rank_list[i])}
            ranked = sorted(zip(top_ids[i], top_lps[i], strict=True), key=lambda p: -p[1])
            for rank, (other, value) in enumerate(ranked, start=1):
                entry.setdefault(other, (_finite(value), rank))
            out.append(
                tuple(
                    RankedLogprob(t, value, rank, piece.text, piece.legacy_label)
                    for t, (value, rank) in entry.items()
                    for piece in [self.pieces(t)]
                )
            )
        return out


# OpenAI's log-probability for a token that cannot be sampled; JSON has no -Infinity.
IMPOSSIBLE_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else IMPOSSIBLE_LOGPROB


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """Control tokens (`<|endoftext|>`, `<|im_start|>`, ...): generated, they add no text."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


def _kv_bytes_per_token(model: nn.Module) -> int:
    """The KV cache bytes one token takes across every layer, measured on a one-token call."""
    cache = new_caches(model)
    model(mx.array([[0]]), cache=cache)
    total = 0
    for layer in cache:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            mx.eval(keys, values)
            total += (keys.nbytes + values.nbytes) // keys.shape[2]  # allocated in steps
    return max(total, 1)
