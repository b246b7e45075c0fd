"""`make bench`, section `adapters`: what LoRA adapters cost on hotlora, on the embedded model.

1. Decode tokens/s with one adapter and with a two-adapter stack, against the base, on the same
   prompt per round (base / a / a+b interleaved).
2. Latency of short requests that alternate between two adapters against requests that keep
   one; mlx_lm.server serves the same alternating workload through its `adapters` field, which
   reloads its model on every change.
3. Mounting and unmounting an adapter: through the admin API of the running server, and
   in-process through `AdapterManager`.

The adapters are random, rank 16 on all seven projections of every layer, in mlx-lm's format,
written under `<home>/adapters/bench-*`. Their residual is kept small so that greedy generations
stay close to the base model's and run as long; the compute is that of any rank-16 adapter.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.bench.servers import Sample, hotlora_bench_spec, launch, mlx_lm_spec, stream_chat
from tests.support.server_process import ServerProcess, ServerSpec

RANK = 16
SCALE = 1.0
INIT_STD = 0.01  # of A and B: a residual of ~1% of a projection's output
ADAPTER_DIRS = {"a": "bench-r16-a", "b": "bench-r16-b", "m": "bench-r16-m"}  # id -> dir
SEEDS = {"a": 1, "b": 2, "m": 3}

DECODE_TARGET = 0.85  # adapter decode tok/s / base decode tok/s, at least
SWITCH_TARGET = 1.05  # p50 latency alternating / one adapter, at most

WARMUP_QUESTION = "Describe the water cycle in detail."
SWITCH_QUESTION = "Describe a sunny day at the beach."  # runs past SWITCH_MAX_TOKENS
SWITCH_MAX_TOKENS = 16
SWITCH_REQUESTS = 16  # per workload
SWITCH_BLOCK = 4  # requests per block; the workloads take turns block by block
SWITCH_TIMEOUT_S = 120.0
MOUNT_REPEATS = 10
ADMIN_TIMEOUT_S = 60.0
WARMUP_TOKENS = 8

# Decode rows: label -> the request's `adapter` field.
DECODE_SETS = {"hotlora base": None, "hotlora a": "a", "hotlora a+b": "a+b"}


@dataclass
class AdapterSection:
    """What the section hands to `tests.bench`: decode rows for the shared table, and notes."""

    title: str
    rows: dict[str, list[Sample]]
    notes: list[str]


@dataclass(frozen=True)
class Timed:
    """One non-streaming request, timed at the client from send to full response."""

    workload: str
    block: int
    adapter: str
    seconds: float
    tokens: int


# -- adapters on disk -------------------------------------------------------------------------


def write_adapters(model_dir: Path, root: Path) -> tuple[dict[str, Path], int]:
    """Random rank-16 mlx-lm adapters `a`, `b`, `m` for every projection of every layer.

    Returns the directories by id and the size of one weight file in bytes. Seeded, so a rerun
    writes the same bytes (and the same revision).
    """
    named = {ADAPTER_DIRS[i]: SEEDS[i] for i in ADAPTER_DIRS}
    size = write_random_adapters(model_dir, root, named)
    return {i: root / name for i, name in ADAPTER_DIRS.items()}, size


def write_random_adapters(model_dir: Path, root: Path, seeds: dict[str, int]) -> int:
    """A random rank-16 mlx-lm adapter on every projection of every layer of the model in
    `model_dir`, under `root/<name>` for each name -> seed of `seeds`; the size of one weight
    file in bytes."""
    import mlx.core as mx

    from hotlora.adapters.projections import find_layers, find_targets, linear_dims
    from hotlora.models.loader import load_model_dir

    model = load_model_dir(model_dir).model
    _, layers = find_layers(model)
    dims = {path: linear_dims(linear) for path, linear in find_targets(model).items()}
    del model
    keys = sorted({path.split(".", 3)[3] for path in dims})  # e.g. self_attn.q_proj
    size = 0
    for name, seed in seeds.items():
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        mx.random.seed(seed)
        tensors = {}
        for path, d in dims.items():
            tensors[f"{path}.lora_a"] = INIT_STD * mx.random.normal((d.in_dims, RANK))  # [in, r]
            tensors[f"{path}.lora_b"] = INIT_STD * mx.random.normal((RANK, d.out_dims))  # [r, out]
        weights = directory / "adapters.safetensors"
        mx.save_safetensors(str(weights), tensors)
        config = {
            "fine_tune_type": "lora",
            "num_layers": len(layers),
            "lora_parameters": {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": keys},
        }
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
        size = weights.stat().st_size
        del tensors
        mx.clear_cache()
    return size


def time_in_process(model_dir: Path, root: Path) -> tuple[list[float], list[float]]:
    """Mount and unmount `m` through an `AdapterManager` over a freshly loaded base (seconds)."""
    import mlx.core as mx

    from hotlora.adapters import AdapterManager
    from hotlora.models.loader import load_model_dir

    model = load_model_dir(model_dir).model
    manager = AdapterManager(model, base_id=model_dir.name, adapter_root=root, max_rank=RANK)
    mounts, unmounts = [], []
    for i in range(MOUNT_REPEATS + 1):  # the first pair warms up
        t0 = time.perf_counter()
        manager.mount("m", ADAPTER_DIRS["m"])
        t1 = time.perf_counter()
        manager.unmount("m")
        t2 = time.perf_counter()
        if i:
            mounts.append(t1 - t0)
            unmounts.append(t2 - t1)
    del manager, model
    gc.collect()
    mx.clear_cache()
    return mounts, unmounts


# -- requests ---------------------------------------------------------------------------------


def hotlora_adapter_spec(model_dir: Path, root: Path) -> ServerSpec:
    """hotlora with `a` and `b` mounted at start-up from under `root`."""
    base = hotlora_bench_spec(model_dir)

    def argv(port: int) -> list[str]:
        mounts = [f"--adapter={i}={ADAPTER_DIRS[i]}" for i in ("a", "b")]
        return [*base.argv(port), "--adapter-root", str(root), *mounts]

    return dataclasses.replace(base, argv=argv)


def timed_chat(
    client: httpx.Client, server: ServerProcess, body: dict[str, Any]
) -> tuple[float, int]:
    """Seconds from send to the full non-streaming response, and its completion tokens."""
    t0 = time.perf_counter()
    r = client.post(f"{server.url}/v1/chat/completions", json=body, timeout=SWITCH_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{server.spec.name}: HTTP {r.status_code}: {r.text[:500]}")
    return seconds, int(r.json()["usage"]["completion_tokens"])


def switch_body(
    server: ServerProcess, adapter: str, dirs: dict[str, Path], model_dir: Path
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": SWITCH_QUESTION}],
        "temperature": 0,
        "max_tokens": SWITCH_MAX_TOKENS,
    }
    if server.spec.name == "hotlora":
        body["adapter"] = adapter
    else:
        # mlx_lm.server ignores `adapters` under its `default_model`; naming the model's
        # directory makes it load the base with the adapter (and reload on each change).
        body["model"] = str(model_dir)
        body["adapters"] = str(dirs[adapter])
    return body


def admin(client: httpx.Client, server: ServerProcess, method: str, path: str, **kw: Any) -> float:
    t0 = time.perf_counter()
    r = client.request(method, f"{server.url}{path}", timeout=ADMIN_TIMEOUT_S, **kw)
    seconds = time.perf_counter() - t0
    if r.status_code not in (200, 201):
        raise RuntimeError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}")
    return seconds


# -- the three measurements -------------------------------------------------------------------


def measure_decode(
    client: httpx.Client,
    hot: ServerProcess,
    others: list[ServerProcess],
    questions: list[str],
    max_tokens: int,
) -> dict[str, list[Sample]]:
    """base / a / a+b on the same question per round, order rotating per round."""
    labels = list(DECODE_SETS)
    samples: dict[str, list[Sample]] = {label: [] for label in labels}
    for label, spec in DECODE_SETS.items():
        extra = {"adapter": spec} if spec else None
        stream_chat(client, hot, WARMUP_QUESTION, WARMUP_TOKENS, -1, extra)
        print(f"warmed up {label}", flush=True)
    for i, question in enumerate(questions):
        shift = i % len(labels)
        for label in labels[shift:] + labels[:shift]:
            spec = DECODE_SETS[label]
            cpu0 = sum(s.cpu_seconds() for s in others)
            sample = stream_chat(
                client, hot, question, max_tokens, i, {"adapter": spec} if spec else None
            )
            idle = sum(s.cpu_seconds() for s in others) - cpu0
            sample = dataclasses.replace(sample, system=label, other_cpu_s=idle)
            samples[label].append(sample)
            print(
                f"round {i + 1}/{len(questions)} {label:<14} ttft {sample.ttft_s:6.3f}s  "
                f"decode {sample.decode_tok_s:6.2f} tok/s  {sample.tokens} tokens "
                f"({sample.finish_reason})",
                flush=True,
            )
    return samples


def measure_switching(
    client: httpx.Client,
    hot: ServerProcess,
    mlx: ServerProcess,
    dirs: dict[str, Path],
    model_dir: Path,
) -> dict[str, list[Timed]]:
    """hotlora a,a,a / hotlora a,b,a,b / mlx_lm.server a,b,a,b, taking turns in blocks."""
    workloads: dict[str, tuple[ServerProcess, Callable[[int], str]]] = {
        "hotlora a,a,a,...": (hot, lambda k: "a"),
        "hotlora a,b,a,b,...": (hot, lambda k: "ab"[k % 2]),
        "mlx_lm.server a,b,a,b,...": (mlx, lambda k: "ab"[k % 2]),
    }
    for server in (hot, mlx):  # each side's first adapter request pays one-off costs
        for adapter in ("a", "b"):
            timed_chat(client, server, switch_body(server, adapter, dirs, model_dir))
    timed: dict[str, list[Timed]] = {name: [] for name in workloads}
    names = list(workloads)
    blocks = -(-SWITCH_REQUESTS // SWITCH_BLOCK)
    for block in range(blocks):
        order = names[:2] if block % 2 == 0 else names[1::-1]
        for name in [*order, names[2]]:
            server, pick = workloads[name]
            for k in range(SWITCH_BLOCK):
                adapter = pick(k)
                seconds, tokens = timed_chat(
                    client, server, switch_body(server, adapter, dirs, model_dir)
                )
                timed[name].append(Timed(name, block, adapter, seconds, tokens))
            last = timed[name][-SWITCH_BLOCK:]
            print(
                f"block {block + 1}/{blocks} {name:<26} "
                + " ".join(f"{t.adapter}:{t.seconds:.2f}s" for t in last),
                flush=True,
            )
    return timed


def measure_admin(client: httpx.Client, hot: ServerProcess) -> tuple[list[float], list[float]]:
    """POST then DELETE /v1/adapters for `m`, repeated; seconds at the client."""
    body = {"id": "m", "path": ADAPTER_DIRS["m"]}
    mounts, unmounts = [], []
    for i in range(MOUNT_REPEATS + 1):  # the first pair warms up
        mount = admin(client, hot, "POST", "/v1/adapters", json=body)
        unmount = admin(client, hot, "DELETE", "/v1/adapters/m")
        if i:
            mounts.append(mount)
            unmounts.append(unmount)
    return mounts, unmounts


# -- reporting --------------------------------------------------------------------------------


def decode_notes(rows: dict[str, list[Sample]]) -> list[str]:
    base = rows["hotlora base"]
    by_round = {s.round: s for s in base}
    base_decode = statistics.median(s.decode_tok_s for s in base)
    notes = []
    for label in list(DECODE_SETS)[1:]:
        samples = rows[label]
        ratio = statistics.median(s.decode_tok_s for s in samples) / base_decode
        paired = statistics.median(s.decode_tok_s / by_round[s.round].decode_tok_s for s in samples)
        mark = "" if ratio >= DECODE_TARGET else " MISSED"
        notes.append(
            f"ratio {label}/hotlora base: decode {ratio:.2f}x (target >= {DECODE_TARGET}x){mark}; "
            f"per-round ratio median {paired:.2f}x"
        )
    counts = "; ".join(f"{label} {[s.tokens for s in samples]}" for label, samples in rows.items())
    notes.append(f"completion tokens per round: {counts}")
    idle = statistics.median(s.other_cpu_s for samples in rows.values() for s in samples)
    notes.append(f"idle mlx_lm.server CPU per request (median): {idle:.2f}s")
    return notes


def switching_notes(timed: dict[str, list[Timed]]) -> list[str]:
    p50 = {name: statistics.median(t.seconds for t in ts) for name, ts in timed.items()}
    same, alternating, mlx = list(timed)
    notes = [
        f"\n-- switching adapters: '{SWITCH_QUESTION}', {SWITCH_MAX_TOKENS} new tokens, "
        f"non-streaming, blocks of {SWITCH_BLOCK}",
        f"{'workload':<28}{'latency_p50_s':>14}{'min_s':>8}{'max_s':>8}{'n':>4}{'tokens_p50':>12}",
    ]
    for name, ts in timed.items():
        seconds = [t.seconds for t in ts]
        tokens = statistics.median(t.tokens for t in ts)
        notes.append(
            f"{name:<28}{p50[name]:>14.3f}{min(seconds):>8.3f}{max(seconds):>8.3f}"
            f"{len(ts):>4}{tokens:>12.0f}"
        )
    # Judged per block, as the concurrency section judges per round: the two workloads take
    # turns block by block, so a block's ratio sees one machine state where a p50 over all
    # requests mixes several.
    paired = block_ratio(timed[alternating], timed[same])
    mark = "" if paired <= SWITCH_TARGET else " MISSED"
    notes.append(
        f"ratio hotlora alternating/one adapter: per-block ratio median {paired:.2f}x "
        f"(target <= {SWITCH_TARGET}x){mark}; p50 {p50[alternating] / p50[same]:.2f}x"
    )
    vs_mlx = p50[alternating] / p50[mlx]
    notes.append(
        f"ratio hotlora alternating/mlx_lm.server alternating: p50 {vs_mlx:.2f}x "
        "(mlx_lm.server reloads its model on each change of adapter)"
    )
    return notes


def block_ratio(ours: list[Timed], theirs: list[Timed]) -> float:
    """Median over blocks of the ratio of block medians: robust to drift in machine load."""

    def medians(ts: list[Timed]) -> dict[int, float]:
        blocks = {t.block for t in ts}
        return {b: statistics.median(t.seconds for t in ts if t.block == b) for b in blocks}

    a, b = medians(ours), medians(theirs)
    return statistics.median(a[k] / b[k] for k in a if k in b)


def mount_notes(
    size: int, http: tuple[list[float], list[float]], local: tuple[list[float], list[float]]
) -> list[str]:
    notes = [
        f"\n-- mount + unmount: rank {RANK}, 7 projections x every layer, "
        f"{size / 1e6:.1f} MB adapters.safetensors, {MOUNT_REPEATS} times after a warm-up",
        f"{'via':<28}{'mount_p50_ms':>14}{'unmount_p50_ms':>16}{'n':>4}",
    ]
    for via, (mounts, unmounts) in (
        ("HTTP admin API (hotlora)", http),
        ("AdapterManager in-process", local),
    ):
        notes.append(
            f"{via:<28}{1e3 * statistics.median(mounts):>14.1f}"
            f"{1e3 * statistics.median(unmounts):>16.1f}{len(mounts):>4}"
        )
    return notes


def run_adapters(
    model_dir: Path, home: Path, env: dict[str, str], questions: list[str], max_tokens: int
) -> AdapterSection:
    """The whole section; servers run one at a time and are stopped however it ends."""
    root = (home / "adapters").resolve()
    dirs, size = write_adapters(model_dir, root)
    print(f"adapters written under {root}: {', '.join(p.name for p in dirs.values())}", flush=True)
    local = time_in_process(model_dir, root)
    with tempfile.TemporaryDirectory(prefix="hotlora-bench-") as logs, httpx.Client() as client:
        # Loading in parallel, serving one at a time.
        specs = [hotlora_adapter_spec(model_dir, root), mlx_lm_spec(model_dir)]
        servers = launch(specs, env, Path(logs))
        try:
            hot, mlx = servers
            rows = measure_decode(client, hot, [mlx], questions, max_tokens)
            timed = measure_switching(client, hot, mlx, dirs, model_dir)
            http = measure_admin(client, hot)
        finally:
            for server in servers:
                server.stop()
    notes = [*decode_notes(rows), *switching_notes(timed), *mount_notes(size, http, local)]
    title = (
        f"adapters (rank {RANK}, all projections, every layer), {len(questions)} rounds, "
        f"{max_tokens} new tokens, greedy, streaming"
    )
    return AdapterSection(title, rows, notes)
