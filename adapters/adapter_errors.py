"""Adapter exceptions, raised where the problem is found; the server decides their HTTP status."""

from __future__ import annotations

from collections.abc import Iterable

from hotlora.adapters.scope import visible
from hotlora.config.errors import HotloraError, listed
from hotlora.config.log_text import clipped


class AdapterError(HotloraError):
    """Base for every adapter problem a client can be told about."""

    code = "invalid_adapter"


class InvalidAdapter(AdapterError):
    """The adapter's id, files or tensors do not fit this base model; nothing was mounted.

    A problem with the files is one with the `path` that names them; a bad id says `param="id"`.
    """

    param = "path"


class AdapterPathMissing(InvalidAdapter):
    """Nothing at the adapter path: no directory, no file."""


class AdapterPathRefused(AdapterError):
    """The adapter path resolves outside the configured adapter root."""

    code = "adapter_path_refused"
    param = "path"


class AdapterConflict(AdapterError):
    """An adapter with this id is mounted from other files; mount with `replace` to swap it."""

    code = "adapter_conflict"
    param = "id"


class AdapterNotFound(AdapterError):
    """A request or admin call names an adapter that is not mounted (or not in its key's scope:
    the same error, listing only the mounted ids the scope may use)."""

    code = "adapter_not_found"
    param = "adapter"

    def __init__(self, adapter_id: str, mounted: Iterable[str], *, param: str = "adapter"):
        names = listed(sorted(visible(mounted)))
        # An id from a URL has passed no length check: one past the ids' 64 characters
        # (spec.MAX_ID_LENGTH) is cut, as a body's are.
        shown = clipped(adapter_id, 64, keep=16)
        super().__init__(
            f"The adapter '{shown}' is not mounted. Mounted adapters: {names}.", param=param
        )
        self.adapter_id = adapter_id


class InvalidAdapterSpec(AdapterError, ValueError):
    """A request's `adapter` field cannot be parsed.

    Also a `ValueError`, so a pydantic validator that raises it yields a validation error.
    """

    code = "invalid_adapter_spec"
    param = "adapter"


class AdapterOverBudget(AdapterError):
    """The adapter can never fit this server's budget on mounted adapters; nothing was mounted."""

    code = "adapter_over_budget"
    param = "path"
