"""Matching an adapter file's tensors to the base model's projections, shape by shape."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import mlx.core as mx

from hotlora.adapters.adapter_errors import InvalidAdapter
from hotlora.adapters.projections import TARGET_PROJECTIONS, TargetDims, canonical_path, float_dtype

# `<module>.lora_a` (mlx-lm) or `<module>.lora_A.weight` (PEFT); either spelling, either suffix.
_TENSOR_NAME = re.compile(r"^(?P<module>.+)\.(?P<half>lora_[aAbB])(?:\.weight)?$")
_SHOWN = 3  # how many offending modules an error message names


@dataclass
class MatchedPairs:
    """The adapter's (A, B) per base module path, A `[in, r]` and B `[r, out]` (mlx-lm layout)."""

    pairs: dict[str, tuple[mx.array, mx.array]] = field(default_factory=dict)
    skipped_tensors: int = 0


def match_pairs(
    tensors: Mapping[str, mx.array], targets: Mapping[str, TargetDims], rank: int
) -> MatchedPairs:
    """Check every LoRA pair against the base and return them in mlx-lm layout.

    `targets` maps base module paths to their dimensions. Tensors for modules that are not one
    of the seven projections are skipped and counted; anything else that does not fit raises
    `InvalidAdapter` naming the module.
    """
    by_canonical = {canonical_path(path): path for path in targets}
    halves: dict[str, dict[str, tuple[str, mx.array]]] = {}
    unknown: list[str] = []
    result = MatchedPairs()
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            result.skipped_tensors += 1
            continue
        module = canonical_path(match["module"])
        if module.rsplit(".", 1)[-1] not in TARGET_PROJECTIONS:
            result.skipped_tensors += 1
            continue
        if module not in by_canonical:
            unknown.append(match["module"])
            continue
        half = match["half"]
        slot = halves.setdefault(by_canonical[module], {})
        if half.lower() in slot:
            raise InvalidAdapter(f"{match['module']}: {half} is given twice ({name})")
        slot[half.lower()] = (half, tensor)

    if not halves:
        raise InvalidAdapter(
            "no tensor in the adapter matches a q/k/v/o/gate/up/down projection of the base "
            "model; it was probably trained for another base model"
        )
    if unknown:
        names = ", ".join(sorted(set(unknown))[:_SHOWN])
        raise InvalidAdapter(
            f"the adapter has tensors for modules the base model does not have ({names}); "
            "it was probably trained for another base model"
        )
    for path, pair in halves.items():
        result.pairs[path] = _checked_pair(path, pair, targets[path], rank)
    return result


def _checked_pair(
    path: str, pair: dict[str, tuple[str, mx.array]], dims: TargetDims, rank: int
) -> tuple[mx.array, mx.array]:
    for half in ("lora_a", "lora_b"):
        if half not in pair:
            other = "lora_b" if half == "lora_a" else "lora_a"
            raise InvalidAdapter(f"{path}: {other} is present but its {half} is missing")
    (a_name, a), (_, b) = pair["lora_a"], pair["lora_b"]
    for name, tensor in (("lora_a", a), ("lora_b", b)):
        if tensor.ndim != 2:
            shape = tuple(tensor.shape)
            raise InvalidAdapter(f"{path}: {name} must be a matrix, got shape {shape}")
        if not float_dtype(tensor.dtype):
            raise InvalidAdapter(f"{path}: {name} has non-float dtype {tensor.dtype}")

    i, o = dims.in_dims, dims.out_dims
    # mlx-lm: A [in, r], B [r, out]. PEFT: A [r, in], B [out, r].
    mlx_fits = a.shape[0] == i and b.shape[1] == o and a.shape[1] == b.shape[0]
    peft_fits = a.shape[1] == i and b.shape[0] == o and a.shape[0] == b.shape[1]
    if mlx_fits and peft_fits:
        # Only a square full-rank pair fits both; the trainer's spelling tells them apart.
        peft_fits = a_name == "lora_A"
        mlx_fits = not peft_fits
    if not (mlx_fits or peft_fits):
        raise InvalidAdapter(
            f"{path}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} do not fit the base "
            f"projection ({i} inputs, {o} outputs)"
        )
    if peft_fits:
        a, b = a.T, b.T  # [in, r], [r, out]
    if a.shape[1] != rank:
        raise InvalidAdapter(
            f"{path}: the tensors have rank {a.shape[1]} but adapter_config.json says {rank}"
        )
    return a.astype(dims.dtype), b.astype(dims.dtype)
