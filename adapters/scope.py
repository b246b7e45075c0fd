"""Which adapters the request being served may name: its key's scope, in the context.

The server sets a scope for each request whose key limits it (`use_scope`); `parse_selection`
refuses what lies outside it exactly as it refuses an id that is not mounted, so an adapter
outside the scope is never selected, never mounted on first use, and never named by an error:
`visible` filters every list of ids an error shows. Outside a request, or for a key with every
right, the scope is `EVERYTHING`.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar, Token
from typing import Protocol


class AdapterScope(Protocol):
    """What a key may run: adapters by id, and the base model alone."""

    @property
    def may_use_base(self) -> bool: ...

    def may_use(self, adapter_id: str) -> bool: ...


class _Everything:
    """The scope of a server without keys, and of a key with every right."""

    may_use_base = True

    def may_use(self, adapter_id: str) -> bool:
        return True


EVERYTHING: AdapterScope = _Everything()

_current: ContextVar[AdapterScope] = ContextVar("hotlora_adapter_scope", default=EVERYTHING)


def use_scope(scope: AdapterScope) -> Token[AdapterScope]:
    """Make `scope` the one this context's requests are held to; `reset_scope(token)` after."""
    return _current.set(scope)


def reset_scope(token: Token[AdapterScope]) -> None:
    _current.reset(token)


def current_scope() -> AdapterScope:
    """The scope of the request served in this context (`EVERYTHING` outside a request)."""
    return _current.get()


def visible(adapter_ids: Iterable[str]) -> list[str]:
    """Those of `adapter_ids` the current scope may use, in their order."""
    scope = current_scope()
    return [adapter_id for adapter_id in adapter_ids if scope.may_use(adapter_id)]
