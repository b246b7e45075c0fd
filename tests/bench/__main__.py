"""`make bench`: hotlora against mlx-lm's own server on the embedded model, side by side.

Each section measures time to first token and decode tokens/s over streaming HTTP, greedy, on
distinct short chat questions. The servers run as subprocesses on loopback ports and take turns
(one busy at a time, order alternating per round); medians are reported, since these machines
are noisy. `base`: the base model on both servers, then mlx-lm's in-process `stream_generate`
alone, as the decode ceiling. `adapters` (tests/bench/adapter_decode.py): decode with LoRA adapters
against the base, latency when requests switch adapters, and mount/unmount times.
`concurrency` (tests/bench/concurrency.py): 1 and 8 concurrent streaming clients on hotlora
(base, and four adapter sets mixed), mlx_lm.server batching, and llama.cpp's server when
`LLAMA_SERVER` names its binary. `prefill` (tests/bench/prefill.py): an 8,000-token prompt's
prefill alone and beside a running stream, and the longest gap between the stream's tokens
meanwhile; llama.cpp's server side by side when `LLAMA_SERVER` names it. `cpu`
(tests/bench/cpu.py, only when named): hotlora against llama.cpp's server on the same weights,
the embedded model and a ~0.8B random llama, 1 to 16 streams, prefill, peak RSS, 16 adapters.
`scoring` (tests/bench/scoring.py): lm-eval-shaped multiple-choice scoring requests per second,
one adapter alone, and 4 adapters evaluated at once against one after another. `fairness`
(tests/bench/fairness.py): tenant B's first token, one request at a time, idle and while tenant
A keeps 64 streams in flight, beside A's queued requests' first token.

    python -m tests.bench [--sections base,adapters,concurrency,prefill,scoring,fairness,cpu]
                          [--rounds 5]
                          [--max-tokens 128] [--clients 8] [--concurrency-tokens 96]
                          [--concurrency-rounds 5] [--prefill-tokens 8000] [--prefill-rounds 1]
                          [--cpu-models embedded,q4km,1b] [--cpu-streams 1,8,16] [--cpu-tokens 96]
                          [--cpu-prefill-tokens 1250] [--cpu-adapters 16]
                          [--cpu-adapter-dtype auto|float32|float16] [--cpu-rounds 1]
                          [--cpu-adapter-pairs 4] [--cpu-precisions fast,exact]
                          [--cpu-isa auto|avx512vnni|avx512vbmi|avx512|avx2|neon]
                          [--cpu-cache DIR] [--scoring-docs 16] [--scoring-clients 8]
                          [--scoring-rounds 1] [--fairness-flood 64] [--fairness-rounds 5]
                          [--model DIR]

Exits 0 when a target is missed: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import httpx

from hotlora.config.settings import KernelsIsa

from tests.bench.adapter_decode import run_adapters
from tests.bench.concurrency import QUESTIONS as CONCURRENT_QUESTIONS
from tests.bench.concurrency import run_concurrency
from tests.bench.cpu import CPU_MODELS, DEFAULT_CPU_MODELS, Options, run_cpu
from tests.bench.fairness import run_fairness
from tests.bench.prefill import run_prefill
from tests.bench.scoring import run_scoring
from tests.bench.servers import Sample, hotlora_bench_spec, launch, mlx_lm_spec, stream_chat
from tests.support.model_args import add_model_args, resolve_model

WARMUP_QUESTION = "Describe the water cycle in detail."
# Distinct per round, so a prompt cache helps neither side beyond the chat template's shared
# prefix (both servers reuse that); each runs to 128 tokens on the embedded model.
QUESTIONS = [
    "Explain how a rainbow forms.",
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of the French Revolution?",
    "How do airplanes stay in the air?",
    "Give me some tips for learning a new language.",
    "Explain photosynthesis to a ten-year-old.",
    "Why is exercise good for your health?",
]
DECODE_TARGET = 0.95  # hotlora / mlx_lm.server decode tok/s, at least
TTFT_TARGET = 1.05  # hotlora / mlx_lm.server time to first token, at most


@dataclass
class Row:
    """One system's samples in a section; the table shows their medians."""

    system: str
    samples: list[Sample]

    @property
    def ttft(self) -> float:
        return statistics.median(s.ttft_s for s in self.samples)

    @property
    def decode(self) -> float:
        return statistics.median(s.decode_tok_s for s in self.samples)


@dataclass
class SectionResult:
    """What a section hands to the shared printer."""

    title: str
    rows: list[Row]
    notes: list[str]


def print_table(result: SectionResult) -> None:
    """The shared results table: one line per system, then the section's notes."""
    print(f"\n== {result.title}")
    if result.rows:
        print_rows(result.rows)
    for note in result.notes:
        print(note)
    sys.stdout.flush()


def print_rows(rows: list[Row]) -> None:
    print(f"{'system':<18}{'ttft_p50_s':>12}{'decode_tok_s_p50':>18}{'n':>4}{'tokens_p50':>12}")
    for row in rows:
        tokens = statistics.median(s.tokens for s in row.samples)
        print(
            f"{row.system:<18}{row.ttft:>12.3f}{row.decode:>18.2f}"
            f"{len(row.samples):>4}{tokens:>12.0f}"
        )


def ratio_line(ours: Row, theirs: Row) -> str:
    decode = ours.decode / theirs.decode
    ttft = ours.ttft / theirs.ttft
    decode_mark = "" if decode >= DECODE_TARGET else " MISSED"
    ttft_mark = "" if ttft <= TTFT_TARGET else " MISSED"
    return (
        f"ratio {ours.system}/{theirs.system}: "
        f"decode {decode:.2f}x (target >= {DECODE_TARGET}x){decode_mark}, "
        f"ttft {ttft:.2f}x (target <= {TTFT_TARGET}x){ttft_mark}"
    )


def paired_note(ours: Row, theirs: Row) -> str:
    """Per-round ratios, robust to drift in machine load between rounds."""
    by_round = {s.round: s for s in theirs.samples}
    pairs = [(s, by_round[s.round]) for s in ours.samples if s.round in by_round]
    decode = statistics.median(a.decode_tok_s / b.decode_tok_s for a, b in pairs)
    ttft = statistics.median(a.ttft_s / b.ttft_s for a, b in pairs)
    same = sum(a.text == b.text for a, b in pairs)
    prompts = sum(a.prompt_tokens == b.prompt_tokens for a, b in pairs)
    return (
        f"per-round ratio medians: decode {decode:.2f}x, ttft {ttft:.2f}x; "
        f"identical greedy text {same}/{len(pairs)}, equal prompt tokens {prompts}/{len(pairs)}"
    )


def idle_note(rows: list[Row]) -> str:
    """How much the waiting server(s) ran while another served: ~0 means no competition."""
    parts = [
        f"while {row.system} served, the others used "
        f"{statistics.median(s.other_cpu_s for s in row.samples):.2f}s"
        for row in rows
    ]
    return "idle-server CPU per request (median): " + "; ".join(parts)


def round_line(sample: Sample, rounds: int) -> str:
    cached = "?" if sample.cached_tokens is None else sample.cached_tokens
    return (
        f"round {sample.round + 1}/{rounds} {sample.system:<14} "
        f"ttft {sample.ttft_s:6.3f}s  decode {sample.decode_tok_s:6.2f} tok/s  "
        f"{sample.tokens} tokens in {sample.chunks} chunks ({sample.finish_reason}), "
        f"prompt {sample.prompt_tokens} tokens, {cached} cached"
    )


def server_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HOTLORA_HOME=str(home))
    return env


def run_direct(model_dir: Path, questions: list[str], max_tokens: int, home: Path) -> list[Sample]:
    """`stream_generate` in a process of its own, after the servers are gone."""
    job = {
        "model": str(model_dir),
        "max_tokens": max_tokens,
        "warmup": WARMUP_QUESTION,
        "questions": questions,
    }
    out = subprocess.run(
        [sys.executable, "-m", "tests.bench.direct"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=60 + 120 * (len(questions) + 1),
        env=server_env(home),
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"stream_generate run failed:\n{out.stderr[-3000:]}")
    return [Sample(**s) for s in json.loads(out.stdout)]


def section_base(args: argparse.Namespace, model_dir: Path) -> SectionResult:
    """Base model only: hotlora vs mlx_lm.server over HTTP, then stream_generate alone."""
    questions = QUESTIONS[: args.rounds]
    env = server_env(args.home)
    samples: dict[str, list[Sample]] = {}
    with tempfile.TemporaryDirectory(prefix="hotlora-bench-") as logs, httpx.Client() as client:
        # Loading in parallel, serving one at a time.
        servers = launch([hotlora_bench_spec(model_dir), mlx_lm_spec(model_dir)], env, Path(logs))
        try:
            for server in servers:
                stream_chat(client, server, WARMUP_QUESTION, args.max_tokens, -1)
            for i, question in enumerate(questions):
                order = servers if i % 2 == 0 else servers[::-1]
                for server in order:
                    others = [s for s in servers if s is not server]
                    cpu0 = sum(s.cpu_seconds() for s in others)
                    sample = stream_chat(client, server, question, args.max_tokens, i)
                    idle_cpu = sum(s.cpu_seconds() for s in others) - cpu0
                    sample = dataclasses.replace(sample, other_cpu_s=idle_cpu)
                    samples.setdefault(server.spec.name, []).append(sample)
                    print(round_line(sample, len(questions)), flush=True)
        finally:
            for server in servers:
                server.stop()
    rows = [Row(name, samples[name]) for name in ("hotlora", "mlx_lm.server")]
    if not args.skip_direct:
        print("stream_generate in-process (servers stopped) ...", flush=True)
        direct = run_direct(model_dir, questions, args.max_tokens, args.home)
        for sample in direct:
            print(round_line(sample, len(questions)), flush=True)
        rows.append(Row("stream_generate", direct))
    hot, mlx = rows[0], rows[1]
    notes = [ratio_line(hot, mlx), paired_note(hot, mlx), idle_note(rows[:2])]
    if not args.skip_direct:
        ceiling = rows[2]
        notes.append(
            "stream_generate prefills each prompt in full; both servers reuse the cached "
            "chat-template prefix, so its TTFT is no ceiling (its decode is)"
        )
        notes.append(
            "share of the stream_generate ceiling (decode): "
            f"hotlora {hot.decode / ceiling.decode:.2f}x, "
            f"mlx_lm.server {mlx.decode / ceiling.decode:.2f}x"
        )
    return SectionResult(
        f"base model, {len(questions)} rounds, {args.max_tokens} new tokens, greedy, streaming",
        rows,
        notes,
    )


def section_adapters(args: argparse.Namespace, model_dir: Path) -> SectionResult:
    """LoRA adapters on hotlora: decode against the base, switching, mounting."""
    questions = QUESTIONS[: args.rounds]
    out = run_adapters(model_dir, args.home, server_env(args.home), questions, args.max_tokens)
    rows = [Row(name, samples) for name, samples in out.rows.items()]
    return SectionResult(out.title, rows, out.notes)


def section_concurrency(args: argparse.Namespace, model_dir: Path) -> SectionResult:
    """Many streaming clients at once: hotlora (base, mixed adapters) against its peers."""
    out = run_concurrency(
        model_dir,
        args.home,
        server_env(args.home),
        args.clients,
        args.concurrency_tokens,
        args.concurrency_rounds,
    )
    return SectionResult(out.title, [], out.lines)


def section_prefill(args: argparse.Namespace, model_dir: Path) -> SectionResult:
    """One long prompt alone and beside a running stream: its prefill time, the stream's gaps."""
    out = run_prefill(
        model_dir, server_env(args.home), args.prefill_tokens, args.prefill_rounds, args.cpu_isa
    )
    return SectionResult(out.title, [], out.lines)


def section_fairness(args: argparse.Namespace, model_dir: Path) -> SectionResult:
    """Tenant B's first token while tenant A floods the batch, against A's queued requests'."""
    out = run_fairness(model_dir, server_env(args.home), args.fairness_flood, args.fairness_rounds)
    return SectionResult(out.title, [], out.lines)


def section_scoring(args: argparse.Namespace, model_dir: Path) -> SectionResult:
    """lm-eval-shaped scoring: one adapter alone, 4 adapters at once and one after another."""
    title, lines = run_scoring(
        model_dir,
        args.home,
        server_env(args.home),
        args.scoring_docs,
        args.scoring_clients,
        args.scoring_rounds,
    )
    return SectionResult(title, [], lines)


def section_cpu(args: argparse.Namespace, model_dir: Path) -> SectionResult:
    """hotlora against llama.cpp's server on the same weights, one server at a time."""
    options = Options(
        models=tuple(args.cpu_models),
        streams=tuple(args.cpu_streams),
        tokens=args.cpu_tokens,
        prefill_tokens=args.cpu_prefill_tokens,
        adapters=args.cpu_adapters,
        adapter_dtype=args.cpu_adapter_dtype,
        rounds=args.cpu_rounds,
        adapter_pairs=args.cpu_adapter_pairs,
        precisions=tuple(args.cpu_precisions),
        isa=args.cpu_isa,
        cache=args.cpu_cache,
    )
    out = run_cpu(args.home, server_env(args.home), options)
    return SectionResult(out.title, [], out.lines)


def section_adapters_at_scale(args: argparse.Namespace, model_dir: Path) -> SectionResult:
    """Generated adapters on disk, mounted on first use under a cap, Zipf traffic against
    base-only traffic; cold loads, evictions, peak RSS (`tests.bench.adapters_at_scale`)."""
    from tests.bench import adapters_at_scale

    argv = ["--model", str(model_dir), "--home", str(args.home)]
    argv += ["--adapters", str(args.scale_adapters), "--seconds", str(args.scale_seconds)]
    argv += ["--clients", str(args.clients)]
    code = adapters_at_scale.main(argv)
    note = "report above (JSON)" if code == 0 else f"failed with exit status {code}"
    return SectionResult("adapters-at-scale: many adapters, mounted on first use", [], [note])


SECTIONS: dict[str, Callable[[argparse.Namespace, Path], SectionResult]] = {
    "base": section_base,
    "adapters": section_adapters,
    "concurrency": section_concurrency,
    "prefill": section_prefill,
    "scoring": section_scoring,
    "fairness": section_fairness,
    "cpu": section_cpu,
    "adapters-at-scale": section_adapters_at_scale,
}
# `cpu` builds a random ~0.8B model and, without LLAMA_SERVER, llama.cpp; `adapters-at-scale`
# writes 1,000 adapters (~10 GB) and runs for minutes: run only when named.
DEFAULT_SECTIONS = ("base", "adapters", "concurrency", "prefill", "scoring", "fairness")


def int_list(text: str) -> list[int]:
    """`1,8,16` -> [1, 8, 16]."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help=f"Comma-separated sections to run, of: {', '.join(SECTIONS)} "
        f"(default: {','.join(DEFAULT_SECTIONS)}).",
    )
    p.add_argument("--rounds", type=int, default=5, help="Timed requests per system.")
    p.add_argument("--max-tokens", type=int, default=128, help="New tokens per request.")
    p.add_argument(
        "--clients", type=int, default=8, help="Concurrent clients (section concurrency)."
    )
    p.add_argument(
        "--concurrency-tokens",
        type=int,
        default=96,
        help="New tokens per request in section concurrency.",
    )
    p.add_argument(
        "--concurrency-rounds",
        type=int,
        default=5,
        help="Alternating rounds of hotlora's two servers in section concurrency.",
    )
    p.add_argument(
        "--scale-adapters",
        type=int,
        default=1000,
        help="Adapters written on disk in section adapters-at-scale.",
    )
    p.add_argument(
        "--scale-seconds",
        type=float,
        default=120.0,
        help="Seconds of each traffic run in section adapters-at-scale.",
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=8000,
        help="Prompt tokens of the long prompt in section prefill.",
    )
    p.add_argument(
        "--prefill-rounds", type=int, default=1, help="Rounds per system in section prefill."
    )
    p.add_argument(
        "--cpu-models",
        default=",".join(DEFAULT_CPU_MODELS),
        help=f"Models of section cpu, of: {', '.join(CPU_MODELS)}.",
    )
    p.add_argument(
        "--cpu-streams",
        type=int_list,
        default=[1, 8, 16],
        help="Concurrent stream counts in section cpu (default: 1,8,16).",
    )
    p.add_argument("--cpu-tokens", type=int, default=96, help="New tokens a row in section cpu.")
    p.add_argument(
        "--cpu-prefill-tokens",
        type=int,
        default=1250,
        help="Prompt tokens of the prefill in section cpu.",
    )
    p.add_argument(
        "--cpu-adapters",
        type=int,
        default=16,
        help="Rows with an adapter each on hotlora in section cpu; 0 leaves them out.",
    )
    p.add_argument(
        "--cpu-adapter-dtype",
        choices=["auto", "float32", "float16"],
        default="auto",
        help="hotlora's --adapter-dtype for those rows in section cpu.",
    )
    p.add_argument("--cpu-rounds", type=int, default=1, help="Rounds per server in section cpu.")
    p.add_argument(
        "--cpu-precisions",
        type=lambda v: [x for x in v.split(",") if x],
        default=["fast", "exact"],
        help="hotlora's --cpu-precision values in section cpu, a run each (default: fast,exact; "
        "the adapters' rows run on the first).",
    )
    p.add_argument(
        "--cpu-isa",
        choices=get_args(KernelsIsa),
        default="auto",
        help="hotlora's --cpu-kernels-isa in sections cpu and prefill: a narrower ISA than the "
        "CPU's widest measures a CPU with only those instructions (set LLAMA_SERVER to a "
        "llama.cpp built for the same ones).",
    )
    p.add_argument(
        "--cpu-adapter-pairs",
        type=int,
        default=4,
        help="Timed pairs of adapter rows and base-only rows in section cpu (default: 4).",
    )
    p.add_argument(
        "--cpu-cache",
        type=Path,
        default=Options().cache,
        help="Where section cpu keeps the random model, adapters and a built llama-server "
        "(default: $XDG_CACHE_HOME/hotlora-bench, else the temporary directory's).",
    )
    p.add_argument(
        "--scoring-docs", type=int, default=16, help="Questions an evaluation in section scoring."
    )
    p.add_argument(
        "--scoring-clients",
        type=int,
        default=8,
        help="Concurrent clients an evaluation in section scoring (lm-eval's num_concurrent).",
    )
    p.add_argument("--scoring-rounds", type=int, default=1, help="Rounds in section scoring.")
    p.add_argument(
        "--fairness-flood",
        type=int,
        default=64,
        help="Streams tenant A keeps in flight in section fairness.",
    )
    p.add_argument(
        "--fairness-rounds",
        type=int,
        default=5,
        help="Tenant B's requests, one at a time, per measurement in section fairness.",
    )
    add_model_args(p)
    p.add_argument(
        "--skip-direct", action="store_true", help="Leave out the in-process stream_generate run."
    )
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s): {', '.join(unknown)}")
    if not 1 <= args.rounds <= len(QUESTIONS):
        p.error(f"--rounds must be 1..{len(QUESTIONS)} (one distinct question per round)")
    asked = args.concurrency_rounds * (args.clients + 1)
    if args.clients < 1 or args.concurrency_rounds < 1 or asked > len(CONCURRENT_QUESTIONS):
        p.error(
            f"--concurrency-rounds x (--clients + 1) must be 1..{len(CONCURRENT_QUESTIONS)} "
            "(a question of its own for every stream of every round)"
        )
    if args.prefill_tokens < 1 or args.prefill_rounds < 1:
        p.error("--prefill-tokens and --prefill-rounds must be at least 1")
    args.cpu_models = [m.strip() for m in args.cpu_models.split(",") if m.strip()]
    if not args.cpu_models or any(m not in CPU_MODELS for m in args.cpu_models):
        p.error(f"--cpu-models takes a comma list of: {', '.join(CPU_MODELS)}")
    if not args.cpu_streams or min(args.cpu_streams) < 1:
        p.error("--cpu-streams takes a comma list of stream counts, each at least 1")
    if args.cpu_tokens < 2 or args.cpu_prefill_tokens < 1 or args.cpu_rounds < 1:
        p.error("--cpu-tokens must be at least 2, --cpu-prefill-tokens and --cpu-rounds 1")
    if args.cpu_adapter_pairs < 1:
        p.error("--cpu-adapter-pairs must be at least 1")
    if not args.cpu_precisions or not set(args.cpu_precisions) <= {"fast", "exact", "float32"}:
        p.error("--cpu-precisions takes a comma list of: fast, exact, float32")
    if args.cpu_adapters < 0:
        p.error("--cpu-adapters must be 0 or more")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 to measure decoding")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    model_dir = resolve_model(args)
    print(f"model: {model_dir}", flush=True)
    results = [SECTIONS[name](args, model_dir) for name in args.sections]
    for result in results:
        print_table(result)
    print(f"\n(bench took {time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
