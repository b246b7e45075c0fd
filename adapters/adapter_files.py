"""Reading an adapter directory from disk and validating it against the base model.

Everything here runs before anything is attached, so a bad adapter fails at mount time with a
message that says which file or tensor is wrong, and leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import mlx.core as mx

from hotlora.adapters.adapter_errors import AdapterPathRefused, InvalidAdapter
from hotlora.adapters.pairs import match_pairs
from hotlora.adapters.projections import TargetDims

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapters.safetensors", "adapter_model.safetensors")  # mlx-lm, PEFT
_CHUNK = 1 << 20


@dataclass(frozen=True)
class AdapterConfig:
    """What `adapter_config.json` says about the low-rank update."""

    rank: int
    scale: float
    rslora: bool = False


@dataclass(frozen=True, eq=False)
class LoadedAdapter:
    """A validated adapter: its arrays per base module path, ready to attach.

    Frozen and compared by identity: a running request holding one keeps exactly these arrays,
    whatever is mounted or unmounted afterwards.
    """

    path: Path
    weight_file: Path
    config: AdapterConfig
    revision: str  # sha256 hex over scale, rank, rsLoRA flag and the weight file's bytes
    size_bytes: int
    weights: Mapping[str, tuple[mx.array, mx.array]]  # path -> (A [in, r], B [r, out])
    skipped_tensors: int

    @property
    def ram_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def resolve_under_root(path: str | Path, root: Path) -> Path:
    """The adapter directory `path` names (relative paths are taken from `root`).

    Symlinks are followed before the check, so `..`, absolute paths elsewhere and links that
    point out of `root` are all refused without opening anything.
    """
    root = Path(root).resolve()
    try:
        resolved = (root / Path(path).expanduser()).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, NUL bytes
        message = f"adapter path {path!r} cannot be resolved: {exc}"
        raise InvalidAdapter(message, param="path") from None
    if not resolved.is_relative_to(root):
        raise AdapterPathRefused(f"adapter path '{path}' is outside the adapter root {root}")
    return resolved


def read_adapter(
    directory: Path,
    targets: Mapping[str, TargetDims],
    *,
    max_rank: int,
    root: Path | None = None,
) -> LoadedAdapter:
    """Read and validate the adapter in `directory` against the base `targets`.

    With `root`, every file is also checked to resolve under it before being opened.
    """
    if not directory.is_dir():
        raise InvalidAdapter(f"adapter directory {directory} does not exist", param="path")
    config_file = _inside(directory / CONFIG_FILE, root)
    candidates = [_inside(directory / name, root) for name in WEIGHT_FILES]
    weight_file = next((path for path in candidates if path.is_file()), None)
    if weight_file is None:
        raise InvalidAdapter(f"{directory} has neither {' nor '.join(WEIGHT_FILES)}", param="path")
    config = read_adapter_config(config_file, max_rank=max_rank)
    try:
        tensors = mx.load(str(weight_file))
    except Exception as exc:  # mlx raises RuntimeError/ValueError for unreadable files
        raise InvalidAdapter(f"cannot read {weight_file.name}: {exc}") from None
    if not isinstance(tensors, dict):
        raise InvalidAdapter(f"{weight_file.name} is not a safetensors file")
    matched = match_pairs(tensors, targets, config.rank)
    del tensors
    mx.eval([array for pair in matched.pairs.values() for array in pair])
    return LoadedAdapter(
        path=directory,
        weight_file=weight_file,
        config=config,
        revision=revision(config, weight_file),
        size_bytes=weight_file.stat().st_size,
        weights=dict(matched.pairs),
        skipped_tensors=matched.skipped_tensors,
    )


def read_adapter_config(path: Path, *, max_rank: int) -> AdapterConfig:
    """Rank and scale from an mlx-lm or PEFT `adapter_config.json`.

    mlx-lm: `lora_parameters.{rank, scale}`. PEFT: `r` and `lora_alpha`, scale `alpha / r`, or
    `alpha / sqrt(r)` with `use_rslora`. A top-level `scale`, which some trainers write, wins
    over `lora_alpha` since it is the number the trainer actually applied.
    """
    if not path.is_file():
        raise InvalidAdapter(f"{path.parent} has no {CONFIG_FILE}", param="path")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidAdapter(f"{CONFIG_FILE} cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidAdapter(f"{CONFIG_FILE} must hold a JSON object")
    _check_kind(raw)

    rslora = False
    params = raw.get("lora_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise InvalidAdapter(f"{CONFIG_FILE}: lora_parameters must be an object")
        rank, scale = params.get("rank"), params.get("scale", raw.get("scale"))
    else:
        for key in ("rank_pattern", "alpha_pattern"):
            if raw.get(key):
                raise InvalidAdapter(f"{CONFIG_FILE}: per-module ranks ({key}) are not supported")
        rank, alpha, rslora = raw.get("r"), raw.get("lora_alpha"), bool(raw.get("use_rslora"))
        scale = raw.get("scale")
        if scale is None and _number(alpha) and _positive_int(rank):
            scale = alpha / (math.sqrt(rank) if rslora else rank)

    if not _positive_int(rank):
        raise InvalidAdapter(
            f"{CONFIG_FILE} gives no valid rank (lora_parameters.rank or r), got {rank!r}"
        )
    if rank > max_rank:
        raise InvalidAdapter(f"adapter rank {rank} is above this server's limit of {max_rank}")
    if not _number(scale) or not math.isfinite(scale):
        raise InvalidAdapter(
            f"{CONFIG_FILE} gives no valid scale (lora_parameters.scale, scale or lora_alpha), "
            f"got {scale!r}"
        )
    return AdapterConfig(rank=rank, scale=float(scale), rslora=rslora)


def revision(config: AdapterConfig, weight_file: Path) -> str:
    """A content hash: equal revisions mean equal residuals, whatever the path."""
    digest = hashlib.sha256(
        f"scale={config.scale!r};rank={config.rank};rslora={config.rslora};".encode()
    )
    with weight_file.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_kind(raw: dict[str, Any]) -> None:
    kind = raw.get("fine_tune_type", "lora")
    if kind != "lora":
        raise InvalidAdapter(
            f"{CONFIG_FILE}: fine_tune_type {kind!r} is not supported; only 'lora' adapters mount"
        )
    peft_type = raw.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise InvalidAdapter(f"{CONFIG_FILE}: peft_type {peft_type!r} is not supported")
    if raw.get("use_dora"):
        raise InvalidAdapter(f"{CONFIG_FILE}: DoRA adapters (use_dora) are not supported")


def _inside(path: Path, root: Path | None) -> Path:
    if root is not None and not path.resolve().is_relative_to(Path(root).resolve()):
        raise AdapterPathRefused(f"{path} links outside the adapter root {root}")
    return path


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
