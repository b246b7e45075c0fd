"""What bounds many distinct adapters in one decode step: how fast the LoRA kernels read pairs.

`python -m tests.bench.lora_reads` builds tests/native/lora_reads.cpp with the kernels' sources
and the extension's flags, and times the LoRA kernels (a row's activations, then its residual)
on rank-`--rank` pairs of each projection of the embedded model's layers (or of `--model-dir`'s
config.json), float16 and float32, one row a pair: pairs cycled within `--cache-mb` (the
kernels' arithmetic, their pairs in cache) and over `--memory-mb` (what rows of distinct
adapters read from memory every step), on one thread and on every core, beside a plain read of
the same bytes (the memory's rate for one long stream). From the rates on every core it gives
what 16 rows of 16 distinct adapters add to a decode step: each row reads its own adapter's
pairs, every layer's, from memory. Prints a table, then one JSON object.

    python -m tests.bench.lora_reads [--rank 16] [--rows 16] [--seconds 0.5]
        [--cache-mb 4] [--memory-mb 512] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hotlora.models.cpu.extension import kernels_program
from hotlora.models.embedded import ensure_embedded_model

from tests.bench.step_times import settings_home

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "native" / "lora_reads.cpp"


def build(out: Path, objects: list[Path] | None = None) -> Path:
    """The program, built as tests/unit/test_native_kernels.py builds the kernels' check, with
    the kernels' sources (or their `objects`, compiled for this machine); a warning fails it as
    an error does."""
    return kernels_program(SOURCE, out, objects=objects)


def projections(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each LoRA'd projection of a llama-shaped layer: (K inputs, N outputs)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    ffn = config["intermediate_size"]
    return {
        "q": (hidden, heads * head_dim),
        "k": (hidden, kv),
        "v": (hidden, kv),
        "o": (heads * head_dim, hidden),
        "gate": (hidden, ffn),
        "up": (hidden, ffn),
        "down": (ffn, hidden),
    }


def measure(
    program: Path,
    K: int,
    N: int,
    rank: int,
    half: bool,
    mb: float,
    threads: int,
    seconds: float,
    read: bool,
) -> tuple[str, float, float | None]:
    """(ISA, the LoRA kernels' GB/s, a plain read's GB/s where `read` asks for it) on `threads`
    threads."""
    arguments = (program, K, N, rank, int(half), int(mb * 2**20), threads, seconds, int(read))
    line = subprocess.run(
        [str(v) for v in arguments], check=True, capture_output=True, text=True
    ).stdout.split()
    return line[0], float(line[1]), float(line[2]) if read else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--cache-mb", type=float, default=4.0)
    parser.add_argument("--memory-mb", type=float, default=512.0)
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()

    model_dir = args.model_dir or ensure_embedded_model(settings_home())
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="hotlora-lora-reads-") as tmp:
        program = build(Path(tmp) / "lora_reads")
        rows: list[dict[str, Any]] = []
        isa = ""
        for name, (K, N) in projections(config).items():
            for half in (True, False):
                row: dict[str, Any] = {"projection": name, "K": K, "N": N}
                row["dtype"] = "float16" if half else "float32"
                for place, mb in (("cache", args.cache_mb), ("memory", args.memory_mb)):
                    for threads in sorted({1, cores}):
                        from_memory = place == "memory"
                        isa, lora, read = measure(
                            program, K, N, args.rank, half, mb, threads, args.seconds, from_memory
                        )
                        row[f"{place} {threads}t"] = lora
                        if from_memory:
                            row[f"read {threads}t"] = read
                rows.append(row)
    columns = [key for key in rows[0] if key not in ("projection", "K", "N", "dtype")]
    print(f"kernels {isa}, {cores} cores; GB/s of pairs (rank {args.rank}, one row a pair):")
    print(f"{'':<16}" + "".join(f"{c:>12}" for c in columns))
    for row in rows:
        label = f"{row['projection']} {row['dtype']}"
        print(f"{label:<16}" + "".join(f"{row[c]:>12.1f}" for c in columns))

    # Every projection's pair, every layer's, for each of `rows` rows of its own adapter, read
    # from memory on every core, at each projection's rate: what those rows add to a step.
    step: dict[str, Any] = {}
    for dtype, size in (("float16", 2), ("float32", 4)):
        seconds = 0.0
        read_seconds = 0.0
        total = 0
        for row in rows:
            if row["dtype"] != dtype:
                continue
            nbytes = (row["K"] + row["N"]) * args.rank * size * layers * args.rows
            total += nbytes
            seconds += nbytes / (row[f"memory {cores}t"] * 1e9)
            read_seconds += nbytes / (row[f"read {cores}t"] * 1e9)
        step[dtype] = {
            "pairs_mb": round(total / 1e6, 1),
            "lora_ms": round(seconds * 1e3, 2),
            "plain_read_ms": round(read_seconds * 1e3, 2),
        }
        print(
            f"{args.rows} rows of distinct {dtype} adapters on {layers} layers: "
            f"{total / 1e6:.0f} MB a step, {seconds * 1e3:.2f} ms at the kernels' rate from "
            f"memory, {read_seconds * 1e3:.2f} ms at a plain read's"
        )
    print(json.dumps({"isa": isa, "cores": cores, "rows": rows, "step": step}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
