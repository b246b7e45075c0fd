"""The adapter registry: one per app, owning every mounted adapter's arrays."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters.adapter_errors import AdapterConflict, AdapterNotFound, InvalidAdapter

from .files import read_adapter, resolve_under_root
from .lora import (
    BASE_ONLY,
    ActiveAdapters,
    AppliedAdapter,
    LoRASlot,
    MountedAdapter,
    install_slots,
    probe_input_dtypes,
)
from .spec import AdapterRef, adapter_id_problem, parse_adapter_spec
from .targets import TargetDims, linear_dims

log = logging.getLogger("hotlora.adapters")

# Adapter arrays follow half-precision activations (half the memory, no per-call upcast);
# against float32 activations they stay float32, which is how mlx-lm keeps trained adapters.
_HALF = (mx.float16, mx.bfloat16)


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
    skipped_tensors: int
    mounted_at: int  # unix seconds
    in_use: int  # requests computing with it now

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class AdapterManager:
    """Mounts, unmounts and resolves LoRA adapters over one base model that never reloads.

    Construction wraps the base's target projections in `LoRASlot`s once. After that,
    `mount`/`unmount` only change the registry (under a lock), and requests get their own
    immutable `ActiveAdapters` from `resolve`, so the worker thread's model calls never see a
    registry change half-way.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        adapter_root: Path,
        max_rank: int,
        reserved_ids: frozenset[str] = frozenset(),
    ):
        self.model = model
        self.reserved_ids = reserved_ids
        self.adapter_root = Path(adapter_root).expanduser().resolve()
        self.max_rank = max_rank
        self._slots = install_slots(model)
        if not self._slots:
            log.warning("%s has no q/k/v/o/gate/up/down projections", type(model).__name__)
        dtypes = probe_input_dtypes(model)
        self._targets = {
            path: _target(slot, dtypes.get(path)) for path, slot in self._slots.items()
        }
        self._lock = threading.Lock()
        self._mounted: dict[str, MountedAdapter] = {}
        self._in_use: dict[MountedAdapter, int] = {}

    @property
    def slots(self) -> Mapping[str, LoRASlot]:
        """Every slot by module path, e.g. `model.layers.3.self_attn.q_proj`."""
        return MappingProxyType(self._slots)

    @property
    def targets(self) -> Mapping[str, TargetDims]:
        """Each slot's base dimensions and the dtype adapter arrays are stored in there."""
        return MappingProxyType(self._targets)

    def mount(self, adapter_id: str, path: str | Path, replace: bool = False) -> AdapterInfo:
        """Validate the adapter at `path` (under the adapter root) and mount it as `adapter_id`.

        All or nothing: any problem raises before the registry changes. The same files under
        the same id return the existing info; other files raise `AdapterConflict` unless
        `replace`, which swaps atomically while running requests keep the old arrays.
        """
        problem = adapter_id_problem(adapter_id)
        if problem is None and adapter_id in self.reserved_ids:
            problem = f"'{adapter_id}' is the base model's id; choose another adapter id"
        if problem:
            raise InvalidAdapter(problem, param="id")
        directory = resolve_under_root(path, self.adapter_root)
        loaded = read_adapter(
            directory, self._targets, max_rank=self.max_rank, root=self.adapter_root
        )
        with self._lock:
            current = self._mounted.get(adapter_id)
            if current is not None and current.adapter.revision == loaded.revision:
                return self._info(current)
            if current is not None and not replace:
                raise AdapterConflict(
                    f"adapter '{adapter_id}' is already mounted from {current.adapter.path} "
                    f"(revision {current.short_revision}); unmount it or mount with replace"
                )
            mounted = MountedAdapter(adapter_id, loaded, int(time.time()))
            self._mounted[adapter_id] = mounted
            info = self._info(mounted)
        if current is not None:
            del current
            mx.clear_cache()
        log.info("mounted adapter %s from %s (rev %s)", adapter_id, directory, info.revision[:12])
        return info

    def unmount(self, adapter_id: str) -> AdapterInfo:
        """Forget `adapter_id` and free its arrays once no running request holds them.

        The slots hold no adapter state, so dropping the registry entry is all it takes; new
        `resolve` calls naming it raise `AdapterNotFound`.
        """
        with self._lock:
            mounted = self._mounted.pop(adapter_id, None)
            if mounted is None:
                raise AdapterNotFound(adapter_id, self._mounted)
            info = self._info(mounted)
        del mounted
        mx.clear_cache()
        log.info("unmounted adapter %s", adapter_id)
        return info

    def resolve(
        self, refs: Iterable[AdapterRef] | str | list[dict[str, Any]] | None
    ) -> ActiveAdapters:
        """The request's adapter set, holding its own references to the arrays.

        `refs` is normally `parse_adapter_spec`'s result; a raw spec is parsed first. An empty
        spec gives the base alone; an unknown id raises `AdapterNotFound`.
        """
        if refs is None or isinstance(refs, str):
            refs = parse_adapter_spec(refs)
        given: tuple[AdapterRef | dict[str, Any], ...] = tuple(refs)
        parsed = tuple(ref for ref in given if isinstance(ref, AdapterRef))
        if len(parsed) != len(given):
            parsed = parse_adapter_spec(list(given))
        if not parsed:
            return BASE_ONLY
        with self._lock:
            entries = []
            for ref in parsed:
                mounted = self._mounted.get(ref.id)
                if mounted is None:
                    raise AdapterNotFound(ref.id, self._mounted)
                entries.append(AppliedAdapter(mounted, ref.weight))
        return ActiveAdapters(tuple(entries))

    @contextmanager
    def lease(self, active: ActiveAdapters) -> Iterator[ActiveAdapters]:
        """Count `active`'s adapters as in use for the duration of a request."""
        with self._lock:
            for entry in active.entries:
                self._in_use[entry.mounted] = self._in_use.get(entry.mounted, 0) + 1
        try:
            yield active
        finally:
            with self._lock:
                for entry in active.entries:
                    left = self._in_use[entry.mounted] - 1
                    if left:
                        self._in_use[entry.mounted] = left
                    else:
                        del self._in_use[entry.mounted]

    def list(self) -> list[AdapterInfo]:
        """Every mounted adapter, in mount order."""
        with self._lock:
            return [self._info(mounted) for mounted in self._mounted.values()]

    def get(self, adapter_id: str) -> AdapterInfo:
        """One mounted adapter's info; `AdapterNotFound` when it is not mounted."""
        with self._lock:
            mounted = self._mounted.get(adapter_id)
            if mounted is None:
                raise AdapterNotFound(adapter_id, self._mounted)
            return self._info(mounted)

    def __contains__(self, adapter_id: object) -> bool:
        with self._lock:
            return adapter_id in self._mounted

    def __len__(self) -> int:
        with self._lock:
            return len(self._mounted)

    def _info(self, mounted: MountedAdapter) -> AdapterInfo:
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
            skipped_tensors=adapter.skipped_tensors,
            mounted_at=mounted.mounted_at,
            in_use=self._in_use.get(mounted, 0),
        )


def _target(slot: LoRASlot, input_dtype: mx.Dtype | None) -> TargetDims:
    dims = linear_dims(slot.base)
    dtype = input_dtype if input_dtype is not None and input_dtype in _HALF else mx.float32
    return TargetDims(dims.in_dims, dims.out_dims, dtype)
