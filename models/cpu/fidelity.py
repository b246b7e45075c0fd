"""The default CPU path's fidelity on a model: measured, recorded, and read at start-up.

`--cpu-precision fast` quantizes each row's activations to int8. Its rule: on teacher-forced
prompts its logits are no further from mlx-lm's float32 run of the same weights than mlx-lm's
own bfloat16 run (what mlx-lm users on a Mac get), figure by figure (`Distance`), with no lower
top-1 agreement. `hotlora fidelity` measures both runs on a model (minutes: bfloat16 on a CPU is
slow) and records the verdict in the home (`<home>/fidelity/<fingerprint>.json`); `serve` reads
it at start-up, and a model whose fast path failed is served with the exact one, the log saying
why. A model with no verdict is served as asked, the log saying how to measure it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

if TYPE_CHECKING:
    from hotlora.models.cpu.layers import CpuPrecision

log = logging.getLogger("hotlora")

# Conversations as a chat client sends them, answers included: every position is scored.
CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
        {"role": "assistant", "content": "The capital of France is Paris, on the Seine."},
    ],
    [
        {"role": "user", "content": "Write a Python function that adds two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    ],
]
POSITIONS = 32  # of each conversation: the bfloat16 run on the CPU is slow


@dataclass(frozen=True)
class Distance:
    """How far a run's logits are from the float32 reference's over teacher-forced positions:
    max |difference| / max |reference logit| per position (median, 99th percentile, largest),
    the mean and largest KL divergence of its next-token distribution from the reference's,
    and the share of positions whose top token is the reference's."""

    median: float
    p99: float
    largest: float
    kl_mean: float
    kl_max: float
    top1: float

    def within(self, other: Distance) -> bool:
        """No further from the reference than `other` on any figure, and no lower top-1."""
        return (
            self.median <= other.median
            and self.p99 <= other.p99
            and self.largest <= other.largest
            and self.kl_mean <= other.kl_mean
            and self.kl_max <= other.kl_max
            and self.top1 >= other.top1
        )

    def __str__(self) -> str:
        return (
            f"relative max |d| median {self.median:.4f} p99 {self.p99:.4f} max {self.largest:.4f}"
            f", KL mean {self.kl_mean:.2e} max {self.kl_max:.2e}, top-1 {self.top1:.3f}"
        )


def _number(value: mx.array) -> float:
    return cast(float, value.item())


def distance(got: mx.array, reference: mx.array) -> Distance:
    """`Distance` of logits [..., vocab] from the reference's, position by position."""
    got = got.astype(mx.float32).reshape(-1, got.shape[-1])
    reference = reference.astype(mx.float32).reshape(-1, reference.shape[-1])
    relative = mx.abs(got - reference).max(axis=-1) / mx.abs(reference).max(axis=-1)
    log_p = reference - mx.logsumexp(reference, axis=-1, keepdims=True)
    log_q = got - mx.logsumexp(got, axis=-1, keepdims=True)
    kl = (mx.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    top1 = (mx.argmax(got, axis=-1) == mx.argmax(reference, axis=-1)).astype(mx.float32).mean()
    ordered = mx.sort(relative)
    n = ordered.size
    return Distance(
        median=_number(ordered[(n - 1) // 2]),
        p99=_number(ordered[min(n - 1, round(0.99 * (n - 1)))]),
        largest=_number(ordered[-1]),
        kl_mean=_number(kl.mean()),
        kl_max=_number(kl.max()),
        top1=_number(top1),
    )


def dequantized_reference(model: nn.Module) -> nn.Module:
    """`model` with every quantized layer dequantized in float32 (scale * value + bias, the
    values the packed kernels multiply by) and every parameter float32, in place; returns it."""
    plain_layers = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            continue
        assert module.biases is not None
        weight = mx.dequantize(
            module.weight,
            module.scales.astype(mx.float32),
            module.biases.astype(mx.float32),
            group_size=module.group_size,
            bits=module.bits,
        )
        if isinstance(module, nn.QuantizedEmbedding):
            plain: nn.Module = nn.Embedding(*weight.shape)
        else:
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                plain.bias = module.bias
        plain.weight = weight
        plain_layers.append((name, plain))
    model.update_modules(tree_unflatten(plain_layers))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@dataclass(frozen=True)
class Verdict:
    """One model's measure: the fast path's and mlx-lm bfloat16's distances from the float32
    reference, and whether the fast path keeps its rule."""

    model: str  # the model directory measured
    fingerprint: str
    fast: Distance
    bfloat16: Distance
    positions: int

    @property
    def holds(self) -> bool:
        return self.fast.within(self.bfloat16)

    def describe(self) -> str:
        return (
            f"int8 activations: {self.fast}; mlx-lm bfloat16: {self.bfloat16} "
            f"({self.positions} teacher-forced positions)"
        )


def fingerprint(model_dir: Path) -> str:
    """What names a model's weights: its config and its weight files' names, sizes and times
    (a model written again is measured again)."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _verdict_file(home: Path, fingerprint: str) -> Path:
    return home / "fidelity" / f"{fingerprint}.json"


def verdict_path(home: Path, model_dir: Path) -> Path:
    return _verdict_file(home, fingerprint(model_dir))


def record(home: Path, verdict: Verdict) -> Path:
    path = _verdict_file(home, verdict.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({**asdict(verdict), "holds": verdict.holds}, indent=2)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # two measures at once: two files
    partial.write_text(text + "\n")
    partial.replace(path)
    return path


def recorded(home: Path, model_dir: Path) -> Verdict | None:
    """The verdict recorded for these weights; None when there is none (or it cannot be read,
    which the log says)."""
    path = verdict_path(home, model_dir)
    if not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return Verdict(
            model=str(data["model"]),
            fingerprint=str(data["fingerprint"]),
            fast=_figures(data["fast"]),
            bfloat16=_figures(data["bfloat16"]),
            positions=int(data["positions"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("fidelity: the verdict %s cannot be read (%s): measuring again", path, exc)
        return None


def _figures(data: dict[str, Any]) -> Distance:
    """A recorded `Distance`: every figure a finite number, or ValueError."""
    figures = Distance(**data)
    for name, value in asdict(figures).items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(f"{name} is {value!r}, not a finite number")
    return figures


def serving_precision(asked: CpuPrecision, home: Path, model_dir: Path) -> CpuPrecision:
    """The precision to serve: `asked`, unless it is fast and this model's recorded verdict says
    the fast path fails its rule here; the log says which and why."""
    if asked != "fast":
        return asked
    verdict = recorded(home, model_dir)
    if verdict is None:
        log.info(
            "fidelity: the int8 path's distance from float32 is not measured on this model; "
            "`hotlora fidelity --model %s` measures it against mlx-lm's bfloat16 run "
            "(minutes on a CPU) and serve then keeps to its verdict",
            model_dir,
        )
        return asked
    if verdict.holds:
        log.info("fidelity: the int8 path keeps its rule on this model (%s)", verdict.describe())
        return asked
    log.warning(
        "fidelity: serving --cpu-precision exact: on this model the int8 path is further from "
        "mlx-lm's float32 logits than mlx-lm's bfloat16 run (%s; recorded in %s). "
        "`hotlora fidelity` measures it again",
        verdict.describe(),
        _verdict_file(home, verdict.fingerprint),
    )
    return "exact"


def teacher_forced(tokenizer: Any, positions: int = POSITIONS) -> mx.array:
    """The conversations' first `positions` tokens each [rows, positions], in the model's chat
    template, or as plain text where it has none."""
    rows = []
    for conversation in CONVERSATIONS:
        if getattr(tokenizer, "chat_template", None):
            tokens = list(tokenizer.apply_chat_template(conversation))
        else:
            text = "\n".join(f"{m['role']}: {m['content']}" for m in conversation)
            tokens = list(tokenizer.encode(text))
        if not tokens:
            raise ValueError("the tokenizer gives no token for the fidelity conversations")
        while len(tokens) < positions:  # a short template: the conversation again
            tokens += tokens
        rows.append(tokens[:positions])
    return mx.array(rows)


def forward(model: nn.Module, tokens: mx.array) -> mx.array:
    """Every position's logits of each row of `tokens` [B, L], one call, float32."""
    out = model(tokens, cache=make_prompt_cache(model)).astype(mx.float32)
    mx.eval(out)
    return out


def measure(
    model_dir: Path,
    threads: int | None = None,
    positions: int = POSITIONS,
    progress: Any = print,
) -> Verdict:
    """The fast path's and mlx-lm bfloat16's distances from the float32 reference on the
    model at `model_dir`: three loads of it, the reference's and bfloat16's runs before the
    packed kernels are installed."""
    from hotlora.models.cpu import extension, install_packed_kernels
    from hotlora.models.cpu.weights import has_gpu
    from hotlora.models.loader import load_model_dir

    if has_gpu():
        raise RuntimeError("MLX runs on a GPU here: the int8 path is the CPU's native kernels'")
    if (why := extension.unavailable()) is not None:
        raise RuntimeError(f"the native kernels cannot run here: {why}")
    loaded = load_model_dir(model_dir)
    tokens = teacher_forced(loaded.tokenizer, positions)
    progress(f"float32 reference: {tokens.size} positions")
    reference = forward(dequantized_reference(loaded.model), tokens)
    del loaded  # its float32 copy, before the next two loads
    progress("mlx-lm bfloat16 (the slow one on a CPU)")
    bfloat16 = load_model_dir(model_dir).model
    bfloat16.set_dtype(mx.bfloat16)
    bfloat16_logits = forward(bfloat16, tokens)
    progress("int8 activations (--cpu-precision fast)")
    fast = load_model_dir(model_dir).model
    state = install_packed_kernels(fast, threads=threads, precision="fast")
    if not state.enabled or "int8 activations" not in state.reason:
        raise RuntimeError(f"the packed kernels do not serve this model: {state.reason}")
    return Verdict(
        model=str(model_dir),
        fingerprint=fingerprint(model_dir),
        fast=distance(forward(fast, tokens), reference),
        bfloat16=distance(bfloat16_logits, reference),
        positions=int(tokens.size),
    )


def measured_rows(verdict: Verdict) -> Sequence[str]:
    """The verdict as `hotlora fidelity` prints it."""
    return [
        f"model: {verdict.model}",
        f"int8 activations (--cpu-precision fast): {verdict.fast}",
        f"mlx-lm bfloat16:                         {verdict.bfloat16}",
        f"verdict: the fast path {'keeps' if verdict.holds else 'breaks'} its rule "
        f"({verdict.positions} teacher-forced positions); serve uses "
        f"--cpu-precision {'fast' if verdict.holds else 'exact'} on this model",
    ]
