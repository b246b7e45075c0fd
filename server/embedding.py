"""Embeddings: the mean of a model's final hidden states over an input's tokens, L2-normalised.

The served model is a chat model, not one trained for embeddings: its vectors rank similar
texts close, but less well than a model made for retrieval. An input runs on the generation
thread in chunks that cost what one prefill step may (its KV cache carried between them), each
between two decode steps, so a long input holds running streams back as a long prompt does; the
request's adapter set applies as on chat.
"""

from __future__ import annotations

import base64
from typing import Any

import mlx.core as mx
import numpy as np

from hotlora.adapters import AdapterSet, activate
from hotlora.config.errors import InvalidRequest
from hotlora.models.cpu.attention import parts_of
from hotlora.server.api.token_requests import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from hotlora.server.engine.kv_caches import new_caches
from hotlora.server.http.request_errors import ContextOverflow
from hotlora.server.serving import InferenceService
from hotlora.server.telemetry.access_log import current_record


class EmbeddingService:
    """Pooled hidden states of the base model or of an adapter set, per input."""

    def __init__(self, inference: InferenceService):
        self.inference = inference
        model = inference.engine.model
        # mlx-lm's models keep the transformer without its head as `model`; its output is the
        # final norm's.
        self.model = model
        self.body: Any = getattr(model, "model", None)
        self.dimensions = int(inference.engine.loaded.config.get("hidden_size") or 0)
        # Chunks cost what a prompt's prefill step may spend: fewer tokens deeper in.
        self.prefill_cost = inference.worker.scheduler.prefill

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """One vector per input, in input order."""
        inference = self.inference
        if self.body is None:
            raise InvalidRequest("This model's architecture gives no hidden states to pool.")
        if request.dimensions is not None and request.dimensions != self.dimensions:
            raise InvalidRequest(
                f"dimensions is not supported: this model's embeddings have {self.dimensions} "
                "dimensions, and cutting them short is not something it was trained for.",
                param="dimensions",
            )
        inputs = request.inputs
        token_lists = await inference.off_loop(
            lambda: [inference.tokens(item, "input") for item in inputs]
        )
        context = inference.engine.context_length
        for tokens in token_lists:
            if len(tokens) > context:
                raise ContextOverflow(
                    f"This model's maximum context length is {context} tokens, but an input has "
                    f"{len(tokens)} tokens.",
                    param="input",
                )
        # Select last: the lease it takes is released whatever happens next.
        lease = await inference.lease(request.model, request.adapter, queued=False)
        record = current_record()  # the access line, and the tenant's usage and token limit
        if record is not None:
            record.model, record.adapters = lease.model, lease.adapters.ids
            record.prompt_tokens = 0
        vectors, used = [], 0
        try:
            for tokens in token_lists:
                vectors.append(await self._pool(tokens, lease.adapters))
                used += len(tokens)
                if record is not None:  # counted as it is pooled, whether the client stays or not
                    record.prompt_tokens = used
        finally:
            lease.release()
        data = [
            Embedding(embedding=_encoded(vector, request.encoding_format), index=i)
            for i, vector in enumerate(vectors)
        ]
        self.inference.metrics.embedded(lease.adapters.ids, prompt_tokens=used)
        return EmbeddingResponse(
            data=data,
            model=lease.model,
            usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used),
        )

    async def _pool(self, tokens: list[int], adapters: AdapterSet) -> np.ndarray:
        """One input's vector, its chunks run on the generation thread one call at a time."""
        pooled = _Pooled(self.model, self.body, adapters)
        cost, start = self.prefill_cost, 0
        while start < len(tokens):
            size = max(1, cost.tokens_within(cost.budget, start, len(tokens) - start))
            piece, start = tokens[start : start + size], start + size
            await self.inference.worker.call(lambda piece=piece: pooled.add(piece))
        return await self.inference.worker.call(pooled.vector)


class _Pooled:
    """The running sum of one input's final hidden states, chunk by chunk; built and read on
    the generation thread (MLX arrays belong to the thread that makes them)."""

    def __init__(self, model: Any, body: Any, adapters: AdapterSet):
        self.model = model  # whose caches the body's layers take (sliding windows included)
        self.body = body
        self.adapters = adapters
        self.cache: list[Any] | None = None
        self.total: mx.array | None = None  # [hidden]
        self.count = 0

    def add(self, tokens: list[int]) -> None:
        if self.cache is None:
            self.cache = new_caches(self.model)
        # As a call of the whole model runs: the attention kernel where it takes every call.
        with activate(self.adapters), parts_of(self.model):
            hidden = self.body(mx.array([tokens]), cache=self.cache)  # [1, tokens, hidden]
        states = hidden[0].astype(mx.float32)  # [tokens, hidden]
        if self.total is not None:
            states = mx.concatenate([self.total[None], states])
        # A running sum, token after token (a scan adds in order): the same bits in any chunking.
        self.total = mx.cumsum(states, axis=0)[-1]
        self.count += len(tokens)
        mx.eval(self.total)

    def vector(self) -> np.ndarray:
        assert self.total is not None
        mean = self.total / self.count
        unit = mean / mx.maximum(mx.linalg.norm(mean), 1e-12)
        mx.eval(unit)
        return np.array(unit, dtype=np.float32)


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """As OpenAI sends it: floats, or base64 of little-endian float32s."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]
