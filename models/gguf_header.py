"""A GGUF file's header: its key/value metadata and its tensor directory, read without touching
the tensor data, and checked as llama.cpp's reader checks it."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotlora.models.gguf_families import UnsupportedGGUF

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file; `shape` in numpy order (rows first)."""

    type: int
    shape: tuple[int, ...]
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    """Everything but the tensor data: the key/value metadata and the tensor directory.

    A metadata array of numbers is a numpy array, one of strings a list.
    """

    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int
    alignment: int = DEFAULT_ALIGNMENT  # `general.alignment`, which tensor offsets keep to


# GGUF value type id -> struct format, for the fixed-size types (8 is a string, 9 an array).
_SCALARS = {**dict(enumerate("BbHhIif?")), 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_header(path: Path) -> GGUFHeader:
    """Parse the GGUF header (v2 or v3, little-endian) without touching the tensor data.

    Whatever is wrong with it (cut short, a length past the end, an unknown value type, an
    array of arrays, a tensor listed twice, an alignment that is not a power of two) raises
    `UnsupportedGGUF`.
    """
    try:
        return _parse_header(path)
    except (struct.error, ValueError, KeyError) as e:
        if isinstance(e, UnsupportedGGUF):
            raise
        raise UnsupportedGGUF(f"{path} has a truncated or corrupt GGUF header ({e})") from e


def _parse_header(path: Path) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise UnsupportedGGUF(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise UnsupportedGGUF(
                f"{path}: GGUF version {version} is not supported (only 2 and 3): convert the "
                "model again with a current llama.cpp"
            )
        pos = 24

        def take(n: int) -> int:
            """Step over the next `n` bytes, which must lie within the file; where they start."""
            nonlocal pos
            if n > len(buf) - pos:
                raise ValueError(f"{n:,} bytes at offset {pos:,} run past the end of the file")
            pos += n
            return pos - n

        def scalar(fmt: str) -> Any:
            (value,) = struct.unpack_from("<" + fmt, buf, take(struct.calcsize(fmt)))
            return value

        def string() -> str:
            n = scalar("Q")
            start = take(n)
            return buf[start : start + n].decode("utf-8", errors="replace")

        def value(kind: int) -> Any:
            if kind == _STRING:
                return string()
            if kind != _ARRAY:
                return scalar(_format(kind))
            item_kind, count = scalar("I"), scalar("Q")
            if item_kind == _ARRAY:
                raise ValueError("an array of arrays, which llama.cpp does not read either")
            if item_kind == _STRING:
                return [string() for _ in range(count)]
            dtype = np.dtype("<" + _format(item_kind))
            start = take(dtype.itemsize * count)
            # As compact as in the file: a Python list would take ten times its size.
            return np.frombuffer(buf, dtype=dtype, count=count, offset=start).copy()  # [count]

        metadata = {}
        for _ in range(n_kv):
            key = string()
            try:
                metadata[key] = value(scalar("I"))
            except ValueError as e:
                raise ValueError(f"metadata key {key!r:.80}: {e}") from e
        tensors = {}
        for _ in range(n_tensors):
            name = string()
            dims = [scalar("Q") for _ in range(scalar("I"))]
            kind, offset = scalar("I"), scalar("Q")
            if name in tensors:
                raise ValueError(f"tensor {name!r:.80} is listed twice")
            tensors[name] = TensorInfo(kind, tuple(reversed(dims)), offset)
        alignment = _alignment(path, metadata)
        return GGUFHeader(metadata, tensors, -(-pos // alignment) * alignment, alignment)


def _alignment(path: Path, metadata: dict[str, Any]) -> int:
    """`general.alignment`, which llama.cpp and gguf-py require to be a power of two."""
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    whole = isinstance(alignment, int) and not isinstance(alignment, bool) and alignment > 0
    if not whole or alignment & (alignment - 1):
        raise UnsupportedGGUF(f"{path}: general.alignment {alignment!r:.40} is not a power of two")
    return alignment


def _format(kind: int) -> str:
    """The struct format of a fixed-size GGUF value type."""
    if kind not in _SCALARS:
        raise ValueError(f"unknown value type {kind}")
    return _SCALARS[kind]


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a file that starts as every GGUF file does (`GGUF`), whatever its name."""
    try:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False
