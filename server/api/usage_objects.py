"""The schema of GET /v1/usage: what each tenant used since the server started."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class AdapterUsage(BaseModel):
    requests: int
    prompt_tokens: int
    completion_tokens: int


class TenantUsageRow(BaseModel):
    tenant: str = Field(description="The tenant: its keys' `name` ('default' without keys).")
    requests: int = Field(description="Requests answered, refusals included.")
    prompt_tokens: int
    completion_tokens: int
    errors: int = Field(description="Requests answered with an error (4xx, 5xx), 429s included.")
    limits_hit: int = Field(description="Requests refused with 429 for one of its limits.")
    limited: dict[str, int] = Field(
        description="Those refusals by limit: requests_per_minute, tokens_per_minute, max_streams."
    )
    adapters: dict[str, AdapterUsage] = Field(
        description="Per adapter in the requests' sets (the base model's id: no adapter)."
    )
    in_flight: int = Field(description="Its requests being answered now.")


class UsageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantUsageRow]
