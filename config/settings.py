"""Typed server settings, the one definition of every `hotlora serve` flag, `HOTLORA_*`
variable and config file key (help, README table and error lines are made from it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from hotlora.config.sources import ConfigFile, Metavar, Variables

# Pages served from this machine, on any port: a local chat UI works out of the box.
LOOPBACK_ORIGINS = "http://localhost:*,http://127.0.0.1:*,http://[::1]:*"
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://([^/\s:\[\]]+|\[[0-9a-fA-F:.]+\])(:(\d+|\*))?")
# A Host name, pattern or bracketed IPv6 address, without a port: `api.example.com`, `*.internal`.
_HOST_NAME = re.compile(r"[A-Za-z0-9*?._-]+\.?|\[[0-9a-fA-F:.]+\]")


def _split(origins: str) -> list[str]:
    return [origin.strip() for origin in origins.split(",") if origin.strip()]


# The native CPU kernels' instruction sets (models/cpu/extension.py's ISAS), widest first.
KernelsIsa = Literal["auto", "avx512vnni", "avx512vbmi", "avx512", "avx2", "neon"]


class Settings(BaseSettings):
    """Everything the app factory needs; built once per app, never at import time.

    Sources, first wins: `hotlora serve` flags, init arguments, `HOTLORA_*` variables, the
    TOML file named by `config`, the defaults. A field's name is its file key; `--kebab-name`
    its flag (`cli_shortcuts` adds another name); `HOTLORA_` and its name in capitals its
    variable. Every field has a description: it is the flag's help and the README's text.
    A renamed setting keeps its old name as the second choice of its `validation_alias`: as
    key, flag and variable it still works, and logs one warning (`sources.old_names`).
    """

    model_config = SettingsConfigDict(
        env_prefix="HOTLORA_",
        env_prefix_target="all",  # a renamed setting's old variable is HOTLORA_ too
        extra="ignore",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_shortcuts={"startup-adapters": "adapter"},
    )

    config: Path | None = Field(
        default=None,
        description="A TOML file of settings, keyed by their names: max_batch = 16.",
    )
    home: Path = Field(
        default=Path("~/.cache/hotlora"),
        validate_default=True,
        description="Cache directory: the imported embedded model and the default adapter root.",
    )
    host: str = Field(default="127.0.0.1", description="Address to bind.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to bind; 0 picks a free one.")
    model: Path | None = Field(
        default=None,
        description="An mlx-lm model directory, or a GGUF file (imported once into the home); "
        "the embedded SmolLM2-135M-Instruct when unset.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="The id clients use for the base model; the directory name when unset.",
    )
    chat_template: Annotated[str | None, Metavar("TEMPLATE")] = Field(
        default=None,
        description="The chat template, in place of the model's own: a built-in (chatml, gemma, "
        "llama3, mistral, phi3, smollm2), a Jinja file, or the template itself (a value holding "
        "{{ or {%). Unset: the model's own; a model without one gets its family's built-in, "
        "with a warning.",
    )
    max_body_bytes: int = Field(default=1 << 20, gt=0, description="Larger request bodies get 413.")
    default_max_tokens: int = Field(
        default=512, gt=0, description="max_tokens when a request sets none."
    )
    default_temperature: float | None = Field(
        default=None,
        ge=0.0,
        le=2.0,
        description="temperature when a request sets none; unset: the model's "
        "generation_config.json value, else 1.",
    )
    default_top_p: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="top_p when a request sets none; unset: the model's generation_config.json "
        "value, else 1.",
    )
    max_tokens_limit: int = Field(default=4096, gt=0, description="Upper bound on max_tokens.")
    max_n: int = Field(default=8, ge=1, description="Upper bound on a request's `n`.")
    max_choices: int = Field(
        default=64,
        ge=1,
        description="Upper bound on a request's choices: its prompts (a list, on "
        "/v1/completions) times `n`. Rows past the batch wait their turn.",
    )
    queue_size: int = Field(
        default=64, ge=1, description="Waiting requests of one tenant beyond this get 503."
    )
    prompt_cache_size: int = Field(
        default=8, ge=0, description="Prompt KV caches kept for reuse (per base+adapter set)."
    )
    prompt_cache_bytes: int = Field(
        default=1 << 30, ge=0, description="Memory the kept prompt KV caches may hold, in bytes."
    )
    prompt_heads: int = Field(
        default=64,
        ge=0,
        description="Prompt heads kept for reuse: the opening a prompt shares with recent "
        "prompts, per base+adapter set, kept when the prompt cache did not have it (none "
        "when prompt_cache_size is 0).",
    )
    prompt_heads_bytes: int = Field(
        default=256 << 20, ge=0, description="Memory the kept prompt heads may hold, in bytes."
    )
    # Batching.
    max_batch: int = Field(
        default=8, ge=1, description="Sequences decoded together in one batched step."
    )
    prefill_chunk: int = Field(
        default=192,
        ge=16,
        description="Prompt tokens a step prefills on an empty cache; deeper in a long prompt a "
        "step takes fewer, as many as cost the same (see prefill_context_unit). Running streams "
        "wait at most one such step; while no row decodes, a step may cost four times as much.",
    )
    decode_ahead: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Launch each decode step from the last one's tokens before reading them, "
        "so that building it and the rows' bookkeeping overlap the step before: on, off, or "
        "auto: on where the model runs on a GPU, off on the CPU, whose cores the step's kernels "
        "already keep busy (measured on 2 cores: the same tokens/s at 1 and 16 streams, 8% more "
        "at 8; 10-20% more peak memory).",
    )
    prefill_context_unit: int = Field(
        default=1024,
        ge=1,
        description="Cached positions whose attention costs as much as a prompt token's "
        "projections: a prefill step counts each token as 1 + positions it reads / this.",
    )
    kv_cache_bytes: int = Field(
        default=2 << 30,
        gt=0,
        description="Memory the running batch's KV cache may reach; new requests wait beyond it.",
    )
    cpu_weights: Literal["auto", "packed", "float32", "mlx"] = Field(
        default="auto",
        description="On a machine without a GPU: packed keeps quantized weights (MLX affine, 4 "
        "or 8 bits) packed for the native kernels, every step and row count; float32 serves a "
        "float32 copy (fast BLAS); mlx keeps the weights as loaded for MLX's own kernels. auto: "
        "packed where the kernels serve the weights, else float32 when the copy fits "
        "cpu_float_budget_bytes.",
    )
    cpu_precision: Literal["fast", "exact", "float32"] = Field(
        default="fast",
        description="On packed quantized weights served by the native kernels: fast quantizes "
        "each row's activations to int8 in blocks of 32 once per projection and takes integer "
        "dot products (no further from mlx-lm's float32 logits than its bfloat16 run); exact "
        "carries each activation in three int8 parts (about float32's precision) through the "
        "same integer products (within 1e-4 of the largest logit of mlx-lm's float32 run); "
        "float32 multiplies the float32 activations by the dequantized weights' float32 values "
        "(as exact, slower). Each gives a row the same bits alone and in any batch. A model "
        "whose recorded fidelity verdict (hotlora fidelity) says fast breaks its rule there is "
        "served exact.",
    )
    cpu_float_budget_bytes: int | None = Field(
        default=None, gt=0, description="Largest float32 copy auto makes; half the RAM when unset."
    )
    cpu_cache_bytes: int = Field(
        default=0,
        ge=0,
        description="On a machine without a GPU: memory MLX keeps in freed buffers for reuse; "
        "beyond it they go back to the system (MLX keeps up to its memory limit otherwise). "
        "By default none: glibc's heap reuses the small ones, and keeping the large ones "
        "bought no speed but held tens of MB more at peak.",
    )
    cpu_vector_jit: bool = Field(
        default=True,
        description="On an x86-64 CPU with AVX2 and FMA and no GPU: MLX builds its fused CPU "
        "kernels with them (same results; faster SiLU and attention softmax).",
    )
    cpu_native_kernels: bool = Field(
        default=True,
        # Its first name, from when it switched one kernel, still sets it (with a warning).
        validation_alias=AliasChoices("cpu_native_kernels", "cpu_batch_matmul"),
        description="On an x86-64 CPU with AVX-512 or AVX2, or an arm64 one with NEON, and no "
        "GPU: every native kernel (built by make setup), or none (MLX's own). They serve "
        "packed quantized weights on every step; with float32 weights the projections of "
        "batched decode steps (2-16 rows) read each weight once for all rows and their "
        "attention takes one operation; every step's norms and RoPEs take one operation each, "
        "to MLX's bits. The old name cpu_batch_matmul still works, with a warning.",
    )
    cpu_kernels_isa: KernelsIsa = Field(
        default="auto",
        description="On a machine without a GPU: the native kernels' vector instructions: auto, "
        "the widest this CPU runs; a narrower one (avx2 on an AVX-512 machine, say) serves as a "
        "CPU with only those would (its sums, in vectors of another width, round apart in the "
        "last bits; a row's results still the same in any batch). Refused at start where the "
        "kernels cannot run them here.",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Threads of the native CPU kernels; every core the process may use when unset.",
    )
    # The process.
    drain_timeout: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM or Ctrl-C, seconds requests in flight get to finish.",
    )
    max_connections: int = Field(
        default=256,
        ge=1,
        description="Open HTTP connections at most; beyond it a new one takes the place of the "
        "oldest that has not sent a whole request (of an address over its cap first), or is "
        "closed when all are answering.",
    )
    max_unfinished_per_address: int = Field(
        default=32,
        ge=0,
        description="Connections one client address may hold without a whole request sent "
        "(connected, idle between requests, or sending one), counted a second after each of its "
        "arrivals; its oldest make way. 0: no cap, e.g. behind a reverse proxy with a larger "
        "keep-alive pool.",
    )
    keep_alive_timeout: int = Field(
        default=5,
        ge=1,
        description="Seconds an idle connection (or one that has sent nothing yet) stays open.",
    )
    request_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a client has to send a whole request, headers and body, from its "
        "first byte; past it the connection is closed (with a 408 once the headers are in).",
    )
    send_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a response waits on a client that takes none of it (the socket's "
        "buffers full); past it the connection is closed.",
    )
    max_unsent_tokens: int = Field(
        default=1024,
        ge=1,
        description="Generated tokens a request may hold that its client has not taken; past "
        "it generation stops and the request ends with a `client_not_reading` error (its rows "
        "pause before, at half of it or 64, whichever is less).",
    )
    log_level: str = Field(
        default="info", description="critical, error, warning, info, debug or trace."
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Log lines as readable text, or as one JSON object per line (an access "
        "line's request facts become keys).",
    )
    warmup: bool = Field(
        default=True, description="Generate two tokens once the model loads, before /ready says so."
    )
    # Adapters.
    adapter_root: Path | None = Field(
        default=None,
        description="Adapters mount only from under here; $HOTLORA_HOME/adapters when unset.",
    )
    max_adapter_rank: int = Field(
        default=256, gt=0, description="Adapters of a higher rank are refused at mount."
    )
    max_adapter_bytes: int = Field(
        default=2 << 30,
        gt=0,
        description="Adapter weight files larger than this are refused at mount, from their size "
        "on disk before anything is read (adapter_config.json is capped at 1 MiB regardless).",
    )
    startup_adapters: Annotated[dict[str, str], Metavar("NAME=PATH")] = Field(
        default_factory=dict,
        description="Adapters to mount before serving, id -> path (repeat the flag; a JSON object "
        "in the variable, a table in the file). A bad one stops the start.",
    )
    persist_mounts: bool = Field(
        default=False,
        description="Record the mounted adapters in $HOTLORA_HOME/mounts.json and mount them "
        "again on the next start; a recorded adapter whose files changed or vanished is "
        "reported and left unmounted.",
    )
    auto_mount: bool = Field(
        default=False,
        description="Mount an adapter on its first request: a request naming an id that is not "
        "mounted, whose directory of that name is under the adapter root, mounts it (requests "
        "that ask at once share one load). Off: only admin mounts are served. Not with ray "
        "(refused at start).",
    )
    adapter_dtype: Literal["auto", "float32", "float16"] = Field(
        default="auto",
        description="What adapters are kept in where the model computes in float32. auto: "
        "float16 where the packed 4-bit kernels serve (the CPU's default for a quantized "
        "model), which halves their memory and what a decode step reads of them, the step's "
        "cost with many distinct adapters; float32 elsewhere. float16 asks for it (said in the "
        "log where those kernels do not serve), float32 keeps every adapter's values as "
        "trained. Rounding to float16 happens at the mount; values past its range are refused "
        "there. Where the activations are float16 or bfloat16, adapters are kept in that dtype.",
    )
    max_mounted_adapters: int | None = Field(
        default=None,
        ge=1,
        description="Adapters kept mounted at most: past it the least recently used one that no "
        "running request holds and no admin pinned is evicted, and mounted again when a request "
        "names it. With ray: per replica, mounted again from the registry. Unset: no bound.",
    )
    adapter_memory_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Memory the mounted adapters' arrays may hold together, in bytes: evicted "
        "as with max_mounted_adapters past it; an adapter larger on its own is refused (400). "
        "Not with ray (refused at start). Unset: no bound.",
    )
    # Ray Serve.
    ray: bool = Field(
        default=False,
        description="Serve on Ray Serve: `replicas` copies of the server behind its HTTP proxy, "
        "one adapter registry for all (needs the `ray` extra; RAY_ADDRESS names a cluster).",
    )
    replicas: int = Field(
        default=1, ge=1, description="With ray: the replicas to start (the fewest, autoscaling)."
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        description="With ray: autoscale between `replicas` and this many on the requests each "
        "replica has in flight (target: max_batch); unset: a fixed number of replicas.",
    )
    api_key: str | None = Field(
        default=None,
        description="Require `Authorization: Bearer KEY` on the inference routes.",
    )
    admin_api_key: str | None = Field(
        default=None,
        description="Require this bearer key on the adapter admin routes; api_key when unset.",
    )
    keys: Path | None = Field(
        default=None,
        description="A TOML file of tenants' keys ([[key]] tables: name, sha256 of the key, role, "
        "adapters, limits; see server/OPERATING.md): the inference and admin routes then need one "
        "of them (or api_key). Read again on SIGHUP and when it changes; a bad file is refused, "
        "the keys read before stay.",
    )
    allowed_origins: str = Field(
        default=LOOPBACK_ORIGINS,
        description="Browser origins that may call the API (CORS): a comma list of "
        "scheme://host[:port] origins, where a port of `*` matches any port (and none); `*` "
        "alone for every origin; empty for none. Default: loopback pages on any port.",
    )

    allowed_hosts: str = Field(
        default="",
        description="Names a request's Host header may give besides loopback ones: a comma list "
        "of names without a port (`*.example.com` patterns; `*` for any). Default: on a loopback "
        "--host, loopback names and this machine's name only (a page whose name is pointed at "
        "127.0.0.1 cannot reach the server: DNS rebinding); on any other --host, every name.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # pydantic-settings puts the flags (a CliSettingsSource) ahead of these.
        return init_settings, Variables(settings_cls), ConfigFile(settings_cls)

    @field_validator("home")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("api_key", "admin_api_key")
    @classmethod
    def _non_empty_key(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("an API key must not be empty; leave it unset to disable the check")
        return value

    @field_validator("ray")
    @classmethod
    def _ray_keeps_no_budget_of_its_own(cls, value: bool, info: ValidationInfo) -> bool:
        # A replica mounts the registry's adapters up to its own cap; these would be dropped.
        if value:
            given = [
                flag
                for flag, field, off in (
                    ("--adapter-memory-bytes", "adapter_memory_bytes", None),
                    ("--auto-mount", "auto_mount", False),
                )
                if info.data.get(field, off) != off
            ]
            if given:
                verb = "does" if len(given) == 1 else "do"
                raise ValueError(
                    f"{' and '.join(given)} {verb} not apply with ray: its replicas mount the "
                    "registry's adapters, up to --max-mounted-adapters each"
                )
        return value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        value = value.lower()
        if value not in {"critical", "error", "warning", "info", "debug", "trace"}:
            raise ValueError(f"unknown log level {value!r}")
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: str) -> str:
        for origin in _split(value):
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"{origin!r} is not an origin: expected scheme://host[:port] (port may be *, "
                    "no path), or * alone"
                )
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: str) -> str:
        for name in _split(value):
            if not _HOST_NAME.fullmatch(name):
                raise ValueError(
                    f"{name!r} is not a host name or pattern: a name without a port (the Host "
                    "header's port is not matched), `*` and `?` standing for any characters"
                )
        return value

    @property
    def allowed_origin_list(self) -> list[str]:
        """`allowed_origins` split at its commas, blanks dropped."""
        return _split(self.allowed_origins)

    @property
    def allowed_host_list(self) -> list[str]:
        """`allowed_hosts` split at its commas, blanks dropped."""
        return _split(self.allowed_hosts)

    @property
    def resolved_adapter_root(self) -> Path:
        return (self.adapter_root or self.home / "adapters").expanduser().resolve()
