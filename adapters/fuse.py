"""Merging one adapter into a copy of the base model's weights, for serving without LoRA."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import save_config, save_model

from hotlora.adapters.adapter_files import read_adapter
from hotlora.adapters.projections import (
    find_targets,
    linear_dims,
    replace_module,
    with_base_layout,
)
from hotlora.models.loader import load_model_dir
from hotlora.models.model_files import atomic_model_dir, copy_aux_files
from hotlora.models.progress import bar


def fuse_adapter(model_dir: Path, adapter_path: Path, out: Path) -> Path:
    """Write the base in `model_dir` with the adapter in `adapter_path` merged in, to `out`.

    Each target becomes `W' = W + scale * (A @ B).T`; a quantized base is dequantized, merged
    and quantized again with its own bits, group size and mode, so the result loads like the
    base. The adapter is validated exactly as a mount would be, without the adapter root or the
    server's rank and file-size limits (this runs on the operator's own files). `out` appears
    whole or not at all.
    """
    loaded_model = load_model_dir(Path(model_dir))
    model = loaded_model.model
    linears = find_targets(model)
    adapter = read_adapter(
        Path(adapter_path).expanduser().resolve(),
        with_base_layout(model, {path: linear_dims(linear) for path, linear in linears.items()}),
        max_rank=sys.maxsize,
        max_bytes=sys.maxsize,
    )
    merging = bar(adapter.weights.items(), "merging", total=len(adapter.weights))
    for path, (a, b) in merging:
        fused = merge_linear(linears[path], a, b, adapter.config.scale)
        mx.eval(fused.parameters())  # one layer at a time: the bar moves, the peak stays low
        replace_module(model, path, fused)
    with atomic_model_dir(Path(out)) as tmp:
        save_model(tmp, model)
        save_config(dict(loaded_model.config), tmp / "config.json")
        copy_aux_files(Path(model_dir), tmp)
    return Path(out)


def merge_linear(linear: nn.Module, a: mx.array, b: mx.array, scale: float) -> nn.Module:
    """A new projection equal to `linear` plus the residual `scale * (x @ a) @ b`.

    `a` is `[in, r]`, `b` is `[r, out]`; `linear` itself is left unchanged.
    """
    quantized = isinstance(linear, nn.QuantizedLinear)
    weight = linear.weight  # [out, in]
    if quantized:
        weight = mx.dequantize(
            linear.weight,
            linear.scales,
            linear.get("biases"),
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    delta = (scale * (a @ b).T).astype(weight.dtype)  # [out, in]
    dims = linear_dims(linear)
    fused = nn.Linear(dims.in_dims, dims.out_dims, bias="bias" in linear)
    fused.weight = weight + delta
    if "bias" in linear:
        fused.bias = linear.bias
    if quantized:
        fused = nn.QuantizedLinear.from_linear(
            fused, linear.group_size, linear.bits, mode=linear.mode
        )
    return fused
