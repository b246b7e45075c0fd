"""Where a packed decode step's time goes: building its graph, evaluating it, and its kernels.

`python -m tests.bench.step_profile` loads the embedded model (or `--model`, a model directory or
a GGUF file, imported into the home once as `serve` imports it) served packed (the native
quantized kernels) twice, once as served (`fused`: llama's attention and MLP on fused products,
`hotlora.models.cpu.fused`) and once with those layers given mlx-lm's own classes back
(`separate`: a product a projection), its packed products at `--precision` (fast, the
default, exact or float32), and for each, for one row and for 16 rows after a short
context, measures in alternating rounds: the seconds to build a decode step's graph in Python
(the model call), to dispatch it (`mx.async_eval`, each primitive queuing its task) and to
evaluate it (`host_ms`: building and dispatching, the calling thread's part); the graph's nodes
by primitive (`mx.export_to_dot`); and the same step's kernel primitives evaluated on their own,
each in a graph of its kind alone (the quantized products, the attention, the norms, the RoPEs),
so that the rest of the evaluation (MLX scheduling the other nodes, the reshapes, the cache's
updates) is what is left. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from hotlora.models.cpu.layers import INT8_PARTS

from tests.bench.step_times import CONTEXT, load, settings_home

ROWS = (1, 16)


def _cache(model: nn.Module, rows: int) -> Any:
    if rows == 1:
        return make_prompt_cache(model)
    return [BatchKVCache([0] * rows) for _ in model.layers]  # type: ignore[attr-defined]


def _prefilled(model: nn.Module, rows: int) -> Any:
    tokens = mx.arange(CONTEXT * rows).reshape(rows, CONTEXT) % 1000 + 100
    cache = _cache(model, rows)
    mx.eval(model(tokens, cache=cache))
    return cache


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def step_split(model: nn.Module, rows: int, steps: int) -> tuple[float, ...]:
    """Median seconds to build one decode step's graph, to dispatch it (`mx.async_eval`: each
    primitive's eval_cpu queuing its task, on the calling thread) and to evaluate it (the
    dispatch and the wait for the tasks): wall-clock, then the CPU time of the process's threads
    to build and evaluate (less sensitive to other processes' load)."""
    cache = _prefilled(model, rows)
    step = mx.full((rows, 1), 42)
    build, dispatch, run, build_cpu, run_cpu = [], [], [], [], []
    for _ in range(steps):
        began = _clocks()
        out = model(step, cache=cache)
        built = _clocks()
        mx.async_eval(out)
        dispatched = time.perf_counter()
        mx.eval(out)
        done = _clocks()
        build.append(built[0] - began[0])
        dispatch.append(dispatched - built[0])
        run.append(done[0] - built[0])
        build_cpu.append(built[1] - began[1])
        run_cpu.append(done[1] - built[1])
    median = statistics.median
    return tuple(median(t) for t in (build, dispatch, run, build_cpu, run_cpu))


def node_counts(model: nn.Module, rows: int) -> Counter[str]:
    """A decode step's graph nodes by primitive name (inputs and constants left out)."""
    cache = _prefilled(model, rows)
    out = model(mx.full((rows, 1), 42), cache=cache)
    with tempfile.TemporaryDirectory() as home:
        dot = Path(home) / "step.dot"
        mx.export_to_dot(str(dot), out)
        labels = re.findall(r'label\s*=\s*"([^"]*)"', dot.read_text())
    mx.eval(out)
    counts: Counter[str] = Counter()
    for label in labels:
        name = label.split(" ")[0]
        if name and name[0].isupper():  # primitives; arrays are labelled by their names
            counts[name] += 1
    return counts


def _kernel_graphs(
    model: nn.Module, rows: int, int8: int
) -> dict[str, Callable[[], list[mx.array]]]:
    """For each kind of kernel primitive, a function that builds the step's calls of it alone,
    on inputs of the step's shapes (already evaluated)."""
    from hotlora.models.cpu import extension
    from hotlora.models.cpu.layers import NativeRMSNorm, PackedEmbedding, PackedLinear

    native = extension.native
    assert native is not None
    layers = model.layers  # type: ignore[attr-defined]
    quantized = [
        m for _, m in model.named_modules() if isinstance(m, PackedLinear | PackedEmbedding)
    ]
    norms = [m for _, m in model.named_modules() if isinstance(m, NativeRMSNorm)]
    inputs = {
        id(m): mx.random.normal((rows, 1, m.scales.shape[1] * m.group_size)) for m in quantized
    }
    attn = layers[0].self_attn
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    width = attn.head_dim
    q = mx.random.normal((rows, heads, 1, width))
    k = mx.random.normal((rows, kv_heads, CONTEXT + 1, width))
    v = mx.random.normal((rows, kv_heads, CONTEXT + 1, width))
    mask = mx.broadcast_to(mx.array(True), (rows, 1, 1, CONTEXT + 1))
    hidden = mx.random.normal((rows, 1, norms[0].weight.shape[0]))
    offset = mx.array([CONTEXT], dtype=mx.int32)
    kv = mx.random.normal((rows, kv_heads, 1, width))
    mx.eval(list(inputs.values()), q, k, v, mask, hidden, offset, kv)
    rope = attn.rope
    return {
        "QuantMatmul": lambda: [
            native.quant_matmul(
                inputs[id(m)], m.weight, m.scales, m.biases, m.group_size, m.bits, int8
            )
            for m in quantized
        ],
        "RowsAttention": lambda: [native.attention_rows(q, k, v, mask, attn.scale) for _ in layers],
        "NativeRMSNorm": lambda: [native.rms_norm_rows(hidden, n.weight, n.eps) for n in norms],
        "NativeRoPE": lambda: [
            native.rope_rows(x, offset, rope.dims, rope.traditional, rope.base, rope.scale)
            for _ in layers
            for x in (q, kv)
        ],
    }


def kernel_times(
    model: nn.Module, rows: int, steps: int, int8: int
) -> dict[str, tuple[float, float]]:
    """Median seconds of each kind of kernel primitive of one step, evaluated alone: wall-clock
    and CPU time."""
    times: dict[str, tuple[float, float]] = {}
    for name, build in _kernel_graphs(model, rows, int8).items():
        wall, cpu = [], []
        for _ in range(steps):
            outs = build()
            began = _clocks()
            mx.eval(outs)
            done = _clocks()
            wall.append(done[0] - began[0])
            cpu.append(done[1] - began[1])
        times[name] = statistics.median(wall), statistics.median(cpu)
    return times


def separate(model: nn.Module) -> nn.Module:
    """The model with its fused layers given mlx-lm's own classes back."""
    from hotlora.models.cpu.fused import uninstall_fused

    uninstall_fused(model)
    return model


def _ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--precision", choices=tuple(INT8_PARTS), default="fast")
    parser.add_argument("--model", type=Path, default=None, help="a model directory or a GGUF")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is not None and model_dir.suffix == ".gguf":
        from hotlora.models.embedded import ensure_gguf_model

        model_dir = ensure_gguf_model(
            model_dir, settings_home(), progress=lambda line: print(line, file=sys.stderr)
        )
    models = {
        "fused": load("packed", args.threads, args.precision, model_dir),
        "separate": separate(load("packed", args.threads, args.precision, model_dir)),
    }
    keys = ("build_ms", "dispatch_ms", "eval_ms", "build_cpu_ms", "eval_cpu_ms")
    samples: dict[str, dict[int, dict[str, list[float]]]] = {
        v: {r: {k: [] for k in keys} for r in ROWS} for v in models
    }
    kernels: dict[int, dict[str, list[tuple[float, float]]]] = {r: {} for r in ROWS}
    for round_ in range(args.rounds):
        order = list(models) if round_ % 2 == 0 else list(reversed(models))
        for rows in ROWS:
            for variant in order:
                for key, t in zip(keys, step_split(models[variant], rows, args.steps), strict=True):
                    samples[variant][rows][key].append(t)
        for rows in ROWS:  # the kernels alone do not depend on the variant
            for name, times in kernel_times(
                models["fused"], rows, args.steps, INT8_PARTS[args.precision]
            ).items():
                kernels[rows].setdefault(name, []).append(times)
    result: dict[str, Any] = {
        "model": str(model_dir or "embedded"),
        "rounds": args.rounds,
        "threads": args.threads,
        "precision": args.precision,
    }
    for rows in ROWS:
        alone = {
            name: {"ms": _ms([w for w, _ in t]), "cpu_ms": _ms([c for _, c in t])}
            for name, t in kernels[rows].items()
        }
        result[f"kernels_alone_{rows}_rows"] = alone
        for variant, model in models.items():
            ms = {key: _ms(t) for key, t in samples[variant][rows].items()}
            counts = node_counts(model, rows)
            result[f"{variant}_{rows}_rows"] = {
                "step_ms": round(ms["build_ms"] + ms["eval_ms"], 2),
                "host_ms": round(ms["build_ms"] + ms["dispatch_ms"], 2),  # the calling thread's
                **ms,
                "eval_cpu_less_quant_kernels_ms": round(
                    ms["eval_cpu_ms"] - alone["QuantMatmul"]["cpu_ms"], 2
                ),
                "nodes": sum(counts.values()),
                "nodes_by_primitive": dict(counts.most_common()),
            }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
