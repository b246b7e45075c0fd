"""What the adapter root holds, resident or not: the admin's view of adapters beyond the mounted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from hotlora.adapters.adapter_config import CONFIG_FILE
from hotlora.adapters.adapter_errors import AdapterPathRefused, InvalidAdapter
from hotlora.adapters.adapter_files import LoadedAdapter, weight_file_of
from hotlora.adapters.gguf_adapter import GGUF_SUFFIX
from hotlora.adapters.residency import Evicted
from hotlora.adapters.spec import adapter_id_problem


@dataclass(frozen=True)
class RootEntry:
    """One adapter: resident, evicted, or a directory under the root never mounted."""

    id: str
    path: str
    state: Literal["resident", "evicted", "on disk"]
    pinned: bool
    size_bytes: int | None  # its weight file on disk
    ram_bytes: int | None  # its arrays once mounted; None before it ever was

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def list_root(
    root: Path,
    mounted: Iterable[tuple[str, LoadedAdapter, bool]],
    evicted: Iterable[Evicted],
    *,
    skip: str,
) -> list[RootEntry]:
    """The resident adapters (id, arrays, pinned), the evicted ones, then each directory under
    `root` (a link's target under it too) with an adapter_config.json or a llama.cpp `.gguf`
    file whose name is a valid id (other than `skip`, the base model's) and no adapter under
    that id; sorted by id."""
    entries: dict[str, RootEntry] = {}
    for adapter_id, adapter, pinned in mounted:
        entries[adapter_id] = RootEntry(
            adapter_id,
            str(adapter.path),
            "resident",
            pinned,
            adapter.size_bytes,
            adapter.ram_bytes,
        )
    for gone in evicted:
        entries[gone.id] = RootEntry(
            gone.id, gone.path, "evicted", False, gone.size_bytes, gone.ram_bytes
        )
    try:
        directories = sorted(root.iterdir())
        inside = root.resolve()
    except OSError:
        directories = []
    for directory in directories:
        name = directory.name
        if name in entries or name == skip or adapter_id_problem(name) is not None:
            continue
        if not directory.resolve().is_relative_to(inside):
            continue  # a link out of the root: no mount reads it, so it is not listed
        if (directory / CONFIG_FILE).is_file() or any(directory.glob(f"*{GGUF_SUFFIX}")):
            entries[name] = RootEntry(
                name, str(directory), "on disk", False, _size(directory, directory), None
            )
    return [entries[adapter_id] for adapter_id in sorted(entries)]


def _size(directory: Path, within: Path) -> int | None:
    """The size of `directory`'s weight file; None when there is none, or it links outside
    `within` (as a mount on first use, which reads only its own directory, would refuse it: its
    size would tell of a file the server never reads for it)."""
    try:
        return weight_file_of(directory, within).stat().st_size
    except (InvalidAdapter, AdapterPathRefused, OSError):  # none, several, or outside
        return None
