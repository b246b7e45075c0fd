"""The Hugging Face tokenizer files of a GGUF model, rebuilt from the vocabulary it carries.

GGUF keeps a BPE tokenizer as its token list, merge list, token types and a pre-tokenizer
*name*; the splitting rules behind each name live in llama.cpp (`llama-vocab.cpp`). The
`tokenizers` pipelines below reproduce those rules for the names this module knows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import Keys
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4

# The splitting regexes llama.cpp uses, as the original tokenizer.json files spell them.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

# Pre-tokenizer names grouped as llama.cpp groups them.
DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"}
GPT2 = {"gpt-2", "phi-2", "mpt", "olmo", "jais", "gpt2"}
LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"}
QWEN2 = {"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"}
# llama.cpp's fallback when the name is missing: four regexes applied one after another.
DEFAULT_PATTERNS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]")


class UnsupportedTokenizer(ValueError):
    """The GGUF tokenizer is of a kind this module cannot rebuild faithfully."""


def _split_then_bytes(*patterns: str) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])


def pre_tokenizer_for(name: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` value `name`."""
    if name in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in LLAMA3:
        return _split_then_bytes(LLAMA3_PATTERN)
    if name in QWEN2:
        return _split_then_bytes(QWEN2_PATTERN)
    if name == "default":
        return _split_then_bytes(*DEFAULT_PATTERNS)
    known = sorted(DIGITS_THEN_GPT2 | GPT2 | LLAMA3 | QWEN2 | {"default"})
    raise UnsupportedTokenizer(
        f"pre-tokenizer {name!r} is not supported (known: {', '.join(known)})"
    )


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE `Tokenizer` from GGUF metadata, control tokens added as special tokens."""
    kind = meta.get(Keys.Tokenizer.MODEL)
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
    tokens: list[str] = meta[Keys.Tokenizer.LIST]
    types: list[int] = meta.get(Keys.Tokenizer.TOKEN_TYPE) or [1] * len(tokens)
    merges = [tuple(m.split(" ")) for m in meta.get(Keys.Tokenizer.MERGES, [])]
    if any(len(m) != 2 for m in merges):
        raise UnsupportedTokenizer("a BPE merge is not two space-separated tokens")
    pre = meta.get(Keys.Tokenizer.PRE, "default")
    try:
        bpe = models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            # llama.cpp looks a whole pre-token up in the vocabulary before merging for these.
            ignore_merges=pre in LLAMA3,
        )
    except Exception as e:  # tokenizers raises a bare Exception for a merge outside the vocab
        raise UnsupportedTokenizer(f"BPE merges do not fit the vocabulary: {e}") from e
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizer_for(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    bos = meta.get(Keys.Tokenizer.BOS_ID)
    if meta.get(Keys.Tokenizer.ADD_BOS, False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    return tokenizer


# Roles of the special token ids GGUF metadata may name.
SPECIAL_ID_KEYS = {
    "bos": Keys.Tokenizer.BOS_ID,
    "eos": Keys.Tokenizer.EOS_ID,
    "eot": Keys.Tokenizer.EOT_ID,
    "eom": Keys.Tokenizer.EOM_ID,
    "pad": Keys.Tokenizer.PAD_ID,
    "unk": Keys.Tokenizer.UNK_ID,
}


def special_token_ids(meta: dict[str, Any]) -> dict[str, int]:
    """The special token ids the metadata names, by role; ids outside the vocabulary dropped."""
    n = len(meta[Keys.Tokenizer.LIST])
    ids = {role: meta.get(key) for role, key in SPECIAL_ID_KEYS.items()}
    return {role: int(i) for role, i in ids.items() if i is not None and 0 <= i < n}


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens, bos/eos flags and the chat template."""
    tokens = meta[Keys.Tokenizer.LIST]
    ids = special_token_ids(meta)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get(Keys.Tokenizer.ADD_BOS, False)),
        "add_eos_token": bool(meta.get(Keys.Tokenizer.ADD_EOS, False)),
        "clean_up_tokenization_spaces": False,
    }
    for role in ("bos", "eos", "pad", "unk"):
        if role in ids:
            config[f"{role}_token"] = tokens[ids[role]]
    arch = meta.get("general.architecture")
    if (context := meta.get(f"{arch}.context_length")) is not None:
        config["model_max_length"] = int(context)
    if (template := meta.get(Keys.Tokenizer.CHAT_TEMPLATE)) is not None:
        config["chat_template"] = template
    return config


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`generation_config.json`: the ids generation starts, pads and stops with."""
    ids = special_token_ids(meta)
    stops = list(dict.fromkeys(ids[r] for r in ("eos", "eot", "eom") if r in ids))
    config: dict[str, Any] = {}
    if "bos" in ids:
        config["bos_token_id"] = ids["bos"]
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if "pad" in ids:
        config["pad_token_id"] = ids["pad"]
    return config


def write_tokenizer_files(meta: dict[str, Any], dest: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `dest`.

    A GGUF that embeds its original tokenizer.json (`tokenizer.huggingface.json`) gets it back
    verbatim; otherwise it is rebuilt from the vocabulary.
    """
    if (original := meta.get(Keys.Tokenizer.HF_JSON)) is not None:
        (dest / "tokenizer.json").write_text(original)
    else:
        build_tokenizer(meta).save(str(dest / "tokenizer.json"))
    for name, content in (
        ("tokenizer_config.json", tokenizer_config(meta)),
        ("generation_config.json", generation_config(meta)),
    ):
        (dest / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
