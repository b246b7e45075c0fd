"""The `hotlora` command: serve, import-gguf, quantize."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

SETTING_FLAGS = {
    # flag -> (settings field, type, help)
    "--host": ("host", str, "Address to bind (default 127.0.0.1)."),
    "--port": ("port", int, "Port to bind (default 8000)."),
    "--model": ("model", Path, "An mlx-lm model directory (default: the embedded SmolLM2-135M)."),
    "--served-model-name": ("served_model_name", str, "The base model's id in the API."),
    "--max-body-bytes": ("max_body_bytes", int, "Largest request body accepted (413 beyond)."),
    "--default-max-tokens": ("default_max_tokens", int, "max_tokens when a request gives none."),
    "--default-temperature": (
        "default_temperature",
        float,
        "temperature when a request gives none (default: the model's, else 1).",
    ),
    "--default-top-p": (
        "default_top_p",
        float,
        "top_p when a request gives none (default: the model's, else 1).",
    ),
    "--max-tokens-limit": ("max_tokens_limit", int, "Largest max_tokens a request may ask for."),
    "--max-batch": ("max_batch", int, "Sequences decoded together in one step (default 8)."),
    "--prefill-chunk": ("prefill_chunk", int, "Prompt tokens processed per step (default 512)."),
    "--kv-cache-bytes": ("kv_cache_bytes", int, "KV cache budget of the running batch (2 GiB)."),
    "--cpu-weights": (
        "cpu_weights",
        str,
        "auto, float32 or quantized: without a GPU, auto serves float32 weights when they fit.",
    ),
    "--drain-timeout": (
        "drain_timeout",
        float,
        "On SIGTERM or Ctrl-C, seconds requests in flight get to finish (default 30).",
    ),
    "--max-connections": (
        "max_connections",
        int,
        "Open HTTP connections at most (default 256); requests beyond it get 503.",
    ),
    "--keep-alive-timeout": (
        "keep_alive_timeout",
        int,
        "Seconds an idle connection stays open (default 5).",
    ),
    "--log-level": ("log_level", str, "critical, error, warning, info, debug or trace."),
    "--home": ("home", Path, "Cache directory (default ~/.cache/hotlora, or $HOTLORA_HOME)."),
    "--adapter-root": (
        "adapter_root",
        Path,
        "Adapters mount only from under this directory (default $HOTLORA_HOME/adapters).",
    ),
    "--max-adapter-rank": ("max_adapter_rank", int, "Refuse adapters of a higher rank."),
    "--max-adapter-bytes": ("max_adapter_bytes", int, "Refuse larger adapter files (2 GiB)."),
    "--api-key": ("api_key", str, "Require 'Authorization: Bearer KEY' on inference routes."),
    "--admin-api-key": ("admin_api_key", str, "Require this bearer key on adapter admin routes."),
    "--allowed-origins": (
        "allowed_origins",
        str,
        "Browser origins that may call the API (CORS): a comma list (a port may be *), * for "
        "any, '' for none (default: loopback origins, any port).",
    ),
}


def _adapter_pair(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="Serve the OpenAI-compatible API.",
        description="Serve the OpenAI-compatible API. Every flag also reads HOTLORA_<NAME>.",
    )
    for flag, (_, kind, text) in SETTING_FLAGS.items():
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument(
        "--adapter",
        dest="adapters",
        metavar="NAME=PATH",
        type=_adapter_pair,
        action="append",
        default=[],
        help="Mount an adapter at start-up (repeatable); a bad one stops the start.",
    )
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from hotlora.config.settings import Settings
    from hotlora.server.app import create_app
    from hotlora.server.lifecycle import DrainingServer, uvicorn_config

    overrides = {
        field: getattr(args, flag[2:].replace("-", "_"))
        for flag, (field, _, _) in SETTING_FLAGS.items()
        if getattr(args, flag[2:].replace("-", "_")) is not None
    }
    if args.adapters:
        overrides["startup_adapters"] = dict(args.adapters)
    settings = Settings(**overrides)
    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s: %(message)s")
    fatal: list[BaseException] = []
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    config = uvicorn_config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keep_alive_timeout,
    )
    runtime = app.state.runtime
    server = DrainingServer(config, drain=lambda: runtime.drain(settings.drain_timeout))
    server.run()
    if fatal:
        print(f"hotlora: could not start: {fatal[0]}", file=sys.stderr)
    _exit_now(1 if fatal else 0)


def _exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown: MLX aborts in its exit-time destructors once a
    thread other than the main one has used it (ml-explore/mlx#3126), and the generation worker
    is such a thread. Everything is shut down by now; only the logs are left to flush."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _import_gguf_parser(sub: Any) -> None:
    p = sub.add_parser(
        "import-gguf",
        help="Convert a llama-family GGUF into an mlx-lm model directory.",
        description="Convert a llama-family GGUF (Q4_0, Q4_1, Q8_0, F16, F32 tensors) into an "
        "mlx-lm model directory, keeping quantized tensors quantized.",
    )
    p.add_argument("src", type=Path, help="The .gguf file.")
    p.add_argument("dest", type=Path, help="The model directory to write (must not exist).")
    p.set_defaults(handler=_import_gguf)


def _import_gguf(args: argparse.Namespace) -> int:
    from hotlora.models.gguf import import_gguf

    out = import_gguf(args.src, args.dest)
    print(f"wrote {out}")
    return 0


def _quantize_parser(sub: Any) -> None:
    p = sub.add_parser(
        "quantize",
        help="Write a quantized copy of a float model directory.",
        description="Write a quantized copy of a float mlx-lm model directory, auxiliary files "
        "(tokenizer, chat template, ...) copied verbatim.",
    )
    p.add_argument("src", type=Path, help="A float mlx-lm model directory.")
    p.add_argument("dest", type=Path, help="The directory to write (must not exist).")
    p.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5, 6, 8))
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    p.set_defaults(handler=_quantize)


def _quantize(args: argparse.Namespace) -> int:
    from hotlora.models.quantize import quantize_model_dir

    out = quantize_model_dir(args.src, args.dest, bits=args.bits, group_size=args.group_size)
    print(f"wrote {out}")
    return 0


def _fuse_parser(sub: Any) -> None:
    p = sub.add_parser(
        "fuse",
        help="Write a model directory with an adapter merged into the base weights.",
        description="Merge a LoRA adapter into a model (quantized bases are dequantized, merged "
        "and re-quantized with the same settings); auxiliary files are copied.",
    )
    p.add_argument("--model", type=Path, required=True, help="The base model directory.")
    p.add_argument("--adapter", type=Path, required=True, help="The adapter directory.")
    p.add_argument("out", type=Path, help="The directory to write (must not exist).")
    p.set_defaults(handler=_fuse)


def _fuse(args: argparse.Namespace) -> int:
    from hotlora.adapters import fuse_adapter

    out = fuse_adapter(args.model, args.adapter, args.out)
    print(f"wrote {out}")
    return 0


PARSERS: list[Callable[[Any], None]] = [
    _serve_parser,
    _import_gguf_parser,
    _quantize_parser,
    _fuse_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotlora",
        description="OpenAI-compatible MLX server: one quantized base model, many LoRA adapters.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in PARSERS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"hotlora {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
