"""The `hotlora` command: serve, import-gguf, quantize, fuse, keys."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from pydantic_settings import CliSettingsSource

from hotlora.config.log_text import one_line
from hotlora.config.settings import Settings
from hotlora.config.sources import (
    InvalidSetting,
    invalid_setting,
    load_settings,
    log_setting_notes,
    metavar,
    old_flags,
    refused,
)


def package_version() -> str:
    """The installed distribution's version; a checkout that was never installed has none."""
    try:
        return version("hotlora")
    except PackageNotFoundError:
        return "0+unknown"


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="Serve the OpenAI-compatible API.",
        description="Serve the OpenAI-compatible API. Every setting is a flag, a HOTLORA_<NAME> "
        "environment variable and a key of the --config TOML file; a flag wins over the "
        "variable, the variable over the file.",
    )

    old = old_flags(Settings)

    def add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> Any:
        field = Settings.model_fields.get(kwargs.get("dest", ""))
        shown = field and metavar(field)
        if shown and "metavar" in kwargs:
            kwargs["metavar"] = shown
        action = parser.add_argument(*[name for name in names if name not in old], **kwargs)
        for name in [name for name in names if name in old]:
            # A renamed setting's old flag: out of the help, and under its own destination,
            # which pydantic-settings reads as the alias it is and load_settings warns of.
            parser.add_argument(name, **{**kwargs, "dest": old[name], "help": argparse.SUPPRESS})
        return action

    # The flags are Settings' fields, added to this subcommand by pydantic-settings.
    source: CliSettingsSource[Settings] = CliSettingsSource(
        Settings, root_parser=p, add_argument_method=add_argument
    )
    p.set_defaults(handler=_serve, settings_source=source)


def _serve(args: argparse.Namespace) -> int:
    # Settings first: a bad value stops the start before anything heavy is imported.
    try:
        settings = serve_settings(args)
    except InvalidSetting as exc:
        log_setting_notes()  # the line may name a setting the user gave under its old name
        print(f"hotlora serve: {exc}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    from hotlora.models.embedded import stop_imports
    from hotlora.models.gguf import ImportStopped
    from hotlora.server.app import create_app
    from hotlora.server.http.lifecycle import ClientTimeouts, DrainingServer, uvicorn_config
    from hotlora.server.telemetry.log_format import configure_logging, uvicorn_logging

    imported = time.perf_counter() - began
    configure_logging(settings)
    log_setting_notes()
    logging.getLogger("hotlora").info(
        "start-up: imports took %.2fs",
        imported,
        extra={"fields": {"phase": "imports", "seconds": round(imported, 3)}},
    )
    if settings.ray:
        return _serve_on_ray(settings)
    fatal: list[BaseException] = []
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    app.state.runtime.phases["imports"] = imported  # the first of the phases /metrics reports
    config = uvicorn_config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        limit_concurrency=settings.max_connections,
        unfinished_per_peer=settings.max_unfinished_per_address,
        timeout_keep_alive=settings.keep_alive_timeout,
        timeouts=ClientTimeouts(settings.request_timeout, settings.send_timeout),
        **uvicorn_logging(settings),
    )
    runtime = app.state.runtime
    stopped: list[int] = []  # a signal that stopped the model's import

    class Server(DrainingServer):
        """The server, whose SIGTERM or Ctrl-C also stops the model's import under way: it
        gives up at its next tensor, writing nothing, rather than holding the exit until it
        ends and then writing an import no one serves."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if stop_imports():
                stopped.append(sig)
            super().handle_exit(sig, frame)

    server = Server(
        config, drain=lambda: runtime.drain(settings.drain_timeout), hurry=runtime.hurry
    )
    server.run()
    # The start reports the stopped import, or was cancelled first: the same line either way.
    if stopped and (not fatal or isinstance(fatal[0], ImportStopped)):
        fatal = [ImportStopped("a signal stopped the model's import; nothing of it was kept")]
    if fatal:
        print(f"hotlora: could not start: {one_line(fatal[0])}", file=sys.stderr)
    _exit_now(1 if fatal else 0)


def _serve_on_ray(settings: Settings) -> int:
    try:
        from hotlora.server.ray.serve_app import serve_on_ray
    except ImportError as exc:
        print(f"hotlora serve: --ray needs the `ray` extra ({exc})", file=sys.stderr)
        return 2
    return serve_on_ray(settings)


def serve_settings(args: argparse.Namespace) -> Settings:
    """`hotlora serve`'s settings from its parsed flags, the environment and the config file."""
    settings = load_settings(Settings, args.settings_source, args)
    if settings.chat_template is not None:
        from hotlora.server.render.chat_templates import ChatTemplateError, read_chat_template

        try:
            read_chat_template(settings.chat_template)
        except ChatTemplateError as exc:
            raise refused(settings, "chat_template", str(exc), args) from None
    return settings


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
        help="Convert a GGUF into an mlx-lm model directory.",
        description="Convert a GGUF of llama, mistral, qwen2, qwen3, gemma2, gemma3 or phi3 "
        "(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K to Q6_K) into an "
        "mlx-lm model directory, keeping quantized tensors quantized: Q4_K and Q5_K exactly, "
        "Q6_K, Q3_K and Q2_K as 8 bits.",
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


def _fidelity_parser(sub: Any) -> None:
    p = sub.add_parser(
        "fidelity",
        help="Measure the int8 CPU path's fidelity on a model; serve keeps to the verdict.",
        description="Measure how far --cpu-precision fast (int8 activations) is from mlx-lm's "
        "float32 logits on teacher-forced chat prompts, against mlx-lm's own bfloat16 run of the "
        "same weights (minutes on a CPU), and record the verdict in the home: serve then uses "
        "--cpu-precision exact on a model whose fast path is further than bfloat16 on any "
        "figure or agrees less often on the top token. Exit status 0 when it keeps its rule, 3 "
        "when it does not.",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="An mlx-lm model directory or a GGUF file, as serve takes it (default: the embedded "
        "model).",
    )
    p.add_argument(
        "--home",
        type=Path,
        default=None,
        help="Where the verdict is recorded, as serve's --home (default: HOTLORA_HOME, else "
        "serve's default).",
    )
    p.add_argument("--threads", type=int, default=None, help="The kernels' threads.")
    p.add_argument(
        "--positions",
        type=int,
        default=32,
        help="Teacher-forced positions of each of the two conversations (default: 32).",
    )
    p.set_defaults(handler=_fidelity)


def _fidelity(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from hotlora.models.cpu.fidelity import measure, measured_rows, record
    from hotlora.server.runtime import model_dir

    if args.positions < 2:
        raise ValueError("--positions is at least 2")
    # The model, home and threads as serve takes them (flags, HOTLORA_* variables), these
    # flags first, held to the same bounds.
    given = {"model": args.model, "home": args.home, "threads": args.threads}
    given = {name: value for name, value in given.items() if value is not None}
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        raise invalid_setting(Settings, exc, given) from None
    path = model_dir(settings, progress=print)
    verdict = measure(path, threads=settings.threads, positions=args.positions)
    print("\n".join(measured_rows(verdict)))
    print(f"recorded in {record(settings.home, verdict)}")
    return 0 if verdict.holds else 3


def _keys_parser(sub: Any) -> None:
    p = sub.add_parser(
        "keys",
        help="Add a tenant's key to a keys file (--keys).",
        description="Manage the keys file that `hotlora serve --keys FILE` reads.",
    )
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    add = keys.add_parser(
        "add",
        help="Make a new key, print it once, and append its hash to the file.",
        description="Make a new random key for tenant NAME, print it (once: the file keeps only "
        "its SHA-256) and append a [[key]] table for it to FILE, made if missing. A running "
        "server reads the file again within a second.",
    )
    add.add_argument("name", help="The tenant, as logs and metrics show it.")
    add.add_argument("--file", type=Path, required=True, help="The keys file.")
    add.add_argument("--role", choices=("user", "tenant-admin", "admin"), default="user")
    add.add_argument(
        "--adapters",
        action="append",
        default=[],
        metavar="IDS",
        help="Adapter ids or globs it may run, comma-separated (repeatable): acme-*.",
    )
    add.add_argument(
        "--base",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Whether it may run the base model alone.",
    )
    add.add_argument("--mount-prefix", help="tenant-admin: the ids it may mount and unmount.")
    add.add_argument("--mount-dir", help="tenant-admin: its folder under --adapter-root.")
    add.add_argument("--requests-per-minute", type=int)
    add.add_argument("--tokens-per-minute", type=int)
    add.add_argument("--max-streams", type=int, help="Its requests in flight at once, at most.")
    add.add_argument("--max-pinned", type=int, help="tenant-admin: its ids pinned at most.")
    add.add_argument("--weight", type=float, help="Its share of the batch (default 1).")
    add.set_defaults(handler=_keys_add)


def _keys_add(args: argparse.Namespace) -> int:
    from hotlora.server.http.keys_file import add_key

    adapters = [a.strip() for given in args.adapters for a in given.split(",") if a.strip()]
    entry = {
        "name": args.name,
        "role": args.role,
        "adapters": adapters,
        "base": args.base,
        "mount_prefix": args.mount_prefix,
        "mount_dir": args.mount_dir,
        "requests_per_minute": args.requests_per_minute,
        "tokens_per_minute": args.tokens_per_minute,
        "max_streams": args.max_streams,
        "max_pinned": args.max_pinned,
        "weight": args.weight,
    }
    key = add_key(args.file, {name: value for name, value in entry.items() if value is not None})
    role = {"admin": "an admin", "tenant-admin": "a tenant-admin", "user": "a user"}[args.role]
    print(f"added {role} key for '{args.name}' to {args.file}; the key (shown once):")
    print(key)
    return 0


PARSERS: list[Callable[[Any], None]] = [
    _serve_parser,
    _import_gguf_parser,
    _quantize_parser,
    _fuse_parser,
    _fidelity_parser,
    _keys_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotlora",
        description="OpenAI-compatible MLX server: one quantized base model, many LoRA adapters.",
    )
    parser.add_argument("--version", action="version", version=f"hotlora {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in PARSERS:
        add(sub)
    return parser


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM stops a command other than serve (whose server drains on it) as Ctrl-C does: the
    # directory it was writing is removed on the way out. Only the main thread may set it.
    on_term = None
    if args.command != "serve" and threading.current_thread() is threading.main_thread():
        on_term = signal.signal(signal.SIGTERM, _interrupted)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(f"hotlora {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - told in one line, never as a traceback
        logging.getLogger("hotlora").debug("hotlora %s failed", args.command, exc_info=True)
        print(f"hotlora {args.command}: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)


if __name__ == "__main__":
    sys.exit(main())
