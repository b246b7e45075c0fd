"""Quantize a float mlx-lm model directory into a new directory, with mlx-lm's own quantizer."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from hotlora.models.model_files import atomic_model_dir, copy_aux_files
from hotlora.models.progress import evaluate

log = logging.getLogger("hotlora")

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)


class AlreadyQuantized(ValueError):
    """The source model is quantized already; quantizing it again would compound the error."""


def quantize_model_dir(src: Path, dest: Path, bits: int = 4, group_size: int = 64) -> Path:
    """Write an affine-quantized copy of the float model at `src` to `dest`; return `dest`.

    Every linear and embedding layer whose input size divides by `group_size` is quantized;
    norms stay float. A `group_size` that leaves more layers in float than another would is
    refused; layers that no group size divides stay float, with a warning naming them.
    Tokenizer, templates and model card are copied byte for byte.
    """
    src, dest = Path(src), Path(dest)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, not {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, not {group_size}")
    config = json.loads((src / "config.json").read_text())
    if existing := config.get("quantization") or config.get("quantization_config"):
        raise AlreadyQuantized(
            f"{src} is already quantized ({json.dumps(existing)[:120]}); quantize a float model"
        )
    model, _ = load_model(src, lazy=True)
    _check_group_size(model, group_size)
    with atomic_model_dir(dest) as tmp:
        # mlx-lm prints a bits-per-weight line; the caller decides what to report.
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, bits)
        # Tensor by tensor, for the bar; at most the quantized model is held, as serving does.
        evaluate(dict(tree_flatten(model.parameters())), f"quantizing to {bits} bits")
        save_model(tmp, model, donate_model=True)
        save_config(config, tmp / "config.json")
        copy_aux_files(src, tmp)
    return dest


def _check_group_size(model: nn.Module, group_size: int) -> None:
    """Refuse a group size that leaves layers in float which another would quantize; warn of
    the layers that none can."""
    widths = {
        path: module.weight.shape[-1]
        for path, module in model.named_modules()
        if hasattr(module, "to_quantized") and "weight" in module
    }

    def left(size: int) -> list[str]:
        return [path for path, width in widths.items() if width % size]

    kept = left(group_size)
    if not kept:
        return
    best = min(SUPPORTED_GROUP_SIZES, key=lambda size: (len(left(size)), -size))
    shown = ", ".join(f"{path} ({widths[path]} wide)" for path in kept[:3])
    if len(left(best)) < len(kept):
        raise ValueError(
            f"group_size {group_size} does not divide the input width of {len(kept)} of "
            f"{len(widths)} layers ({shown}, ...): they would stay in float; use "
            f"--group-size {best}"
        )
    log.warning(
        "%d of %d layers stay in float: no group size divides their input width (%s)",
        len(kept),
        len(widths),
        shown,
    )
