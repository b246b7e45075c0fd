"""Many adapters on one server: `python -m tests.bench.adapters_at_scale`.

`--adapters` (1,000) random adapters are written under an adapter root (ranks 8 to 32, every
projection of every layer, seeded: a rerun reuses them). One hotlora server serves them with
`--auto-mount --max-mounted-adapters` (32): `--clients` (8) streaming clients for `--seconds`
(60) each send request after request, each naming one of `--hot` (100) of the adapters drawn
Zipf-like (s=1.1), and, in turns with that, the same clients on the base model alone. Reported:
aggregate tokens/s of both, adapters mounted on first use against the base (ratio), the share
of prompt tokens each found in the prompt cache, the cold loads' latency (p50/p95, from the
server's `hotlora_adapter_load_seconds` histogram), the evictions, and the server's peak RSS.
First, `--cold-loads` (20) mounts of one rank-16 adapter on every projection (19 MB on the
embedded model) in this process: their latency p50/p95. The servers keep adapters in
`--adapter-dtype` (auto, as a server does by default: float16 where the packed 4-bit kernels
serve, float32 elsewhere).

Then whether what is mounted costs anything when it is not used: two servers, one with
`--mounted` (200) adapters mounted (rank `--mounted-rank`, 8) and one with none, take turns
serving base-only traffic from the same clients; reported: each one's decode step time (the
median gap between a stream's tokens) and aggregate tokens/s.

    python -m tests.bench.adapters_at_scale [--adapters 1000] [--hot 100] [--cap 32]
        [--clients 8] [--seconds 60] [--rounds 2] [--max-tokens 32] [--mounted 200]
        [--mounted-rank 8] [--cold-loads 20] [--adapter-dtype auto|float32|float16] [--root DIR]
        [--model DIR]

A measurement, not a test: it exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.bench.concurrency import QUESTIONS
from tests.bench.servers import Sample, stream_chat
from tests.support.model_args import add_model_args, resolve_model
from tests.support.server_process import ServerProcess, hotlora_spec

ZIPF_S = 1.1
INIT_STD = 0.01  # small residuals: answers stay fluent, so every request runs to max_tokens
SCALE = 2.0


def write_adapters(model_dir: Path, root: Path, names: list[str], ranks: list[int]) -> int:
    """Random mlx-lm adapters on every projection, one directory per name (kept if there);
    returns the bytes written."""
    import mlx.core as mx

    from hotlora.adapters.projections import find_targets, linear_dims
    from hotlora.models.loader import load_model_dir

    model = load_model_dir(model_dir).model
    dims = {path: linear_dims(linear) for path, linear in find_targets(model).items()}
    del model
    written = 0
    for index, (name, rank) in enumerate(zip(names, ranks, strict=True)):
        directory = root / name
        config = directory / "adapter_config.json"
        if config.is_file():
            continue
        directory.mkdir(parents=True, exist_ok=True)
        mx.random.seed(1000 + index)
        tensors = {}
        for path, d in dims.items():
            tensors[f"{path}.lora_a"] = INIT_STD * mx.random.normal((d.in_dims, rank))  # [in, r]
            tensors[f"{path}.lora_b"] = INIT_STD * mx.random.normal((rank, d.out_dims))  # [r, out]
        weights = directory / "adapters.safetensors"
        mx.save_safetensors(str(weights), tensors)
        parameters = {"rank": rank, "scale": SCALE, "dropout": 0.0}
        config.write_text(json.dumps({"fine_tune_type": "lora", "lora_parameters": parameters}))
        written += weights.stat().st_size
        mx.clear_cache()
    return written


def cold_loads(
    model_dir: Path, root: Path, loads: int, rank: int = 16, dtype: str = "auto"
) -> dict[str, float]:
    """Mount and unmount one rank-`rank` adapter on every projection `loads` times in this
    process, through the adapter manager on the model prepared as a server with the default
    settings prepares it, the adapters kept as a server with `--adapter-dtype dtype` keeps
    them: each mount's latency, files read to arrays mounted."""
    import mlx.core as mx

    from hotlora.adapters import AdapterManager
    from hotlora.config.settings import Settings
    from hotlora.models.cpu import prepare_cpu
    from hotlora.models.loader import load_model_dir
    from hotlora.server.runtime import kept_adapter_dtype

    name = f"cold-r{rank}"
    write_adapters(model_dir, root, [name], [rank])
    model = load_model_dir(model_dir).model
    settings = Settings()
    setup = prepare_cpu(
        model,
        weights=settings.cpu_weights,
        float_budget=settings.cpu_float_budget_bytes,
        vector_jit=settings.cpu_vector_jit,
        batch_kernels=settings.cpu_native_kernels,
        home=settings.home,
    )
    kept = kept_adapter_dtype(dtype, setup.packed)
    manager = AdapterManager(
        model, base_id="base", adapter_root=root, max_rank=rank, adapter_dtype=kept
    )
    seconds = []
    for _ in range(loads):
        began = time.perf_counter()
        info = manager.mount(name, name)
        seconds.append(time.perf_counter() - began)
        manager.unmount(name)
    del manager, model
    mx.clear_cache()
    seconds.sort()
    return {
        "rank": rank,
        "file_mb": round(info.size_bytes / 1e6, 1),
        "loads": loads,
        "p50_ms": round(statistics.median(seconds) * 1000, 1),
        "p95_ms": round(seconds[min(loads - 1, int(0.95 * loads))] * 1000, 1),
    }


@dataclass
class Traffic:
    """What `clients` streaming clients got in one timed run."""

    seconds: float
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cached: float = 0.0  # the share of prompt tokens the prompt cache held

    @property
    def tok_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.seconds

    @property
    def step_ms(self) -> float:
        """The median gap between a stream's tokens: one decode step of the batch it ran in."""
        gaps = [1000.0 / s.decode_tok_s for s in self.samples if s.decode_tok_s > 0]
        return statistics.median(gaps) if gaps else float("nan")

    @property
    def ttft_ms(self) -> float:
        """The median time from sending a request to its first token."""
        times = [1000.0 * s.ttft_s for s in self.samples]
        return statistics.median(times) if times else float("nan")

    @property
    def prompt_tokens(self) -> float:
        return statistics.mean(s.prompt_tokens for s in self.samples) if self.samples else 0.0


def run_clients(
    server: ServerProcess,
    clients: int,
    seconds: float,
    max_tokens: int,
    adapter_for: Callable[[random.Random], str | None],
    seed: int,
) -> Traffic:
    """`clients` threads, each sending one streaming request after another for `seconds`."""
    deadline = time.perf_counter() + seconds
    traffic = Traffic(seconds)
    lock = threading.Lock()

    def client(index: int) -> None:
        draw = random.Random(seed * 1000 + index)
        with httpx.Client() as http:
            while time.perf_counter() < deadline:
                adapter = adapter_for(draw)
                question = draw.choice(QUESTIONS)
                extra = {"adapter": adapter} if adapter else None
                try:
                    sample = stream_chat(http, server, question, max_tokens, seed, extra)
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    with lock:
                        traffic.errors.append(str(exc)[:200])
                    continue
                with lock:
                    traffic.samples.append(sample)

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    traffic.seconds = time.perf_counter() - began  # the last requests end past the deadline
    return traffic


def zipf(ids: list[str], s: float = ZIPF_S) -> Callable[[random.Random], str]:
    """A draw of one of `ids`, the k-th with weight 1/k^s."""
    weights = [1.0 / (k**s) for k in range(1, len(ids) + 1)]
    return lambda draw: draw.choices(ids, weights)[0]


def metrics(server: ServerProcess) -> dict[str, float]:
    """The server's Prometheus samples, by name with labels."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def prefix_cache(samples: dict[str, float]) -> tuple[float, float]:
    """Prompt tokens found in the prompt cache, and looked up there, so far."""

    def total(name: str) -> float:
        return sum(value for key, value in samples.items() if key.startswith(name + "{"))

    return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


def load_quantiles(samples: dict[str, float], quantiles: tuple[float, ...]) -> list[float]:
    """Quantiles of the cold-load histogram, interpolated within buckets as Prometheus does."""
    prefix = "hotlora_adapter_load_seconds_bucket{le="
    buckets = sorted(
        (float(name[len(prefix) + 1 : -2]), count)
        for name, count in samples.items()
        if name.startswith(prefix) and "+Inf" not in name
    )
    total = samples.get("hotlora_adapter_load_seconds_count", 0.0)
    out = []
    for q in quantiles:
        rank, lower, below = q * total, 0.0, 0.0
        value = float("nan")
        for upper, count in buckets:
            if count >= rank and total:
                inside = count - below
                value = lower + (upper - lower) * ((rank - below) / inside if inside else 0.0)
                break
            lower, below = upper, count
        out.append(value)
    return out


def peak_rss_mb(server: ServerProcess) -> float:
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def mount_all(server: ServerProcess, names: list[str]) -> None:
    with httpx.Client(base_url=server.url, timeout=300) as http:
        for name in names:
            response = http.post("/v1/adapters", json={"id": name, "path": f"mounted/{name}"})
            response.raise_for_status()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000, help="adapters written on disk")
    parser.add_argument("--hot", type=int, default=100, help="adapters the clients name")
    parser.add_argument("--cap", type=int, default=32, help="--max-mounted-adapters")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0, help="per run")
    parser.add_argument("--rounds", type=int, default=2, help="base and adapter runs, alternated")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--mounted", type=int, default=200, help="mounted, unused adapters (0: skip that part)"
    )
    parser.add_argument("--mounted-rank", type=int, default=8)
    parser.add_argument(
        "--cold-loads", type=int, default=20, help="in-process rank-16 mounts timed (0: skip)"
    )
    parser.add_argument("--root", type=Path, default=None, help="adapter root (kept)")
    parser.add_argument(
        "--adapter-dtype",
        choices=["auto", "float32", "float16"],
        default="auto",
        help="the servers' --adapter-dtype",
    )
    add_model_args(parser)
    args = parser.parse_args(argv)
    model_dir = resolve_model(args)
    root = args.root or Path(tempfile.gettempdir()) / "hotlora-adapters-at-scale"
    names = [f"a{i:04d}" for i in range(args.adapters)]
    began = time.perf_counter()
    written = write_adapters(model_dir, root, names, [8 + (i * 7) % 25 for i in range(len(names))])
    mounted_names = [f"m{i:03d}" for i in range(args.mounted)]
    written += write_adapters(
        model_dir, root / "mounted", mounted_names, [args.mounted_rank] * args.mounted
    )
    print(
        f"adapters on disk under {root}: {written / 1e9:.2f} GB written in "
        f"{time.perf_counter() - began:.0f}s",
        file=sys.stderr,
    )
    hot = names[: args.hot]
    report: dict[str, object] = {
        "adapters": args.adapters,
        "hot": len(hot),
        "cap": args.cap,
        "clients": args.clients,
        "seconds": args.seconds,
        "max_tokens": args.max_tokens,
        "adapter_dtype": args.adapter_dtype,
    }
    if args.cold_loads:
        report["cold_load_rank16"] = cold_loads(
            model_dir, root, args.cold_loads, dtype=args.adapter_dtype
        )

    serve = [
        *("--model", str(model_dir), "--adapter-root", str(root), "--max-batch", "16"),
        *("--adapter-dtype", args.adapter_dtype),
    ]
    lazy = ServerProcess(
        hotlora_spec(*serve, "--auto-mount", "--max-mounted-adapters", str(args.cap))
    )
    with lazy:
        runs: dict[str, list[Traffic]] = {"base": [], "adapters": []}
        for round_ in range(args.rounds):
            order = ["base", "adapters"] if round_ % 2 == 0 else ["adapters", "base"]
            for kind in order:
                pick = zipf(hot) if kind == "adapters" else (lambda _draw: None)
                before = prefix_cache(metrics(lazy))
                traffic = run_clients(
                    lazy, args.clients, args.seconds, args.max_tokens, pick, round_
                )
                after = prefix_cache(metrics(lazy))
                hits, queries = (a - b for a, b in zip(after, before, strict=True))
                traffic.cached = hits / queries if queries else 0.0
                runs[kind].append(traffic)
                print(
                    f"round {round_} {kind}: {traffic.tok_s:.1f} tok/s, "
                    f"{len(traffic.samples)} requests, {len(traffic.errors)} errors, "
                    f"{traffic.cached:.0%} of prompt tokens from the prompt cache, "
                    f"decode step {traffic.step_ms:.0f} ms, first token {traffic.ttft_ms:.0f} ms "
                    f"(medians), {traffic.prompt_tokens:.0f} prompt tokens a request",
                    file=sys.stderr,
                )
        samples = metrics(lazy)
        p50, p95 = load_quantiles(samples, (0.5, 0.95))
        base_tok_s = statistics.median(t.tok_s for t in runs["base"])
        adapters_tok_s = statistics.median(t.tok_s for t in runs["adapters"])
        report["zipf"] = {
            "base_tok_s": round(base_tok_s, 1),
            "adapters_tok_s": round(adapters_tok_s, 1),
            "ratio": round(adapters_tok_s / base_tok_s, 3),
            "prompt_tokens_cached": {
                kind: round(statistics.median(t.cached for t in traffics), 3)
                for kind, traffics in runs.items()
            },
            "requests": sum(len(t.samples) for t in runs["adapters"]),
            "errors": sum(len(t.errors) for ts in runs.values() for t in ts),
            "loads": samples.get("hotlora_adapter_loads_total", 0.0),
            "evictions": samples.get("hotlora_adapter_evictions_total", 0.0),
            "cold_load_p50_s": round(p50, 4),
            "cold_load_p95_s": round(p95, 4),
            "peak_rss_mb": round(peak_rss_mb(lazy)),
        }

    if not args.mounted:
        print(json.dumps(report, indent=2))
        return 0
    none = ServerProcess(hotlora_spec(*serve))
    many = ServerProcess(hotlora_spec(*serve))
    with none, many:
        mount_all(many, mounted_names)
        steps: dict[str, list[Traffic]] = {"0": [], str(args.mounted): []}
        for round_ in range(args.rounds):
            pair = [("0", none), (str(args.mounted), many)]
            for label, server in pair if round_ % 2 == 0 else pair[::-1]:
                traffic = run_clients(
                    server, args.clients, args.seconds / 2, args.max_tokens, lambda _d: None, round_
                )
                steps[label].append(traffic)
        report["mounted_unused"] = {
            label: {
                "step_ms": round(statistics.median(t.step_ms for t in runs_), 2),
                "tok_s": round(statistics.median(t.tok_s for t in runs_), 1),
                "peak_rss_mb": round(peak_rss_mb(many if label != "0" else none)),
            }
            for label, runs_ in steps.items()
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
