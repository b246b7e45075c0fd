"""Tiny GGUFs of each family, written the way llama.cpp's convert_hf_to_gguf.py writes them.

The weights start as a Hugging Face checkpoint would hold them (mlx-lm's names are the same);
the converter then renames them, permutes llama's q/k rows, adds 1 to gemma's norm weights and
keeps Phi-3's fused projections fused. The metadata carries what the converter writes for the
family, and the vocabulary is the family's kind: byte-level BPE for Qwen, sentencepiece for
Mistral, Gemma and Phi-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten
from mlx_lm.models import gemma2, gemma3_text, llama, phi3, qwen2, qwen3

from tests.support.gguf_files import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    add_tensor,
    encode,
    llama_cpp_permute,
    tiny_vocab,
)

CONTEXT = 256
SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
}
# The converter's tensor map (gguf-py tensor_mapping.py) for the names these families use.
TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA_LAYER = {
    **LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Quantized tensors by llama.cpp name (layer index substituted); the rest stay float32.
QUANTIZED = {
    "token_embd": Q.Q8_0,
    "output": Q.Q4_0,
    "blk.0.attn_q": Q.Q4_0,
    "blk.0.attn_k": Q.Q8_0,
    "blk.1.attn_v": Q.Q4_1,
    "blk.0.attn_qkv": Q.Q4_0,
    "blk.1.attn_qkv": Q.Q8_0,
    "blk.0.attn_output": Q.Q4_1,
    "blk.0.ffn_gate": Q.Q4_0,
    "blk.1.ffn_up": Q.Q8_0,
    "blk.0.ffn_up": Q.Q4_0,
    "blk.1.ffn_down": Q.Q4_1,
    "blk.0.ffn_down": Q.F16,
}
# Sentencepiece pieces beyond the single characters, best first (llama.cpp merges by score).
SPM_PIECES = ("▁t", "he", "▁the", "in", "▁a", "er", "on", "or", "▁w", "▁wor", "ld", "▁world")
LONG_FACTORS = [1.0, 1.5, 2.0, 4.0, 8.0, 16.0]
SHORT_FACTORS = [1.0, 1.0, 1.25, 1.5, 2.0, 2.5]
SPM_CHARS = "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'"


def spm_vocab(
    specials: tuple[str, ...] = SPECIAL_TOKENS[1:],
) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types as the converter writes a sentencepiece model: `<unk>`, `<s>`,
    `</s>`, the chat markers (or `specials`), 256 byte tokens, single characters, then merged
    pieces."""
    tokens = ["<unk>", "<s>", "</s>", *specials]
    types = [2, 3, 3] + [3] * len(specials)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores = [0.0] * len(tokens)
    pieces = [*SPM_CHARS, *SPM_PIECES]
    tokens += pieces
    types += [1] * len(pieces)
    # Sentencepiece scores characters below every merged piece and later pieces lower.
    scores += [-1000.0 - i for i in range(len(SPM_CHARS))]
    scores += [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, scores, types


@dataclass(frozen=True)
class TinyFamily:
    """One family's tiny model: mlx-lm's class and arguments, and how its GGUF is written."""

    arch: str  # general.architecture
    module: ModuleType
    args: dict[str, Any]
    vocab: str  # "bpe" or "spm"
    tied: bool
    metadata: dict[str, Any] = field(default_factory=dict)  # family keys beyond the common ones
    add_space_prefix: bool = True
    gemma: bool = False
    tensors: dict[str, list[float]] = field(default_factory=dict)  # settings held as tensors

    @property
    def model_type(self) -> str:
        return {"gemma3": "gemma3_text"}.get(self.arch, self.arch)

    def model_args(self, vocab_size: int, shape: dict[str, Any] | None = None) -> Any:
        """mlx-lm's arguments for the tiny model, `shape` (hidden size, layers...) over `SHAPE`."""
        args = {**SHAPE, **self.args, **(shape or {}), "vocab_size": vocab_size}
        if "tie_word_embeddings" in {f.name for f in fields(self.module.ModelArgs)}:
            args["tie_word_embeddings"] = self.tied
        return self.module.ModelArgs(model_type=self.model_type, **args)


FAMILIES = {
    # llama.cpp writes Mistral (7B v0.1-v0.3) as llama, with its sentencepiece vocabulary.
    "mistral": TinyFamily(
        "llama",
        llama,
        {"rope_theta": 1000000.0, "max_position_embeddings": CONTEXT},
        vocab="spm",
        tied=False,
    ),
    "qwen2": TinyFamily(
        "qwen2",
        qwen2,
        {"rope_theta": 1000000.0, "max_position_embeddings": CONTEXT},
        vocab="bpe",
        tied=True,
    ),
    "qwen3": TinyFamily(
        "qwen3",
        qwen3,
        {"head_dim": 32, "rope_theta": 1000000.0, "max_position_embeddings": CONTEXT},
        vocab="bpe",
        tied=False,
    ),
    "gemma2": TinyFamily(
        "gemma2",
        gemma2,
        {
            "head_dim": 32,
            "rope_theta": 10000.0,
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 10.0,
            "query_pre_attn_scalar": 32,
        },
        vocab="spm",
        tied=True,
        metadata={"attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0},
        add_space_prefix=False,
        gemma=True,
    ),
    # Six layers: llama.cpp's default pattern makes the sixth one global, the rest sliding.
    "gemma3": TinyFamily(
        "gemma3",
        gemma3_text,
        {
            "num_hidden_layers": 6,
            "head_dim": 32,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": 32,
            "sliding_window": 8,
            "sliding_window_pattern": 6,
            "max_position_embeddings": CONTEXT,
        },
        vocab="spm",
        tied=True,
        metadata={"attention.sliding_window": 8},
        add_space_prefix=False,
        gemma=True,
    ),
    # Rotary on three quarters of each head, as Phi-4-mini has it.
    "phi3": TinyFamily(
        "phi3",
        phi3,
        {
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": CONTEXT,
            "original_max_position_embeddings": CONTEXT,
        },
        vocab="spm",
        tied=False,
        metadata={
            "rope.dimension_count": 12,
            "rope.scaling.original_context_length": CONTEXT,
            "attention.sliding_window": 0,
        },
    ),
    # Phi-3's long-context rope: llama.cpp keeps the factors as tensors and the attention scale
    # (sqrt(1 + ln 4 / ln 256) for 1,024 positions over 256) as a key.
    "phi3_longrope": TinyFamily(
        "phi3",
        phi3,
        {
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 4 * CONTEXT,
            "original_max_position_embeddings": CONTEXT,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": LONG_FACTORS,
                "short_factor": SHORT_FACTORS,
            },
        },
        vocab="spm",
        tied=False,
        metadata={
            "rope.dimension_count": 12,
            "rope.scaling.original_context_length": CONTEXT,
            "rope.scaling.attn_factor": 1.25**0.5,
            "attention.sliding_window": 0,
        },
        tensors={
            "rope_factors_long.weight": LONG_FACTORS,
            "rope_factors_short.weight": SHORT_FACTORS,
        },
    ),
}


def hf_weights(
    family: TinyFamily, vocab_size: int, seed: int = 0, shape: dict[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """Random float32 weights by Hugging Face (= mlx-lm) name, scaled to keep activations O(1).

    Norm weights are as the checkpoint stores them: near 1, or near 0 for gemma, whose norm
    multiplies by 1 + weight.
    """
    mx.random.seed(seed)
    model = family.module.Model(family.model_args(vocab_size, shape))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        shape = value.shape
        if "norm" in name:
            w = 0.1 * rng.standard_normal(shape) + (0.0 if family.gemma else 1.0)
        elif "embed_tokens" in name:
            w = 0.5 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        weights[name] = w.astype(np.float32)
    return weights


def gguf_name(family: TinyFamily, hf_name: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight`, as the converter maps."""
    base, _, part = hf_name.rpartition(".")
    if base in TOP_LEVEL:
        return f"{TOP_LEVEL[base]}.{part}"
    _, _, index, module = base.split(".", 3)
    names = GEMMA_LAYER if family.gemma else LAYER
    return f"blk.{index}.{names[module]}.{part}"


def stored(w: np.ndarray, kind: Q) -> np.ndarray:
    """The float32 values a GGUF tensor of `kind` holds for `w`."""
    if kind == Q.F32:
        return w
    return gguf.quants.dequantize(encode(w, kind), kind).astype(np.float32)


def write_family_gguf(
    path: Path,
    name: str,
    arch: str | None = None,
    metadata: dict[str, Any] | None = None,
    shape: dict[str, Any] | None = None,
    tensor_types: dict[str, Q] | None = None,
    special_tokens: tuple[str, ...] | None = None,
    eos_token: str | None = None,
    chat_template: str | None = CHAT_TEMPLATE,
    add_bos: bool | None = True,
) -> tuple[dict[str, np.ndarray], dict[str, Q]]:
    """Write family `name`'s tiny GGUF to `path`, `arch` and `{arch}.` keys in `metadata`
    instead of the family's own, `shape` over `SHAPE` and `tensor_types` (GGUF type by llama.cpp
    name without `.weight`, float32 where absent) instead of `QUANTIZED`. `special_tokens` are
    the vocabulary's control tokens in place of the ChatML markers (after `<unk>`, `<s>` and
    `</s>` in a sentencepiece one), `eos_token` the one the metadata names eos (else id 2), and
    `chat_template` the template (None: none). A sentencepiece vocabulary's `add_bos` is
    `tokenizer.ggml.add_bos_token` (None: the key left out).

    Returns the values the GGUF holds as mlx-lm's class takes them (dequantized, by mlx-lm
    name) and the GGUF type of each tensor (by llama.cpp name, without `.weight`).
    """
    family = FAMILIES[name]
    writer = gguf.GGUFWriter(str(path), arch or family.arch)
    if family.vocab == "bpe":
        tokens, types, merges = (
            tiny_vocab() if special_tokens is None else tiny_vocab(special_tokens)
        )
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(tokens.index(eos_token) if eos_token else 2)
    else:
        tokens, scores, types = spm_vocab() if special_tokens is None else spm_vocab(special_tokens)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(tokens.index(eos_token) if eos_token else 2)
        writer.add_unk_token_id(0)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)
        if not family.add_space_prefix:
            writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    args = family.model_args(len(tokens), shape)
    writer.add_block_count(args.num_hidden_layers)
    writer.add_context_length(getattr(args, "max_position_embeddings", None) or 8192)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    if (head_dim := family.args.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    for key, value in {**family.metadata, **(metadata or {})}.items():
        full = f"{family.arch}.{key}"
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    values, kinds = {}, {}
    tensor_types = QUANTIZED if tensor_types is None else tensor_types
    for hf, w in hf_weights(family, len(tokens), shape=shape).items():
        if family.tied and hf == "lm_head.weight":
            continue
        name = gguf_name(family, hf)
        base = name.removesuffix(".weight")
        kind = tensor_types.get(base, Q.F32) if name.endswith(".weight") and w.ndim == 2 else Q.F32
        values[hf], kinds[base] = stored(w, kind), kind
        if family.gemma and "norm" in name:
            w = w + 1  # the converter's `data_torch + 1`
        if family.arch == "llama" and base.rpartition(".")[2] in ("attn_q", "attn_k"):
            heads = args.num_attention_heads if "attn_q" in base else args.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        add_tensor(writer, name, w, kind)
    for name, factors in family.tensors.items():
        writer.add_tensor(name, np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values, kinds
