"""LoRA adapters over one base model: mounted, unmounted and selected per request.

The public API is what this module exports; code outside the package imports from here.
A request's `adapter` field is parsed once (`parse_adapter_spec`, into `AdapterRef`s) and read
with its `model` field by `parse_selection`; `AdapterManager.select` turns the selection into an
`AdapterLease` holding the request's own `AdapterSet`; `activate` makes that set the one the LoRA
slots apply while the model runs, or, for a batch, a `RowAdapters` from `RowAdapterCache` that
applies each row's own set; each slot adds them through the residual backend of its weights'
kind (`backends`), chosen once when the slots are installed. With a `MountJournal` (the mount
record `MountFile`, or the Ray cluster's registry) every mount and unmount is recorded before it
is made, and a `MountStore` mounts the recorded set again when a server starts. Listeners the
manager is given hear of every mount, on-demand load, unmount and eviction (`MountEvent`),
whatever made it. With a `Budget` the manager keeps the least recently used adapters within it
(`residency`); an adapter it evicted, or one under the adapter root with `auto_mount`, is
mounted on first use (`first_use`).
"""

from hotlora.adapters.adapter_errors import (
    AdapterConflict,
    AdapterError,
    AdapterNotFound,
    AdapterOverBudget,
    AdapterPathMissing,
    AdapterPathRefused,
    InvalidAdapter,
    InvalidAdapterSpec,
)
from hotlora.adapters.adapter_files import resolve_under_root
from hotlora.adapters.adapter_info import AdapterInfo, MountEvent, MountListener
from hotlora.adapters.adapter_set import BASE_ONLY, AdapterSet
from hotlora.adapters.backends import RowAdapterCache, RowAdapters
from hotlora.adapters.fuse import fuse_adapter
from hotlora.adapters.manager import AdapterLease, AdapterManager
from hotlora.adapters.mount_journal import (
    MOUNTS_FILE,
    MountedSet,
    MountFile,
    MountJournal,
    MountRecord,
    MountStore,
    mount_file,
    open_mounted_set,
    report_unmountable,
    write_mounted_set,
)
from hotlora.adapters.residency import Budget, PinQuota
from hotlora.adapters.root_listing import RootEntry
from hotlora.adapters.scope import (
    EVERYTHING,
    AdapterScope,
    current_scope,
    reset_scope,
    shown_path,
    use_scope,
)
from hotlora.adapters.slots import activate
from hotlora.adapters.spec import (
    ADAPTER_ID_SCHEMA,
    AdapterRef,
    parse_adapter_spec,
    parse_selection,
)

__all__ = [
    "ADAPTER_ID_SCHEMA",
    "MOUNTS_FILE",
    "BASE_ONLY",
    "EVERYTHING",
    "AdapterConflict",
    "AdapterError",
    "AdapterInfo",
    "AdapterLease",
    "AdapterManager",
    "AdapterNotFound",
    "AdapterOverBudget",
    "AdapterPathMissing",
    "AdapterPathRefused",
    "AdapterRef",
    "AdapterScope",
    "AdapterSet",
    "Budget",
    "InvalidAdapter",
    "InvalidAdapterSpec",
    "MountEvent",
    "MountFile",
    "MountJournal",
    "MountListener",
    "MountRecord",
    "MountStore",
    "MountedSet",
    "PinQuota",
    "RootEntry",
    "RowAdapterCache",
    "RowAdapters",
    "activate",
    "current_scope",
    "fuse_adapter",
    "mount_file",
    "open_mounted_set",
    "parse_adapter_spec",
    "parse_selection",
    "report_unmountable",
    "reset_scope",
    "resolve_under_root",
    "shown_path",
    "use_scope",
    "write_mounted_set",
]
