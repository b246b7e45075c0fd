"""Typed dependencies: routes get their services from the app's runtime, never from globals."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from hotlora.server.runtime import Runtime
from hotlora.server.serving import InferenceService


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def get_inference(runtime: Annotated[Runtime, Depends(get_runtime)]) -> InferenceService:
    return runtime.require_inference()


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
InferenceDep = Annotated[InferenceService, Depends(get_inference)]
