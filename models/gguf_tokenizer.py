"""The Hugging Face tokenizer files of a GGUF model, rebuilt from the vocabulary it carries.

GGUF keeps a BPE tokenizer (`gpt2`: Qwen, SmolLM, Llama 3) as its token list, merge list, token
types and a pre-tokenizer *name*; the splitting rules behind each name live in llama.cpp
(`llama-vocab.cpp`). The `tokenizers` pipelines below reproduce those rules for the names this
module knows. A sentencepiece tokenizer (`llama`: Mistral, Gemma, Phi-3) comes as tokens,
scores and types; llama.cpp merges the adjacent pair whose joined piece scores highest, which a
BPE whose merges are ranked by that score reproduces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gguf import Keys
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
SPM_SPACE = "\u2581"  # sentencepiece's visible space

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
# The pre-tokenizers whose BPE vocabularies llama.cpp starts with BOS when the file does not say
# (`tokenizer.ggml.add_bos_token`); it always does for a sentencepiece one.
BOS_BY_DEFAULT = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "tekken",
    "chameleon",
}


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
    """A `Tokenizer` from GGUF metadata that splits text into the ids llama.cpp gives it."""
    kind = meta.get(Keys.Tokenizer.MODEL)
    if kind == "gpt2":
        tokenizer = _bpe_tokenizer(meta)
    elif kind == "llama":
        tokenizer = _spm_tokenizer(meta)
    else:
        raise UnsupportedTokenizer(
            f"tokenizer model {kind!r} is not supported (only 'gpt2' BPE and 'llama' sentencepiece)"
        )
    tokens: list[str] = meta[Keys.Tokenizer.LIST]
    types = meta.get(Keys.Tokenizer.TOKEN_TYPE)
    if types is None:
        types = [1] * len(tokens)
    rstrip = _rstripped(meta, tokens, types)
    # llama.cpp matches these in the text before anything else; control and unknown tokens
    # only where special tokens are parsed, which is how chat prompts are encoded.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
            for t, k in zip(tokens, types, strict=True)
            if k in (CONTROL, UNKNOWN)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False, rstrip=t in rstrip)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    bos = special_token_ids(meta).get("bos")
    if adds_bos(meta) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    return tokenizer


def adds_bos(meta: dict[str, Any]) -> bool:
    """Whether llama.cpp starts a prompt with BOS: as `tokenizer.ggml.add_bos_token` says, else
    as it does by default for the vocabulary (sentencepiece, and BPE with `BOS_BY_DEFAULT`)."""
    if (flag := meta.get(Keys.Tokenizer.ADD_BOS)) is not None:
        return bool(flag)
    kind = meta.get(Keys.Tokenizer.MODEL)
    return kind == "llama" or (kind == "gpt2" and meta.get(Keys.Tokenizer.PRE) in BOS_BY_DEFAULT)


def _rstripped(meta: dict[str, Any], tokens: list[str], types: Sequence[int]) -> set[str]:
    """Tokens that swallow the whitespace after them. llama.cpp decides it by the model's name:
    for Phi-3 every special token but `<unk>`, `<s>` and `<|endoftext|>`, and `</s>`."""
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    special = {
        t for t, k in zip(tokens, types, strict=True) if k in (CONTROL, USER_DEFINED, UNKNOWN)
    }
    return (special | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"}


def _bpe_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Byte-level BPE with llama.cpp's pre-tokenizer for `tokenizer.ggml.pre`."""
    tokens: list[str] = meta[Keys.Tokenizer.LIST]
    if Keys.Tokenizer.MERGES not in meta:
        # Without them every word would split into single bytes: llama.cpp refuses it too.
        raise UnsupportedTokenizer(
            f"its byte-level BPE vocabulary has no merges ({Keys.Tokenizer.MERGES}), without "
            "which no text is tokenized as the model was trained; llama.cpp refuses such a "
            "file too: get one converted with its merges"
        )
    merges = [tuple(m.split(" ")) for m in meta[Keys.Tokenizer.MERGES]]
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
    return tokenizer


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the higher the whole piece scores the earlier.

    llama.cpp merges the adjacent pair whose joined text is the best-scoring piece, leftmost on
    a tie; a BPE that ranks its merges so makes the same choices.
    """
    ids: dict[str, int] = {}
    for i, token in enumerate(tokens):
        ids.setdefault(token, i)
    ranked = [
        (-scores[i], i, cut, piece[:cut], piece[cut:])
        for piece, i in ids.items()
        for cut in range(1, len(piece))
        if piece[:cut] in ids and piece[cut:] in ids
    ]
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Sentencepiece as llama.cpp runs it: spaces as `▁`, a leading `▁` unless the model says
    otherwise (gemma), best-scoring merges first, unknown characters as `<0xNN>` byte tokens."""
    tokens: list[str] = meta[Keys.Tokenizer.LIST]
    scores = meta.get(Keys.Tokenizer.SCORES)
    if scores is None or len(scores) != len(tokens):
        raise UnsupportedTokenizer("a sentencepiece vocabulary needs a score for every token")
    unk = special_token_ids(meta).get("unk")
    bpe = models.BPE(
        vocab={token: i for i, token in reversed(list(enumerate(tokens)))},
        merges=spm_merges(tokens, [float(score) for score in scores]),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    add_prefix = bool(meta.get(Keys.Tokenizer.ADD_PREFIX, True))
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPM_SPACE)]
    decode: list[decoders.Decoder] = [
        decoders.Replace(SPM_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_prefix:
        # llama.cpp puts the space before the text and after every special token; the
        # normalizer runs on each stretch of text between added tokens, so does the same.
        steps.insert(0, normalizers.Prepend(" "))
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence(decode)
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


# llama.cpp's ids for a sentencepiece vocabulary's special tokens the metadata does not name.
SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unk": 0}


def special_token_ids(meta: dict[str, Any]) -> dict[str, int]:
    """The special token ids the metadata names, by role (a sentencepiece vocabulary's bos, eos
    and unk as llama.cpp takes them where it names none); ids outside the vocabulary dropped."""
    n = len(meta[Keys.Tokenizer.LIST])
    ids = {role: meta.get(key) for role, key in SPECIAL_ID_KEYS.items()}
    if meta.get(Keys.Tokenizer.MODEL) == "llama":
        ids |= {role: i for role, i in SPM_DEFAULT_IDS.items() if ids[role] is None}
    return {role: int(i) for role, i in ids.items() if i is not None and 0 <= i < n}


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens, bos/eos flags and the chat template."""
    tokens = meta[Keys.Tokenizer.LIST]
    ids = special_token_ids(meta)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": adds_bos(meta),
        # llama.cpp adds no EOS by default to the vocabularies built here.
        "add_eos_token": bool(meta.get(Keys.Tokenizer.ADD_EOS, False)),
        "clean_up_tokenization_spaces": False,
    }
    for role in ("bos", "eos", "pad", "unk"):
        if role in ids:
            config[f"{role}_token"] = tokens[ids[role]]
    arch = meta.get("general.architecture")
    if (context := meta.get(f"{arch}.context_length")) is not None and int(context) > 0:
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
