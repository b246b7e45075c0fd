"""A batched decode step's time for each model family, with and without the native kernels.

Each family's model is built at a small random size by mlx-lm's own classes (`--hidden`,
`--layers`), in float32, twice from one seed: one copy as MLX runs it, one with the native
kernels installed. Both prefill the same rows (prompts of different lengths, one past the
sliding window), then alternate rounds of decode steps on merged caches; the table shows each
copy's median step time and their ratio, and what the kernels leave to MLX's own operations.

    python -m tests.bench.family_steps [--rows 8] [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from hotlora.models.batch_masks import install_row_masks
from hotlora.models.cpu import extension, install_rows_kernels

from tests.support.families import FAMILIES, LONG


def float32_model(name: str, shape: dict[str, int]) -> nn.Module:
    model = FAMILIES[name].build(name, **shape)
    model.set_dtype(mx.float32)
    install_row_masks(model)  # as the loader does
    return model


def prefilled(model: nn.Module, rows: int) -> list:
    """Merged caches of `rows` rows, each prompt prefilled alone as the scheduler does."""
    caches = []
    for row in range(rows):
        cache = make_prompt_cache(model)
        length = 3 + (7 * row) % (LONG.shape[1] - 3)
        mx.eval(model(LONG[:, :length], cache=cache))
        caches.append(cache)
    return [layer[0].merge(list(layer)) for layer in zip(*caches, strict=True)]


def step_seconds(model: nn.Module, cache: list, rows: int, steps: int) -> float:
    """The mean time of `steps` batched decode steps, each evaluated before the next."""
    tokens = mx.array([[5 + row] for row in range(rows)])
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(tokens, cache=cache)
        tokens = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(tokens)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="Rows of the batched step.")
    parser.add_argument("--steps", type=int, default=20, help="Decode steps a round.")
    parser.add_argument("--rounds", type=int, default=5, help="Alternating rounds a family.")
    parser.add_argument("--hidden", type=int, default=256, help="Hidden size of the models.")
    parser.add_argument("--layers", type=int, default=4, help="Layers of the models.")
    parser.add_argument("--families", default=",".join(FAMILIES), help="Comma-separated.")
    args = parser.parse_args(argv)
    if extension.unavailable():
        print(f"native kernels: {extension.unavailable()}", file=sys.stderr)
        return 1
    shape = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": 3 * args.hidden,
    }
    print(f"batched decode step, {args.rows} rows, hidden {args.hidden}, {args.layers} layers")
    print(f"{'family':<12} {'MLX ms':>8} {'kernels ms':>11} {'ratio':>6}  left to MLX")
    for name in args.families.split(","):
        plain, native = float32_model(name, shape), float32_model(name, shape)
        kernels = install_rows_kernels(native)
        if not kernels.enabled:
            print(f"{name:<12} kernels not installed: {kernels.reason}")
            continue
        caches = {id(m): prefilled(m, args.rows) for m in (plain, native)}
        for model in (plain, native):  # warm-up: MLX's compiled functions, the kernels' pool
            step_seconds(model, caches[id(model)], args.rows, 2)
        times: dict[int, list[float]] = {id(plain): [], id(native): []}
        for _ in range(args.rounds):
            for model in (plain, native):
                # Each round decodes further into the same caches: both copies alike.
                times[id(model)].append(
                    step_seconds(model, caches[id(model)], args.rows, args.steps)
                )
        mlx_ms = 1e3 * statistics.median(times[id(plain)])
        native_ms = 1e3 * statistics.median(times[id(native)])
        left = kernels.reason.rpartition("MLX's own operations: ")[2]
        print(f"{name:<12} {mlx_ms:>8.2f} {native_ms:>11.2f} {mlx_ms / native_ms:>5.2f}x  {left}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
