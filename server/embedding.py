"""Embeddings: the mean of a model's final hidden states over an input's tokens, L2-normalised.

The served model is a chat model, not one trained for embeddings: its vectors rank similar
texts close, but less well than a model made for retrieval. The pooling runs on the generation
thread between two decode steps, with the request's adapter set applied as on chat.
"""

from __future__ import annotations

import base64
from typing import Any

import mlx.core as mx
import numpy as np

from hotlora.adapters import AdapterSet, activate
from hotlora.config.errors import InvalidRequest
from hotlora.server.api.token_requests import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from hotlora.server.http.request_errors import ContextOverflow
from hotlora.server.serving import InferenceService


class EmbeddingService:
    """Pooled hidden states of the base model or of an adapter set, per input."""

    def __init__(self, inference: InferenceService):
        self.inference = inference
        model = inference.engine.model
        # mlx-lm's models keep the transformer without its head as `model`; its output is the
        # final norm's.
        self.body: Any = getattr(model, "model", None)
        self.dimensions = int(inference.engine.loaded.config.get("hidden_size") or 0)

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
        lease = inference.adapters.select(request.model, request.adapter)
        try:
            vectors = await inference.worker.call(lambda: self._pool(token_lists, lease.adapters))
        finally:
            lease.release()
        data = [
            Embedding(embedding=_encoded(vector, request.encoding_format), index=i)
            for i, vector in enumerate(vectors)
        ]
        used = sum(len(tokens) for tokens in token_lists)
        return EmbeddingResponse(
            data=data,
            model=lease.model,
            usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used),
        )

    def _pool(self, token_lists: list[list[int]], adapters: AdapterSet) -> list[np.ndarray]:
        """Each input's vector (on the generation thread)."""
        vectors = []
        with activate(adapters):
            for tokens in token_lists:
                hidden = self.body(mx.array([tokens]))  # [1, tokens, hidden]
                mean = hidden[0].astype(mx.float32).mean(axis=0)  # [hidden]
                unit = mean / mx.maximum(mx.linalg.norm(mean), 1e-12)
                mx.eval(unit)
                vectors.append(np.array(unit, dtype=np.float32))
        return vectors


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """As OpenAI sends it: floats, or base64 of little-endian float32s."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]
