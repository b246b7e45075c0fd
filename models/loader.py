"""Load the base model and its tokenizer from a local model directory."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.nn as nn
from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_config, load_model, load_tokenizer

from hotlora.config.errors import HotloraError
from hotlora.models.batch_masks import install_row_masks
from hotlora.models.dialects import UnsupportedConfig, read_config, text_section
from hotlora.models.end_of_generation import end_of_generation
from hotlora.models.model_files import layers_in, safetensors_names

# Names configs use for the longest sequence the position encoding was trained for.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "seq_length",
    "n_positions",
    "n_ctx",
)
# Used when neither the config nor the tokenizer states a context length: small enough that
# any architecture handles it, large enough for a chat turn.
DEFAULT_CONTEXT_LENGTH = 4096
# No model is trained on more (the longest take about 10 million tokens): a length stated past
# it is a damaged or made-up config, and the model is served with this one, with a warning.
MAX_CONTEXT_LENGTH = 1 << 24
# transformers reports this when a tokenizer has no model_max_length.
_UNSET_TOKENIZER_LENGTH = 10**12
# Config numbers a model is built from: each a whole number above 0 where it is one number.
_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
)
# Files one of which a tokenizer is loaded from (tokenizer.json, tokenizer.model, vocab.json,
# a tiktoken file, Mistral's tekken.json).
_TOKENIZER_FILES = ("tokenizer*", "*.model", "vocab*", "*.tiktoken", "tekken.json")


log = logging.getLogger("hotlora")


class ModelLoadError(HotloraError, RuntimeError):
    """The model directory cannot be loaded; the message says what is wrong and where."""


@dataclass
class LoadedModel:
    """The base model, its tokenizer and the config it was built from (after its dialect)."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    path: Path
    # The tokens that end a generation, each with why (`find_end_of_generation`).
    end_of_generation: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def find_end_of_generation(self) -> None:
        """Gather the tokens that end a generation (`end_of_generation`): the tokenizer's eos
        ids become that set, which every generation stops at unless a request ignores eos."""
        self.end_of_generation = end_of_generation(self.tokenizer, self.config.get("eos_token_id"))
        self.tokenizer.eos_token_ids = set(self.end_of_generation)

    def use_chat_template(self, template: str) -> None:
        """Render chats with the Jinja `template` in place of the model's own (if any); the
        turn's end it writes joins the tokens that end a generation."""
        self.tokenizer.chat_template = template
        self.tokenizer._chat_template = None  # mlx-lm's renderer in code, where it has one
        self.tokenizer.has_chat_template = True
        self.find_end_of_generation()

    @cached_property
    def context_length(self) -> int:
        """The longest sequence the model takes.

        The first of the usual config keys (text section first, then top level) that holds a
        length; else the tokenizer's `model_max_length` if it states one; else
        `DEFAULT_CONTEXT_LENGTH`. A key that holds no length (0, a string) is passed over and
        one past `MAX_CONTEXT_LENGTH` is cut to it, each with a warning naming the key and the
        length served; so is a model that states none.
        """
        passed: list[str] = []  # the keys that hold no length, as the warning names them
        for section in _sections(self.config):
            for key in _CONTEXT_KEYS:
                value = section.get(key)
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    passed.append(f"{key} {value!r:.40}")
                    continue
                return self._served_length(value, key, passed)
        limit = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(limit, int) and 0 < limit < _UNSET_TOKENIZER_LENGTH:
            return self._served_length(limit, "the tokenizer's model_max_length", passed)
        stated = f"its {', '.join(passed)} states none" if passed else "it states none"
        log.warning(
            "%s: no context length (%s): served with %d tokens, the default",
            self.path / "config.json",
            stated,
            DEFAULT_CONTEXT_LENGTH,
        )
        return DEFAULT_CONTEXT_LENGTH

    def _served_length(self, value: int, source: str, passed: list[str]) -> int:
        """`value` (from `source`) capped at `MAX_CONTEXT_LENGTH`, with a warning where it is
        cut or keys before it were `passed` over."""
        served = min(value, MAX_CONTEXT_LENGTH)
        if served < value:
            log.warning(
                "%s: %s is %d, past any model's context: served with %d tokens",
                self.path / "config.json",
                source,
                value,
                served,
            )
        elif passed:
            log.warning(
                "%s: %s is no context length: served with %d tokens, from %s",
                self.path / "config.json",
                ", ".join(passed),
                served,
                source,
            )
        return served


def load_model_dir(path: Path) -> LoadedModel:
    """Load the model in `path` (config.json, model*.safetensors, tokenizer files).

    The config is read through its dialect (`read_config`) and that config is what the
    mlx-lm model constructor receives; the tokens that end a generation are gathered
    (`LoadedModel.find_end_of_generation`). Nothing is downloaded. Raises `ModelLoadError`
    when the directory is incomplete, the config is refused, or mlx-lm cannot build it.
    """
    path = Path(path)
    _check_files(path)
    config = _read(path)
    model_type = config["model_type"]
    try:
        _get_classes(config)
    except (ValueError, ImportError) as e:
        raise ModelLoadError(
            f"{path}: model_type {model_type!r} is not an architecture mlx-lm can build"
        ) from e
    # The tokenizer first: it is cheap, so a directory without one fails before the weights load.
    if not any(p.is_file() for pattern in _TOKENIZER_FILES for p in path.glob(pattern)):
        raise ModelLoadError(
            f"{path}: cannot load the tokenizer: the directory has no tokenizer files "
            "(tokenizer.json, tokenizer.model, vocab.json); copy the model's into it"
        )
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; each is reported
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {_one_line(e)}") from e
    _check_chat_template(path, tokenizer)
    try:
        # load_model merges `model_config` over the raw file; read_config keeps every raw key,
        # so the merge is exactly the read config.
        model, config = load_model(path, model_config=config)
    except Exception as e:  # noqa: BLE001 - mlx-lm raises many kinds; each is reported
        raise ModelLoadError(
            f"{path}: cannot build the {model_type!r} model: {_one_line(e)}"
        ) from e
    install_row_masks(model)  # rows of a batch each under their own mask (gemma2)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)
    loaded.find_end_of_generation()
    return loaded


def generation_defaults(path: Path) -> dict[str, float]:
    """Sampling defaults a model ships in generation_config.json (temperature, top_p, top_k)."""
    try:
        raw = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {
        k: raw[k] for k in ("temperature", "top_p", "top_k") if isinstance(raw.get(k), int | float)
    }


def _check_files(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(
            f"model path {path} is neither a model directory nor a GGUF file (one starts with "
            "the bytes GGUF): give the model's directory or its .gguf file"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    if not any(path.glob("model*.safetensors")):
        raise ModelLoadError(f"model directory {path} has no model*.safetensors weights")


def _read(path: Path) -> dict[str, Any]:
    """config.json (with generation_config.json's eos ids, as mlx-lm reads it) after its dialect;
    its sizes (`_SIZES`) each a whole number above 0, and the weights whole, first."""
    file = path / "config.json"
    try:
        written = json.loads(file.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(written, dict):
        raise ModelLoadError(
            f"{file} holds a JSON {type(written).__name__}, not an object of settings; "
            "it should be the model's own config.json"
        )
    raw = load_config(path)
    if not raw.get("model_type"):
        raise ModelLoadError(f"{file} does not name a model_type")
    for section in _sections(raw):
        for key in _SIZES:
            value = section.get(key)
            if value is None or isinstance(value, list):  # unset, or one a layer
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelLoadError(
                    f"{file}: {key} is {value!r:.40}, not a whole number above 0; fix it to "
                    "the model's own"
                )
    _check_weights(path, raw)  # before the dialect, which sizes lists by the layer count
    try:
        return read_config(raw)
    except UnsupportedConfig as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _check_chat_template(path: Path, tokenizer: TokenizerWrapper) -> None:
    """Warn at start of a chat template of the model's own that Jinja cannot compile, as the
    chat routes would find it at the first chat: the model is served all the same (completions
    need no template), each chat refused with a 400 unless `--chat-template` gives another."""
    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, str):
        templates = {"": templates}
    if not isinstance(templates, dict):
        return
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    for name, template in templates.items():
        try:
            environment.from_string(template)  # compiled: a filter or test it names must exist
        except TemplateSyntaxError as e:  # and TemplateAssertionError, an unknown filter
            log.warning(
                "%s: the model's own chat template%s is not valid Jinja (%s, line %s): chats "
                "are refused with a 400 unless --chat-template gives another; completions are "
                "served",
                path,
                f" {name!r}" if name else "",
                " ".join(str(e.message).split()),
                e.lineno,
            )


def _sections(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The config's text section where one is nested in it, then the config itself."""
    text = text_section(config)
    return [config] if text is config else [text, config]


def _check_weights(path: Path, config: dict[str, Any]) -> None:
    """Refuse a weight file that is not a whole safetensors file (read from its header), and a
    layer count past the layers the weights hold, before either sizes anything."""
    names = []
    for file in sorted(path.glob("model*.safetensors")):
        try:
            names += safetensors_names(file)
        except ValueError as e:
            raise ModelLoadError(f"{file} {e}; download or write it again") from e
    stated, held = text_section(config).get("num_hidden_layers"), layers_in(names)
    if isinstance(stated, int) and held is not None and stated > held:
        raise ModelLoadError(
            f"{path / 'config.json'}: num_hidden_layers is {stated:,}, but the weights hold "
            f"{held} layers; fix it to the model's own"
        )


def _one_line(e: BaseException) -> str:
    """A library's error as one line: a missing weight named as such, a list of names cut to
    the first few; the whole text goes to the DEBUG log."""
    if isinstance(e, MemoryError):
        return "out of memory: config.json describes a model larger than this machine holds"
    if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str) and "." in e.args[0]:
        return f"the weights have no {e.args[0]}"
    text = str(e).strip() or type(e).__name__
    lines = [line.strip().rstrip(",") for line in text.splitlines() if line.strip()]
    if len(lines) == 1:
        return lines[0]
    log.debug("%s", text)
    first, rest = lines[0], lines[1:]
    more = f" and {len(rest) - 3} more" if len(rest) > 3 else ""
    line = f"{first.rstrip(':')}: {', '.join(r.rstrip('.') for r in rest[:3])}{more}"
    if "not in model" in first and any(r.rstrip(".").endswith(".scales") for r in rest):
        line += " (quantized weights: config.json needs its quantization section)"
    return line
