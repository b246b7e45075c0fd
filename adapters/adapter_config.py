"""Reading `adapter_config.json`: the rank and scale of the low-rank update, within bounds.

The file is written by whoever can write under the adapter root, so it is read with limits: its
size is checked before it is read, its nesting before it is parsed, and every number that feeds
the scale before it is used.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from hotlora.adapters.adapter_errors import InvalidAdapter

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20  # real configs are a few KiB
MAX_CONFIG_DEPTH = 32  # real configs nest 2 or 3 deep; Python's JSON parser recurses per level
# Bound on the adapter's effective scale (after `lora_alpha / r`). Trained adapters sit around
# 0.1 to 100; beyond this the residual swamps the base and overflows half precision.
MAX_SCALE = 1e4

# A JSON string (escapes included) or a bracket: all the nesting scan needs to look at.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_SHOWN_CHARS = 40  # how much of a bad value an error message repeats


@dataclass(frozen=True)
class AdapterConfig:
    """What `adapter_config.json` says about the low-rank update."""

    rank: int
    scale: float
    rslora: bool = False
    # mlx-lm's `num_layers`: its pairs are in the base's last that many layers (None: in any, as
    # for 0, -1 or no such key), and `lora_parameters.keys`: the projections they may be, as
    # paths within a layer (None: any). mlx-lm refuses a file with pairs elsewhere.
    layers: int | None = None
    keys: frozenset[str] | None = None
    # PEFT's `target_modules` and what narrows them: the modules its LoRA was put on.
    peft_targets: PeftTargets | None = None


@dataclass(frozen=True)
class PeftTargets:
    """The modules a PEFT config put LoRA on, matched against a module's name in the base (its
    name in the file without `base_model.model.`) as PEFT matches them: `modules` a pattern the
    whole name matches, or names the name is or ends with after a dot (None: `all-linear`, any);
    `exclude` (PEFT's `exclude_modules`) likewise, taken out; `layers` (`layers_to_transform`)
    the layer indices a list of `modules` is limited to, the index found after one of
    `layers_pattern` (any part of the name where empty)."""

    modules: str | frozenset[str] | None
    exclude: str | frozenset[str] | None = None
    layers: frozenset[int] | None = None
    layers_pattern: tuple[str, ...] = ()

    def holds(self, name: str) -> bool:
        """Whether PEFT would have put LoRA on the module `name`."""
        if self.exclude is not None and _names(self.exclude, name, fullmatch=True):
            return False
        if isinstance(self.modules, str):
            return re.fullmatch(self.modules, name) is not None
        if self.modules is not None and name in self.modules:
            return True
        if self.modules is not None and not _names(self.modules, name, fullmatch=False):
            return False
        if self.layers is None:
            return True
        patterns = self.layers_pattern or (r"[^.]*",)
        found = next((m for p in patterns if (m := re.match(rf".*\.{p}\.(\d+)\.", name))), None)
        return found is not None and int(found[1]) in self.layers


def _names(given: str | frozenset[str], name: str, *, fullmatch: bool) -> bool:
    """Whether `name` is one of `given`'s names or ends with one after a dot; a `given` string is
    a pattern (`fullmatch`), else a name (PEFT reads `exclude_modules` so, `target_modules` not)."""
    if isinstance(given, str):
        return re.fullmatch(given, name) is not None if fullmatch else name == given
    return name in given or any(name.endswith(f".{key}") for key in given)


def read_adapter_config(
    path: Path, *, max_rank: int, max_bytes: int = MAX_CONFIG_BYTES
) -> AdapterConfig:
    """Rank and scale from an mlx-lm or PEFT `adapter_config.json`.

    mlx-lm: `lora_parameters.{rank, scale}`. PEFT: `r` and `lora_alpha`, scale `alpha / r`, or
    `alpha / sqrt(r)` with `use_rslora`. A top-level `scale`, which some trainers write, wins
    over `lora_alpha` since it is the number the trainer actually applied. The rank must be a
    positive integer up to `max_rank`, the scale finite with `|scale| <= MAX_SCALE`; the file is
    refused above `min(max_bytes, MAX_CONFIG_BYTES)` or nested deeper than `MAX_CONFIG_DEPTH`.
    """
    raw = _load(path, min(max_bytes, MAX_CONFIG_BYTES))
    _check_kind(raw)
    _check_only_pairs(raw)

    params = raw.get("lora_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise InvalidAdapter(f"{CONFIG_FILE}: lora_parameters must be an object")
        rank = _rank(params.get("rank"), "lora_parameters.rank", max_rank)
        field = "scale" if "scale" not in params and "scale" in raw else "lora_parameters.scale"
        scale = _scale(params.get("scale", raw.get("scale")), field)
        layers, keys = _layers(raw.get("num_layers")), _keys(params.get("keys"))
        return AdapterConfig(rank, scale, layers=layers, keys=keys)

    for key, what in (("rank_pattern", "ranks"), ("alpha_pattern", "alphas")):
        if raw.get(key):
            raise InvalidAdapter(f"{CONFIG_FILE}: per-module {what} ({key}) are not supported")
    rank = _rank(raw.get("r"), "r", max_rank)
    rslora = bool(raw.get("use_rslora"))
    targets = _peft_targets(raw)
    if raw.get("scale") is not None:
        return AdapterConfig(rank, _scale(raw["scale"], "scale"), rslora, peft_targets=targets)
    alpha = _finite(raw.get("lora_alpha"))
    if alpha is None:
        raise InvalidAdapter(
            f"{CONFIG_FILE} gives no valid scale (scale or lora_alpha): lora_alpha must be a "
            f"finite number, got {_shown(raw.get('lora_alpha'))}"
        )
    if rslora:
        scale = _scale(alpha / math.sqrt(rank), "lora_alpha / sqrt(r)")
        return AdapterConfig(rank, scale, True, peft_targets=targets)
    return AdapterConfig(rank, _scale(alpha / rank, "lora_alpha / r"), peft_targets=targets)


def _peft_targets(raw: dict[str, Any]) -> PeftTargets | None:
    """PEFT's `target_modules` (None where the config gives none), `exclude_modules`,
    `layers_to_transform` and `layers_pattern`; a pattern that is not a valid regex is refused."""
    modules = _modules(raw.get("target_modules"), "target_modules")
    if modules is None:
        return None
    exclude = _modules(raw.get("exclude_modules"), "exclude_modules")
    layers = raw.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (
        isinstance(layers, list) and all(_positive_int(i) or i == 0 for i in layers)
    ):
        raise InvalidAdapter(
            f"{CONFIG_FILE}: layers_to_transform must be a layer index or a list of them, got "
            f"{_shown(layers)}"
        )
    pattern = raw.get("layers_pattern")
    patterns = [pattern] if isinstance(pattern, str) else pattern or []
    if not (isinstance(patterns, list) and all(isinstance(p, str) for p in patterns)):
        raise InvalidAdapter(
            f"{CONFIG_FILE}: layers_pattern must be a name or a list of names, got "
            f"{_shown(pattern)}"
        )
    return PeftTargets(
        None if modules == "all-linear" else modules,
        exclude,
        frozenset(layers) if layers else None,
        tuple(patterns),
    )


def _modules(value: Any, field: str) -> str | frozenset[str] | None:
    """A PEFT module list: a regex the whole name matches (checked), or names."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as exc:
            raise InvalidAdapter(f"{CONFIG_FILE}: {field} is not a valid pattern: {exc}") from None
        return value
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return frozenset(value)
    raise InvalidAdapter(
        f"{CONFIG_FILE}: {field} must be a pattern or a list of module names, got {_shown(value)}"
    )


def _layers(value: Any) -> int | None:
    """mlx-lm's `num_layers`: a count of the base's last layers; 0 or below (or none): all."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidAdapter(f"{CONFIG_FILE}: num_layers must be an integer, got {_shown(value)}")
    return value if value > 0 else None


def _keys(value: Any) -> frozenset[str] | None:
    """mlx-lm's `lora_parameters.keys`: module paths within a layer (`self_attn.q_proj`)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(key, str) for key in value):
        raise InvalidAdapter(
            f"{CONFIG_FILE}: lora_parameters.keys must be a list of module paths, got "
            f"{_shown(value)}"
        )
    return frozenset(value)


def _load(path: Path, max_bytes: int) -> dict[str, Any]:
    """The config's JSON object, its size checked before reading and its depth before parsing."""
    if not path.is_file():
        raise InvalidAdapter(f"{path.parent} has no {CONFIG_FILE}")
    size = path.stat().st_size
    if size > max_bytes:
        raise InvalidAdapter(f"{CONFIG_FILE} is over the limit of {max_bytes} bytes ({size} bytes)")
    with path.open("rb") as stream:
        data = stream.read(max_bytes + 1)  # bounded even if the file grew since the stat
    if len(data) > max_bytes:
        raise InvalidAdapter(f"{CONFIG_FILE} is over the limit of {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidAdapter(f"{CONFIG_FILE} cannot be read as JSON: {exc}") from None
    _check_depth(text)
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also ints of over 4300 digits
        raise InvalidAdapter(f"{CONFIG_FILE} cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidAdapter(f"{CONFIG_FILE} must hold a JSON object")
    return raw


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than `MAX_CONFIG_DEPTH` without parsing (the parser recurses)."""
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match[0]
        if token in ("[", "{"):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                raise InvalidAdapter(
                    f"{CONFIG_FILE} nests deeper than {MAX_CONFIG_DEPTH} levels of objects or "
                    "arrays"
                )
        elif token in ("]", "}"):
            depth -= 1


def _check_kind(raw: dict[str, Any]) -> None:
    kind = raw.get("fine_tune_type", "lora")
    if kind != "lora":
        raise InvalidAdapter(
            f"{CONFIG_FILE}: fine_tune_type {_shown(kind)} is not supported; only 'lora' "
            "adapters mount"
        )
    peft_type = raw.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise InvalidAdapter(f"{CONFIG_FILE}: peft_type {_shown(peft_type)} is not supported")
    if raw.get("use_dora"):
        raise InvalidAdapter(f"{CONFIG_FILE}: DoRA adapters (use_dora) are not supported")


def _check_only_pairs(raw: dict[str, Any]) -> None:
    """Refuse a PEFT config that trained more than LoRA pairs: full copies of modules
    (`modules_to_save`) or biases (`bias` other than "none"). Their weights, in the file or not,
    would not be applied, and the adapter served without them is not the one trained."""
    saved = raw.get("modules_to_save")
    if saved not in (None, []):
        names = ", ".join(map(_shown, saved)) if isinstance(saved, list) else _shown(saved)
        raise InvalidAdapter(
            f"{CONFIG_FILE}: modules_to_save ({names}) says the adapter was trained with full "
            "copies of those modules, which this server does not apply (only LoRA pairs of the "
            "projections mount); nothing was mounted"
        )
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise InvalidAdapter(
            f"{CONFIG_FILE}: bias {_shown(bias)} says the adapter trained biases, which this "
            "server does not apply (only LoRA pairs mount); nothing was mounted"
        )


def _rank(value: Any, field: str, max_rank: int) -> int:
    if not _positive_int(value):
        raise InvalidAdapter(
            f"{CONFIG_FILE} gives no valid rank: {field} must be a positive integer, "
            f"got {_shown(value)}"
        )
    if value > max_rank:
        raise InvalidAdapter(
            f"adapter rank {value} ({field}) is above this server's limit of {max_rank}"
        )
    return value


def _scale(value: Any, field: str) -> float:
    scale = _finite(value)
    if scale is None:
        raise InvalidAdapter(
            f"{CONFIG_FILE} gives no valid scale: {field} must be a finite number, "
            f"got {_shown(value)}"
        )
    if abs(scale) > MAX_SCALE:
        raise InvalidAdapter(
            f"{CONFIG_FILE}: the adapter scale {scale:g} ({field}) is outside the bound "
            f"|scale| <= {MAX_SCALE:g}"
        )
    return scale


def _finite(value: Any) -> float | None:
    """`value` as a finite float; None for anything else (strings, bools, NaN, 10**400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}..."
