"""Generation as plain steps on one loaded model: prefill (with prompt-cache reuse), then decode.

A job goes in (prompt, sampling parameters, the request's adapter set); text deltas and one
`Finished` come out. Everything here runs on the generation worker's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from hotlora.adapters import BASE_ONLY, AdapterSet, activate
from hotlora.models.loader import LoadedModel
from hotlora.server.engine.sampling import (
    SamplingParams,
    build_logits_processors,
    build_sampler,
)
from hotlora.server.engine.stops import StopMatcher
from hotlora.server.engine.tokens import TokenPiece, TokenPieces


@dataclass
class GenerationJob:
    """One sequence to generate, with the request's own adapter set (empty: the base alone)."""

    prompt: list[int]
    params: SamplingParams
    adapters: AdapterSet = BASE_ONLY
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class SampledToken:
    """A generated token with its log-probability and the `top` most likely alternatives."""

    token: TokenPiece
    logprob: float
    top: tuple[tuple[TokenPiece, float], ...]


@dataclass(frozen=True)
class Delta:
    """Text that is safe to show, with the tokens that produced it."""

    text: str
    logprobs: tuple[SampledToken, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The end of a job: why it stopped, and its token counts."""

    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


Event = Delta | Finished
# One cache per layer (mlx-lm's KVCache, RotatingKVCache, ...), as `make_prompt_cache` builds.
LayerCaches = list[Any]


def prompt_cache_key(base_id: str, adapters: AdapterSet) -> tuple[str, ...]:
    """The namespace of a cached prompt: the base model, then the ordered adapter revisions."""
    return (base_id, *adapters.key)


class Engine:
    """Owns the model, its tokenizer and the prompt cache; serves one job at a time."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        base_id: str,
        prompt_cache_size: int = 8,
        prompt_cache_bytes: int = 1 << 30,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.base_id = base_id
        self.pieces = TokenPieces(self.tokenizer)
        self.prompt_cache = LRUPromptCache(max_size=prompt_cache_size, max_bytes=prompt_cache_bytes)

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.config.get("vocab_size") or len(self.tokenizer))

    def generate(self, job: GenerationJob) -> Iterator[Event]:
        """Run one job to completion, yielding text deltas then one `Finished`."""
        params = job.params
        key = prompt_cache_key(self.base_id, job.adapters)
        cache, rest = self._prefill_cache(key, job.prompt)
        cached = len(job.prompt) - len(rest)
        if params.seed is not None:
            mx.random.seed(params.seed % 2**64)  # MLX seeds are unsigned 64-bit
        detokenizer = self.tokenizer.detokenizer  # a fresh, reset copy per call
        stops = StopMatcher(list(params.stop))
        eos = set(self.tokenizer.eos_token_ids)
        tokens = list(job.prompt)
        generated = 0
        reason = "length"
        with activate(job.adapters):
            steps = generate_step(
                mx.array(rest),
                self.model,
                max_tokens=params.max_tokens,
                sampler=build_sampler(params),
                logits_processors=build_logits_processors(params),
                prompt_cache=cache,
            )
            for step_token, logprobs in steps:
                token = int(step_token)  # generate_step yields Python ints despite its annotation
                tokens.append(token)  # fed to the cache already, eos included
                if token in eos:
                    reason = "stop"
                    break
                generated += 1
                detokenizer.add_token(token)
                text = stops.feed(detokenizer.last_segment)
                info = (
                    (self._logprob(token, logprobs, params.top_logprobs),)
                    if params.logprobs
                    else ()
                )
                if text or info:
                    yield Delta(text, info)
                if stops.stopped:
                    reason = "stop"
                    break
                if job.cancelled.is_set():
                    reason = "cancelled"
                    break
        detokenizer.finalize()
        tail = stops.feed(detokenizer.last_segment) + stops.flush()
        if tail:
            yield Delta(tail)
        self._store_cache(key, tokens, cache)
        yield Finished(reason, len(job.prompt), generated, cached)

    def _prefill_cache(
        self, key: tuple[str, ...], prompt: list[int]
    ) -> tuple[LayerCaches, list[int]]:
        """The nearest cached prefix of `prompt` under `key`, and the tokens still to process."""
        cache, rest = self.prompt_cache.fetch_nearest_cache(key, prompt)
        if cache is None:
            return make_prompt_cache(self.model), prompt
        if not rest:
            # The whole prompt is cached; re-run its last token to get the first logits.
            if not can_trim_prompt_cache(cache):
                return make_prompt_cache(self.model), prompt
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        return cache, rest

    def _store_cache(self, key: tuple[str, ...], tokens: list[int], cache: LayerCaches) -> None:
        offset = getattr(cache[0], "offset", None) if cache else None
        if isinstance(offset, int) and 0 < offset <= len(tokens):
            self.prompt_cache.insert_cache(key, tokens[:offset], cache)

    def _logprob(self, token: int, logprobs: mx.array, k: int) -> SampledToken:
        # logprobs: [vocab], already log-softmaxed by generate_step.
        top: tuple[tuple[TokenPiece, float], ...] = ()
        if k > 0:
            ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            id_list = cast(list[int], ids.tolist())
            values = cast(list[float], logprobs[ids].tolist())
            pairs = sorted(zip(id_list, values, strict=True), key=lambda p: -p[1])
            top = tuple((self.pieces(i), v) for i, v in pairs)
        chosen = cast(float, logprobs[token].item())
        return SampledToken(self.pieces(token), chosen, top)
