"""Which base-plus-adapters a request is served with, from its `model` and `adapter` fields.

`model` may name the base (`adapter` then selects), a mounted adapter id, or
`"<base-id>:<spec>"`; the response's `model` echoes what was served.
"""

from __future__ import annotations

import contextlib

from hotlora.adapters import InvalidAdapterSpec
from hotlora.adapters.manager import AdapterManager
from hotlora.adapters.spec import AdapterRef, parse_adapter_spec
from hotlora.config.errors import InvalidRequest, ModelNotFound
from hotlora.server.serving import Target


class TargetResolver:
    """Resolves a request into a leased, request-owned adapter set over the one base model."""

    def __init__(self, base_id: str, manager: AdapterManager):
        self.base_id = base_id
        self.manager = manager

    def __call__(self, model: str, refs: tuple[AdapterRef, ...]) -> Target:
        spec = self._spec(model, refs)
        active = self.manager.resolve(spec)
        lease = contextlib.ExitStack()
        lease.enter_context(self.manager.lease(active))
        if model != self.base_id:
            label = model
        else:
            label = f"{self.base_id}:{_spelling(spec)}" if spec else self.base_id
        return Target(label, active if active else None, lease.close)

    def _spec(self, model: str, refs: tuple[AdapterRef, ...]) -> tuple[AdapterRef, ...]:
        if model == self.base_id:
            return refs
        prefix = f"{self.base_id}:"
        if model.startswith(prefix):
            named = self._parse(model[len(prefix) :])
        elif model in self.manager:
            named = (AdapterRef(model),)
        else:
            names = [self.base_id, *(info.id for info in self.manager.list())]
            raise ModelNotFound(model, names)
        if refs:
            raise InvalidRequest(
                f"'model' already selects adapters ({model!r}); leave 'adapter' out, or set "
                f"'model' to the base model '{self.base_id}'.",
                param="adapter",
            )
        return named

    @staticmethod
    def _parse(spec: str) -> tuple[AdapterRef, ...]:
        try:
            return parse_adapter_spec(spec)
        except InvalidAdapterSpec as exc:
            raise InvalidRequest(str(exc), param="model") from exc


def _spelling(refs: tuple[AdapterRef, ...]) -> str:
    """The spec as a request would write it, weights included: 'sft@0.5+dpo'."""
    return "+".join(ref.id if ref.weight == 1.0 else f"{ref.id}@{ref.weight:g}" for ref in refs)
