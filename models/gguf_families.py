"""The GGUF architectures llama.cpp's converter writes, each mapped onto an mlx-lm model class.

A family says which mlx-lm `model_type` a `general.architecture` becomes, where each llama.cpp
tensor goes, what the converter did to the Hugging Face weights that must be undone (q/k rows
permuted for llama, gemma norms stored with 1 added), and how the metadata becomes config.json.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hotlora.models.loader import DEFAULT_CONTEXT_LENGTH


class UnsupportedGGUF(ValueError):
    """The GGUF file uses an architecture, tensor type or tokenizer this importer cannot keep."""


class Metadata:
    """The `{arch}.*` keys of one GGUF file, read with the checks every family needs."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.raw = metadata
        self.arch = arch

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, else `default`; a missing key without default or a per-layer list is
        refused."""
        value = self.raw.get(f"{self.arch}.{key}", default)
        if value is None:
            raise UnsupportedGGUF(f"GGUF metadata lacks {self.arch}.{key}")
        if isinstance(value, (list, np.ndarray)):
            raise UnsupportedGGUF(f"per-layer {self.arch}.{key} is not supported")
        return value

    def has(self, key: str) -> bool:
        """Whether the file sets `{arch}.{key}`."""
        return f"{self.arch}.{key}" in self.raw


def float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds back to it (1e-05)."""
    return float(np.format_float_positional(np.float32(value)))


# llama.cpp tensor names -> mlx-lm module paths, shared by every family.
TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
MLP = {
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_LAYER = {**ATTENTION, "ffn_norm": "post_attention_layernorm", **MLP}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2 and 3 norm around both attention and MLP; llama.cpp's ffn_norm is the pre-MLP one.
GEMMA_LAYER = {
    **ATTENTION,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **MLP,
}
# Phi-3 keeps q, k, v in one matrix and gate, up in another (gate rows first), as llama.cpp does.
PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture becomes an mlx-lm model directory."""

    model_type: str
    architecture: str  # the Hugging Face class name config.json carries
    layer_names: dict[str, str]
    config: Callable[[Metadata, dict[str, Any]], dict[str, Any]]
    # llama.cpp permutes q/k rows for its rotary layout in llama models only.
    permuted_qk: bool = False
    # Gemma's converter stores every norm weight with 1 added; mlx-lm's gemma adds the 1 itself.
    norm_offset: float = 0.0
    # The family's lm_head is always the embedding (mlx-lm has no separate one for it).
    always_tied: bool = False
    # Layer tensors mlx-lm's class always has besides the `.weight` of every layer name.
    required_biases: tuple[str, ...] = ()
    # Top-level tensors that carry settings rather than weights, read into the config.
    setting_tensors: tuple[str, ...] = ()


def rope_scaling(meta: Metadata, allowed: tuple[str, ...]) -> dict[str, Any] | None:
    """config.json's `rope_scaling` from `{arch}.rope.scaling.*`; kinds not in `allowed` refused."""
    kind = meta.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in allowed:
        raise UnsupportedGGUF(f"rope scaling {kind!r} is not supported for {meta.arch}")
    return {"type": kind, "factor": float32(meta.get("rope.scaling.factor"))}


def common_config(meta: Metadata, tensors: dict[str, Any], *, head_dim_key: bool) -> dict:
    """The keys every family's config.json shares; `head_dim` when the class takes one."""
    hidden, n_head = int(meta.get("embedding_length")), int(meta.get("attention.head_count"))
    head_dim = int(meta.get("attention.key_length", hidden // n_head))
    if int(meta.get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedGGUF("different key and value head sizes are not supported")
    if not head_dim_key and head_dim != hidden // n_head:
        raise UnsupportedGGUF(
            f"{meta.arch}: a head size ({head_dim}) other than hidden size / heads "
            f"({hidden // n_head}) is not supported"
        )
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(meta.get("feed_forward_length")),
        "num_hidden_layers": int(meta.get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("attention.head_count_kv", n_head)),
        "rms_norm_eps": float32(meta.get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        # The embedding's rows, one a token (the importer checks), not {arch}.vocab_size.
        "vocab_size": tensors["token_embd.weight"].shape[0],
        # A length of 0 states none: the server's default instead (the importer warns).
        "max_position_embeddings": int(meta.get("context_length")) or DEFAULT_CONTEXT_LENGTH,
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if head_dim_key:
        config["head_dim"] = head_dim
    return config


def full_rotary(meta: Metadata, head_dim: int) -> None:
    """Refuse rotary on part of each head for the classes that rotate all of it."""
    if int(meta.get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedGGUF("rotary embedding on part of each head is not supported")


def llama_config(meta: Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """Llama and Mistral (llama.cpp writes Mistral as `llama`); Llama 3 rope is added later."""
    config = common_config(meta, tensors, head_dim_key=True)
    full_rotary(meta, config["head_dim"])
    if config["head_dim"] == config["hidden_size"] // config["num_attention_heads"]:
        del config["head_dim"]
    config["hidden_act"] = "silu"
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if (scaling := rope_scaling(meta, ("linear",))) is not None:
        config["rope_scaling"] = scaling
    return config


def qwen2_config(meta: Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """Qwen 2 / 2.5: q, k, v biases; the head size is always hidden size / heads."""
    config = common_config(meta, tensors, head_dim_key=False)
    full_rotary(meta, config["hidden_size"] // config["num_attention_heads"])
    if (scaling := rope_scaling(meta, ("linear",))) is not None:
        config["rope_scaling"] = scaling
    return config


def qwen3_config(meta: Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """Qwen 3: q/k norms, a head size of its own."""
    config = common_config(meta, tensors, head_dim_key=True)
    full_rotary(meta, config["head_dim"])
    if (scaling := rope_scaling(meta, ("linear",))) is not None:
        config["rope_scaling"] = scaling
    return config


def gemma_query_scalar(config: dict[str, Any], layers_27b: int) -> int:
    """The query scale's divisor llama.cpp uses: hidden size / heads for the 27B model (which
    it recognises by its layer count), the head size otherwise."""
    if config["num_hidden_layers"] == layers_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return int(config["head_dim"])


def gemma2_config(meta: Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2: soft-capped attention and logits; sliding window on every other layer."""
    config = common_config(meta, tensors, head_dim_key=True)
    full_rotary(meta, config["head_dim"])
    rope_scaling(meta, ())
    config |= {
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": float32(meta.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float32(meta.get("final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": gemma_query_scalar(config, layers_27b=46),
        # Recorded for other readers; mlx-lm's gemma2 attends to the whole context.
        "sliding_window": int(meta.get("attention.sliding_window", 4096)),
    }
    return config


def gemma3_config(meta: Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 (text): q/k norms; sliding-window layers with their own rope base, one global
    layer in every `sliding_window_pattern` (llama.cpp's default 6)."""
    config = common_config(meta, tensors, head_dim_key=True)
    full_rotary(meta, config["head_dim"])
    if meta.has("final_logit_softcapping"):
        raise UnsupportedGGUF("gemma3 with final logit soft-capping is not supported")
    window = int(meta.get("attention.sliding_window", 0))
    config |= {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": gemma_query_scalar(config, layers_27b=62),
        "rope_local_base_freq": float(meta.get("rope.freq_base_swa", 10000.0)),
        "sliding_window": window if window > 0 else config["max_position_embeddings"],
        "sliding_window_pattern": sliding_pattern(meta, config["num_hidden_layers"], window),
    }
    if (scaling := rope_scaling(meta, ("linear",))) is not None:
        config["rope_scaling"] = scaling
    return config


def sliding_pattern(meta: Metadata, layers: int, window: int) -> int:
    """mlx-lm's `sliding_window_pattern` n: layers n-1, 2n-1, ... attend globally, the rest
    through the window. Without a window every layer is global (n = 1)."""
    if window <= 0:
        return 1
    key = f"{meta.arch}.attention.sliding_window_pattern"
    pattern = meta.raw.get(key, 6)
    if isinstance(pattern, (list, np.ndarray)):  # one flag a layer, true where the layer slides
        for n in range(1, layers + 1):
            if [bool(p) for p in pattern] == [(i + 1) % n != 0 for i in range(layers)]:
                return n
        raise UnsupportedGGUF(f"{key} {pattern} has no period mlx-lm's gemma3 can express")
    return int(pattern)


def phi3_config(meta: Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 (and Phi-4-mini): fused projections, rotary on part of each head."""
    config = common_config(meta, tensors, head_dim_key=False)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rope_dim = int(meta.get("rope.dimension_count", head_dim))
    rope_scaling(meta, ())
    config |= {
        "hidden_act": "silu",
        "partial_rotary_factor": rope_dim / head_dim,
        "original_max_position_embeddings": int(
            meta.get("rope.scaling.original_context_length", config["max_position_embeddings"])
        ),
    }
    return config


def longrope_scaling(
    meta: Metadata, config: dict[str, Any], long: np.ndarray, short: np.ndarray
) -> dict[str, Any]:
    """Phi-3's long-context rope from the factor tensors llama.cpp writes, checked against the
    attention factor it stored (mlx-lm recomputes that factor from the two lengths)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    half = int(head_dim * config["partial_rotary_factor"]) // 2
    if long.shape != (half,) or short.shape != (half,):
        raise UnsupportedGGUF(f"rope_factors_long/short must hold {half} values")
    scale = config["max_position_embeddings"] / config["original_max_position_embeddings"]
    old = config["original_max_position_embeddings"]
    expected = math.sqrt(1 + math.log(scale) / math.log(old)) if scale > 1 else 1.0
    stored = float(meta.get("rope.scaling.attn_factor", expected))
    if not math.isclose(stored, expected, rel_tol=1e-5):
        raise UnsupportedGGUF(f"rope attention factor {stored} is not longrope's {expected:.6f}")
    return {"type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}


FAMILIES = {
    "llama": Family(
        "llama",
        "LlamaForCausalLM",
        LLAMA_LAYER,
        llama_config,
        permuted_qk=True,
        setting_tensors=("rope_freqs.weight",),
    ),
    "qwen2": Family(
        "qwen2",
        "Qwen2ForCausalLM",
        LLAMA_LAYER,
        qwen2_config,
        required_biases=("attn_q", "attn_k", "attn_v"),
    ),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", {**LLAMA_LAYER, **QK_NORMS}, qwen3_config),
    "gemma2": Family(
        "gemma2",
        "Gemma2ForCausalLM",
        GEMMA_LAYER,
        gemma2_config,
        norm_offset=1.0,
        always_tied=True,
    ),
    "gemma3": Family(
        "gemma3_text",
        "Gemma3ForCausalLM",
        {**GEMMA_LAYER, **QK_NORMS},
        gemma3_config,
        norm_offset=1.0,
    ),
    "phi3": Family(
        "phi3",
        "Phi3ForCausalLM",
        PHI3_LAYER,
        phi3_config,
        setting_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
    ),
}


def family_of(arch: Any) -> Family:
    """The family of `general.architecture` `arch`; any other is refused, naming it."""
    if arch not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedGGUF(f"architecture {arch!r} is not supported (supported: {supported})")
    return FAMILIES[arch]
