"""`make soak`: one real hotlora server under mixed traffic and adapter churn for a bounded time.

The server runs on the embedded model (the default float32 CPU path) with four random rank-8
adapters under a temporary adapter root; `a`, `b` and `c` are mounted at start. For
`--seconds` (120, or $SOAK_SECONDS), at once:

- `--clients` (10) clients send chat completions back to back, streamed and not, 8-24 new
  tokens, over a mix of adapter selections (base, `a`, `b`, `c`, `a+b@0.5`, `a@0.7+c`, and the
  `model` field forms); some hang up mid-stream, or before a non-streaming answer;
- an admin loop replaces `a` and mounts, replaces and unmounts `b` and `c`;
- a remount race: `x` is mounted, then in turn unmounted and mounted again from the same
  directory, or replaced by other files and back, while a long `x` stream and a long base stream
  share the batch; after each remount a greedy `x` request must answer exactly what `x` answered
  alone at the start;
- stuck clients, one of each, again and again: a stream (`a`, 4 choices, 20 top logprobs) whose
  client never reads, a request whose body stops halfway, and headers sent a byte every 0.5 s.

The server runs with short client bounds: `--request-timeout` 5 s, `--send-timeout` 5 s and
`--max-unsent-tokens` 64. A half-sent body must be closed with a 408, and slow headers closed,
within the request timeout + 5 s of the first byte; a never-reading stream must be cut within
150 s of its request (its socket's buffers, a few MB, fill; then 64 tokens wait; then 5 s pass:
about a minute on a busy 2-core machine, so a short soak may end before the first cut), and its
lease of `a` released.

The queue is kept short (`--queue-size`, 2) so that full-queue refusals happen. Legitimate
refusals are counted apart: 404 for an adapter unmounted at that moment, 503 with Retry-After
for a full queue. The server's RSS is read at start, after the warm-up (the first 20% of the
time, at least 20 s) and at the end.

    python -m tests.bench.soak [--seconds 120] [--clients 10] [--queue-size 2] [--model DIR]

Exits 1 on any failure: another error status (a 500, a 404 for an adapter that stays mounted,
...), a connection error or timeout, a broken stream, a remounted adapter answering otherwise,
a stuck client's connection left open beyond its bound, leases still held once traffic stops, a
traceback in the server log, or RSS growth after the warm-up beyond the bound below.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.bench.soak_remount import remount_loop
from tests.bench.soak_stuck import half_body_client, never_reading_client, slow_headers_client
from tests.bench.soak_traffic import Tally, Traffic, churn_loop, client_loop
from tests.support.model_args import add_model_args, resolve_model
from tests.support.server_process import ServerProcess, hotlora_spec

DEFAULT_SECONDS = 120.0
# The warm-up: the first 20% of the time, and at least 20 s (the first requests on a loaded
# 2-core machine take seconds each, and the caches fill with the first few dozen).
WARMUP_FRACTION = 0.2
WARMUP_MIN_S = 20.0
TRACE_POINTS = 10  # RSS readings over the soak besides the warm-up's, one every tenth of it
# RSS may grow after the warm-up by at most this share of the warm-up figure, or this many MB,
# whichever is larger. Set for the default length: an adapter holds ~10 MB and the churn mounts
# about a hundred, so keeping them would pass it several times over. Without a leak RSS still
# creeps (the batch's memory peaks grow rarer and higher, and glibc keeps freed heap): +60 to
# +90 MB in two minutes on a 2-core machine, +150 to +210 MB in eight.
RSS_GROWTH_SHARE = 0.15
RSS_GROWTH_MB = 150.0
# And the never-reading stream's own cost: its 4 choices decode until its socket's buffers fill
# (some 1,000 tokens), beside the rest of the batch, and the memory peak they make stays in
# MLX's buffer cache. Measured: +250 MB with it over two minutes, +125 MB without.
RSS_STUCK_STREAM_MB = 150.0
RANK = 8
ADAPTER_SCALE = 0.05  # random A, B have std 0.2; this keeps each residual small
ADAPTER_DIRS = [f"soak-r{RANK}-{i}" for i in range(1, 5)]
STARTUP_MOUNTS = {"a": ADAPTER_DIRS[0], "b": ADAPTER_DIRS[1], "c": ADAPTER_DIRS[2]}
CHURN_SEED = 1000  # the clients' seeds are 0, 1, ...
REQUEST_TIMEOUT_S = 120.0  # a request slower than this counts as a hang
LEASE_GRACE_S = 15.0  # after traffic stops, for in-flight cancellations to release adapters
# The server's client bounds, short so that stuck clients are closed many times over.
CLIENT_TIMEOUT_S = 5.0  # --request-timeout and --send-timeout
MAX_UNSENT_TOKENS = 64
NEVER_READ_CUT_S = 150.0  # from a never-reading stream's request to its connection cut


def write_adapters(model_dir: Path, root: Path) -> None:
    """Random rank-8 mlx-lm adapters on every projection of every layer, seeded per directory."""
    import mlx.core as mx

    from hotlora.models.loader import load_model_dir

    from tests.support.adapter_builders import random_pairs, write_mlx_adapter

    model = load_model_dir(model_dir).model
    for seed, name in enumerate(ADAPTER_DIRS, start=1):
        pairs = random_pairs(model, rank=RANK, seed=seed)
        write_mlx_adapter(root / name, pairs, rank=RANK, scale=ADAPTER_SCALE)
    del model
    mx.clear_cache()


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    """A /proc/<pid>/status memory figure in MB (VmRSS now, VmHWM the peak); 0 without /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def rss_bound_mb(warm_mb: float) -> float:
    return max(RSS_GROWTH_SHARE * warm_mb, RSS_GROWTH_MB) + RSS_STUCK_STREAM_MB


def leases_released(url: str) -> list[str]:
    """Adapters still counted in use once traffic has stopped (empty when all were released)."""
    deadline = time.monotonic() + LEASE_GRACE_S
    held: list[str] = []
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            cards = client.get(f"{url}/v1/adapters").json()["data"]
            held = [f"{c['id']} ({c['in_use']})" for c in cards if c["in_use"]]
            if not held:
                break
            time.sleep(0.5)
    return held


def adapter_ram_mb(url: str) -> float:
    """What one mounted adapter holds in RAM, in MB (`a` stays mounted throughout)."""
    cards = httpx.get(f"{url}/v1/adapters", timeout=30).json()["data"]
    return max((c["ram_bytes"] for c in cards), default=0) / 1e6


def still_serves(url: str, base_id: str) -> str | None:
    """Why one plain request fails after the soak, or None when it succeeds."""
    body = {
        "model": base_id,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "adapter": "a",
    }
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return repr(exc)
    return None if response.status_code == 200 else f"HTTP {response.status_code}"


def warmup_seconds(seconds: float) -> float:
    return max(WARMUP_FRACTION * seconds, WARMUP_MIN_S)


def watch(
    pid: int, tally: Tally, started: float, offsets: list[float], warmup_s: float
) -> list[float]:
    """Sleep out the soak, reading the server's RSS (MB) at each offset and printing progress."""
    readings = []
    for offset in offsets:
        time.sleep(max(0.0, started + offset - time.monotonic()))
        readings.append(rss_mb(pid))
        mark = " (warm-up over)" if offset == warmup_s else ""
        print(
            f"  {time.monotonic() - started:5.0f}s: {tally.served.total():5d} served, "
            f"RSS {readings[-1]:.0f} MB{mark}",
            flush=True,
        )
    return readings


def start_traffic(traffic: Traffic, clients: int, port: int) -> list[threading.Thread]:
    """The client threads, the churn thread, the remount race and the stuck clients, started."""
    workers = [
        threading.Thread(target=client_loop, args=(traffic, i), name=f"client-{i}")
        for i in range(clients)
    ]
    churn_args = (traffic, ADAPTER_DIRS, dict(STARTUP_MOUNTS), CHURN_SEED)
    workers.append(threading.Thread(target=churn_loop, args=churn_args, name="churn"))
    remount_args = (traffic, ADAPTER_DIRS[3], ADAPTER_DIRS[0])
    workers.append(threading.Thread(target=remount_loop, args=remount_args, name="remount"))
    for name, target, bound in (
        ("half-body", half_body_client, CLIENT_TIMEOUT_S),
        ("slow-headers", slow_headers_client, CLIENT_TIMEOUT_S),
    ):
        workers.append(threading.Thread(target=target, args=(traffic, port, bound), name=name))
    never_args = (traffic, port, NEVER_READ_CUT_S, "a")
    workers.append(threading.Thread(target=never_reading_client, args=never_args, name="never"))
    for worker in workers:
        worker.start()
    return workers


def final_checks(server: ServerProcess, workers: list[threading.Thread]) -> tuple[list[str], float]:
    """Once traffic has stopped: what is wrong with the server, and an adapter's RAM in MB."""
    problems = []
    hung = [w.name for w in workers if w.is_alive()]
    if hung:
        problems.append(f"still waiting on a request after {REQUEST_TIMEOUT_S:.0f}s: {hung}")
    adapter_mb = 0.0
    try:
        held = leases_released(server.url)
        adapter_mb = adapter_ram_mb(server.url)
        broken = still_serves(server.url, server.model_id)
    except httpx.HTTPError as exc:
        problems.append(f"the server did not answer after the soak: {exc!r}")
    else:
        if held:
            problems.append(f"adapters still in use after traffic stopped: {', '.join(held)}")
        if broken:
            problems.append(f"a plain request after the soak failed: {broken}")
    tracebacks = server.log(lines=sys.maxsize).count("Traceback")
    if tracebacks:
        problems.append(f"{tracebacks} traceback(s) in the server log")
    return problems, adapter_mb


def run(args: argparse.Namespace, model_dir: Path, root: Path, log_dir: Path) -> int:
    write_adapters(model_dir, root)
    mounts = [f"--adapter={i}={d}" for i, d in STARTUP_MOUNTS.items()]
    bounds = [
        f"--request-timeout={CLIENT_TIMEOUT_S:g}",
        f"--send-timeout={CLIENT_TIMEOUT_S:g}",
        f"--max-unsent-tokens={MAX_UNSENT_TOKENS}",
    ]
    spec = hotlora_spec(
        "--model",
        str(model_dir),
        "--adapter-root",
        str(root),
        *mounts,
        *bounds,
        "--log-level",
        "warning",
    )
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HOTLORA_HOME": str(args.home),
        "HOTLORA_QUEUE_SIZE": str(args.queue_size),
    }
    with ServerProcess(spec, env=env, log_dir=log_dir) as server:
        assert server.proc is not None
        pid = server.proc.pid
        rss = {"start": rss_mb(pid)}
        print(f"server ready (pid {pid}), soaking for {args.seconds:.0f}s", flush=True)
        tally = Tally()
        traffic = Traffic(server.url, server.model_id, threading.Event(), tally, REQUEST_TIMEOUT_S)
        started = time.monotonic()
        workers = start_traffic(traffic, args.clients, server.port)
        warmup_s = warmup_seconds(args.seconds)
        tenths = {args.seconds * k / TRACE_POINTS for k in range(1, TRACE_POINTS + 1)}
        offsets = sorted(tenths | {warmup_s})
        readings = watch(pid, tally, started, offsets, warmup_s)
        rss["after warm-up"], rss["end"] = readings[offsets.index(warmup_s)], readings[-1]
        traffic.stop.set()
        for worker in workers:
            worker.join(timeout=REQUEST_TIMEOUT_S + 10)
        elapsed = time.monotonic() - started
        checks, adapter_mb = final_checks(server, workers)
        rss["peak"] = rss_mb(pid, "VmHWM")
        problems = report(tally, rss, elapsed, adapter_mb, args) + checks
        if problems:
            print("\nFAILED:\n  " + "\n  ".join(problems))
            print(f"\nserver log ({server.log_path}), last lines:\n{server.log(60)}")
            return 1
    print("\nOK")
    return 0


def report(
    tally: Tally, rss: dict[str, float], elapsed: float, adapter_mb: float, args: argparse.Namespace
) -> list[str]:
    """Print what the soak did and saw; return the failures (empty when it passed)."""
    served = tally.served.total()
    print(f"\n== soak: {elapsed:.0f}s, {args.clients} clients, queue size {args.queue_size}")
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(tally.served.items()))
    print(f"requests served: {served} ({served / elapsed:.1f}/s): {kinds}")
    by_spec = ", ".join(f"{k} {n}" for k, n in sorted(tally.served_by_spec.items()))
    print(f"served by adapter selection: {by_spec}")
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items())) or "none"
    print(f"error statuses: {statuses}")
    print(f"  404 adapter unmounted at the time (expected): {tally.unmounted_404}")
    print(f"  503 queue full, with Retry-After (expected): {tally.queue_full_503}")
    hang_ups = ", ".join(f"{k} {n}" for k, n in sorted(tally.disconnects.items())) or "none"
    print(f"disconnects done: {tally.disconnects.total()} ({hang_ups})")
    admin = ", ".join(f"{op} {tally.admin[op]}" for op in ("mount", "replace", "unmount"))
    print(f"adapter churn: {admin} (an adapter holds {adapter_mb:.1f} MB of RAM)")
    for kind, seconds in sorted(tally.closes.items()):
        print(
            f"stuck clients closed by the server: {kind} {len(seconds)} times, after "
            f"{min(seconds):.1f}-{max(seconds):.1f}s"
        )
    failures = ", ".join(f"{k}: {n}" for k, n in sorted(tally.failures.items())) or "none"
    print(f"failures: {failures}")
    for example in tally.examples:
        print(f"  {example}")
    start, warm, end = rss["start"], rss["after warm-up"], rss["end"]
    growth, bound = end - warm, rss_bound_mb(warm)
    print(
        f"server RSS: start {start:.0f} MB, after warm-up {warm:.0f} MB, end {end:.0f} MB, "
        f"peak {rss['peak']:.0f} MB"
    )
    print(
        f"RSS growth after warm-up: {growth:+.0f} MB ({growth / warm:+.1%}); bound "
        f"{bound:.0f} MB (the larger of {RSS_GROWTH_SHARE:.0%} and {RSS_GROWTH_MB:.0f} MB, "
        f"+ {RSS_STUCK_STREAM_MB:.0f} MB for the never-reading stream)"
    )
    problems = [f"{n} x {kind}" for kind, n in sorted(tally.failures.items())]
    if served == 0:
        problems.append("no request was served")
    if growth > bound:
        problems.append(f"RSS grew {growth:.0f} MB after the warm-up (bound {bound:.0f} MB)")
    return problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.bench.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=float(os.environ.get("SOAK_SECONDS", DEFAULT_SECONDS)),
        help=f"How long the traffic runs (default $SOAK_SECONDS or {DEFAULT_SECONDS:.0f}).",
    )
    p.add_argument("--clients", type=int, default=10, help="Concurrent chat clients.")
    p.add_argument(
        "--queue-size", type=int, default=2, help="The server's queue (503 once it is full)."
    )
    add_model_args(p)
    args = p.parse_args(argv)
    if args.seconds < 2 * WARMUP_MIN_S:
        p.error(f"--seconds must be at least {2 * WARMUP_MIN_S:.0f} (twice the shortest warm-up)")
    if args.clients < 1 or args.queue_size < 1:
        p.error("--clients and --queue-size must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model(args)
    print(f"model: {model_dir}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hotlora-soak-") as tmp:
        root, logs = Path(tmp) / "adapters", Path(tmp) / "logs"
        logs.mkdir()
        return run(args, model_dir, root, logs)


if __name__ == "__main__":
    sys.exit(main())
