"""Server-side reasons to refuse a request; `error_responses` turns them into HTTP."""

from __future__ import annotations

from hotlora.config.errors import HotloraError, InvalidRequest


class ContextOverflow(InvalidRequest):
    """The prompt plus `max_tokens` does not fit the model's context."""

    code = "context_length_exceeded"


class NotReady(HotloraError):
    """The model is still loading or warming up (or failed to)."""

    code = "model_not_ready"


class ClientDisconnected(HotloraError):
    """The client left before its response was ready; the answer goes nowhere."""


class RequestTimeout(HotloraError):
    """The client did not send its whole request in time; the connection is closed after."""

    code = "request_timeout"


class LoraPathNotFound(HotloraError):
    """vLLM's `/v1/load_lora_adapter` names a path with nothing there: vLLM's 404 (the admin
    API's mount answers 400 `invalid_adapter`)."""

    code = "adapter_path_not_found"
    param = "lora_path"


class Unauthorized(HotloraError):
    """A missing or wrong bearer key."""

    code = "invalid_api_key"


class Forbidden(HotloraError):
    """A valid key used where its tenant may not go: an inference key on the admin API."""

    code = "permission_denied"
