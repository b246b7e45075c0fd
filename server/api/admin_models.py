"""The schema of the model list and the adapter admin routes (what is not OpenAI's completions).

Fields that OpenAI does not have carry a `Field(description=...)`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from hotlora.adapters import ADAPTER_ID_SCHEMA
from hotlora.server.api.completion_requests import RequestBody


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
    path: str
    rank: int
    scale: float
    rslora: bool
    revision: str
    size_bytes: int
    ram_bytes: int
    mounted_layers: int
    mounted_at: int
    in_use: int


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
