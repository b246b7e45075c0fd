"""Decode step times, prefill rate and peak RSS of the CPU paths, side by side in one process.

`python -m tests.bench.step_times` loads the embedded model twice, once served packed (the
native quantized kernels, `--cpu-weights packed`, at `--cpu-precision exact`: three int8 parts a
value, logits within float32's rounding as the copy's are) and once as a float32 copy
(`--cpu-weights float32`), and times, in alternating rounds so that a noisy machine weighs on
both alike: one decode step at 1, 2, 4, 8 and 16 rows (median of each round's steps), and a
~1,250-token prompt prefilled in the scheduler's 192-token chunks. Each path's peak RSS is
measured in a process of its own (`--rss PATH`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

PATHS = {"packed": "packed", "float32": "float32"}
ROWS = (1, 2, 4, 8, 16)
CONTEXT = 64  # cached tokens each row decodes after
PROMPT_TOKENS = 1250
CHUNK = 192


def load(
    path: str, threads: int | None, precision: str = "exact", model_dir: Path | None = None
) -> nn.Module:
    """The embedded model (or the one in `model_dir`) as `--cpu-weights path` serves it, its
    packed products at `--cpu-precision precision`."""
    from hotlora.models.cpu import prepare_cpu
    from hotlora.models.embedded import ensure_embedded_model
    from hotlora.models.loader import load_model_dir

    home = Path(tempfile.gettempdir()) / "hotlora-bench-home"
    model = load_model_dir(model_dir or ensure_embedded_model(settings_home())).model
    setup = prepare_cpu(
        model,
        weights=PATHS[path],  # type: ignore[arg-type]
        float_budget=None,
        vector_jit=True,
        batch_kernels=True,
        home=home,
        threads=threads,
        precision=precision,  # type: ignore[arg-type]
    )
    print(f"{path}: {setup.weights}; {setup.batch_kernels}", file=sys.stderr)
    return model


def settings_home() -> Path:
    from hotlora.config.settings import Settings

    return Settings().home


def step_time(model: nn.Module, rows: int, steps: int) -> float:
    """Median seconds of one decode step of `rows` rows after CONTEXT cached tokens."""
    tokens = mx.arange(CONTEXT * rows).reshape(rows, CONTEXT) % 1000 + 100
    if rows == 1:
        cache: Any = make_prompt_cache(model)
    else:
        cache = [BatchKVCache([0] * rows) for _ in model.layers]  # type: ignore[attr-defined]
    mx.eval(model(tokens, cache=cache))
    step = mx.full((rows, 1), 42)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        mx.eval(model(step, cache=cache))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def prefill_rate(model: nn.Module) -> float:
    """Tokens a second of a PROMPT_TOKENS prompt alone, in CHUNK-token chunks."""
    prompt = mx.arange(PROMPT_TOKENS) % 5000 + 100
    cache = make_prompt_cache(model)
    began = time.perf_counter()
    for start in range(0, PROMPT_TOKENS, CHUNK):
        model(prompt[None, start : start + CHUNK], cache=cache)
        mx.eval([c.state for c in cache])
    return PROMPT_TOKENS / (time.perf_counter() - began)


def _peak_rss_mb() -> float:
    """This process's peak RSS in MB. Not getrusage's ru_maxrss: Linux carries the parent's
    over fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss(path: str, threads: int | None) -> float:
    """MB at most resident in a process that loads the model served so and decodes 8 rows."""
    command = [sys.executable, "-m", "tests.bench.step_times", "--rss", path]
    if threads:
        command += ["--threads", str(threads)]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(run.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rss", choices=sorted(PATHS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss:
        model = load(args.rss, args.threads)
        step_time(model, 8, 3)
        prefill_rate(model)
        print(_peak_rss_mb())
        return 0
    models = {path: load(path, args.threads) for path in PATHS}
    steps: dict[str, dict[int, list[float]]] = {p: {r: [] for r in ROWS} for p in PATHS}
    prefill: dict[str, list[float]] = {p: [] for p in PATHS}
    for round_ in range(args.rounds):
        order = list(PATHS) if round_ % 2 == 0 else list(reversed(PATHS))
        for rows in ROWS:
            for path in order:
                steps[path][rows].append(step_time(models[path], rows, args.steps))
        for path in order:
            prefill[path].append(prefill_rate(models[path]))
    result: dict[str, Any] = {"rounds": args.rounds, "step_ms": {}, "tok_s": {}}
    for path in PATHS:
        ms = {rows: 1000 * statistics.median(t) for rows, t in steps[path].items()}
        result["step_ms"][path] = {rows: round(v, 2) for rows, v in ms.items()}
        result["tok_s"][path] = {rows: round(1000 * rows / v, 1) for rows, v in ms.items()}
    result["packed_speedup"] = {
        rows: round(result["step_ms"]["float32"][rows] / result["step_ms"]["packed"][rows], 2)
        for rows in ROWS
    }
    result["prefill_tok_s"] = {p: round(statistics.median(v), 1) for p, v in prefill.items()}
    del models
    result["peak_rss_mb"] = {p: round(peak_rss(p, args.threads), 1) for p in PATHS}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
