"""Typed server settings: `HOTLORA_*` environment variables, overridden by `hotlora serve` flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path("~/.cache/hotlora").expanduser()


class Settings(BaseSettings):
    """Everything the app factory needs; built once per app, never at import time."""

    model_config = SettingsConfigDict(env_prefix="HOTLORA_", extra="ignore")

    home: Path = Field(
        default_factory=default_home,
        description="Cache directory: the imported embedded model and the default adapter root.",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    model: Path | None = Field(
        default=None,
        description="An mlx-lm model directory; the embedded SmolLM2-135M-Instruct when unset.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="The id clients use for the base model; the directory name when unset.",
    )
    max_body_bytes: int = Field(default=1 << 20, gt=0, description="Larger request bodies get 413.")
    default_max_tokens: int = Field(default=512, gt=0)
    max_tokens_limit: int = Field(default=4096, gt=0, description="Upper bound on max_tokens.")
    max_n: int = Field(default=8, ge=1, description="Upper bound on a request's `n`.")
    queue_size: int = Field(default=64, ge=1, description="Waiting requests beyond this get 503.")
    prompt_cache_size: int = Field(
        default=8, ge=0, description="Prompt KV caches kept for reuse (per base+adapter set)."
    )
    prompt_cache_bytes: int = Field(
        default=1 << 30, ge=0, description="Memory the kept prompt KV caches may hold, in bytes."
    )
    # Batching.
    max_batch: int = Field(
        default=8, ge=1, description="Sequences decoded together in one batched step."
    )
    prefill_chunk: int = Field(
        default=512,
        ge=16,
        description="Prompt tokens processed per step; running streams wait at most one chunk.",
    )
    kv_cache_bytes: int = Field(
        default=2 << 30,
        gt=0,
        description="Memory the running batch's KV cache may reach; new requests wait beyond it.",
    )
    cpu_weights: Literal["auto", "float32", "quantized"] = Field(
        default="auto",
        description="On a machine without a GPU: serve float32 weights (fast BLAS) or keep them "
        "as loaded. auto: float32 when the copy fits cpu_float_budget_bytes.",
    )
    cpu_float_budget_bytes: int | None = Field(
        default=None, gt=0, description="Largest float32 copy auto makes; half the RAM when unset."
    )
    log_level: str = "info"
    warmup: bool = True
    # Adapters.
    adapter_root: Path | None = Field(
        default=None,
        description="Adapters mount only from under here; $HOTLORA_HOME/adapters when unset.",
    )
    max_adapter_rank: int = Field(default=256, gt=0)
    startup_adapters: dict[str, str] = Field(
        default_factory=dict, description="Adapters to mount before serving: id -> path."
    )
    api_key: str | None = None
    admin_api_key: str | None = None

    @field_validator("api_key", "admin_api_key")
    @classmethod
    def _non_empty_key(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("an API key must not be empty; leave it unset to disable the check")
        return value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        value = value.lower()
        if value not in {"critical", "error", "warning", "info", "debug", "trace"}:
            raise ValueError(f"unknown log level {value!r}")
        return value

    @property
    def resolved_adapter_root(self) -> Path:
        return (self.adapter_root or self.home / "adapters").expanduser().resolve()
