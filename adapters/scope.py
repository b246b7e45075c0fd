"""Which adapters the request being served may name: its key's scope, in the context.

The server sets a scope for each request whose key limits it (`use_scope`); `parse_selection`
refuses what lies outside it exactly as it refuses an id that is not mounted, so an adapter
outside the scope is never selected, never mounted on first use, and never named by an error:
`visible` filters every list of ids an error shows. Outside a request, or for a key with every
right, the scope is `EVERYTHING`.

Where the server keeps its files is for an admin key: a request held to a narrower key is given
the adapter root to leave out (`use_scope(..., hidden_root=)`), and `shown_path` writes a path
under it as a mount names it (`acme/b`, relative to the root) in what that request is answered,
errors included.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from pathlib import Path
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


@dataclass(frozen=True)
class _Held:
    scope: AdapterScope
    hidden_root: str | None  # the adapter root, absolute, where its path is not to be shown


_OUTSIDE = _Held(EVERYTHING, None)  # frozen: shared as the default safely
_current: ContextVar[_Held] = ContextVar("hotlora_adapter_scope", default=_OUTSIDE)  # noqa: B039


def use_scope(scope: AdapterScope, *, hidden_root: Path | None = None) -> Token[_Held]:
    """Make `scope` the one this context's requests are held to, and `hidden_root` (absolute)
    the folder whose path they are not shown; `reset_scope(token)` after."""
    shown_whole = hidden_root is None or hidden_root.parent == hidden_root  # `/` hides nothing
    hidden = None if shown_whole else str(hidden_root)
    return _current.set(_Held(scope, hidden))


def reset_scope(token: Token[_Held]) -> None:
    _current.reset(token)


def current_scope() -> AdapterScope:
    """The scope of the request served in this context (`EVERYTHING` outside a request)."""
    return _current.get().scope


def shown_path(text: str) -> str:
    """`text` (a path, or a message naming paths) as the request served in this context may see
    it: a path under a hidden adapter root relative to it, the root itself "the adapter root"."""
    root = _current.get().hidden_root
    if root is None:
        return text
    # The root's path where a path of its own ends (not `/srv/adapters2` for `/srv/adapters`).
    inside = re.compile(re.escape(root) + r"(?:(" + re.escape(os.sep) + r")|(?![\w-]|\.[\w-]))")
    return inside.sub(lambda found: "" if found.group(1) else "the adapter root", text)


def visible(adapter_ids: Iterable[str]) -> list[str]:
    """Those of `adapter_ids` the current scope may use, in their order."""
    scope = current_scope()
    return [adapter_id for adapter_id in adapter_ids if scope.may_use(adapter_id)]
