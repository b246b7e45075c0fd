"""What distinct adapters cost a batched decode step, in one process, away from HTTP's noise.

`python -m tests.bench.adapter_steps` loads the embedded model as a CPU server serves it (packed
4-bit kernels at `--precision`, the server's default `fast` unless told), or the model in
`--model-dir` (such as the random ~0.8B llama of the bench's section `cpu`), and mounts `--adapters`
(16) random rank-16 adapters on every projection twice, through two adapter managers: kept in
float32 (`--adapter-dtype float32`) and in float16 (the default there). Then, in blocks of `--steps`
(100) decode steps of 16 rows after a 64-token context, it times step by step, each kind in turn:
the base alone; every row with an adapter of its own, in float32 and in float16; and one adapter on
every row (float32 and float16), which reads one adapter's arrays, its rows sharing the kernels'
calls four at a time (each value of the pairs loaded once for four rows: `RowResiduals::run`), so
that the gap between it and the distinct rows is what reading 16 adapters, one row at a time, costs.
Each block's medians, then their medians, as one JSON object; ratios are the base step's time over
each kind's. With them, the time a step spent in the residuals' own passes (`lora_ms`, the native
kernels' clock) and the rate at which those passes read the adapters' arrays (`lora_gb_s`: each
adapter's arrays once a step, over `lora_ms`): a one-adapter kind's passes are the residuals'
arithmetic with the arrays mostly in cache.

    python -m tests.bench.adapter_steps [--adapters 16] [--blocks 3] [--steps 100]
        [--precision fast|exact|float32] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from tests.bench.adapter_decode import write_random_adapters
from tests.bench.step_times import CONTEXT, load

KINDS = (
    "base",
    "distinct float32",
    "distinct float16",
    "one adapter float32",
    "one adapter float16",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--precision", choices=("fast", "exact", "float32"), default="fast")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()

    from hotlora.adapters import AdapterManager, RowAdapterCache, activate, parse_adapter_spec
    from hotlora.config.settings import Settings
    from hotlora.models.cpu import extension
    from hotlora.models.embedded import ensure_embedded_model

    rows = args.adapters
    model_dir = args.model_dir or ensure_embedded_model(Settings().home)
    root = Path(tempfile.gettempdir()) / "hotlora-bench-adapter-steps"
    if args.model_dir:  # its own adapters, named by the model's last two folders
        root /= "-".join(args.model_dir.resolve().parts[-2:])
    names = [f"r16-{i}" for i in range(rows)]
    missing = {n: 100 + i for i, n in enumerate(names) if not (root / n).is_dir()}
    if missing:
        write_random_adapters(model_dir, root, missing)
    model = load("packed", None, args.precision, args.model_dir)
    managers = {
        dtype: AdapterManager(
            model, base_id="base", adapter_root=root, max_rank=64, adapter_dtype=dtype
        )
        for dtype in (mx.float32, mx.float16)
    }
    sets = {}
    for dtype, manager in managers.items():
        for name in names:
            manager.mount(name, name)
        sets[dtype] = [manager.resolve(parse_adapter_spec(name)) for name in names]
    native = extension.native
    assert native is not None, "the native kernels are not built"
    # Each kind's batch, and the megabytes of adapters' arrays its step reads (each once).
    batches: dict[str, Any] = {"base": None}
    read_mb = {"base": 0.0}
    for dtype, manager in managers.items():
        mb = [manager.get(name).ram_bytes / 1e6 for name in names]
        label = "float32" if dtype == mx.float32 else "float16"
        batches[f"distinct {label}"] = RowAdapterCache().for_rows(sets[dtype])
        read_mb[f"distinct {label}"] = sum(mb)
        batches[f"one adapter {label}"] = sets[dtype][0]
        read_mb[f"one adapter {label}"] = mb[0]
    assert set(batches) == set(KINDS)

    def call(tokens: mx.array, cache: list[Any], batch: Any) -> mx.array:
        if batch is None:
            return model(tokens, cache=cache)
        with activate(batch):
            return model(tokens, cache=cache)

    context = mx.arange(CONTEXT * rows).reshape(rows, CONTEXT) % 1000 + 100
    step = mx.full((rows, 1), 42)
    blocks: dict[str, list[float]] = {kind: [] for kind in KINDS}
    lora_blocks: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for block in range(args.blocks):
        caches = {kind: [BatchKVCache([0] * rows) for _ in model.layers] for kind in KINDS}
        for kind in KINDS:
            mx.eval(call(context, caches[kind], batches[kind]))
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        lora: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.steps):
            for kind in KINDS:
                native.lora_seconds()
                began = time.perf_counter()
                mx.eval(call(step, caches[kind], batches[kind]))
                times[kind].append(time.perf_counter() - began)
                lora[kind].append(native.lora_seconds())
        for kind in KINDS:
            blocks[kind].append(1000 * statistics.median(times[kind]))
            lora_blocks[kind].append(1000 * statistics.median(lora[kind]))
        print(
            f"block {block + 1}: "
            + ", ".join(f"{kind} {blocks[kind][-1]:.1f} ms" for kind in KINDS),
            file=sys.stderr,
            flush=True,
        )
    step_ms = {kind: round(statistics.median(ms), 2) for kind, ms in blocks.items()}
    ratios = {
        kind: round(statistics.median(b / k for b, k in zip(blocks["base"], ms, strict=True)), 3)
        for kind, ms in blocks.items()
        if kind != "base"
    }
    lora_ms = {kind: round(statistics.median(ms), 2) for kind, ms in lora_blocks.items()}
    rates = {kind: round(read_mb[kind] / ms, 1) for kind, ms in lora_ms.items() if ms > 0}
    print(
        json.dumps(
            {
                "rows": rows,
                "precision": args.precision,
                "step_ms": step_ms,
                "base_over": ratios,
                "lora_ms": lora_ms,
                "adapters_mb": {kind: round(read_mb[kind]) for kind in KINDS},
                "lora_gb_s": rates,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
