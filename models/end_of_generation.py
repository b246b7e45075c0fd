"""The tokens that end a generation, gathered as llama.cpp gathers its end-of-generation set: the
model's eos ids, the vocabulary's end-of-turn tokens and the chat template's end of a turn."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("hotlora")

# llama.cpp's end-of-generation names (`llama-vocab.cpp`): a token of the vocabulary's special
# (control or user-defined) tokens spelt so ends a generation, whatever the metadata names eos.
END_OF_TURN_NAMES = frozenset(
    {
        "<|eot_id|>",  # Llama 3
        "<|eom_id|>",  # Llama 3.1, after a built-in tool call
        "<|im_end|>",  # ChatML: Qwen, SmolLM
        "<|end|>",  # Phi-3
        "<end_of_turn>",  # Gemma
        "<|endoftext|>",
        "<|end_of_text|>",
        "</s>",
        "<eos>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|return|>",  # gpt-oss
        "<|call|>",  # gpt-oss
        "<end_of_utterance>",
        "<｜end▁of▁sentence｜>",  # DeepSeek
    }
)
# gpt-oss ends a message with `<|end|>` and goes on with the next one: where its answer and tool
# call ends are in the vocabulary, `<|end|>` is not an end (as llama.cpp has it).
_HARMONY_ENDS = frozenset({"<|return|>", "<|call|>"})
# Stands for an assistant message's text while the chat template's end marker is looked for.
_PROBE = "HOTLORA-END-OF-TURN-PROBE"

# Why a token is in the set, as the log and `/v1/models` say it.
EOS = "eos"
CONFIG = "generation_config"
NAME = "end-of-turn name"
TEMPLATE = "chat template"


def end_of_generation(tokenizer: Any, config_eos: Any) -> dict[int, tuple[str, ...]]:
    """The token ids that end a generation, each with why: the tokenizer's eos token, every id of
    the config's `eos_token_id` (an int or a list; mlx-lm reads generation_config.json's into
    it), the special tokens named as `END_OF_TURN_NAMES` spells them, and the special token the
    chat template ends an assistant turn with."""
    special = special_tokens(tokenizer)
    found: dict[int, list[str]] = {}

    def add(token_id: int, why: str) -> None:
        reasons = found.setdefault(int(token_id), [])
        if why not in reasons:
            reasons.append(why)

    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        add(tokenizer.eos_token_id, EOS)
    for token_id in config_eos if isinstance(config_eos, list) else [config_eos]:
        if isinstance(token_id, int) and not isinstance(token_id, bool):
            add(token_id, CONFIG)
    names = END_OF_TURN_NAMES
    if special.keys() >= _HARMONY_ENDS:
        names = names - {"<|end|>"}
    for text, token_id in sorted(special.items(), key=lambda item: item[1]):
        if text in names:
            add(token_id, NAME)
    if (marker := template_end_marker(tokenizer, special)) is not None:
        add(special[marker], TEMPLATE)
    return {token_id: tuple(found[token_id]) for token_id in sorted(found)}


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The vocabulary's added tokens (a GGUF's control and user-defined ones), text -> id."""
    get = getattr(tokenizer, "get_added_vocab", None)
    added = get() if callable(get) else {}
    return {str(text): int(token_id) for text, token_id in added.items()}


def template_end_marker(tokenizer: Any, special: dict[str, int]) -> str | None:
    """The special token the chat template writes right after an assistant message's text (its
    `<|im_end|>`, `<end_of_turn>`, `</s>`); None without a template, or where the template puts
    plain text there or cannot render a user and an assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template raises what it likes; no marker then
        log.debug("the chat template's end of turn is not known: %s", exc)
        return None
    if not isinstance(text, str) or _PROBE not in text:
        return None
    after = text[text.rindex(_PROBE) + len(_PROBE) :].lstrip()
    markers = [token for token in special if token and after.startswith(token)]
    return max(markers, key=len) if markers else None


def describe(tokens: dict[int, tuple[str, ...]], tokenizer: Any) -> str:
    """`'<|im_end|>' (2: eos, chat template), '<|endoftext|>' (0: end-of-turn name)`."""
    return ", ".join(
        f"{token_text(tokenizer, token_id)!r} ({token_id}: {', '.join(why)})"
        for token_id, why in tokens.items()
    )


def token_text(tokenizer: Any, token_id: int) -> str:
    """The vocabulary's spelling of a token id, `<id N>` for one the vocabulary lacks."""
    try:
        text = tokenizer.convert_ids_to_tokens(token_id)
    except (IndexError, KeyError, TypeError, ValueError, OverflowError):
        text = None
    return text if isinstance(text, str) else f"<id {token_id}>"
