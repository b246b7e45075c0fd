"""The request-side adapter selection: ids, weights and the `adapter` field's syntax.

Accepted forms (all parse to a tuple of `AdapterRef`, in the order given, which is the order
the residuals are summed):

- `None`, `""`, `"none"` (any case), `[]`: the base model alone.
- `"sft"`, `"sft+dpo"`, `"sft,dpo"`: one or more mounted ids.
- `"sft@0.5+dpo"`: a per-request weight multiplying that adapter's own scale.
- `[{"id": "sft", "scale": 0.5}, {"id": "dpo"}]` or `["sft@0.5", "dpo"]`: the list form.

An id may appear only once per request: `"sft+sft"` is refused rather than silently summed,
since the caller can say `"sft@2"` if that is what they mean.

`parse_selection` adds the `model` field: the base's id, a mounted adapter's id, or
`"<base-id>:<spec>"`. The adapter manager and the Ray ingress both read a request with it.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from hotlora.adapters.adapter_errors import AdapterNotFound, InvalidAdapterSpec
from hotlora.adapters.scope import current_scope, visible
from hotlora.config.errors import InvalidRequest, ModelNotFound
from hotlora.config.log_text import clipped

MAX_ADAPTERS_PER_REQUEST = 16
MAX_ID_LENGTH = 64
# A request's weight multiplies the adapter's trained scale; beyond this it only breaks the model
# (and in half precision overflows the logits).
MAX_WEIGHT = 10.0
RESERVED_IDS = frozenset({"none"})
# URLs drop these as path segments ("/v1/adapters/.." is "/v1"): no route could name them.
DOT_SEGMENTS = frozenset({".", ".."})

_ID = re.compile(r"[A-Za-z0-9._-]+")


def _any_case(word: str) -> str:
    return "".join(f"[{c.upper()}{c.lower()}]" for c in word)


# The rules above as JSON Schema, for the API's document (the base model's id, known only at run
# time, aside); `adapter_id_problem` enforces them.
ADAPTER_ID_SCHEMA: dict[str, Any] = {
    "minLength": 1,
    "maxLength": MAX_ID_LENGTH,
    "pattern": f"^{_ID.pattern}$",
    "not": {
        "anyOf": [
            {"enum": sorted(DOT_SEGMENTS)},
            # Any case; written out, since not every regex dialect has `(?i)`.
            *({"pattern": f"^{_any_case(word)}$"} for word in sorted(RESERVED_IDS)),
        ]
    },
}
_SEPARATOR = re.compile(r"[+,]")
# A weight as JSON writes a number (a leading '+' or '.' aside): ASCII digits only, where Python's
# float() also reads "1_0" and other scripts' digits.
_WEIGHT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class AdapterRef:
    """One adapter named by a request, with its per-request weight."""

    id: str
    weight: float = 1.0


def adapter_id_problem(value: object) -> str | None:
    """Why `value` cannot be an adapter id, or None when it can."""
    if not isinstance(value, str):
        return f"an adapter id must be a string, not {type(value).__name__}"
    if not value:
        return "an adapter id must not be empty"
    if len(value) > MAX_ID_LENGTH:
        return f"adapter id '{clipped(value, 16)}' is longer than {MAX_ID_LENGTH} characters"
    if not _ID.fullmatch(value):
        return (
            f"adapter id {value!r} may only contain letters, digits, '.', '_' and '-' "
            "(no '+', ',', '@' or whitespace)"
        )
    if value.lower() in RESERVED_IDS:
        return f"'{value}' is reserved: it selects the base model alone"
    if value in DOT_SEGMENTS:
        return f"adapter id '{value}' is a path segment that URLs drop: no route could name it"
    return None


def parse_adapter_spec(value: str | list[Any] | tuple[Any, ...] | None) -> tuple[AdapterRef, ...]:
    """Parse a request's `adapter` field; raise `InvalidAdapterSpec` on anything malformed."""
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip()
        if not text or text.lower() in RESERVED_IDS:
            return ()
        refs = [_parse_item(part) for part in _SEPARATOR.split(text)]
    elif isinstance(value, (list, tuple)):
        refs = [_parse_entry(entry) for entry in value]
    else:
        raise InvalidAdapterSpec(
            f"adapter must be a string like 'sft+dpo' or a list of {{'id', 'scale'}} objects, "
            f"not {type(value).__name__}"
        )
    return _checked(refs)


def parse_selection(
    base_id: str, model: str, refs: tuple[AdapterRef, ...], mounted: Collection[str]
) -> tuple[AdapterRef, ...]:
    """The adapters a request's `model` and parsed `adapter` field (`refs`) select together.

    `model` may name the base (then `refs` are the selection), an id in `mounted`, or
    `"<base-id>:<spec>"`. Raises `ModelNotFound` for any other model (listing the base and
    `mounted`, in their order), and `InvalidRequest` when the model's spec is malformed
    (`param="model"`) or both fields select adapters (`param="adapter"`). Whether the ids
    are mounted is the caller's to check (`selecting_field` says which field named them).

    The request's key scope (`scope.current_scope`) is checked here, before anything is
    looked up or loaded: an id outside it is refused as one that is not mounted would be
    (`AdapterNotFound`; `ModelNotFound` as the `model`), the base alone as an unknown model,
    and the errors list only what the scope may use.
    """
    scope = current_scope()
    if model == base_id:
        return _in_scope(base_id, model, refs, mounted)
    prefix = f"{base_id}:"
    if model.startswith(prefix):
        try:
            named = parse_adapter_spec(model[len(prefix) :])
        except InvalidAdapterSpec as exc:
            raise InvalidRequest(exc.message, param="model") from exc
        named = _in_scope(base_id, model, named, mounted, param="model")
    elif scope.may_use(model) and model in mounted:
        named = (AdapterRef(model),)
    else:
        raise _model_not_found(base_id, model, mounted)
    if refs:
        raise InvalidRequest(
            f"'model' already selects adapters ({model!r}); leave 'adapter' out, or set "
            f"'model' to the base model '{base_id}'.",
            param="adapter",
        )
    return named


def selecting_field(refs: tuple[AdapterRef, ...]) -> str:
    """The request field that named the adapters `parse_selection` returned for these parsed
    `adapter` field's `refs`: the `adapter` field where it named any, else `model`."""
    return "adapter" if refs else "model"


def _in_scope(
    base_id: str,
    model: str,
    refs: tuple[AdapterRef, ...],
    mounted: Collection[str],
    param: str = "adapter",
) -> tuple[AdapterRef, ...]:
    """`refs`, when the current scope may run them (the base alone, when they are none or all at
    weight 0); `param` is the field that named them."""
    scope = current_scope()
    # Adapters all at weight 0 add nothing: the base alone, whatever they are.
    if not scope.may_use_base and all(ref.weight == 0 for ref in refs):
        raise _model_not_found(base_id, model, mounted)
    for ref in refs:
        if not scope.may_use(ref.id):
            raise AdapterNotFound(ref.id, mounted, param=param)
    return refs


def _model_not_found(base_id: str, model: str, mounted: Collection[str]) -> ModelNotFound:
    base = [base_id] if current_scope().may_use_base else []
    return ModelNotFound(model, [*base, *visible(mounted)])


def format_adapter_spec(refs: tuple[AdapterRef, ...]) -> str:
    """The spec as a request would write it, weights included: 'sft@0.5+dpo'."""
    return "+".join(ref.id if ref.weight == 1.0 else f"{ref.id}@{ref.weight:g}" for ref in refs)


def _parse_item(text: str) -> AdapterRef:
    item = text.strip()
    if not item:
        raise InvalidAdapterSpec("adapter has an empty entry; write ids as 'sft+dpo'")
    adapter_id, at, weight_text = item.partition("@")
    weight = 1.0
    if at:
        if not _WEIGHT.fullmatch(weight_text.strip()):
            raise InvalidAdapterSpec(
                f"adapter weight in {clipped(item, 40)!r} is not a number like 0.5"
            )
        weight = float(weight_text)
    return _ref(adapter_id.strip(), weight)


def _parse_entry(entry: Any) -> AdapterRef:
    if isinstance(entry, str):
        return _parse_item(entry)
    if not isinstance(entry, dict):
        raise InvalidAdapterSpec(
            f"each adapter entry must be an object like {{'id': 'sft', 'scale': 0.5}}, "
            f"not {type(entry).__name__}"
        )
    unknown = set(entry) - {"id", "scale"}
    if unknown:
        raise InvalidAdapterSpec(f"unknown adapter entry field(s): {', '.join(sorted(unknown))}")
    if "id" not in entry:
        raise InvalidAdapterSpec("an adapter entry is missing its 'id'")
    weight = entry.get("scale", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise InvalidAdapterSpec(f"adapter scale {weight!r} is not a number")
    return _ref(entry["id"], weight)


def _ref(adapter_id: Any, weight: float) -> AdapterRef:
    problem = adapter_id_problem(adapter_id)
    if problem:
        raise InvalidAdapterSpec(problem)
    # Compared before any conversion (an integer like 10**400 has no float); NaN fails too.
    if not -MAX_WEIGHT <= weight <= MAX_WEIGHT:
        raise InvalidAdapterSpec(
            f"adapter weight for '{adapter_id}' must be a finite number between "
            f"-{MAX_WEIGHT:g} and {MAX_WEIGHT:g}"
        )
    return AdapterRef(adapter_id, float(weight))


def _checked(refs: list[AdapterRef]) -> tuple[AdapterRef, ...]:
    if len(refs) > MAX_ADAPTERS_PER_REQUEST:
        raise InvalidAdapterSpec(
            f"a request may combine at most {MAX_ADAPTERS_PER_REQUEST} adapters, got {len(refs)}"
        )
    seen: set[str] = set()
    for ref in refs:
        if ref.id in seen:
            raise InvalidAdapterSpec(
                f"adapter '{ref.id}' is named twice; give it once with a weight, e.g. '{ref.id}@2'"
            )
        seen.add(ref.id)
    return tuple(refs)
