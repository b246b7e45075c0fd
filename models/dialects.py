"""Config dialects: how each model family's `config.json` is read before the model is built.

Checkpoints of one family write the same facts in different shapes (a flat `rope_theta` or a
`rope_parameters` map keyed by attention type, `layer_types` spelled out or left implied), and
some values were never verified against this server. Exactly one `DialectRule`, chosen by
`model_type`, says how to read a config; `read_config` applies it. Callers branch on the rule's
fields, never on a model type.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from collections.abc import Callable, Collection, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeGuard

RopeLayout = Literal["map", "theta", "flat"]
Validator = Callable[[dict], None]

FULL_ATTENTION = "full_attention"
_EMPTY: Mapping[str, Any] = MappingProxyType({})


class UnsupportedConfig(ValueError):
    """A config value nobody has verified this server against, refused at load time."""

    def __init__(self, model_type: str, field: str, value: Any, allowed: Collection[Any]):
        self.model_type = model_type
        self.field = field
        self.value = value
        self.allowed = tuple(allowed)
        super().__init__(
            f"{model_type}: {field}={value!r} is not supported; "
            f"allowed: {', '.join(repr(a) for a in self.allowed)}"
        )


@dataclasses.dataclass(frozen=True)
class DialectRule:
    """How to read the config of the model types that `name` matches.

    `name` is a model type or a glob over model types (`qwen3_5*`).
    `text_defaults` fill fields the architecture omits (or writes as null); present fields win.
    `rope_layout`: `map` reads a `rope_parameters` map keyed by attention type; `theta` does the
    same but lets a flat `rope_theta` / `rope_scaling` stand in when the map is missing; `flat`
    keeps one flat `rope_parameters` dict; None leaves rope fields as written.
    `full_attention_default` makes every layer full attention when `layer_types` is missing.
    `validators` refuse values nobody has verified, raising `UnsupportedConfig`.
    """

    name: str
    text_defaults: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    rope_layout: RopeLayout | None = None
    full_attention_default: bool = False
    validators: tuple[Validator, ...] = ()

    def specificity(self, model_type: str) -> tuple[int, int] | None:
        """How closely this rule matches `model_type` (higher wins), or None if it does not."""
        if self.name == model_type:
            return (1, len(self.name))
        if fnmatch.fnmatchcase(model_type, self.name):
            return (0, sum(c not in "*?[]" for c in self.name))
        return None


def allowed_values(field: str, allowed: Collection[Any]) -> Validator:
    """A validator refusing `field` unless its value is one of `allowed` (absent is fine)."""
    allowed = tuple(allowed)

    def validate(config: dict) -> None:
        for section in _sections(config):
            if field in section and section[field] not in allowed:
                model_type = config.get("model_type", "?")
                raise UnsupportedConfig(model_type, field, section[field], allowed)

    validate.__name__ = f"allowed_{field}"
    return validate


# DiffusionGemma's published text-config defaults (transformers `DiffusionGemmaTextConfig`,
# checkpoint google/diffusiongemma-26B-A4B-it); sizes a real checkpoint always states are left out.
_DIFFUSION_GEMMA_DEFAULTS = MappingProxyType(
    {
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "global_head_dim": 512,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "sliding_window": 512,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131_072,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        },
    }
)

DEFAULT_RULE = DialectRule(name="default")

RULES: tuple[DialectRule, ...] = (
    DialectRule(name="llama", rope_layout="theta", full_attention_default=True),
    DialectRule(name="qwen3", rope_layout="theta"),
    DialectRule(
        name="qwen3_5*",
        rope_layout="flat",
        # The attention output gate was only checked against swish.
        validators=(allowed_values("output_gate_type", ("swish",)),),
    ),
    DialectRule(name="diffusion_gemma", text_defaults=_DIFFUSION_GEMMA_DEFAULTS, rope_layout="map"),
)


def rule_for(model_type: str, rules: Iterable[DialectRule] = RULES) -> DialectRule:
    """The one rule for `model_type`: the most specific match, the default rule when none."""
    ranked = sorted(
        ((score, rule) for rule in rules if (score := rule.specificity(model_type)) is not None),
        key=lambda pair: pair[0],
        reverse=True,
    )
    if not ranked:
        return DEFAULT_RULE
    if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
        names = [rule.name for _, rule in ranked]
        raise ValueError(f"rules {names} match {model_type!r} equally; the table is ambiguous")
    return ranked[0][1]


def read_config(raw: Mapping[str, Any], rules: Iterable[DialectRule] = RULES) -> dict:
    """Apply the rule for `raw["model_type"]`, returning the config for the model constructor.

    The result keeps every key of `raw` (it only adds or rewrites), so merging it over the raw
    file, as mlx-lm's loader does, yields exactly this config. `raw` is not modified.
    """
    config = copy.deepcopy(dict(raw))
    rule = rule_for(str(config.get("model_type", "")), rules)
    text = text_section(config)
    for key, value in rule.text_defaults.items():
        if text.get(key) is None:  # transformers writes null for "use the default"
            text[key] = copy.deepcopy(value)
    layers = text.get("num_hidden_layers")
    if rule.full_attention_default and text.get("layer_types") is None and layers is not None:
        text["layer_types"] = [FULL_ATTENTION] * layers
    if rule.rope_layout == "flat":
        _read_rope_flat(text)
    elif rule.rope_layout is not None:
        _read_rope_map(text, config, flat_stands_in=rule.rope_layout == "theta")
    for validate in rule.validators:
        validate(config)
    return config


def text_section(config: dict) -> dict:
    """The dict holding the text architecture: `text_config` when nested, else the config."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _sections(config: dict) -> list[dict]:
    text = text_section(config)
    return [config] if text is config else [config, text]


def _is_rope_map(value: Any) -> TypeGuard[Mapping[str, Mapping[str, Any]]]:
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(v, Mapping) for v in value.values())
    )


def _entry(params: Mapping[str, Any]) -> dict:
    """One rope entry with `rope_type` spelled out (older configs write `type`)."""
    entry = dict(params)
    if "rope_type" not in entry:
        entry["rope_type"] = entry.pop("type", "default")
    return entry


def _attention_types(text: dict) -> list[str]:
    return list(dict.fromkeys(text.get("layer_types") or [FULL_ATTENTION]))


def _read_rope_map(text: dict, config: dict, *, flat_stands_in: bool) -> None:
    """Normalise rope fields into a per-attention-type `rope_parameters` map.

    The flat `rope_theta` (and `rope_scaling` when the entry scales) that mlx-lm's model
    classes read are rewritten from the map's full-attention entry so both always agree.
    """
    params = text.get("rope_parameters")
    if _is_rope_map(params):
        rope_map = {kind: _entry(entry) for kind, entry in params.items()}
    elif isinstance(params, Mapping) and params:
        # transformers >= 5 writes one flat dict when every attention type shares it.
        rope_map = {kind: _entry(params) for kind in _attention_types(text)}
    elif flat_stands_in and text.get("rope_theta") is not None:
        entry = _entry({**(text.get("rope_scaling") or {}), "rope_theta": text["rope_theta"]})
        rope_map = {kind: dict(entry) for kind in _attention_types(text)}
    elif flat_stands_in:
        return  # nothing written: the model class's own default theta applies
    else:
        model_type = config.get("model_type", "?")
        raise UnsupportedConfig(
            model_type, "rope_parameters", params, ["a map keyed by attention type"]
        )
    text["rope_parameters"] = rope_map
    main = rope_map.get(FULL_ATTENTION) or next(iter(rope_map.values()))
    if "rope_theta" in main:
        text["rope_theta"] = main["rope_theta"]
    if main["rope_type"] != "default" and not text.get("rope_scaling"):
        text["rope_scaling"] = {k: v for k, v in main.items() if k != "rope_theta"}


def _read_rope_flat(text: dict) -> None:
    """Keep rope fields as one flat `rope_parameters` dict, with `rope_theta` beside it."""
    params = text.get("rope_parameters")
    if _is_rope_map(params):
        params = params.get(FULL_ATTENTION) or next(iter(params.values()))
    elif not params:
        params = dict(text.get("rope_scaling") or {})
        if text.get("rope_theta") is not None:
            params.setdefault("rope_theta", text["rope_theta"])
        if not params:
            return  # nothing written: the model class's own defaults apply
    text["rope_parameters"] = dict(params)
    if params.get("rope_theta") is not None:
        text["rope_theta"] = params["rope_theta"]
