"""What the adapter root holds, resident or not: the admin's view of adapters beyond the mounted."""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
    """One adapter: resident, evicted, or a directory under the root never mounted (in a
    tenant's folder, with no id until one is given it by a mount)."""

    id: str | None
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
    folder: Path | None = None,
    shown: Callable[[str], bool] = lambda adapter_id: True,
) -> list[RootEntry]:
    """The resident adapters (id, arrays, pinned), the evicted ones, then each directory under
    `root` (a link's target under it too) with an adapter_config.json or a llama.cpp `.gguf`
    file whose name is a valid id (other than `skip`, the base model's) and no adapter under
    that id; those whose id is `shown`, sorted by id. Then, given a `folder` under the root (a
    tenant's, mounted from by path: no request names its directories), each adapter directory
    in it that no entry above was mounted from, with no id, sorted by path."""
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
    for directory in _adapter_directories(root):
        name = directory.name
        if name not in entries and name != skip and adapter_id_problem(name) is None:
            entries[name] = RootEntry(
                name, str(directory), "on disk", False, _size(directory, directory), None
            )
    listed = [entries[adapter_id] for adapter_id in sorted(entries) if shown(adapter_id)]
    if folder is None:
        return listed
    paths = [Path(entry.path) for entry in entries.values()]  # shown or not: mounted from
    mounted_from = {*paths, *(path.parent for path in paths)}  # a `.gguf` file's directory
    return listed + [
        RootEntry(None, str(directory), "on disk", False, _size(directory, directory), None)
        for directory in _adapter_directories(folder, within=root)
        if directory.resolve() not in mounted_from
    ]


def _adapter_directories(folder: Path, within: Path | None = None) -> list[Path]:
    """The directories in `folder` holding an adapter_config.json or a `.gguf` file, by name,
    leaving out links out of `within` (`folder` itself unless given): no mount reads them."""
    try:
        directories = sorted(folder.iterdir())
        inside = (within or folder).resolve()
    except OSError:
        return []
    return [
        directory
        for directory in directories
        if directory.resolve().is_relative_to(inside)
        and ((directory / CONFIG_FILE).is_file() or any(directory.glob(f"*{GGUF_SUFFIX}")))
    ]


def _size(directory: Path, within: Path) -> int | None:
    """The size of `directory`'s weight file; None when there is none, or it links outside
    `within` (as a mount on first use, which reads only its own directory, would refuse it: its
    size would tell of a file the server never reads for it)."""
    try:
        return weight_file_of(directory, within).stat().st_size
    except (InvalidAdapter, AdapterPathRefused, OSError):  # none, several, or outside
        return None
