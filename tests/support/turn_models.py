"""Tiny GGUFs with no chat template whose vocabularies end a turn the way each family does, and
what each built-in chat template makes of one conversation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.gguf_models import write_family_gguf

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
# Each built-in's rendering of CONVERSATION with the generation prompt, bos `<s>`, eos `</s>`.
RENDERED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    "<|im_start|>assistant\n",
    "smollm2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    "<|im_start|>assistant\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    "Hello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "<s>[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Bye [/INST]",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
    "<|user|>\nBye<|end|>\n<|assistant|>\n",
}


@dataclass(frozen=True)
class TurnFamily:
    """A tiny model of `family` (`gguf_models.FAMILIES`) whose control tokens are `specials`,
    eos `eos` (else `</s>`), served with the built-in `template`, which ends a turn with
    `end_of_turn` (a token other than eos)."""

    family: str
    specials: tuple[str, ...]
    eos: str | None
    template: str | None
    end_of_turn: str | None


TURN_FAMILIES = {
    "chatml": TurnFamily(
        "qwen2",
        ("<|im_start|>", "<|endoftext|>", "<|im_end|>"),
        "<|endoftext|>",
        "chatml",
        "<|im_end|>",
    ),
    # llama.cpp writes Llama 3 as llama, as it writes Mistral: the vocabulary tells them apart.
    "llama3": TurnFamily(
        "mistral",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"),
        None,
        "llama3",
        "<|eot_id|>",
    ),
    "gemma": TurnFamily(
        "gemma3", ("<start_of_turn>", "<end_of_turn>"), None, "gemma", "<end_of_turn>"
    ),
    "phi3": TurnFamily(
        "phi3",
        ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"),
        "<|endoftext|>",
        "phi3",
        "<|end|>",
    ),
}
# A llama with none of the families' turn markers: no built-in fits it.
NO_MARKERS = TurnFamily("mistral", (), None, None, None)


def write_turn_gguf(path: Path, turn: TurnFamily) -> Path:
    """Write `turn`'s tiny GGUF (float32, no chat template) to `path`; return `path`."""
    write_family_gguf(
        path,
        turn.family,
        tensor_types={},
        special_tokens=turn.specials,
        eos_token=turn.eos,
        chat_template=None,
    )
    return path
