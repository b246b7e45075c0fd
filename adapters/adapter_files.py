"""Reading an adapter from disk and validating it against the base model: an mlx-lm or PEFT
directory, or a llama.cpp LoRA file (`gguf_adapter`).

Everything here runs before anything is attached, so a bad adapter fails at mount time with a
message that says which file or tensor is wrong, and leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path

import mlx.core as mx

from hotlora.adapters.adapter_config import CONFIG_FILE, AdapterConfig, read_adapter_config
from hotlora.adapters.adapter_errors import (
    AdapterConflict,
    AdapterError,
    AdapterPathMissing,
    AdapterPathRefused,
    InvalidAdapter,
)
from hotlora.adapters.gguf_adapter import (
    GGUF_SUFFIX,
    is_gguf,
    load_gguf_tensors,
    read_gguf_adapter,
)
from hotlora.adapters.pairs import check_declared, check_targeted, match_pairs
from hotlora.adapters.projections import TargetDims
from hotlora.models.cpu import give_back_freed_memory

WEIGHT_FILES = ("adapters.safetensors", "adapter_model.safetensors")  # mlx-lm, PEFT
MAX_ADAPTER_BYTES = 2 << 30  # the default cap on an adapter's weight file; servers set their own
_CHUNK = 16 << 20  # each read and hash update lets go of the GIL: a few large ones
# A file's content hash is reused while the file is the same one, unchanged: same device, inode,
# size, modification and change times (to the nanosecond). As git does for its index, a hash is
# only kept for a file whose times were older than its hashing by this much, so that a write
# within the file system's timestamp granularity of the hashing cannot go unseen.
_UNCHANGED_AFTER_NS = 2_000_000_000
_KEPT_REVISIONS = 4096
SHORT_REVISION = 12  # the hex digits of a revision that messages show


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
        raise AdapterPathRefused(
            f"adapter path '{shown}' is outside the adapter root (GET /v1/adapter_root names it)"
        )
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


def read_to_mount(
    adapter_id: str,
    directory: Path,
    targets: Mapping[str, TargetDims],
    *,
    revision: str | None,
    max_rank: int,
    max_bytes: int,
    root: Path,
) -> LoadedAdapter:
    """`read_adapter` for a mount of `adapter_id`, the arrays of an adapter refused freed at once.

    With `revision`, files that no longer hash to it are refused (`AdapterConflict`, code
    `adapter_changed`): a recorded mount is made again exactly or not at all.
    """
    try:
        loaded = read_adapter(directory, targets, max_rank=max_rank, max_bytes=max_bytes, root=root)
    except AdapterError as exc:
        # The traceback's frames hold the refused file's arrays: drop them and free the
        # memory now, not whenever the error is collected.
        exc.__context__ = None
        exc.with_traceback(None)
        give_back_freed_memory()
        raise
    if revision is not None and loaded.revision != revision:
        found = loaded.revision
        del loaded  # free the arrays of files that will not be mounted
        give_back_freed_memory()
        raise AdapterConflict(
            f"adapter '{adapter_id}' at {directory} changed since it was recorded (revision "
            f"{revision[:SHORT_REVISION]}, now {found[:SHORT_REVISION]})",
            code="adapter_changed",
        )
    return loaded


def _read(
    directory: Path,
    targets: Mapping[str, TargetDims],
    *,
    max_rank: int,
    max_bytes: int,
    root: Path | None,
) -> LoadedAdapter:
    weight_file = weight_file_of(directory, root)
    before = os.stat(weight_file)  # also what tells the file unchanged since it was hashed
    size = before.st_size
    if size > max_bytes:
        raise InvalidAdapter(
            f"{weight_file.name} is over this server's limit of {max_bytes} bytes per adapter "
            f"file ({size} bytes)"
        )
    load: Callable[[], Mapping[str, mx.array]]
    if weight_file.name not in WEIGHT_FILES:  # a llama.cpp file, mounted or in the directory
        gguf = read_gguf_adapter(weight_file, targets, max_rank=max_rank)
        config = gguf.config
        load = partial(load_gguf_tensors, gguf)
    else:
        config_file = _inside(directory / CONFIG_FILE, root)
        config = read_adapter_config(config_file, max_rank=max_rank, max_bytes=max_bytes)
        load = partial(_load_safetensors, weight_file)
    known = _REVISIONS.get(config, weight_file, before)
    # The hash reads the file beside MLX reading and checking its tensors: both let go of the
    # GIL, and a cold load is a request's wait. A refusal does not wait for the hash to end.
    # A file hashed before and unchanged since (an evicted adapter's, loaded again) is not
    # hashed again.
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-hash")
    try:
        began = time.time_ns()
        hashed = (
            None if known else hasher.submit(revision, config, weight_file, max_bytes=max_bytes)
        )
        tensors = load()
        matched = match_pairs(tensors, targets, config.rank)
        check_targeted(tensors, config)
        del tensors
        check_declared(matched.pairs, targets, config)
        mx.eval([array for pair in matched.pairs.values() for array in pair])
        after = os.stat(weight_file)
        if known and _same_file(before, after):
            content = known
        else:
            content = (
                hashed.result() if hashed else revision(config, weight_file, max_bytes=max_bytes)
            )
            if _same_file(before, after):
                _REVISIONS.keep(config, weight_file, after, content, began)
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


def weight_file_of(path: Path, root: Path | None = None) -> Path:
    """The weight file of the adapter at `path`: a directory's `adapters.safetensors` (mlx-lm)
    or `adapter_model.safetensors` (PEFT), else its one `.gguf` file; or `path` itself, a
    llama.cpp LoRA file. With `root`, the file must resolve under it."""
    if path.is_file():
        if path.suffix != GGUF_SUFFIX and not is_gguf(path):
            raise InvalidAdapter(
                f"{path.name} is not an adapter: mount a directory holding "
                f"{' or '.join(WEIGHT_FILES)} with {CONFIG_FILE}, or a llama.cpp LoRA "
                f"{GGUF_SUFFIX} file"
            )
        return _inside(path, root)
    if not path.is_dir():
        raise AdapterPathMissing(f"adapter directory {path} does not exist")
    candidates = [_inside(path / name, root) for name in WEIGHT_FILES]
    weight_file = next((file for file in candidates if file.is_file()), None)
    if weight_file is not None:
        return weight_file
    ggufs = sorted(file for file in path.glob(f"*{GGUF_SUFFIX}") if file.is_file())
    if len(ggufs) == 1:
        return _inside(ggufs[0], root)
    if ggufs:
        names = ", ".join(file.name for file in ggufs[:3])
        raise InvalidAdapter(
            f"{path} holds {len(ggufs)} {GGUF_SUFFIX} files ({names}); mount one by its path"
        )
    raise InvalidAdapter(
        f"{path} has neither {' nor '.join(WEIGHT_FILES)}, nor a llama.cpp LoRA {GGUF_SUFFIX} file"
    )


def _load_safetensors(weight_file: Path) -> dict[str, mx.array]:
    try:
        tensors = mx.load(str(weight_file))
    except Exception as exc:  # mlx raises RuntimeError/ValueError for unreadable files
        raise InvalidAdapter(f"cannot read {weight_file.name}: {exc}") from None
    if not isinstance(tensors, dict):
        raise InvalidAdapter(f"{weight_file.name} is not a safetensors file")
    return tensors


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


def _same_file(one: os.stat_result, other: os.stat_result) -> bool:
    return (one.st_dev, one.st_ino, one.st_size, one.st_mtime_ns, one.st_ctime_ns) == (
        other.st_dev,
        other.st_ino,
        other.st_size,
        other.st_mtime_ns,
        other.st_ctime_ns,
    )


class _Revisions:
    """Content hashes of weight files read before, by path and config, with the file's identity
    and times when hashed; the most recent `_KEPT_REVISIONS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], tuple[os.stat_result, str]] = OrderedDict()

    @staticmethod
    def _key(config: AdapterConfig, weight_file: Path) -> tuple[str, str]:
        return str(weight_file.resolve()), f"{config.scale!r};{config.rank};{config.rslora}"

    def get(self, config: AdapterConfig, weight_file: Path, now: os.stat_result) -> str | None:
        """The file's hash, if it was hashed before and is the same file, unchanged, now."""
        key = self._key(config, weight_file)
        with self._lock:
            found = self._kept.get(key)
            if found is None or not _same_file(found[0], now):
                return None
            self._kept.move_to_end(key)
            return found[1]

    def keep(
        self,
        config: AdapterConfig,
        weight_file: Path,
        stat: os.stat_result,
        content: str,
        began: int,
    ) -> None:
        """Keep the hash of a file that did not change while it was read (`stat`, from before
        and after), unless its times are too close to `began` (the hashing's start, ns) to tell
        a later write from it."""
        if max(stat.st_mtime_ns, stat.st_ctime_ns) + _UNCHANGED_AFTER_NS > began:
            return
        key = self._key(config, weight_file)
        with self._lock:
            self._kept[key] = (stat, content)
            self._kept.move_to_end(key)
            while len(self._kept) > _KEPT_REVISIONS:
                self._kept.popitem(last=False)


_REVISIONS = _Revisions()


def _inside(path: Path, root: Path | None) -> Path:
    if root is not None and not path.resolve().is_relative_to(Path(root).resolve()):
        raise AdapterPathRefused(f"{path} links outside {root}, where its files must be")
    return path


def _clipped(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."
