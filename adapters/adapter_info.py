"""What the adapter manager reports: one adapter's info, and the changes its listeners hear."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from hotlora.adapters.adapter_set import MountedAdapter
from hotlora.adapters.residency import Evicted


@dataclass(frozen=True)
class AdapterInfo:
    """What the admin API reports about one mounted adapter."""

    id: str
    path: str
    rank: int
    scale: float
    rslora: bool
    revision: str
    size_bytes: int  # the weight file on disk
    ram_bytes: int  # the mounted arrays
    mounted_layers: int  # slots it attaches to
    mounted_at: int  # unix seconds
    in_use: int  # requests computing with any revision mounted under this id now
    pinned: bool = False  # never evicted to keep within the budget
    on_demand: bool = False  # mounted by a request naming it, not by an admin

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MountEvent:
    """One change to the mounted set, told to the manager's listeners once it is made."""

    # A replace is "mounted"; "loaded" is a mount a request asked for, on first use.
    kind: Literal["mounted", "loaded", "unmounted", "evicted"]
    adapter_id: str
    revision: str  # what was mounted, or what was unmounted or evicted
    seconds: float = 0.0  # how long a load took, files read to arrays mounted
    ram_bytes: int = 0  # what the adapter's arrays hold


MountListener = Callable[[MountEvent], None]


def mounted_info(
    mounted: MountedAdapter, *, in_use: int, pinned: bool, on_demand: bool
) -> AdapterInfo:
    """A resident adapter's info, with what the manager counts beside it."""
    adapter = mounted.adapter
    return AdapterInfo(
        id=mounted.id,
        path=str(adapter.path),
        rank=adapter.config.rank,
        scale=adapter.config.scale,
        rslora=adapter.config.rslora,
        revision=adapter.revision,
        size_bytes=adapter.size_bytes,
        ram_bytes=adapter.ram_bytes,
        mounted_layers=len(adapter.weights),
        mounted_at=mounted.mounted_at,
        in_use=in_use,
        pinned=pinned,
        on_demand=on_demand,
    )


def evicted_info(gone: Evicted) -> AdapterInfo:
    """An evicted adapter's info: what is known of it without its arrays (no layer mounted)."""
    return AdapterInfo(
        id=gone.id,
        path=gone.path,
        rank=0,
        scale=0.0,
        rslora=False,
        revision=gone.revision,
        size_bytes=gone.size_bytes,
        ram_bytes=gone.ram_bytes,
        mounted_layers=0,
        mounted_at=gone.evicted_at,
        in_use=0,
        on_demand=gone.on_demand,
    )
