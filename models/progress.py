"""Progress bars for long offline work (GGUF import, quantize, fuse), on a terminal only."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

import mlx.core as mx
from tqdm import tqdm

T = TypeVar("T")


def bar(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """`items`, with a bar on stderr while they are consumed when stderr is a terminal."""
    # disable=None: no bar when stderr is not a TTY (logs, pipes, CI).
    yield from tqdm(items, desc=description, total=total, unit="tensor", disable=None, leave=False)


def evaluate(arrays: Mapping[str, mx.array], description: str) -> None:
    """Compute lazy `arrays` one at a time, so the work shows as it goes."""
    for array in bar(arrays.values(), description, total=len(arrays)):
        mx.eval(array)
