"""The one base for every problem this project reports, and the request errors shared by packages.

An error carries what a client is told (`message`, `param`, `code`); how it travels (HTTP
status, OpenAI error type, headers) is decided once, by the server, from its class.
"""

from __future__ import annotations


class HotloraError(Exception):
    """Base for every problem a caller can be told about, raised where it is found."""

    code: str | None = None
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(HotloraError):
    """A request that is well-formed JSON but asks for something that cannot be done."""

    code = "invalid_value"


class ModelNotFound(HotloraError):
    """A request names a model that is neither the base nor a mounted adapter."""

    code = "model_not_found"
    param = "model"

    def __init__(self, model: str, available: list[str]):
        names = listed(available)
        super().__init__(f"The model '{model}' does not exist. Available models: {names}.")


# An error names at most this many ids: a server may hold thousands of adapters.
LISTED = 20


def listed(names: list[str]) -> str:
    """`names` for an error message, comma-separated: the first `LISTED`, then how many more."""
    if not names:
        return "none"
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more
