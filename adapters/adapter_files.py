"""Reading an adapter directory from disk and validating it against the base model.

Everything here runs before anything is attached, so a bad adapter fails at mount time with a
message that says which file or tensor is wrong, and leaves nothing behind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import mlx.core as mx

from hotlora.adapters.adapter_config import CONFIG_FILE, AdapterConfig, read_adapter_config
from hotlora.adapters.adapter_errors import AdapterPathRefused, InvalidAdapter
from hotlora.adapters.pairs import match_pairs
from hotlora.adapters.projections import TargetDims

WEIGHT_FILES = ("adapters.safetensors", "adapter_model.safetensors")  # mlx-lm, PEFT
MAX_ADAPTER_BYTES = 2 << 30  # the default cap on an adapter's weight file; servers set their own
_CHUNK = 16 << 20  # each read and hash update lets go of the GIL: a few large ones


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

    @property
    def ram_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @cached_property
    def dtype(self) -> mx.Dtype | None:
        """The one dtype of all its arrays; None where they mix dtypes (or there are none)."""
        dtypes = [array.dtype for pair in self.weights.values() for array in pair]
        return dtypes[0] if dtypes and all(d == dtypes[0] for d in dtypes) else None


def resolve_under_root(path: str | Path, root: Path) -> Path:
    """The adapter directory `path` names (relative paths are taken from `root`).

    Symlinks are followed before the check, so `..`, absolute paths elsewhere and links that
    point out of `root` are all refused without opening anything.
    """
    root = Path(root).resolve()
    try:
        resolved = (root / Path(path).expanduser()).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, NUL bytes
        message = f"adapter path {_clipped(str(path))!r} cannot be resolved: {exc}"
        raise InvalidAdapter(message, param="path") from None
    if not resolved.is_relative_to(root):
        shown = _clipped(str(path))
        raise AdapterPathRefused(f"adapter path '{shown}' is outside the adapter root {root}")
    return resolved


def read_adapter(
    directory: Path,
    targets: Mapping[str, TargetDims],
    *,
    max_rank: int,
    max_bytes: int = MAX_ADAPTER_BYTES,
    root: Path | None = None,
) -> LoadedAdapter:
    """Read and validate the adapter in `directory` against the base `targets`.

    A weight file over `max_bytes` is refused from its size on disk, before it is read. With
    `root`, every file is also checked to resolve under it before being opened. A file system
    error (a name too long, a permission) refuses the adapter rather than escaping as an
    `OSError`.
    """
    try:
        return _read(directory, targets, max_rank=max_rank, max_bytes=max_bytes, root=root)
    except OSError as exc:
        shown = _clipped(str(directory))
        message = f"adapter path {shown!r} cannot be read: {exc.strerror or exc}"
        raise InvalidAdapter(message, param="path") from None


def _read(
    directory: Path,
    targets: Mapping[str, TargetDims],
    *,
    max_rank: int,
    max_bytes: int,
    root: Path | None,
) -> LoadedAdapter:
    if not directory.is_dir():
        raise InvalidAdapter(f"adapter directory {directory} does not exist")
    config_file = _inside(directory / CONFIG_FILE, root)
    candidates = [_inside(directory / name, root) for name in WEIGHT_FILES]
    weight_file = next((path for path in candidates if path.is_file()), None)
    if weight_file is None:
        raise InvalidAdapter(f"{directory} has neither {' nor '.join(WEIGHT_FILES)}")
    size = weight_file.stat().st_size
    if size > max_bytes:
        raise InvalidAdapter(
            f"{weight_file.name} is over this server's limit of {max_bytes} bytes per adapter "
            f"file ({size} bytes)"
        )
    config = read_adapter_config(config_file, max_rank=max_rank, max_bytes=max_bytes)
    # The hash reads the file beside MLX reading and checking its tensors: both let go of the
    # GIL, and a cold load is a request's wait. A refusal does not wait for the hash to end.
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-hash")
    try:
        hashed = hasher.submit(revision, config, weight_file, max_bytes=max_bytes)
        try:
            tensors = mx.load(str(weight_file))
        except Exception as exc:  # mlx raises RuntimeError/ValueError for unreadable files
            raise InvalidAdapter(f"cannot read {weight_file.name}: {exc}") from None
        if not isinstance(tensors, dict):
            raise InvalidAdapter(f"{weight_file.name} is not a safetensors file")
        matched = match_pairs(tensors, targets, config.rank)
        del tensors
        mx.eval([array for pair in matched.pairs.values() for array in pair])
        content = hashed.result()
    finally:
        hasher.shutdown(wait=False)
    return LoadedAdapter(
        path=directory,
        weight_file=weight_file,
        config=config,
        revision=content,
        size_bytes=size,
        weights=dict(matched.pairs),
    )


def revision(config: AdapterConfig, weight_file: Path, *, max_bytes: int | None = None) -> str:
    """A content hash: equal revisions mean equal residuals, whatever the path.

    With `max_bytes`, a file that has grown past it since it was checked is refused.
    """
    digest = hashlib.sha256(
        f"scale={config.scale!r};rank={config.rank};rslora={config.rslora};".encode()
    )
    read = 0
    with weight_file.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            read += len(chunk)
            if max_bytes is not None and read > max_bytes:
                raise InvalidAdapter(
                    f"{weight_file.name} grew past this server's limit of {max_bytes} bytes "
                    "per adapter file while it was read"
                )
            digest.update(chunk)
    return digest.hexdigest()


def _inside(path: Path, root: Path | None) -> Path:
    if root is not None and not path.resolve().is_relative_to(Path(root).resolve()):
        raise AdapterPathRefused(f"{path} links outside the adapter root {root}")
    return path


def _clipped(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."
