"""The model families hotlora serves, each as a tiny random-weight model built by mlx-lm's own
classes: what the family tests and the family step-time bench run on."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, granite, llama, olmo2, phi3, qwen2, qwen3, qwen3_moe

from tests.support.tiny import MAX_POSITION_EMBEDDINGS, VOCAB_SIZE

WINDOW = 8  # the sliding window of the sliding-window families, shorter than LONG
LONG = mx.array([[(7 * i + 5) % (VOCAB_SIZE - 4) + 4 for i in range(3 * WINDOW)]])
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

# Common to every family: 2 layers, hidden 64, 4 query heads over 2 key-value heads.
SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB_SIZE,
}


@dataclass(frozen=True)
class Family:
    """A family: its mlx-lm module, its arguments, and what its adapters target."""

    module: ModuleType
    args: dict
    keys: tuple[str, ...] | None = None  # projections the adapters target; None: all
    sliding: bool = False

    def model_args(self, name: str, **shape: int):
        """mlx-lm's arguments of the family's model: `SHAPE`, as far as `shape` does not
        replace it."""
        return self.module.ModelArgs(model_type=name, **{**SHAPE, **shape}, **self.args)

    def build(self, name: str, seed: int = 0, **shape: int) -> nn.Module:
        """The family's tiny model; the same seed gives the same weights."""
        mx.random.seed(seed)
        model = self.module.Model(self.model_args(name, **shape))
        mx.eval(model.parameters())
        return model


FAMILIES: dict[str, Family] = {
    "llama": Family(llama, {}),
    # mlx-lm builds mistral with its llama module; a sliding layer beside a full one.
    "mistral": Family(
        llama,
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        sliding=True,
    ),
    "qwen2": Family(qwen2, {}),
    "qwen3": Family(
        qwen3,
        {
            "head_dim": 16,
            "rope_theta": 10000.0,
            "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3_text": Family(
        gemma3_text,
        {"head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 2},
        sliding=True,
    ),
    "olmo2": Family(olmo2, {}),
    "granite": Family(
        granite,
        {
            "logits_scaling": 4.0,
            "attention_multiplier": 0.25,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
            "attention_bias": False,
            "mlp_bias": False,
            "rope_theta": 10000.0,
        },
    ),
    "gemma2": Family(gemma2, {"head_dim": 16}),
    "phi3": Family(phi3, {}),
    # LoRA on the attention projections only: the experts' switch layers take none.
    "qwen3_moe": Family(
        qwen3_moe,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 32,
            "head_dim": 16,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
            "norm_topk_prob": True,
        },
        keys=ATTENTION,
    ),
}
