"""The `--model` and `--home` flags of the benchmark and the soak, and the model they name."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, help="A model directory (default: the embedded model)."
    )
    parser.add_argument(
        "--home",
        type=Path,
        default=Path(os.environ.get("HOTLORA_HOME", "~/.cache/hotlora")).expanduser(),
        help="hotlora's cache directory (default: $HOTLORA_HOME or ~/.cache/hotlora).",
    )


def resolve_model(args: argparse.Namespace) -> Path:
    """`--model`, or the embedded model imported into `--home` (once)."""
    if args.model is not None:
        return args.model.expanduser().resolve()
    from hotlora.models.embedded import ensure_embedded_model

    return ensure_embedded_model(args.home)
