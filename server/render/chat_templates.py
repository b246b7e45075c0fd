"""The chat template a model is served with: its own, the one `--chat-template` names (a built-in,
a Jinja file or the template's text), or, for a model without one, its family's built-in."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotlora.config.errors import HotloraError
from hotlora.models.end_of_generation import special_tokens

if TYPE_CHECKING:  # the settings check reads templates before anything heavy is imported
    from hotlora.models.loader import LoadedModel

log = logging.getLogger("hotlora")

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
# The built-in templates, each `templates/<name>.jinja`; smollm2 is the embedded model's own.
BUILTINS = ("chatml", "gemma", "llama3", "mistral", "phi3", "smollm2")

_CHATML = ("<|im_start|>", "<|im_end|>")
_LLAMA3 = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_GEMMA = ("<start_of_turn>", "<end_of_turn>")
_PHI3 = ("<|user|>", "<|assistant|>", "<|end|>")
# The turn markers each built-in writes that a vocabulary it suits holds as tokens (Mistral's
# `[INST]` is text in its older vocabularies).
BUILTIN_MARKERS: dict[str, tuple[str, ...]] = {
    "chatml": _CHATML,
    "smollm2": _CHATML,
    "llama3": _LLAMA3,
    "gemma": _GEMMA,
    "phi3": _PHI3,
    "mistral": (),
}
# The built-ins each family's models speak (by config.json's `model_type`, which a GGUF's
# `general.architecture` becomes at import), each with the turn markers it writes: the first
# whose markers are all tokens of the vocabulary serves a model that has no template.
# llama.cpp writes Llama 2 and 3, Mistral and SmolLM all as llama, so the vocabulary tells.
FAMILY_TEMPLATES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "llama": (("llama3", _LLAMA3), ("chatml", _CHATML), ("mistral", ("[INST]", "[/INST]"))),
    "mistral": (("mistral", ()),),
    "qwen2": (("chatml", _CHATML),),
    "qwen3": (("chatml", _CHATML),),
    "gemma": (("gemma", _GEMMA),),
    "gemma2": (("gemma", _GEMMA),),
    "gemma3": (("gemma", _GEMMA),),
    "gemma3_text": (("gemma", _GEMMA),),
    "phi3": (("phi3", _PHI3),),
}

FLAG = "--chat-template NAME|FILE"
# The chat routes' 400 for a model served without a template; the caller says what else to send.
NO_CHAT_TEMPLATE = (
    f"This model has no chat template: start the server with {FLAG} (built-ins: "
    f"{', '.join(BUILTINS)})"
)


class ChatTemplateError(HotloraError, ValueError):
    """A `--chat-template` value that names no built-in, no readable file, or is not Jinja."""


def is_inline(value: str) -> bool:
    """Whether a `--chat-template` value is the template itself rather than a name or a path."""
    return "{{" in value or "{%" in value


def read_chat_template(value: str) -> str:
    """The template text a `--chat-template` value stands for: a built-in's (by name), the value
    itself when it holds Jinja markup, else the file it names. Raises `ChatTemplateError` saying
    what is wrong, for a missing file and a template Jinja cannot parse too."""
    if value in BUILTINS:
        return (TEMPLATE_DIR / f"{value}.jinja").read_text()
    if is_inline(value):
        text, where = value, "the template given"
    else:
        path = Path(value).expanduser()
        if not path.exists():
            raise ChatTemplateError(
                f"{value} is neither a built-in template ({', '.join(BUILTINS)}) nor a file"
            )
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"{value}: cannot be read as a text file ({exc})") from None
        where = value
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        environment.from_string(text)  # compiled: a filter or test it names must exist
    except TemplateSyntaxError as exc:  # and TemplateAssertionError, an unknown filter
        raise ChatTemplateError(
            f"{where}: not a valid Jinja template: {exc.message} (line {exc.lineno})"
        ) from None
    return text


def for_replicas(value: str | None) -> str | None:
    """A `--chat-template` value as other machines can read it: a file's text in place of its
    path (a built-in's name and a template given inline travel as they are)."""
    if value is None or value in BUILTINS or is_inline(value):
        return value
    return read_chat_template(value)


def family_template(model_type: str, vocabulary: set[str]) -> str | None:
    """The built-in a model of `model_type` without a template is served with: the first of its
    family's whose turn markers are all in `vocabulary`; None where there is none."""
    for name, markers in FAMILY_TEMPLATES.get(model_type, ()):
        if all(marker in vocabulary for marker in markers):
            return name
    return None


def install_chat_template(loaded: LoadedModel, setting: str | None) -> None:
    """Serve `loaded` with the template `setting` names, or with its own; a model without one
    gets its family's built-in, with a warning. The log says which, unless the model's own."""
    if setting is not None:
        had_one = bool(loaded.tokenizer.has_chat_template)
        loaded.use_chat_template(read_chat_template(setting))
        log.info(
            "chat template: %s (--chat-template)%s",
            "the one given" if is_inline(setting) else repr(setting),
            ", in place of the model's own" if had_one else "",
        )
        vocabulary = set(special_tokens(loaded.tokenizer))
        missing = [m for m in BUILTIN_MARKERS.get(setting, ()) if m not in vocabulary]
        if missing:
            log.warning(
                "the built-in %r chat template writes turn markers this model's vocabulary has "
                "no token for (%s): the model reads them as plain text, and its answers may "
                "run past the end of their turn; its own family's template may suit it better",
                setting,
                ", ".join(missing),
            )
        return
    if loaded.tokenizer.has_chat_template:
        return
    model_type = str(loaded.config.get("model_type"))
    vocabulary = set(special_tokens(loaded.tokenizer))
    name = family_template(model_type, vocabulary)
    if name is None:
        log.warning(
            "this model has no chat template, and its family (%s) no built-in one that fits its "
            "vocabulary: the chat routes answer 400; start it with %s to chat",
            model_type,
            FLAG,
        )
        return
    loaded.use_chat_template(read_chat_template(name))
    log.warning(
        "this model has no chat template: chats are rendered with the built-in %r template of "
        "its family (%s); start it with %s to use another",
        name,
        model_type,
        FLAG,
    )
