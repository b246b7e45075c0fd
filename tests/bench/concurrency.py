"""`make bench`, section `concurrency`: many streaming clients at once, on the embedded model.

Each system serves first one streaming client alone, then `--clients` (8) streaming clients at
once, each asking for `--max-tokens` (96) new tokens on a question of its own. Reported: single-
stream time to first token and decode rate, aggregate tokens/s over the concurrent run (all
completion tokens / wall time), the concurrent run's time-to-first-token median, and each
server's peak RSS.

Systems: hotlora on the base model; hotlora with four adapter sets mixed across the clients
(`a`, `b`, `m`, `a+b`; random rank-16 adapters on every projection); hotlora with its weights
as loaded for MLX's own kernels (`--cpu-weights mlx`, single stream only: the path served before
float32 and packed weights); mlx_lm.server with `--decode-concurrency` and
`--prompt-concurrency` set to the client count; and llama.cpp's `llama-server` on the same
GGUF when `LLAMA_SERVER` names its binary.

The two ratios hotlora is compared with itself on (8 streams against its single stream, mixed
sets against the base) come from `--concurrency-rounds` (5) rounds: both hotlora servers run at
once, taking turns, and each round measures the single stream and the 8 streams back to back on
questions no earlier round asked (no prompt-cache hits). Each figure is the median over rounds of
the per-round value, so a change in the machine's speed between rounds cancels out. The other
systems, one at a time, run one round.
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

from tests.bench.adapter_decode import ADAPTER_DIRS, write_adapters
from tests.bench.servers import Sample, hotlora_bench_spec, launch, mlx_lm_spec, stream_chat
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
    "Explain how a refrigerator keeps food cold.",
    "Describe the busiest day at a small train station.",
    "Write a long fable about a fox and a clever crow.",
    "Explain how bees make honey and why it matters.",
    "Describe a storm at sea from the deck of a ship.",
    "Write a diary entry of an explorer crossing a desert.",
    "Explain how a bridge carries the weight of traffic.",
    "Describe the morning routine of a city baker.",
    "Write a story about a child who finds a hidden door.",
    "Explain how tides follow the moon.",
    "Describe an afternoon in an old botanical garden.",
    "Write a speech for the opening of a new library.",
    "Explain how paper is made from trees.",
    "Describe the sounds of a forest at night.",
    "Write a story about a musician who loses her voice.",
    "Explain how glass is made, from sand to window.",
    "Describe a winter festival in a northern town.",
    "Write a letter from a gardener to the next owner of her garden.",
    "Explain how a submarine dives and surfaces.",
    "Describe the workshop of a violin maker.",
    "Write a story about a lighthouse that guides a lost ship home.",
    "Explain how a clock keeps time, from pendulum to quartz.",
    "Describe a morning at a busy fishing harbour.",
    "Write a letter from an astronaut to her younger self.",
    "Explain how plants turn sunlight into food.",
    "Describe the streets of an old town after the first snow.",
    "Write a story about a baker who opens a shop on the moon.",
    "Explain how an airplane stays in the air.",
    "Describe a summer evening at a village fair.",
    "Write a long fable about a tortoise who wants to fly.",
    "Explain how a battery stores and releases energy.",
    "Describe the inside of a busy post office before a holiday.",
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
SINGLE_TTFT_SPEEDUP = 4.0  # single-stream first token, MLX's kernels / the served path, at least


@dataclass
class Round:
    """One system's single stream and, if measured, its concurrent run right after it."""

    single: Sample
    concurrent: list[Sample] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0

    @property
    def aggregate(self) -> float:
        tokens = sum(s.tokens for s in self.concurrent)
        return tokens / self.wall_s if self.wall_s else float("nan")

    @property
    def single_rate(self) -> float:
        """The single stream's tokens per second end to end (first token wait included)."""
        one = self.single
        return one.tokens / (one.ttft_s + one.tokens / one.decode_tok_s)


@dataclass
class Run:
    """One system's rounds; each figure is the median over them."""

    system: str
    rounds: list[Round] = dataclasses.field(default_factory=list)
    peak_rss_mb: float = 0.0

    @property
    def concurrent(self) -> bool:
        return bool(self.rounds) and bool(self.rounds[0].concurrent)

    def per_round(self, value: Callable[[Round], float]) -> float:
        """The median over rounds of one per-round figure."""
        return statistics.median(value(r) for r in self.rounds)

    @property
    def ttft_s(self) -> float:
        return self.per_round(lambda r: r.single.ttft_s)

    @property
    def decode_tok_s(self) -> float:
        return self.per_round(lambda r: r.single.decode_tok_s)

    @property
    def aggregate(self) -> float:
        return self.per_round(lambda r: r.aggregate)

    @property
    def ttft_p50(self) -> float:
        return self.per_round(lambda r: statistics.median(s.ttft_s for s in r.concurrent))


def round_questions(round_: int, clients: int) -> tuple[str, list[str]]:
    """The single stream's question and the clients' ones, none asked in an earlier round."""
    chunk = QUESTIONS[round_ * (clients + 1) : (round_ + 1) * (clients + 1)]
    return chunk[0], chunk[1:]


@dataclass
class ConcurrencySection:
    title: str
    lines: list[str]


def peak_rss_mb(server: ServerProcess) -> float:
    """The server process's peak resident set (VmHWM), in MB; 0 where /proc has none."""
    assert server.proc is not None
    try:
        for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
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


def warm_up(server: ServerProcess, clients: int, extras: list[dict], concurrent: bool) -> None:
    """The workload once, short and on other questions (so no prompt cache helps later): every
    system is then measured serving, not starting up."""
    questions = WARMUP_QUESTIONS[:clients]
    if concurrent:
        concurrent_chats(server, questions, WARMUP_TOKENS, extras)
    with httpx.Client() as client:
        stream_chat(client, server, questions[0], WARMUP_TOKENS, -1, extras[0] if extras else {})


def measure(
    server: ServerProcess,
    round_: int,
    clients: int,
    max_tokens: int,
    extras: list[dict],
    concurrent: bool,
) -> Round:
    """One stream alone, then (if `concurrent`) every client at once."""
    name = server.spec.name
    question, questions = round_questions(round_, clients)
    with httpx.Client() as client:
        single = stream_chat(
            client, server, question, max_tokens, round_, extras[0] if extras else {}
        )
    result = Round(single)
    print(
        f"{name}, round {round_ + 1}: single stream ttft {single.ttft_s:.2f}s, "
        f"decode {single.decode_tok_s:.1f} tok/s",
        flush=True,
    )
    if concurrent:
        result.concurrent, result.wall_s = concurrent_chats(server, questions, max_tokens, extras)
        print(
            f"{name}, round {round_ + 1}: {clients} streams, aggregate "
            f"{result.aggregate:.1f} tok/s, ttft p50 "
            f"{statistics.median(s.ttft_s for s in result.concurrent):.2f}s",
            flush=True,
        )
    return result


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
    model_dir: Path, home: Path, env: dict[str, str], clients: int, max_tokens: int, rounds: int
) -> ConcurrencySection:
    """hotlora's two servers in alternating rounds, then every other system in turn; returns the
    printed table and the ratio lines."""
    adapter_root = home / "adapters"
    write_adapters(model_dir, adapter_root)
    mounts = [f"--adapter={i}={ADAPTER_DIRS[i]}" for i in ("a", "b", "m")]
    hot = hotlora_bench_spec(model_dir)
    paired: list[tuple[ServerSpec, list[dict]]] = [
        (hot, [{}] * clients),
        (
            _with_args(
                hot, "hotlora mixed", lambda: ["--adapter-root", str(adapter_root), *mounts]
            ),
            [{"adapter": MIXED_SETS[i % len(MIXED_SETS)]} for i in range(clients)],
        ),
    ]
    alone: list[tuple[ServerSpec, list[dict], bool]] = [
        (_with_args(hot, "hotlora mlx", lambda: ["--cpu-weights", "mlx"]), [], False),
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

        alone.append(
            (llama_server_spec(Path(llama), embedded_gguf_path(), clients), [{}] * clients, True)
        )
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="hotlora-bench-") as logs:
        servers = launch([spec for spec, _ in paired], env, Path(logs))  # idle while not asked
        try:
            pair = [Run(server.spec.name) for server in servers]
            for server, (_, extras) in zip(servers, paired, strict=True):
                warm_up(server, clients, extras, True)
            for round_ in range(rounds):
                for run, server, (_, extras) in zip(pair, servers, paired, strict=True):
                    run.rounds.append(measure(server, round_, clients, max_tokens, extras, True))
            for run, server in zip(pair, servers, strict=True):
                run.peak_rss_mb = peak_rss_mb(server)
            runs.extend(pair)
        finally:
            for server in servers:
                server.stop()
        for spec, extras, concurrent in alone:
            (server,) = launch([spec], env, Path(logs))  # one server at a time
            try:
                warm_up(server, clients, extras, concurrent)
                run = Run(spec.name, [measure(server, 0, clients, max_tokens, extras, concurrent)])
                run.peak_rss_mb = peak_rss_mb(server)
                runs.append(run)
            finally:
                server.stop()
    return ConcurrencySection(
        f"concurrency: 1 and {clients} streaming clients, {max_tokens} new tokens, greedy "
        f"(hotlora and hotlora mixed: medians of {rounds} alternating rounds)",
        table(runs, clients) + ratios({r.system: r for r in runs}, clients),
    )


def table(runs: list[Run], clients: int) -> list[str]:
    head = (
        f"{'system':<20}{'1: ttft_s':>10}{'1: decode':>11}"
        f"{f'{clients}: agg tok/s':>16}{f'{clients}: ttft p50':>15}{'peak RSS MB':>13}"
    )
    lines = [head]
    for r in runs:
        agg = f"{r.aggregate:.1f}" if r.concurrent else "-"
        ttft = f"{r.ttft_p50:.2f}" if r.concurrent else "-"
        lines.append(
            f"{r.system:<20}{r.ttft_s:>10.2f}{r.decode_tok_s:>11.1f}"
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
    quant = runs["hotlora mlx"]
    # Per round, the 8 streams against the single stream just before them; the mixed server's
    # round against the base server's round next to it.
    own = hot.per_round(lambda r: r.aggregate / r.single_rate)
    by_round = zip(mixed.rounds, hot.rounds, strict=True)
    mixed_vs_base = statistics.median(m.aggregate / b.aggregate for m, b in by_round)
    single_rate = hot.per_round(lambda r: r.single_rate)
    lines = [
        check(
            f"hotlora/mlx_lm.server, {clients} streams aggregate",
            hot.aggregate / mlx.aggregate,
            AGGREGATE_VS_PEER,
        ),
        check(
            f"hotlora {clients} streams / its single stream ({single_rate:.1f} tok/s end to end)",
            own,
            AGGREGATE_VS_SINGLE,
        ),
        check("mixed adapter sets / base only, aggregate", mixed_vs_base, 0.85),
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
            "single-stream first token, mlx / served (speed-up)",
            quant.ttft_s / hot.ttft_s,
            SINGLE_TTFT_SPEEDUP,
        ),
        check(
            "single-stream decode, served / mlx",
            hot.decode_tok_s / quant.decode_tok_s,
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
