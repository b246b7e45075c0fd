"""llama.cpp's LoRA files: a GGUF adapter as `convert_lora_to_gguf.py` writes it, read as the
pairs the mlx-lm and PEFT readers give and checked against the base before its data is read.

Such a file says `general.type = adapter`, `adapter.type = lora` and `adapter.lora.alpha`, and
holds `blk.N.<tensor>.weight.lora_a` `[r, in]` and `.lora_b` `[out, r]` (rows first, PEFT's
layout) under llama.cpp's tensor names. The names are mapped to module paths by the GGUF
importer's own table, and the rows of a llama q/k `lora_b`, which the converter permuted as it
permutes the base's q/k weights, are put back by the importer's own un-permutation. As in
llama.cpp, the scale is `alpha / r`, or 1 where the file gives no alpha (or 0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
from mlx_lm.utils import MODEL_REMAPPING

from hotlora.adapters.adapter_config import MAX_SCALE, AdapterConfig
from hotlora.adapters.adapter_errors import InvalidAdapter
from hotlora.adapters.projections import TARGET_PROJECTIONS, TargetDims, canonical_path
from hotlora.models.gguf import (
    _mlx_path,  # the importer's own name table and q/k row order: adapter and base agree
    _unpermute_rows,
    check_whole,
)
from hotlora.models.gguf_families import Family, UnsupportedGGUF, family_of
from hotlora.models.gguf_header import GGUF_MAGIC, GGUFHeader, TensorInfo, read_header
from hotlora.models.gguf_tensors import read_tensor, tensor_bytes

Q = GGMLQuantizationType
GGUF_SUFFIX = ".gguf"
# What the converter writes a LoRA tensor as (`--outtype f32|f16|bf16|q8_0`).
STORED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0)
_HALVES = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight"}  # PEFT's names, PEFT's layout
_PERMUTED = ("attn_q", "attn_k")  # llama's rotary row order, as the importer undoes it
_SHOWN = 3  # how many offending tensors a message names


@dataclass(frozen=True)
class GGUFAdapter:
    """A checked llama.cpp LoRA file: its rank and scale, and where each pair goes."""

    path: Path
    config: AdapterConfig
    header: GGUFHeader
    # llama.cpp module name (`blk.0.attn_q`) -> (module path, heads to un-permute lora_b by)
    modules: dict[str, tuple[str, int | None]]


def is_gguf(path: Path) -> bool:
    """Whether the file at `path` opens with GGUF's magic."""
    with path.open("rb") as stream:
        return stream.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def read_gguf_adapter(
    path: Path, targets: Mapping[str, TargetDims], *, max_rank: int
) -> GGUFAdapter:
    """Read the header of the llama.cpp LoRA file at `path` and check it against `targets`.

    Refused, naming the key or tensors at fault: a file that is not a GGUF LoRA adapter (a
    base model's GGUF included), an architecture other than the base's, activated LoRA, a
    tensor that is not a LoRA half of a projection the base has, a pair that does not fit its
    projection, ranks that differ between pairs or pass `max_rank`, a scale past `MAX_SCALE`,
    a file cut short.
    """
    try:
        header = read_header(path)
    except UnsupportedGGUF as exc:
        raise InvalidAdapter(f"{path.name} cannot be read as a GGUF adapter: {exc}") from None
    meta = header.metadata
    kind = meta.get("general.type")
    if not _is(kind, "adapter"):
        shown = "none" if kind is None else f"{kind!r:.40}"
        raise InvalidAdapter(
            f"{path.name} is not a LoRA adapter: its general.type is {shown}, not 'adapter' "
            "(a model GGUF is served with --model, not mounted)"
        )
    if not _is(adapter_type := meta.get("adapter.type"), "lora"):
        raise InvalidAdapter(
            f"{path.name}: adapter.type {adapter_type!r:.40} is not supported; only "
            "'lora' adapters mount"
        )
    if "adapter.alora.invocation_tokens" in meta:
        raise InvalidAdapter(
            f"{path.name} is an activated LoRA (adapter.alora.invocation_tokens), whose residual "
            "applies only after its invocation tokens; it is not supported"
        )
    family = _family(path, meta.get("general.architecture"), targets)
    modules, pairs = _pairs(header, family, targets)
    rank = _rank(pairs, targets, modules, max_rank)
    try:
        check_whole(path, header)  # every tensor's type known by now (`_pairs`, `_rank`)
    except UnsupportedGGUF as exc:
        raise InvalidAdapter(str(exc)) from None
    for name, (module_path, _) in list(modules.items()):
        modules[name] = (module_path, _heads(name, family, targets[module_path]))
    return GGUFAdapter(path, AdapterConfig(rank, _scale(path, meta, rank)), header, modules)


def load_gguf_tensors(adapter: GGUFAdapter) -> dict[str, mx.array]:
    """The adapter's tensors in PEFT's names and layout (`<path>.lora_A.weight` `[r, in]`,
    `.lora_B.weight` `[out, r]`), llama's q/k `lora_b` rows back in mlx-lm's order."""
    header = adapter.header
    data = np.memmap(adapter.path, dtype=np.uint8, mode="r")
    tensors: dict[str, mx.array] = {}
    for name, (module_path, heads) in adapter.modules.items():
        for half, peft_half in _HALVES.items():
            tensor = f"{name}.weight.{half}"
            info = header.tensors[tensor]
            start = header.data_start + info.offset
            end = start + tensor_bytes(info.type, info.shape)
            array = _values(data[start:end], info)
            if heads is not None and half == "lora_b":
                array = _unpermute_rows(array, heads)
            tensors[f"{module_path}.{peft_half}"] = array
    return tensors


def _values(raw: np.ndarray, info: TensorInfo) -> mx.array:
    """One tensor as stored, a Q8_0 one as the float32 values llama.cpp dequantizes it to."""
    if info.type == Q.Q8_0:
        return mx.array(dequantize(raw.reshape(info.shape[0], -1), Q.Q8_0).astype(np.float32))
    return read_tensor(raw, info.type, info.shape)[0]


def _family(path: Path, arch: Any, targets: Mapping[str, TargetDims]) -> Family:
    """The importer's family of the file's architecture, which must be the base's."""
    if not isinstance(arch, str):
        raise InvalidAdapter(f"{path.name} gives no general.architecture")
    try:
        family = family_of(arch)
    except UnsupportedGGUF as exc:
        raise InvalidAdapter(f"{path.name}: {exc}") from None
    base_types = {dims.model_type for dims in targets.values()}
    if None in base_types or len(base_types) != 1:
        raise InvalidAdapter(
            f"{path.name}: the base model's type is not known here, so a llama.cpp adapter "
            "cannot be checked against it"
        )
    base_type = str(base_types.pop())
    if MODEL_REMAPPING.get(base_type, base_type) not in (arch, family.model_type):
        raise InvalidAdapter(
            f"{path.name} is a LoRA adapter for {arch} models; the base model is {base_type}"
        )
    return family


def _pairs(
    header: GGUFHeader, family: Family, targets: Mapping[str, TargetDims]
) -> tuple[dict[str, tuple[str, int | None]], dict[str, dict[str, TensorInfo]]]:
    """Each LoRA pair by llama.cpp module name with the base path it goes to, every tensor
    accounted for: anything that cannot be applied refuses the file, naming it and why."""
    by_canonical = {canonical_path(path): path for path in targets}
    modules: dict[str, tuple[str, int | None]] = {}
    pairs: dict[str, dict[str, TensorInfo]] = {}
    unusable: list[str] = []
    for name, info in header.tensors.items():
        base, _, half = name.rpartition(".")
        module = base.removesuffix(".weight")
        path = _mlx_path(module, family) if half in _HALVES and base != module else None
        why = _why_unusable(name, half, module, path, by_canonical, family)
        if why is not None:
            unusable.append(f"{name} ({why})")
            continue
        assert path is not None
        modules[module] = (by_canonical[canonical_path(path)], None)
        pairs.setdefault(module, {})[half] = info
    if unusable:
        raise InvalidAdapter(
            f"the adapter has tensors that cannot be applied, so it was not mounted: "
            f"{_listed(unusable)}"
        )
    if not pairs:
        raise InvalidAdapter("the adapter holds no lora_a/lora_b pairs")
    for module, halves in pairs.items():
        for half in _HALVES:
            if half not in halves:
                other = "lora_b" if half == "lora_a" else "lora_a"
                raise InvalidAdapter(
                    f"{module}.weight: {other} is present but its {half} is missing"
                )
    return modules, pairs


def _why_unusable(
    name: str,
    half: str,
    module: str,
    path: str | None,
    by_canonical: Mapping[str, str],
    family: Family,
) -> str | None:
    if half not in _HALVES:
        if name.endswith("_norm.weight"):
            return (
                "a norm vector: llama.cpp skips these; here every tensor of an adapter is "
                "applied, or the adapter is refused"
            )
        return "not a LoRA half (.lora_a or .lora_b)"
    if "_exps" in module or "_shexp" in module:
        return "MoE expert weights take no LoRA here"
    if path is None:
        return f"not a tensor name of llama.cpp's {family.model_type} models"
    if path == "model.embed_tokens":
        return "embeddings take no LoRA here"
    if path == "lm_head":
        return "the output head takes no LoRA here"
    leaf = path.rpartition(".")[2]
    if leaf not in TARGET_PROJECTIONS:
        return f"{leaf} is not a projection that takes LoRA"
    if canonical_path(path) not in by_canonical:
        return f"the base model has no {path}; the adapter was probably made for another model"
    return None


def _rank(
    pairs: Mapping[str, Mapping[str, TensorInfo]],
    targets: Mapping[str, TargetDims],
    modules: Mapping[str, tuple[str, int | None]],
    max_rank: int,
) -> int:
    """The one rank of every pair, each checked to fit its projection (shapes rows first)."""
    ranks: dict[int, str] = {}
    for module, halves in pairs.items():
        a, b = halves["lora_a"], halves["lora_b"]
        dims = targets[modules[module][0]]
        i, o = dims.in_dims, dims.out_dims
        for half, info in halves.items():
            if info.type not in STORED_TYPES:
                stored = ", ".join(t.name for t in STORED_TYPES)
                raise InvalidAdapter(
                    f"{module}.weight.{half} is stored as {_type_name(info.type)}; LoRA tensors "
                    f"mount from {stored}"
                )
            block = GGML_QUANT_SIZES[Q(info.type)][0]
            if not info.shape or info.shape[-1] % block:
                raise InvalidAdapter(
                    f"{module}.weight.{half}: {Q(info.type).name} rows of {block} values cannot "
                    f"hold shape {info.shape}"
                )
        fits = len(a.shape) == len(b.shape) == 2 and a.shape[1] == i and b.shape[0] == o
        if not fits or a.shape[0] != b.shape[1]:
            raise InvalidAdapter(
                f"{module}.weight: lora_a {a.shape} and lora_b {b.shape} (rows first) do not fit "
                f"the base projection: it takes {i} inputs to {o} outputs, so they must be "
                f"(r, {i}) and ({o}, r)"
            )
        ranks.setdefault(a.shape[0], module)
    if len(ranks) > 1:
        shown = ", ".join(f"{module} {rank}" for rank, module in sorted(ranks.items()))
        raise InvalidAdapter(f"the adapter's pairs differ in rank ({shown}); one rank is supported")
    (rank,) = ranks
    if rank > max_rank:
        raise InvalidAdapter(f"adapter rank {rank} is above this server's limit of {max_rank}")
    return rank


def _heads(name: str, family: Family, dims: TargetDims) -> int | None:
    """The heads a llama q/k `lora_b`'s rows are un-permuted by; None where nothing moved."""
    if not family.permuted_qk or name.rpartition(".")[2] not in _PERMUTED:
        return None
    if dims.heads is None or dims.out_dims % (2 * dims.heads):
        raise InvalidAdapter(
            f"{name}.weight.lora_b: the base model does not say how many heads its "
            f"{dims.out_dims} rows hold, so llama.cpp's row order cannot be undone"
        )
    return dims.heads


def _scale(path: Path, meta: Mapping[str, Any], rank: int) -> float:
    """llama.cpp's `alpha / r`, or 1 where the file gives no alpha (or 0), within bounds."""
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InvalidAdapter(
            f"{path.name}: adapter.lora.alpha must be a finite number, got {alpha!r:.40}"
        )
    scale = alpha / rank if alpha else 1.0
    if abs(scale) > MAX_SCALE:
        raise InvalidAdapter(
            f"{path.name}: the adapter scale {scale:g} (adapter.lora.alpha / r) is outside the "
            f"bound |scale| <= {MAX_SCALE:g}"
        )
    return float(scale)


def _is(value: Any, text: str) -> bool:
    """Whether a metadata value is the string `text` (an array of numbers compares to none)."""
    return isinstance(value, str) and value == text


def _type_name(kind: int) -> str:
    try:
        return Q(kind).name
    except ValueError:
        return f"type id {kind}"


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more
