"""Where LoRA attaches in a base model: the attention and MLP projections of every layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

# Fused projections (phi3's `qkv_proj`, `gate_up_proj`) are plain linears too: LoRA on one is a
# residual on its whole fused output, as mlx-lm's trainer and PEFT both apply it.
TARGET_PROJECTIONS = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "qkv_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "gate_up_proj",
        "down_proj",
    }
)

# Adapter arrays follow half-precision activations (half the memory, no per-call upcast);
# against float32 activations they stay float32, which is how mlx-lm keeps trained adapters.
_HALF = (mx.float16, mx.bfloat16)

# Attribute chains (not module-tree paths) to a model's decoder layers, most common first.
# mlx-lm's text models expose `.layers` as a property; multimodal wrappers nest the text model.
_LAYER_LISTS = (
    ("layers",),
    ("language_model", "model", "layers"),
    ("language_model", "layers"),
    ("model", "language_model", "layers"),
)

# The attention's attribute holding the heads a projection's output rows hold (mlx-lm's names).
_HEAD_COUNTS = {"q_proj": "n_heads", "k_proj": "n_kv_heads"}

# Prefixes that name the same module in adapter files and wrapped models.
_WRAPPERS = ("base_model.model.",)
_LANGUAGE_MODEL = (("model.language_model.", "model."), ("language_model.", ""))


@dataclass(frozen=True)
class TargetDims:
    """The real shape of a base projection, `y[..., out] = x[..., in] @ W.T`, and the dtype
    adapter arrays attached to it are stored in."""

    in_dims: int
    out_dims: int
    dtype: mx.Dtype = mx.float32
    # What files laid out for another runtime are checked and put in order against (llama.cpp's
    # GGUF adapters): the base's mlx-lm `model_type`, and the attention heads a q_proj or k_proj
    # holds in its output rows.
    model_type: str | None = None
    heads: int | None = None


def canonical_path(name: str) -> str:
    """A module path with trainer and multimodal wrappers removed.

    `base_model.model.model.layers.0.self_attn.q_proj` (PEFT) and
    `language_model.model.layers.0.self_attn.q_proj` (a wrapped base) both become
    `model.layers.0.self_attn.q_proj`, so files and models match whichever side is wrapped.
    """
    for prefix in _WRAPPERS:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    for prefix, replacement in _LANGUAGE_MODEL:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def linear_dims(linear: nn.Module) -> TargetDims:
    """Input/output sizes of a `Linear` or `QuantizedLinear` (whose weight is packed)."""
    out_dims = linear.weight.shape[0]
    if isinstance(linear, nn.QuantizedLinear):
        # The packed weight hides the input size; each scale covers one group of inputs.
        in_dims = linear.scales.shape[-1] * linear.group_size
    else:
        in_dims = linear.weight.shape[1]
    return TargetDims(in_dims=in_dims, out_dims=out_dims)


def target_dims(
    linear: nn.Module, input_dtype: mx.Dtype | None, adapter_dtype: mx.Dtype
) -> TargetDims:
    """The projection's shape, and what adapters are kept in there: the activations' dtype
    where it is a half one, else `adapter_dtype` (float32, or float16 to halve their bytes)."""
    dims = linear_dims(linear)
    kept = input_dtype if input_dtype is not None and input_dtype in _HALF else adapter_dtype
    return TargetDims(dims.in_dims, dims.out_dims, kept)


def with_base_layout(model: nn.Module, targets: Mapping[str, TargetDims]) -> dict[str, TargetDims]:
    """`targets` with the base's `model_type` and each q/k projection's heads filled in, as
    mlx-lm's models keep them (`model_type`, the attention's `n_heads` and `n_kv_heads`)."""
    model_type = getattr(model, "model_type", None)
    modules = dict(model.named_modules())
    laid_out = {}
    for path, dims in targets.items():
        parent, _, leaf = path.rpartition(".")
        attribute = _HEAD_COUNTS.get(leaf)
        heads = getattr(modules.get(parent), attribute, None) if attribute else None
        laid_out[path] = replace(
            dims,
            model_type=model_type if isinstance(model_type, str) else None,
            heads=heads if isinstance(heads, int) and heads > 0 else None,
        )
    return laid_out


def find_layers(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The decoder layer list and its module-tree path (e.g. `model.layers`)."""
    for chain in _LAYER_LISTS:
        node: object = model
        for attr in chain:
            node = getattr(node, attr, None)
            if node is None:
                break
        if isinstance(node, list) and node and all(isinstance(m, nn.Module) for m in node):
            paths = {id(module): name for name, module in model.named_modules()}
            first = paths.get(id(node[0]))
            if first is not None:
                return first.rsplit(".", 1)[0], node
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def find_targets(
    model: nn.Module, kinds: tuple[type[nn.Module], ...] = (nn.Linear, nn.QuantizedLinear)
) -> dict[str, nn.Module]:
    """Every target projection of every layer, by module path, in layer order."""
    prefix, layers = find_layers(model)
    found: dict[str, nn.Module] = {}
    for index, layer in enumerate(layers):
        for sub, module in layer.named_modules():
            if sub.rsplit(".", 1)[-1] in TARGET_PROJECTIONS and isinstance(module, kinds):
                found[f"{prefix}.{index}.{sub}"] = module
    return found


def replace_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at `path` in the model tree, leaving every other module as it is."""
    model.update_modules(tree_unflatten([(path, module)]))


def float_dtype(dtype: mx.Dtype) -> bool:
    """Whether adapter tensors of this dtype can take part in the residual."""
    return mx.issubdtype(dtype, mx.floating)
