"""`make bench`, section `concurrency`: many streaming clients at once, on the embedded model.

Each system serves, in turn (one server busy at a time), first one streaming client alone, then
`--clients` (8) streaming clients at once, each asking for `--max-tokens` (96) new tokens on a
question of its own. Reported: single-stream time to first token and decode rate, aggregate
tokens/s over the concurrent run (all completion tokens / wall time), the concurrent run's
time-to-first-token median, and each server's peak RSS.

Systems: hotlora on the base model; hotlora with four adapter sets mixed across the clients
(`a`, `b`, `m`, `a+b`; random rank-16 adapters on every projection); hotlora with its weights
kept quantized (`--cpu-weights quantized`, single stream only: the path served before float32
weights); mlx_lm.server with `--decode-concurrency` and `--prompt-concurrency` set to the
client count; and llama.cpp's `llama-server` on the same GGUF when `LLAMA_SERVER` names its
binary.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.bench_adapters import ADAPTER_DIRS, write_adapters
from tests.bench_http import Sample, hotlora_bench_spec, launch, mlx_lm_spec, stream_chat
from tests.support.server_process import ServerProcess, ServerSpec

QUESTIONS = [
    "Write a long story about a dragon who learns to bake bread.",
    "Explain in detail how a steam engine works.",
    "Describe a walk through a busy market in a foreign city.",
    "Write a letter from a sailor to his family.",
    "Explain how the internet works to a curious child.",
    "Describe the life cycle of a star in detail.",
    "Write a long poem about the changing seasons.",
    "Tell the history of the bicycle.",
    "Describe how bread is made, step by step.",
    "Write a story about a robot exploring an abandoned city.",
    "Explain why the sky is blue and sunsets are red.",
    "Describe a day in the life of a lighthouse keeper.",
    "Write a detailed guide to planting a vegetable garden.",
    "Explain how vaccines train the immune system.",
    "Describe the journey of a river from mountain to sea.",
    "Write a story about two friends lost in a forest.",
]
WARMUP_QUESTIONS = [
    "Describe your favourite season.",
    "Explain how a bicycle brake works.",
    "Write a short note to a neighbour.",
    "Describe a quiet library.",
    "Explain what a volcano is.",
    "Describe a train journey at night.",
    "Write a limerick about a cat.",
    "Explain how ice forms on a lake.",
    "Describe a busy kitchen.",
    "Explain what clouds are made of.",
    "Describe a mountain village.",
    "Write a haiku about the sea.",
    "Explain how a kite flies.",
    "Describe an old clock tower.",
    "Explain what a comet is.",
    "Describe a farmers' market.",
]
WARMUP_TOKENS = 8
MIXED_SETS = ("a", "b", "m", "a+b")  # the adapter set of client i is MIXED_SETS[i % 4]

AGGREGATE_VS_PEER = 5.0  # hotlora 8-stream aggregate / mlx_lm.server's, at least
AGGREGATE_VS_SINGLE = 5.0  # hotlora 8-stream aggregate / its own single stream, at least
TTFT_P50_TARGET_S = 3.0  # with 8 concurrent clients, at most
SINGLE_TTFT_SPEEDUP = 4.0  # single-stream first token, quantized path / float32 path, at least


@dataclass
class Run:
    """One system's single stream and its concurrent run."""

    system: str
    single: Sample | None = None
    concurrent: list[Sample] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0

    @property
    def aggregate(self) -> float:
        tokens = sum(s.tokens for s in self.concurrent)
        return tokens / self.wall_s if self.wall_s else float("nan")

    @property
    def ttft_p50(self) -> float:
        return statistics.median(s.ttft_s for s in self.concurrent)


@dataclass
class ConcurrencySection:
    title: str
    lines: list[str]


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB; 0 where /proc has none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def concurrent_chats(
    server: ServerProcess, questions: list[str], max_tokens: int, extras: list[dict]
) -> tuple[list[Sample], float]:
    """All questions at once, one thread and client each; the samples and the wall time."""
    samples: list[Sample | BaseException] = [RuntimeError("not run")] * len(questions)
    start = threading.Barrier(len(questions) + 1)

    def one(i: int) -> None:
        with httpx.Client() as client:
            start.wait()
            try:
                samples[i] = stream_chat(client, server, questions[i], max_tokens, i, extras[i])
            except BaseException as exc:  # noqa: BLE001 - reported below
                samples[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for thread in threads:
        thread.start()
    start.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    failed = [s for s in samples if isinstance(s, BaseException)]
    if failed:
        raise RuntimeError(f"{server.spec.name}: {len(failed)} requests failed: {failed[0]}")
    return [s for s in samples if isinstance(s, Sample)], wall


def measure(
    server: ServerProcess,
    questions: list[str],
    max_tokens: int,
    extras: list[dict],
    concurrent: bool,
) -> Run:
    """A warm-up, one stream alone, then (if `concurrent`) every question at once.

    The warm-up runs the workload once, short and on other questions (so no prompt cache
    helps later): every system is then measured serving, not starting up.
    """
    name = server.spec.name
    run = Run(name)
    first = extras[0] if extras else {}
    warm_up = WARMUP_QUESTIONS[: len(questions)]
    if concurrent:
        concurrent_chats(server, warm_up, WARMUP_TOKENS, extras)
    with httpx.Client() as client:
        stream_chat(client, server, warm_up[0], WARMUP_TOKENS, -1, first)
        run.single = stream_chat(client, server, questions[0], max_tokens, 0, first)
    print(
        f"{name}: single stream ttft {run.single.ttft_s:.2f}s, "
        f"decode {run.single.decode_tok_s:.1f} tok/s",
        flush=True,
    )
    if concurrent:
        run.concurrent, run.wall_s = concurrent_chats(server, questions, max_tokens, extras)
        print(
            f"{name}: {len(questions)} streams, aggregate {run.aggregate:.1f} tok/s, "
            f"ttft p50 {run.ttft_p50:.2f}s",
            flush=True,
        )
    assert server.proc is not None
    run.peak_rss_mb = peak_rss_mb(server.proc.pid)
    return run


def llama_server_spec(binary: Path, gguf: Path, clients: int) -> ServerSpec:
    """llama.cpp's server on the GGUF itself, with a slot per client."""

    def argv(port: int) -> list[str]:
        return [
            str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(clients), "-c", str(1024 * clients), "-t", str(os.cpu_count() or 2),
        ]  # fmt: skip

    def ready(client: httpx.Client, url: str) -> str | None:
        return "default" if client.get(f"{url}/health", timeout=5).status_code == 200 else None

    return ServerSpec("llama-server", argv, ready)


def _with_args(spec: ServerSpec, name: str, extra: Callable[[], list[str]]) -> ServerSpec:
    base = spec.argv
    return dataclasses.replace(spec, name=name, argv=lambda port: [*base(port), *extra()])


def run_concurrency(
    model_dir: Path, home: Path, env: dict[str, str], clients: int, max_tokens: int
) -> ConcurrencySection:
    """Every system in turn; returns the printed table and the ratio lines."""
    questions = QUESTIONS[:clients]
    adapter_root = home / "adapters"
    write_adapters(model_dir, adapter_root)
    mounts = [f"--adapter={i}={ADAPTER_DIRS[i]}" for i in ("a", "b", "m")]
    hot = hotlora_bench_spec(model_dir)
    specs: list[tuple[ServerSpec, list[dict], bool]] = [
        (hot, [{}] * clients, True),
        (
            _with_args(
                hot, "hotlora mixed", lambda: ["--adapter-root", str(adapter_root), *mounts]
            ),
            [{"adapter": MIXED_SETS[i % len(MIXED_SETS)]} for i in range(clients)],
            True,
        ),
        (_with_args(hot, "hotlora quantized", lambda: ["--cpu-weights", "quantized"]), [], False),
        (
            _with_args(
                mlx_lm_spec(model_dir),
                "mlx_lm.server",
                lambda: [
                    "--decode-concurrency",
                    str(clients),
                    "--prompt-concurrency",
                    str(clients),
                ],
            ),
            [{}] * clients,
            True,
        ),
    ]
    llama = os.environ.get("LLAMA_SERVER")
    if llama:
        from hotlora.models.embedded import embedded_gguf_path

        specs.append(
            (llama_server_spec(Path(llama), embedded_gguf_path(), clients), [{}] * clients, True)
        )
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="hotlora-bench-") as logs:
        for spec, extras, concurrent in specs:
            (server,) = launch([spec], env, Path(logs))  # one server at a time
            try:
                runs.append(measure(server, questions, max_tokens, extras, concurrent))
            finally:
                server.stop()
    return ConcurrencySection(
        f"concurrency: 1 and {clients} streaming clients, {max_tokens} new tokens, greedy",
        table(runs, clients) + ratios({r.system: r for r in runs}, clients),
    )


def table(runs: list[Run], clients: int) -> list[str]:
    head = (
        f"{'system':<20}{'1: ttft_s':>10}{'1: decode':>11}"
        f"{f'{clients}: agg tok/s':>16}{f'{clients}: ttft p50':>15}{'peak RSS MB':>13}"
    )
    lines = [head]
    for r in runs:
        single = r.single
        agg = f"{r.aggregate:.1f}" if r.concurrent else "-"
        ttft = f"{r.ttft_p50:.2f}" if r.concurrent else "-"
        lines.append(
            f"{r.system:<20}{single.ttft_s if single else float('nan'):>10.2f}"
            f"{single.decode_tok_s if single else float('nan'):>11.1f}"
            f"{agg:>16}{ttft:>15}{r.peak_rss_mb:>13.0f}"
        )
    return lines


def check(
    label: str, value: float, target: float, *, at_most: bool = False, unit: str = "x"
) -> str:
    """One result line against its target, flagged when missed."""
    met = value <= target if at_most else value >= target
    bound = "<=" if at_most else ">="
    return f"{label}: {value:.2f}{unit} (target {bound} {target}{unit})" + (
        "" if met else " MISSED"
    )


def ratios(runs: dict[str, Run], clients: int) -> list[str]:
    hot, mixed, mlx = runs["hotlora"], runs["hotlora mixed"], runs["mlx_lm.server"]
    quant = runs["hotlora quantized"]
    assert hot.single is not None and quant.single is not None
    one = hot.single
    single_rate = one.tokens / (one.ttft_s + one.tokens / one.decode_tok_s)  # end to end
    lines = [
        check(
            f"hotlora/mlx_lm.server, {clients} streams aggregate",
            hot.aggregate / mlx.aggregate,
            AGGREGATE_VS_PEER,
        ),
        check(
            f"hotlora {clients} streams / its single stream ({single_rate:.1f} tok/s end to end)",
            hot.aggregate / single_rate,
            AGGREGATE_VS_SINGLE,
        ),
        check("mixed adapter sets / base only, aggregate", mixed.aggregate / hot.aggregate, 0.85),
        check(
            f"hotlora ttft p50, {clients} clients",
            hot.ttft_p50,
            TTFT_P50_TARGET_S,
            at_most=True,
            unit="s",
        ),  # fmt: skip
        check(
            f"mixed ttft p50, {clients} clients",
            mixed.ttft_p50,
            TTFT_P50_TARGET_S,
            at_most=True,
            unit="s",
        ),  # fmt: skip
        check(
            "single-stream first token, quantized / float32 (speed-up)",
            quant.single.ttft_s / one.ttft_s,
            SINGLE_TTFT_SPEEDUP,
        ),
        check(
            "single-stream decode, float32 / quantized",
            one.decode_tok_s / quant.single.decode_tok_s,
            1.0,
        ),
    ]
    llama = runs.get("llama-server")
    if llama is not None and llama.concurrent:
        lines.append(
            f"hotlora/llama-server: {clients} streams aggregate "
            f"{hot.aggregate / llama.aggregate:.2f}x, ttft p50 {hot.ttft_p50 / llama.ttft_p50:.2f}x"
        )
    return lines


if __name__ == "__main__":
    sys.exit("run through `python -m tests.bench --sections concurrency`")
