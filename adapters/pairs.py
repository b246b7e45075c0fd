"""Matching an adapter file's tensors to the base model's projections, shape by shape."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from hotlora.adapters.adapter_config import CONFIG_FILE, AdapterConfig
from hotlora.adapters.adapter_errors import InvalidAdapter
from hotlora.adapters.projections import TARGET_PROJECTIONS, TargetDims, canonical_path, float_dtype
from hotlora.models.cpu import extension

# `<module>.lora_a` (mlx-lm) or `<module>.lora_A.weight` (PEFT); either spelling, either suffix.
_TENSOR_NAME = re.compile(r"^(?P<module>.+)\.(?P<half>lora_[aAbB])(?:\.weight)?$")
_PEFT_WRAPPER = "base_model.model."  # before a module's name in the base, in PEFT's files
_SHOWN = 3  # how many offending modules or tensors an error message names
_PROJECTIONS = " ".join(sorted(TARGET_PROJECTIONS))
_NUMPY_FLOATS = (mx.float16, mx.float32, mx.float64)  # the float dtypes NumPy reads as they are
_NATIVE_FLOATS = (mx.float32, mx.float16, mx.bfloat16)  # what the extension's all_finite reads
# Modules an adapter may carry weights for that no LoRA slot stands in for, by a part of the name.
_NOT_TARGETS = (
    (("experts", "switch_mlp", "block_sparse_moe"), "MoE expert weights take no LoRA here"),
    (("embed_tokens", "wte", "embeddings", "embed"), "embeddings take no LoRA here"),
    (("lm_head",), "lm_head takes no LoRA here"),
)


@dataclass
class MatchedPairs:
    """The adapter's (A, B) per base module path, A `[in, r]` and B `[r, out]` (mlx-lm layout)."""

    pairs: dict[str, tuple[mx.array, mx.array]] = field(default_factory=dict)


def match_pairs(
    tensors: Mapping[str, mx.array], targets: Mapping[str, TargetDims], rank: int
) -> MatchedPairs:
    """Check every LoRA pair against the base and return them in mlx-lm layout.

    `targets` maps base module paths to their dimensions. Every tensor is applied or the
    adapter is refused: anything that is not a LoRA half of one of the base's target
    projections, or does not fit it, raises `InvalidAdapter` naming the tensor or module and
    why. The returned arrays are evaluated.
    """
    by_canonical = {canonical_path(path): path for path in targets}
    # base module path -> "lora_a"/"lora_b" -> (the file's spelling of the half, name, tensor)
    halves: dict[str, dict[str, tuple[str, str, mx.array]]] = {}
    unknown: list[str] = []
    unusable: list[str] = []  # "<tensor> (<why>)", in file order
    result = MatchedPairs()
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        module = canonical_path(match["module"]) if match else ""
        if match is None or module not in by_canonical:
            why = _why_unusable(name, module)
            if why is not None:
                unusable.append(f"{name} ({why})")
            elif match is not None:  # a target projection, but not one this base has
                unknown.append(match["module"])
            continue
        half = match["half"]
        slot = halves.setdefault(by_canonical[module], {})
        if half.lower() in slot:
            raise InvalidAdapter(f"{match['module']}: {half} is given twice ({name})")
        slot[half.lower()] = (half, name, tensor)

    if not halves and not unknown:
        raise InvalidAdapter(
            f"no tensor in the adapter matches a projection of the base model that takes LoRA "
            f"({_PROJECTIONS}); it was probably trained for another base model"
            + (f": {_listed(unusable)}" if unusable else "")
        )
    if unusable:
        raise InvalidAdapter(
            f"the adapter has tensors that cannot be applied, so it was not mounted: "
            f"{_listed(unusable)}; LoRA applies to {_PROJECTIONS} only"
        )
    if unknown:
        names = ", ".join(sorted(set(unknown))[:_SHOWN])
        raise InvalidAdapter(
            f"the adapter has tensors for modules the base model does not have ({names}); "
            "it was probably trained for another base model"
        )
    # (tensor name, as stored, in mlx-lm layout, the dtype it is mounted in)
    checked: list[tuple[str, mx.array, mx.array, mx.Dtype]] = []
    for path, pair in halves.items():
        a, b = _checked_pair(path, pair, targets[path], rank)
        (_, a_name, a_stored), (_, b_name, b_stored) = pair["lora_a"], pair["lora_b"]
        dtype = targets[path].dtype
        checked += [(a_name, a_stored, a, dtype), (b_name, b_stored, b, dtype)]
    mounted = iter(_mounted(checked))
    for path in halves:
        result.pairs[path] = (next(mounted), next(mounted))
    return result


def _mounted(tensors: list[tuple[str, mx.array, mx.array, mx.Dtype]]) -> list[mx.array]:
    """Each tensor as mounted: in mlx-lm layout, row-major, in its mount dtype, evaluated.

    Refuses NaN or infinite values, as stored or once cast to the mount dtype (float32 values
    past float16's range become inf), naming the tensors. The file's tensors are read in one
    evaluation and checked in place. Rounding float32 to float16 (where adapters are kept in
    float16) is the native kernels' extension's, where it is loaded: MLX's rounding, to the bit,
    in one call that keeps the GIL and queues nothing on MLX's stream behind the decoding steps.
    Any other cast, and a transpose, are MLX's, all in one more evaluation.
    """
    mx.eval([stored for _, stored, _, _ in tensors])
    stored_ok = _all_finite([stored for _, stored, _, _ in tensors])
    stored_bad = [name for (name, *_), ok in zip(tensors, stored_ok, strict=True) if not ok]
    if stored_bad:
        names = ", ".join(stored_bad[:_SHOWN])
        more = f" and {len(stored_bad) - _SHOWN} more" if len(stored_bad) > _SHOWN else ""
        noun = "tensor" if len(stored_bad) == 1 else "tensors"
        raise InvalidAdapter(f"NaN or infinite values in the {noun} {names}{more}")
    # Where each mounted array comes from: the extension's rounding, else MLX's graph.
    native = {
        index
        for index, (_, _, oriented, dtype) in enumerate(tensors)
        if extension.native is not None and oriented.dtype == mx.float32 and dtype == mx.float16
    }
    # A tensor stored in mlx-lm's layout and the mount dtype is mounted as read.
    out = [
        oriented
        if index in native or (oriented is stored and stored.dtype == dtype)
        else mx.contiguous(oriented.astype(dtype))
        for index, (_, stored, oriented, dtype) in enumerate(tensors)
    ]
    finite: dict[int, bool] = {}  # the cast ones: finite once cast
    if native:
        order = sorted(native)
        halves, flags = extension.native.to_half([tensors[index][2] for index in order])
        for index, half, ok in zip(order, halves, flags, strict=True):
            out[index], finite[index] = half, ok
    mx.eval(out)
    by_mlx = [
        index
        for index, (_, _, oriented, dtype) in enumerate(tensors)
        if oriented.dtype != dtype and index not in native
    ]
    finite.update(zip(by_mlx, _all_finite([out[i] for i in by_mlx]), strict=True))
    beyond = [index for index in sorted(finite) if not finite[index]]
    if beyond:
        name, dtype = tensors[beyond[0]][0], _dtype_name(out[beyond[0]].dtype)
        raise InvalidAdapter(
            f"the tensor {name} has values beyond the range of {dtype}, the dtype this server "
            "keeps adapters in (its activations', or --adapter-dtype; where the activations are "
            "float32, --adapter-dtype float32 keeps the values as stored)"
        )
    return out


def _all_finite(arrays: list[mx.array]) -> list[bool]:
    """Whether each evaluated array holds finite values only.

    The native kernels' extension, where it is loaded, checks them all in one call that keeps
    the GIL: a load runs beside the decoding threads, and each time it lets go of the GIL it may
    wait a switch interval to have it back. Else NumPy reads MLX's buffers without a copy, one
    pass a tensor (a graph of one reduction per tensor costs more in per-operation overhead
    than the pass itself); bfloat16, which NumPy lacks, is checked by MLX, all such tensors in
    one evaluation.
    """
    if extension.native is not None and all(array.dtype in _NATIVE_FLOATS for array in arrays):
        return cast(list[bool], extension.native.all_finite(arrays))
    found: dict[int, bool] = {}
    in_mlx: list[int] = []
    for index, array in enumerate(arrays):
        if array.dtype in _NUMPY_FLOATS:
            found[index] = bool(np.isfinite(np.asarray(array)).all())
        else:
            in_mlx.append(index)
    if in_mlx:
        flags = mx.stack([mx.isfinite(arrays[index]).all() for index in in_mlx])  # [n]
        for index, ok in zip(in_mlx, cast(list[bool], flags.tolist()), strict=True):
            found[index] = ok
    return [found[index] for index in range(len(arrays))]


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _checked_pair(
    path: str, pair: dict[str, tuple[str, str, mx.array]], dims: TargetDims, rank: int
) -> tuple[mx.array, mx.array]:
    for half in ("lora_a", "lora_b"):
        if half not in pair:
            other = "lora_b" if half == "lora_a" else "lora_a"
            raise InvalidAdapter(f"{path}: {other} is present but its {half} is missing")
    (a_name, _, a), (_, _, b) = pair["lora_a"], pair["lora_b"]
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
    return a, b  # a PEFT pair's transpose is a view: `_mounted` lays it out row-major


def _why_unusable(name: str, module: str) -> str | None:
    """Why the tensor `name` (a LoRA half of `module`, or `""`) can have no slot in any base
    this adapter could fit; None for a half of a target projection."""
    parts = set(name.split("."))
    for words, why in _NOT_TARGETS:
        if parts & set(words):
            return why
    if not module:
        return "not a LoRA A or B matrix (lora_a, lora_b, lora_A.weight, lora_B.weight)"
    leaf = module.rsplit(".", 1)[-1]
    if leaf not in TARGET_PROJECTIONS:
        return f"{leaf} is not a projection that takes LoRA"
    return None


_IN_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")  # a layer's index, the path within it


def check_declared(
    pairs: Mapping[str, Any], targets: Mapping[str, TargetDims], config: AdapterConfig
) -> None:
    """Refuse pairs (by base module path) outside what an mlx-lm config declares: its
    `num_layers` (the base's last that many layers) and `lora_parameters.keys` (the paths
    within a layer), as mlx-lm refuses them; it would never compute such an adapter."""
    if config.layers is None and config.keys is None:
        return
    indices = [int(found[1]) for path in targets if (found := _IN_LAYER.search(path))]
    count = max(indices, default=-1) + 1  # the base's layers, as mlx-lm counts them
    first = count - config.layers if config.layers is not None else 0
    in_layers: list[str] = []  # pairs in a layer before the first the config declares
    in_keys: list[str] = []  # pairs for a projection its keys leave out
    for path in pairs:
        found = _IN_LAYER.search(path)
        if found is None:
            continue
        # A key is a path within a layer, or (as mlx-lm also reads one, in any layer, whatever
        # `num_layers` says) the module's whole path.
        whole = config.keys is not None and path in config.keys
        if int(found[1]) < first and not whole:
            in_layers.append(path)
        if config.keys is not None and not whole and found[2] not in config.keys:
            in_keys.append(path)
    said, outside = [], sorted({*in_layers, *in_keys})
    if in_layers:
        said.append(f"num_layers {config.layers} (layers {max(first, 0)} to {count - 1})")
    if in_keys:
        said.append(f"lora_parameters.keys {sorted(config.keys or ())}")
    if outside:
        raise InvalidAdapter(
            f"{CONFIG_FILE} says {' and '.join(said)}, but the file holds pairs outside them, "
            f"so it was not mounted (mlx-lm refuses it too): {_listed(outside)}"
        )


def check_targeted(names: Iterable[str], config: AdapterConfig) -> None:
    """Refuse a PEFT adapter holding pairs for modules its config's `target_modules` (less its
    `exclude_modules`, within its `layers_to_transform`) leaves out: PEFT puts LoRA on none of
    them and would load the file without those pairs, so served with them it is not the adapter
    its trainer made."""
    targets = config.peft_targets
    if targets is None:
        return
    modules = {found["module"] for name in names if (found := _TENSOR_NAME.match(name))}
    outside = sorted(m for m in modules if not targets.holds(m.removeprefix(_PEFT_WRAPPER)))
    if outside:
        raise InvalidAdapter(
            f"{CONFIG_FILE}'s target_modules (with its exclude_modules and layers_to_transform) "
            "leave out modules the file holds pairs for, which PEFT would not apply, so it was "
            f"not mounted: {_listed(outside)}"
        )


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more
