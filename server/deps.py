"""Typed dependencies: routes get their services from the app's runtime, never from globals."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from hotlora.server.embedding import EmbeddingService
from hotlora.server.runtime import Runtime
from hotlora.server.serving import InferenceService
from hotlora.server.telemetry.prometheus import Metrics
from hotlora.server.tokenizing import TokenizingService


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def get_inference(runtime: Annotated[Runtime, Depends(get_runtime)]) -> InferenceService:
    return runtime.require_inference()


def get_tokenizing(runtime: Annotated[Runtime, Depends(get_runtime)]) -> TokenizingService:
    return runtime.require_tokenizing()


def get_embeddings(runtime: Annotated[Runtime, Depends(get_runtime)]) -> EmbeddingService:
    return runtime.require_embeddings()


def get_metrics(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Metrics:
    return runtime.metrics


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
InferenceDep = Annotated[InferenceService, Depends(get_inference)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
TokenizingDep = Annotated[TokenizingService, Depends(get_tokenizing)]
EmbeddingsDep = Annotated[EmbeddingService, Depends(get_embeddings)]
