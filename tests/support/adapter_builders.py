"""Shared builders for the adapter tests: tiny random models and adapter directories.

No tests here; the adapter test modules import these builders.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama, phi3

from hotlora.adapters import AdapterManager, AdapterSet, parse_adapter_spec
from hotlora.adapters.projections import TARGET_PROJECTIONS, find_targets, linear_dims
from hotlora.adapters.slots import LoRASlot

from tests.support.tiny import tiny_args

BASE_ID = "tiny"
RANK = 4
SCALE = 2.0
TOKENS = mx.array([[5, 17, 3, 99, 42, 7]])

Pairs = dict[str, tuple[mx.array, mx.array]]  # module path -> (A [in, r], B [r, out])


def tiny_model(quantize: bool = False, seed: int = 0) -> nn.Module:
    """The 2-layer llama; the same seed gives the same weights, so copies are comparable."""
    mx.random.seed(seed)
    model = llama.Model(tiny_args())
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def tiny_phi3(seed: int = 0) -> nn.Module:
    """A 2-layer phi3 the size of the tiny llama: fused `qkv_proj` and `gate_up_proj`."""
    llama_args = tiny_args()
    args = phi3.ModelArgs(
        model_type="phi3",
        hidden_size=llama_args.hidden_size,
        num_hidden_layers=llama_args.num_hidden_layers,
        intermediate_size=llama_args.intermediate_size,
        num_attention_heads=llama_args.num_attention_heads,
        num_key_value_heads=llama_args.num_key_value_heads,
        rms_norm_eps=llama_args.rms_norm_eps,
        vocab_size=llama_args.vocab_size,
        max_position_embeddings=llama_args.max_position_embeddings,
    )
    mx.random.seed(seed)
    model = phi3.Model(args)
    mx.eval(model.parameters())
    return model


def logits(model: nn.Module, tokens: mx.array = TOKENS) -> mx.array:
    out = model(tokens)
    mx.eval(out)
    return out


def random_pairs(
    model: nn.Module,
    *,
    rank: int = RANK,
    seed: int = 1,
    keys: Iterable[str] = TARGET_PROJECTIONS,
) -> Pairs:
    """Random A/B for the chosen projections of every layer of a model without slots."""
    keys = set(keys)
    mx.random.seed(seed)
    pairs: Pairs = {}
    for path, linear in find_targets(model).items():
        if path.rsplit(".", 1)[-1] not in keys:
            continue
        dims = linear_dims(linear)
        a = 0.2 * mx.random.normal((dims.in_dims, rank))  # [in, r]
        b = 0.2 * mx.random.normal((rank, dims.out_dims))  # [r, out]
        pairs[path] = (a, b)
    return pairs


def layer_keys(pairs: Pairs) -> list[str]:
    """mlx-lm's `lora_parameters.keys`: module paths relative to a layer."""
    return sorted({path.split(".", 3)[3] for path in pairs})


def write_mlx_adapter(
    directory: Path,
    pairs: Pairs,
    *,
    rank: int = RANK,
    scale: float = SCALE,
    extra_tensors: dict[str, mx.array] | None = None,
    config: dict | None = None,
) -> Path:
    """An mlx-lm adapter directory that mlx-lm's own `load_adapters` reads."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, (a, b) in pairs.items():
        tensors[f"{path}.lora_a"] = a
        tensors[f"{path}.lora_b"] = b
    tensors.update(extra_tensors or {})
    mx.save_safetensors(str(directory / "adapters.safetensors"), tensors)
    default = {
        "fine_tune_type": "lora",
        "num_layers": -1,  # every layer: the pairs may be in any
        "lora_parameters": {
            "rank": rank,
            "scale": scale,
            "dropout": 0.0,
            "keys": layer_keys(pairs),
        },
    }
    (directory / "adapter_config.json").write_text(json.dumps(config or default))
    return directory


def write_peft_adapter(
    directory: Path,
    pairs: Pairs,
    *,
    rank: int = RANK,
    alpha: float = 2.0 * RANK,
    rslora: bool = False,
    prefix: str = "base_model.model.",
) -> Path:
    """The same pairs in PEFT's layout: A `[r, in]`, B `[out, r]`, `lora_A.weight` names."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, (a, b) in pairs.items():
        tensors[f"{prefix}{path}.lora_A.weight"] = mx.array(a.T)
        tensors[f"{prefix}{path}.lora_B.weight"] = mx.array(b.T)
    mx.save_safetensors(str(directory / "adapter_model.safetensors"), tensors)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": layer_keys(pairs),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def merged_model(terms: Iterable[tuple[Pairs, float]]) -> nn.Module:
    """A fresh model with `W + scale * (A @ B).T` written into its float weights (reference)."""
    model = tiny_model(quantize=False)
    linears = find_targets(model)
    updates = {}
    for pairs, scale in terms:
        for path, (a, b) in pairs.items():
            weight = updates.get(path, linears[path].weight)
            updates[path] = weight + scale * (a @ b).T  # [out, in]
    for path, weight in updates.items():
        linears[path].weight = weight
    mx.eval(model.parameters())
    return model


def make_manager(
    root: Path, *, quantize: bool = False, max_rank: int = 64, max_bytes: int = 2 << 30
) -> tuple[nn.Module, AdapterManager]:
    model = tiny_model(quantize=quantize)
    manager = AdapterManager(
        model, base_id=BASE_ID, adapter_root=root, max_rank=max_rank, max_bytes=max_bytes
    )
    return model, manager


def manager_with_a_and_b(root: Path) -> tuple[nn.Module, AdapterManager]:
    """A manager over the tiny model with two random adapters mounted, `a` and `b`."""
    model, manager = make_manager(root)
    for seed, adapter_id in enumerate(("a", "b"), start=1):
        write_mlx_adapter(root / adapter_id, random_pairs(tiny_model(), seed=seed))
        manager.mount(adapter_id, adapter_id)
    return model, manager


def adapter_set(manager: AdapterManager, spec: str) -> AdapterSet:
    """The set a request's `adapter` field `spec` names, not counted as in use."""
    return manager.resolve(parse_adapter_spec(spec))


def slots(model: nn.Module) -> dict[str, LoRASlot]:
    """The LoRA slots installed in `model`, by module path."""
    return {path: slot for path, slot in find_targets(model, (LoRASlot,)).items()}


def parameter_ids(model: nn.Module) -> list[tuple[str, int]]:
    return [(name, id(array)) for name, array in tree_flatten(model.parameters())]
