"""LoRA adapters over one base model: mounted, unmounted and selected per request.

The public API is what this module exports; code outside the package imports from here.
"""

from hotlora.adapters.adapter_errors import (
    AdapterConflict,
    AdapterError,
    AdapterNotFound,
    AdapterPathRefused,
    InvalidAdapter,
    InvalidAdapterSpec,
)

__all__ = [
    "AdapterConflict",
    "AdapterError",
    "AdapterNotFound",
    "AdapterPathRefused",
    "InvalidAdapter",
    "InvalidAdapterSpec",
]
