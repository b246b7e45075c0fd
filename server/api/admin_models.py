"""The schema of the model list and the adapter admin routes (what is not OpenAI's completions).

Fields that OpenAI does not have carry a `Field(description=...)`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from hotlora.adapters import ADAPTER_ID_SCHEMA
from hotlora.server.api.completion_requests import RequestBody


class EndOfGenerationToken(BaseModel):
    """A token that ends the model's answers, and why it does."""

    id: int
    token: str = Field(description="The token as the vocabulary spells it.")
    sources: list[str] = Field(
        description="Why it ends an answer: eos (the tokenizer's), generation_config (its "
        "eos_token_id), end-of-turn name (a special token llama.cpp ends on), chat template "
        "(what the template closes an assistant turn with)."
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = Field(default=None, description="Local model directory or adapter path.")
    parent: str | None = Field(default=None, description="The base model id, for adapters.")
    max_model_len: int | None = Field(
        default=None, description="The context length: prompt and answer tokens together."
    )
    end_of_generation: list[EndOfGenerationToken] | None = Field(
        default=None,
        description="The tokens that end an answer unless a request sets ignore_eos (its "
        "stop_token_ids end it too).",
    )


class AdminBody(RequestBody):
    """An adapter admin body: a key it does not declare (a misspelt `replace`) is a 400."""

    model_config = ConfigDict(extra="forbid")


class MountAdapterRequest(AdminBody):
    # The document shows the id rules; the manager enforces them, with messages of its own.
    id: str = Field(
        description="The adapter id requests use: letters, digits, '.', '_', '-'.",
        json_schema_extra=ADAPTER_ID_SCHEMA,
    )
    path: str = Field(description="The adapter directory, under the server's adapter root.")
    replace: StrictBool = Field(default=False, description="Swap an adapter mounted under this id.")
    pin: StrictBool = Field(
        default=False,
        description="Never evict it to keep within --max-mounted-adapters or "
        "--adapter-memory-bytes.",
    )


class LoadLoraAdapterRequest(AdminBody):
    """vLLM's spelling of a mount."""

    lora_name: str = Field(json_schema_extra=ADAPTER_ID_SCHEMA)
    lora_path: str
    load_inplace: StrictBool = False


class UnloadLoraAdapterRequest(AdminBody):
    lora_name: str = Field(json_schema_extra=ADAPTER_ID_SCHEMA)
    lora_int_id: StrictInt | None = Field(
        default=None, description="vLLM's own number for the adapter; the name alone finds it."
    )


class AdapterCard(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    path: str = Field(
        description="Where its files are: absolute for an admin key; under the adapter root, "
        "relative to it for other keys."
    )
    rank: int
    scale: float
    rslora: bool
    revision: str
    size_bytes: int
    ram_bytes: int
    mounted_layers: int
    mounted_at: int
    in_use: int
    pinned: bool = Field(default=False, description="Never evicted to keep within the budget.")
    on_demand: bool = Field(
        default=False, description="Mounted by a request naming it (--auto-mount), not by hand."
    )


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


class AdapterRootEntry(BaseModel):
    id: str | None = Field(
        description="The id a request names it by; null for an adapter in a tenant-admin "
        "key's folder never mounted (a mount gives it one)."
    )
    path: str = Field(
        description="Where its files are: absolute for an admin key, relative to the adapter "
        "root for a tenant-admin key, as its mounts name them."
    )
    state: Literal["resident", "evicted", "on disk"] = Field(
        description="resident: mounted now; evicted: unmounted to keep within the budget, "
        "mounted again on next use; on disk: under the root, never mounted (with --auto-mount, "
        "mounted on first use)."
    )
    pinned: bool
    size_bytes: int | None = Field(description="Its weight file on disk.")
    ram_bytes: int | None = Field(description="Its arrays mounted; null before it ever was.")


class AdapterRootList(BaseModel):
    object: Literal["list"] = "list"
    root: str = Field(
        description="The adapter root (a tenant-admin key: its folder, relative to the root)."
    )
    auto_mount: bool = Field(description="Whether a request mounts an adapter on first use.")
    resident_bytes: int = Field(
        description="What the resident adapters' arrays hold together (a tenant-admin key: "
        "those it may see)."
    )
    max_mounted_adapters: int | None
    adapter_memory_bytes: int | None
    data: list[AdapterRootEntry]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
