"""Tiny random-weight model directories (llama, gemma2), written by the tests that need one.

The directory looks like a real checkpoint: config.json, generation_config.json,
model.safetensors, and a character-level BPE tokenizer (tokenizer.json + tokenizer_config.json)
with ChatML special tokens and chat template. Every id in the 128-token vocabulary decodes, so
whatever a random model samples can be detokenized.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import gemma2, llama
from tokenizers import Tokenizer, decoders, models

VOCAB_SIZE = 128
MAX_POSITION_EMBEDDINGS = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, UNK_ID = range(len(SPECIAL_TOKENS))
EOS_TOKEN = "<|im_end|>"
EOS_TOKEN_ID = IM_END_ID
QUANTIZATION = {"group_size": 32, "bits": 4, "mode": "affine"}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A template that shows tools and writes tool calls as Qwen's does: JSON in <tool_call> tags.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:"
    "{% for tool in tools %} {{ tool.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "</tool_call>{% endfor %}{% else %}{{ message.content or '' }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Common English pairs, merged so that ordinary text takes fewer tokens than characters.
_MERGES = (
    ("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("r", "e"), ("o", "n"),
    ("e", "n"), ("a", "t"), ("o", "u"), ("e", "d"), ("h", "a"), ("t", "o"), ("o", "r"),
    ("i", "t"), ("i", "s"), ("h", "i"), ("e", "s"), ("n", "g"), ("s", "t"), ("a", "r"),
    ("n", "d"), (" ", "t"), (" ", "a"), (" ", "s"), (" ", "w"), (" ", "c"),
)  # fmt: skip


def tiny_args() -> llama.ModelArgs:
    """The tiny architecture: 2 layers, hidden 64, 4 query / 2 key-value heads, vocab 128."""
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
    )


def write_tiny_llama(
    dir: Path, quantize: bool = False, seed: int = 0, chat_template: str = CHAT_TEMPLATE
) -> Path:
    """Write a tiny random llama checkpoint into `dir` (created if needed) and return `dir`.

    `quantize` packs the linear and embedding weights to 4 bits (group 32) the way mlx-lm's
    converter does. The same `seed` gives the same weights.
    """
    args = tiny_args()
    mx.random.seed(seed)
    model = llama.Model(args)
    config = _config(args)
    if quantize:
        nn.quantize(model, group_size=QUANTIZATION["group_size"], bits=QUANTIZATION["bits"])
        config["quantization"] = dict(QUANTIZATION)
        config["quantization_config"] = dict(QUANTIZATION)
    return write_checkpoint(dir, model, config, chat_template)


def with_context(dir: Path, tokens: int) -> Path:
    """The model directory `dir` with its context length set to `tokens`: the character-level
    tokenizer spends a token on most characters, and a prompt describing tools runs to hundreds
    of them."""
    config = json.loads((dir / "config.json").read_text())
    config["max_position_embeddings"] = tokens
    _write_json(dir / "config.json", config)
    return dir


def with_control_tokens(dir: Path, tokens: list[str]) -> Path:
    """The model directory `dir` with `tokens` made special tokens of its vocabulary (as
    Mistral's `[TOOL_CALLS]` is), in the ids of the last merged pairs, which go."""
    assert tokens, "no control tokens to add"
    vocab, merges = _vocab()
    freed = [vocab.pop("".join(pair)) for pair in merges[-len(tokens) :]]
    vocab.update(zip(tokens, freed, strict=True))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges[: -len(tokens)], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([*SPECIAL_TOKENS, *tokens])
    tokenizer.save(str(dir / "tokenizer.json"))
    return dir


def write_checkpoint(
    dir: Path, model: nn.Module, config: dict, chat_template: str = CHAT_TEMPLATE
) -> Path:
    """Write `model`'s weights with `config` and the tiny tokenizer into `dir` (created if
    needed), as a model directory the loader reads; returns `dir`."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(dir / "config.json", config)
    _write_json(dir / "generation_config.json", {"eos_token_id": EOS_TOKEN_ID})
    _write_tokenizer(dir, chat_template)
    return dir


def tiny_gemma2_args() -> gemma2.ModelArgs:
    """gemma2 at the tiny size: 2 layers, hidden 64, 4 query / 2 key-value heads of 16."""
    return gemma2.ModelArgs(
        model_type="gemma2",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB_SIZE,
        num_key_value_heads=2,
    )


def write_tiny_gemma2(dir: Path, seed: int = 0) -> Path:
    """Write a tiny random gemma2 checkpoint into `dir` (created if needed) and return `dir`."""
    args = tiny_gemma2_args()
    mx.random.seed(seed)
    model = gemma2.Model(args)
    config = {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": args.model_type,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "query_pre_attn_scalar": int(args.query_pre_attn_scalar),
        "attn_logit_softcapping": args.attn_logit_softcapping,
        "final_logit_softcapping": args.final_logit_softcapping,
        "bos_token_id": IM_START_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": ENDOFTEXT_ID,
    }
    return write_checkpoint(dir, model, config)


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of `model` holds packed quantized weights."""
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    return any(hasattr(module, "bits") for _, module in leaves)


def _config(args: llama.ModelArgs) -> dict:
    # Written as transformers would, without layer_types, so the llama dialect fills them in.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": args.model_type,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": args.tie_word_embeddings,
        "bos_token_id": IM_START_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": ENDOFTEXT_ID,
    }


def _vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    tokens = list(SPECIAL_TOKENS) + ["\n", "\t"] + list(string.printable[:95])
    merges = list(_MERGES)
    tokens += ["".join(pair) for pair in merges]
    assert len(tokens) == len(set(tokens)) == VOCAB_SIZE, len(tokens)
    return {token: i for i, token in enumerate(tokens)}, merges


def _write_tokenizer(dir: Path, chat_template: str) -> None:
    vocab, merges = _vocab()
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()  # character pieces join without separators
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(dir / "tokenizer.json"))
    _write_json(
        dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOS_TOKEN,
            "pad_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "model_max_length": MAX_POSITION_EMBEDDINGS,
            "clean_up_tokenization_spaces": False,
            "chat_template": chat_template,
        },
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
