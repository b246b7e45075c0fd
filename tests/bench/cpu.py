"""`make bench`, section `cpu`: hotlora against llama.cpp's server on the CPU, on the same weights.

For each model of `--cpu-models`, each server in turn, alone on the machine:
- `embedded`: the embedded model; llama.cpp serves the GGUF it is imported from.
- `q4km`: the embedded model requantized by llama.cpp's own `llama-quantize` to Q4_K_M (written
  once into `--cpu-cache`; its rows of 576 values fall back to Q5_0, so most layers are 5-bit,
  read at 5 bits by hotlora's integer products); hotlora imports that file, llama.cpp serves it. No
  adapter rows on it (its base rows are the comparison).
- `bigvocab`: a random-weight llama of Gemma 3 270M's hidden width, layers, MLP and vocabulary
  (hidden 640, 18 layers, ffn 2048, vocabulary 262,144; llama's attention, heads 10/2 of 64):
  its tied embedding and head, 168 M weights, are two thirds of the model and the most read a
  decoded token; built as `1b` is.
- `1b`: a ~0.8B random-weight llama (hidden 2048, 16 layers, ffn 5632, heads 32/4, vocabulary
  49,152 with the embedded model's tokenizer) built once into `--cpu-cache`: a 4-bit (group 32)
  mlx-lm directory for hotlora and a Q4_1 GGUF of the same 4-bit weights for llama.cpp
  (tests/bench/random_llama.py).

Measured on each: 1, 8 and 16 (`--cpu-streams`) concurrent streaming chats of `--cpu-tokens`
(96) new tokens, each on a prompt of its own, with the end-of-text and special tokens biased
away (llama.cpp also gets `ignore_eos`) so that every row runs to the end: the median time to
first token and decode tokens/s per stream, and the aggregate (all tokens / wall time); a
`--cpu-prefill-tokens` (1,250) token prompt's prefill tokens/s (`/v1/completions`, one new
token); the server's peak RSS (its VmHWM, or the polled RSS of it and its children when larger).
hotlora runs once a precision of `--cpu-precisions` (fast: its default, int8 activations; exact:
`--cpu-precision exact`, activations in three int8 parts; float32: float32 activations), each in
a table of its own against the same llama.cpp run; the first line names the vector instructions
the kernels ran with.
Then on hotlora (the first precision) alone: two full-length runs of `--cpu-adapters` (16)
base-only rows, whose peak RSS is the one the adapters' is held to (the same traffic, without
them); then that many random rank-16 adapters on every projection are mounted (kept as
`--cpu-adapter-dtype` says, by default the server's own default, auto), and that many rows, each
with an adapter of its own, run beside a base-only run of as many rows on the same server: after
two untimed rounds of each, `--cpu-adapter-pairs` (4) timed pairs, in alternating order; their
ratio is the median of the pairs' ratios; the peak RSS with them against (base-only + their
arrays) x 1.1.
`LLAMA_SERVER` names llama.cpp's server, else one is built once with `llama-quantize`
(tests/bench/llama_cpp.py); `LLAMA_QUANTIZE` names the quantizer.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.bench.adapter_decode import admin, write_random_adapters
from tests.bench.concurrency import QUESTIONS, concurrent_chats
from tests.bench.llama_cpp import (
    ensure_llama_server,
    find_llama_quantize,
    llama_server_spec,
    quantize_gguf,
)
from tests.bench.prefill import complete, end_ids, long_prompt
from tests.bench.random_llama import Shape, ensure_random_llama
from tests.bench.servers import Sample, hotlora_bench_spec, kernels_isa, launch
from tests.support.server_process import ServerProcess, ServerSpec

CPU_MODELS = ("embedded", "q4km", "1b", "bigvocab")
DEFAULT_CPU_MODELS = ("embedded", "q4km", "1b")  # bigvocab when named
# Gemma 3 270M's sizes as a llama: its vocabulary, hidden width, layers and MLP.
BIG_VOCAB = Shape(hidden=640, layers=18, ffn=2048, heads=10, kv_heads=2, vocab=262144)
WARMUP_TOKENS = 8
ADAPTER_WARMUPS = 2  # untimed rounds of adapter rows and of base-only rows before the pairs
WARMUP_PROMPT_TOKENS = 300
RSS_POLL_S = 0.2
SETTLE_S, SETTLE_MOST_S = 0.5, 5.0  # RssWatch.peak_mb: the server's high-water mark settled
RSS_MARGIN = 1.1  # the adapters' peak RSS at most (base-only + their arrays) times this


@dataclass(frozen=True)
class Options:
    """The section's flags."""

    models: tuple[str, ...] = DEFAULT_CPU_MODELS
    streams: tuple[int, ...] = (1, 8, 16)
    tokens: int = 96
    prefill_tokens: int = 1250
    adapters: int = 16
    adapter_dtype: str = "auto"  # hotlora's --adapter-dtype
    rounds: int = 1
    adapter_pairs: int = 4  # timed pairs of adapter rows and base-only rows
    precisions: tuple[str, ...] = ("fast", "exact")  # hotlora's --cpu-precision, one run each
    isa: str = "auto"  # hotlora's --cpu-kernels-isa
    cache: Path = Path(os.environ.get("XDG_CACHE_HOME") or tempfile.gettempdir()) / "hotlora-bench"


@dataclass
class Streams:
    """One run of n concurrent streams."""

    samples: list[Sample]
    wall_s: float

    @property
    def aggregate(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall_s

    @property
    def decode(self) -> float:
        return statistics.median(s.decode_tok_s for s in self.samples)

    @property
    def ttft(self) -> float:
        return statistics.median(s.ttft_s for s in self.samples)


@dataclass
class SystemRun:
    """One server's figures on one model; lists hold one entry per round."""

    system: str
    streams: dict[int, list[Streams]] = field(default_factory=dict)
    prefill: list[tuple[float, int]] = field(default_factory=list)  # (seconds, prompt tokens)
    peak_rss_mb: float = 0.0
    adapter_rounds: list[tuple[Streams, Streams]] = field(default_factory=list)  # (adapters, base)
    adapters_rss_mb: float = 0.0
    # Base-only rows as many as the adapter rows, run to the steady state the adapter rows are
    # measured in (the prompt cache holding whole conversations of that length): the peak RSS
    # the adapters' is held to, and what their arrays hold (the server's ram_bytes, summed).
    steady_rss_mb: float = 0.0
    adapter_bytes_mb: float = 0.0

    def at(self, n: int, attr: str) -> float:
        """The median over rounds of one `Streams` figure at n streams."""
        return statistics.median(getattr(s, attr) for s in self.streams[n])

    @property
    def prefill_tok_s(self) -> float:
        return statistics.median(tokens / seconds for seconds, tokens in self.prefill)

    def short_rows(self, tokens: int) -> int:
        """Rows that stopped before `tokens` new tokens, over every run."""
        every = [one for rounds in self.streams.values() for one in rounds]
        every += [one for pair in self.adapter_rounds for one in pair]
        return sum(sample.tokens < tokens for one in every for sample in one.samples)


class RssWatch(threading.Thread):
    """Polls the resident memory of a process and its descendants; `peak_mb()` also takes the
    process's own high-water mark (VmHWM), which sees peaks between two polls."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.polled_kb = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(RSS_POLL_S):
            total = sum(_status_kb(pid, "VmRSS") for pid in _tree(self.pid))
            self.polled_kb = max(self.polled_kb, total)

    def peak_mb(self) -> float:
        """The peak so far, once the server has settled: a finished request's cache is kept for
        reuse (a copy) just after its response ends, so the high-water mark is read again until
        it has not moved for `SETTLE_S` (at most `SETTLE_MOST_S`)."""
        deadline = time.monotonic() + SETTLE_MOST_S
        mark = _status_kb(self.pid, "VmHWM")
        while time.monotonic() < deadline:
            time.sleep(SETTLE_S)
            again = _status_kb(self.pid, "VmHWM")
            if again == mark:
                break
            mark = again
        return max(self.polled_kb, mark) / 1024


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc's children lists."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the task ended meanwhile
                todo.extend(int(child) for child in task.read_text().split())
    return found


def prompts(tag: str, n: int) -> list[str]:
    """n distinct chat prompts: a line naming the run and row, so no prompt cache helps."""
    return [f"Request {tag}-{i}. {QUESTIONS[i % len(QUESTIONS)]}" for i in range(n)]


def special_ids(model_dir: Path) -> list[int]:
    """End-of-text and special token ids: biased away so that every row runs to the end (a
    random-weight model samples them as readily as any other)."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    added = [i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special]
    return sorted({*end_ids(model_dir), *added})


def no_stop_body(system: str, ids: Sequence[int]) -> dict[str, Any]:
    """The request fields that keep a row from stopping before its max_tokens."""
    body: dict[str, Any] = {"logit_bias": {str(i): -100 for i in ids}}
    if system == "llama-server":
        body["ignore_eos"] = True
    return body


def run_streams(
    server: ServerProcess, tag: str, n: int, tokens: int, extras: list[dict[str, Any]]
) -> Streams:
    samples, wall = concurrent_chats(server, prompts(tag, n), tokens, extras)
    return Streams(samples, wall)


def measure(
    server: ServerProcess,
    model_dir: Path,
    options: Options,
    adapter_ids: list[str],
    progress: Callable[[str], None],
) -> SystemRun:
    """Every figure of one server on one model (adapters on hotlora only)."""
    name = server.spec.name
    assert server.proc is not None
    watch = RssWatch(server.proc.pid)
    watch.start()
    run = SystemRun(name)
    body = no_stop_body(name, special_ids(model_dir))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    try:
        with httpx.Client() as client:
            for n in options.streams:  # every batch shape once, before any is timed
                run_streams(server, f"warm-up-{n}", n, WARMUP_TOKENS, [body] * n)
            complete(client, server, long_prompt(tokenizer, WARMUP_PROMPT_TOKENS, seed=-1))
            for round_ in range(options.rounds):
                for n in options.streams:
                    got = run_streams(server, f"{round_}-{n}", n, options.tokens, [body] * n)
                    run.streams.setdefault(n, []).append(got)
                    progress(
                        f"{name}, round {round_ + 1}: {n} stream{'s' * (n > 1)}, ttft "
                        f"{got.ttft:.2f}s, decode {got.decode:.1f} tok/s a stream, "
                        f"aggregate {got.aggregate:.1f} tok/s"
                    )
                long = long_prompt(tokenizer, options.prefill_tokens, seed=round_)
                seconds, prompt = complete(client, server, long)
                run.prefill.append((seconds, prompt))
                progress(
                    f"{name}, round {round_ + 1}: {prompt}-token prefill {prompt / seconds:.0f}"
                )
            run.peak_rss_mb = watch.peak_mb()
            if adapter_ids:
                measure_adapters(client, server, run, body, adapter_ids, options, progress, watch)
                run.adapters_rss_mb = watch.peak_mb()
    finally:
        watch.stop.set()
    return run


def measure_adapters(
    client: httpx.Client,
    server: ServerProcess,
    run: SystemRun,
    body: dict[str, Any],
    adapter_ids: list[str],
    options: Options,
    progress: Callable[[str], None],
    watch: RssWatch,
) -> None:
    """`ADAPTER_WARMUPS` runs of as many base-only rows as there are adapters, of full length,
    whose peak RSS (`steady_rss_mb`) the adapters' is held to: the same traffic as theirs,
    without them. Then mount the adapters, and `adapter_pairs` pairs of runs: a row for each
    adapter, and as many base-only rows.

    Both kinds first run twice, untimed, on prompts shaped as the timed ones (the same
    opening, then a tag of their own), so that each is timed in its steady state: the prompt
    cache and the prompt heads hold what earlier rounds left (base-only rows find the chat
    template's opening cached from their first run on, a row with an adapter of its own only
    once its set has a head). Pair p runs the adapter rows first when p is even and the
    base-only rows first when odd, so that a drift of the machine's speed during the pairs
    weighs on both kinds alike."""
    rows = len(adapter_ids)
    for steady in range(ADAPTER_WARMUPS):
        run_streams(server, f"s{steady}", rows, options.tokens, [body] * rows)
    run.steady_rss_mb = watch.peak_mb()
    for adapter_id in adapter_ids:
        admin(client, server, "POST", "/v1/adapters", json={"id": adapter_id, "path": adapter_id})
    listed = client.get(f"{server.url}/v1/adapters", timeout=30).json()["data"]
    run.adapter_bytes_mb = sum(card["ram_bytes"] for card in listed) / 2**20
    kinds = {"a": [{**body, "adapter": i} for i in adapter_ids], "b": [body] * rows}
    for warm in range(ADAPTER_WARMUPS):  # the timed prompts' tags: the same openings
        for kind, extras in kinds.items():
            run_streams(server, f"{kind}{warm}", rows, WARMUP_TOKENS, extras)
    for pair in range(options.adapter_pairs):
        order = "ab" if pair % 2 == 0 else "ba"
        tag = ADAPTER_WARMUPS + pair
        got = {
            kind: run_streams(server, f"{kind}{tag}", rows, options.tokens, kinds[kind])
            for kind in order
        }
        run.adapter_rounds.append((got["a"], got["b"]))
        progress(
            f"{run.system}, pair {pair + 1} ({order}): {rows} rows with {rows} adapters "
            f"{got['a'].aggregate:.1f} tok/s, base only {got['b'].aggregate:.1f} tok/s, "
            f"{got['a'].aggregate / got['b'].aggregate:.2f}x (first token {got['a'].ttft:.2f} / "
            f"{got['b'].ttft:.2f} s, decode {got['a'].decode:.1f} / {got['b'].decode:.1f} tok/s "
            "a stream)"
        )


@dataclass(frozen=True)
class Line:
    """One figure of the comparison: hotlora's and llama-server's (None: not measured)."""

    label: str
    hotlora: float | None
    llama: float | None
    digits: int = 1


def ratio_table(lines: Sequence[Line]) -> list[str]:
    """The figures side by side with hotlora / llama-server; '-' where one is missing."""

    def cell(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    width = max(len(line.label) for line in lines) + 2
    out = [f"{'':<{width}}{'hotlora':>10}{'llama-server':>14}{'hotlora/llama':>15}"]
    for line in lines:
        ratio = (
            f"{line.hotlora / line.llama:.2f}x" if line.hotlora is not None and line.llama else "-"
        )
        out.append(
            f"{line.label:<{width}}{cell(line.hotlora, line.digits):>10}"
            f"{cell(line.llama, line.digits):>14}{ratio:>15}"
        )
    return out


def comparison(runs: dict[str, SystemRun], options: Options) -> list[str]:
    """The table and notes for one model."""
    systems = (runs.get("hotlora"), runs.get("llama-server"))

    def line(label: str, value: Callable[[SystemRun], float], digits: int = 1) -> Line:
        hot, llama = (None if run is None else value(run) for run in systems)
        return Line(label, hot, llama, digits)

    lines: list[Line] = []
    for n in options.streams:
        streams = f"{n} stream{'s' * (n > 1)}"
        lines += [
            line(f"{streams}: first token s", partial(SystemRun.at, n=n, attr="ttft"), 2),
            line(f"{streams}: decode tok/s a stream", partial(SystemRun.at, n=n, attr="decode")),
            line(f"{streams}: aggregate tok/s", partial(SystemRun.at, n=n, attr="aggregate")),
        ]
    prompt = max((p for r in runs.values() for _, p in r.prefill), default=0)
    lines.append(line(f"{prompt}-token prefill tok/s", lambda r: r.prefill_tok_s, 0))
    lines.append(line("peak RSS MB", lambda r: r.peak_rss_mb, 0))
    notes: list[str] = []
    hot = systems[0]
    if hot is not None and hot.adapter_rounds:
        rows = len(hot.adapter_rounds[0][0].samples)
        ratio = statistics.median(a.aggregate / b.aggregate for a, b in hot.adapter_rounds)
        adapters = statistics.median(a.aggregate for a, _ in hot.adapter_rounds)
        base = statistics.median(b.aggregate for _, b in hot.adapter_rounds)
        pairs = ", ".join(f"{a.aggregate / b.aggregate:.2f}" for a, b in hot.adapter_rounds)
        notes.append(
            f"hotlora, {rows} rows with {rows} distinct rank-16 adapters "
            f"(--adapter-dtype {options.adapter_dtype}): {adapters:.1f} tok/s "
            f"aggregate, {ratio:.2f}x its base-only {rows} rows beside them ({base:.1f} tok/s; "
            f"median of {len(hot.adapter_rounds)} pairs: {pairs}); "
            f"peak RSS with them mounted {hot.adapters_rss_mb:.0f} MB"
        )
        if hot.steady_rss_mb:
            bound = (hot.steady_rss_mb + hot.adapter_bytes_mb) * RSS_MARGIN
            within = "within" if hot.adapters_rss_mb <= bound else "over"
            notes.append(
                f"hotlora, peak RSS: {hot.steady_rss_mb:.0f} MB after {ADAPTER_WARMUPS} runs of "
                f"{rows} base-only rows, {hot.adapters_rss_mb:.0f} MB with the adapters; their "
                f"arrays {hot.adapter_bytes_mb:.0f} MB; (base-only + arrays) x {RSS_MARGIN} = "
                f"{bound:.0f} MB: {within}"
            )
    if hot is not None and systems[1] is not None:
        notes.append(agreement(hot, systems[1]))
    for run in runs.values():
        if short := run.short_rows(options.tokens):
            notes.append(f"{run.system}: {short} rows stopped before {options.tokens} tokens")
    return ratio_table(lines) + notes


def agreement(hot: SystemRun, llama: SystemRun) -> str:
    """How far the two servers' greedy answers to the same prompts agree: with the same weights
    they open alike, then drift apart where float32 and llama.cpp's 8-bit activations round
    differently."""
    pairs = [
        (a.text, b.text)
        for n, rounds in hot.streams.items()
        for ours, theirs in zip(rounds, llama.streams.get(n, []), strict=False)
        for a, b in zip(ours.samples, theirs.samples, strict=True)
    ]
    if not pairs:
        return "greedy answers: no rows to compare"
    same = sum(a == b for a, b in pairs)
    prefix = statistics.median(len(os.path.commonprefix([a, b])) for a, b in pairs)
    return (
        f"greedy answers to the same prompts: {same}/{len(pairs)} identical, "
        f"common opening {prefix:.0f} characters (median)"
    )


@dataclass(frozen=True)
class CpuSection:
    title: str
    lines: list[str]


def model_pair(name: str, home: Path, cache: Path) -> tuple[str, Path, Path]:
    """(label, the mlx-lm directory hotlora serves, the GGUF llama-server serves)."""
    from hotlora.models.embedded import (
        embedded_gguf_path,
        ensure_embedded_model,
        ensure_gguf_model,
    )

    embedded = ensure_embedded_model(home, progress=print)
    if name == "embedded":
        return f"embedded model ({embedded.name})", embedded, embedded_gguf_path()
    if name == "q4km":
        quantizer = find_llama_quantize(cache)
        if quantizer is None:
            raise RuntimeError("no llama-quantize beside LLAMA_SERVER: set LLAMA_QUANTIZE")
        gguf = cache / "gguf" / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
        quantize_gguf(quantizer, embedded_gguf_path(), gguf, "Q4_K_M")
        return (
            "embedded model as llama.cpp's Q4_K_M (most layers Q5_0)",
            ensure_gguf_model(gguf, home, progress=print),
            gguf,
        )
    shape = BIG_VOCAB if name == "bigvocab" else Shape()
    built = ensure_random_llama(cache, shape, embedded, embedded_gguf_path())
    return f"random llama ({shape.name}, GGUF Q4_1 of the same codes)", built.model_dir, built.gguf


def run_cpu(home: Path, env: dict[str, str], options: Options) -> CpuSection:
    """Every model of `options`, hotlora then llama-server, one server at a time."""
    binary = ensure_llama_server(options.cache)
    most = max(options.streams)
    lines: list[str] = []
    if options.isa != "auto" and not os.environ.get("LLAMA_SERVER"):
        lines.append(
            f"note: hotlora on --cpu-kernels-isa {options.isa} beside a llama.cpp built natively "
            "(LLAMA_SERVER unset): not a comparison of like instructions"
        )
    for name in options.models:
        label, model_dir, gguf = model_pair(name, home, options.cache)
        adapter_root = options.cache / "adapters" / model_dir.parent.name / model_dir.name
        adapter_ids = [f"cpu-r16-{i}" for i in range(options.adapters * (name != "q4km"))]
        # adapter_config.json is written last: where it is, the adapter is whole.
        missing = {
            a: 100 + i
            for i, a in enumerate(adapter_ids)
            if not (adapter_root / a / "adapter_config.json").is_file()
        }
        if missing:
            print(f"writing {len(missing)} rank-16 adapters into {adapter_root}", flush=True)
            write_random_adapters(model_dir, adapter_root, missing)
        hot_args = [
            "--max-batch",
            str(max(most, options.adapters)),
            "--adapter-root",
            str(adapter_root),
            "--adapter-dtype",
            options.adapter_dtype,
            "--cpu-kernels-isa",
            options.isa,
        ]
        slot_context = options.prefill_tokens + options.tokens + 256
        hotlora = _with_args(hotlora_bench_spec(model_dir), hot_args)
        specs: list[tuple[ServerSpec, list[str]]] = [
            (
                _with_args(hotlora, ["--cpu-precision", precision], _hotlora_name(i, precision)),
                adapter_ids if i == 0 else [],
            )
            for i, precision in enumerate(options.precisions)
        ]
        specs.append((llama_server_spec(binary, gguf, most, slot_context), []))
        runs: dict[str, SystemRun] = {}
        with tempfile.TemporaryDirectory(prefix="hotlora-bench-") as logs:
            for spec, adapters in specs:
                print(f"{label}: starting {spec.name}", flush=True)
                (server,) = launch([spec], env, Path(logs))
                try:
                    runs[spec.name] = measure(server, model_dir, options, adapters, _progress)
                finally:
                    server.stop()
        for i, precision in enumerate(options.precisions):
            name = _hotlora_name(i, precision)
            pair = {"hotlora": runs[name], "llama-server": runs["llama-server"]}
            lines += [f"-- {label}, --cpu-precision {precision}", *comparison(pair, options)]
    title = (
        f"cpu: hotlora against llama.cpp's server, {options.tokens} new tokens a row, greedy, "
        f"rows run to the end (medians of {options.rounds} round{'s' * (options.rounds > 1)}); "
        f"{kernels_isa(options.isa)}"
    )
    return CpuSection(title, lines)


def _hotlora_name(index: int, precision: str) -> str:
    """The first precision's server is `hotlora` (the adapters' rows run there)."""
    return "hotlora" if index == 0 else f"hotlora-{precision}"


def _with_args(spec: ServerSpec, extra: list[str], name: str | None = None) -> ServerSpec:
    base = spec.argv
    return ServerSpec(name or spec.name, lambda port: [*base(port), *extra], spec.ready)


def _progress(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit("run through `python -m tests.bench --sections cpu`")
