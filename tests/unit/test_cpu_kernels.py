"""The CPU kernels: the same bits as MLX's own, with the vector flags and the compiled softmax."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache

from hotlora.models.cpu import vector_jit
from hotlora.models.cpu.attention import cpu_attention, install_cpu_attention, softmax
from hotlora.models.cpu.vector_jit import JIT_FLAGS, enable_vector_jit, vector_jit_unavailable
from hotlora.models.loader import load_model_dir

from tests.support.tiny import write_tiny_llama

# (batch, query heads, kv heads, query length, key length, mask)
ATTENTION_CASES = [
    (1, 4, 4, 1, 9, None),
    (3, 6, 2, 1, 17, None),
    (2, 6, 2, 5, 5, "causal"),
    (2, 6, 3, 4, 11, "causal"),
    (4, 6, 2, 1, 13, "bool"),  # a left-padded batch: padding columns masked off
    (2, 4, 2, 3, 8, "bool"),
    (2, 6, 2, 1, 7, "additive"),
    (1, 4, 1, 6, 6, "bool-2d"),
    # The embedded model's heads (9 over 3), long caches and prompt chunks.
    (8, 9, 3, 1, 300, "bool"),
    (1, 9, 3, 48, 48, "causal"),
    (2, 9, 3, 32, 600, "bool"),
]


def attention_inputs(
    batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, mask: str | None, seed: int
) -> tuple[mx.array, mx.array, mx.array, mx.array | str | None]:
    key = mx.random.key(seed)
    kq, kk, kv, km = mx.random.split(key, 4)
    q = mx.random.normal((batch, heads, q_len, 16), key=kq) * 2
    k = mx.random.normal((batch, kv_heads, kv_len, 16), key=kk) * 2
    v = mx.random.normal((batch, kv_heads, kv_len, 16), key=kv)
    arr: mx.array | str | None = mask
    if mask == "bool":
        pads = mx.random.randint(0, kv_len - q_len + 1, (batch,), key=km)
        arr = (mx.arange(kv_len)[None, :] >= pads[:, None])[:, None, None, :]
        arr = mx.broadcast_to(arr, (batch, 1, q_len, kv_len))
    elif mask == "additive":
        arr = mx.random.normal((batch, 1, q_len, kv_len), key=km) * 3
    elif mask == "bool-2d":
        arr = mx.tril(mx.ones((q_len, kv_len), dtype=mx.bool_))
    return q, k, v, arr


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_attention_is_mlx_attention_bit_for_bit(case: tuple):
    q, k, v, mask = attention_inputs(*case, seed=len(str(case)))
    scale = 16**-0.5
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = cpu_attention(q, k, v, cache=None, scale=scale, mask=mask)
    assert got.shape == expected.shape
    assert mx.array_equal(got, expected).item()


# Query heads grouped as larger models group them (4 and 7 to a KV head, widths 64 and 128), a
# decode step and a prompt: one BLAS product of a group's rows takes other kernels than MLX's
# product per head, and gives other bits.
@pytest.mark.parametrize(
    "shape",
    [(1, 8, 2, 1, 50, 64), (1, 28, 4, 1, 77, 128), (1, 8, 2, 7, 50, 64), (1, 28, 4, 33, 33, 128)],
)
def test_grouped_heads_are_mlx_attention_bit_for_bit(shape: tuple[int, ...]):
    batch, heads, kv_heads, q_len, kv_len, width = shape
    kq, kk, kv = mx.random.split(mx.random.key(sum(shape)), 3)
    q = mx.random.normal((batch, heads, q_len, width), key=kq)
    k = mx.random.normal((batch, kv_heads, kv_len, width), key=kk)
    v = mx.random.normal((batch, kv_heads, kv_len, width), key=kv)
    mask = "causal" if q_len > 1 else None
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=width**-0.5, mask=mask)
    got = cpu_attention(q, k, v, cache=None, scale=width**-0.5, mask=mask)
    assert mx.array_equal(got, expected).item()


def test_softmax_is_mlx_softmax_bit_for_bit_on_masked_and_large_scores():
    scores = mx.random.normal((5, 3, 200), key=mx.random.key(3)) * 30
    lowest = mx.finfo(mx.float32).min
    scores = mx.where(mx.arange(200) % 7 == 0, mx.array(lowest), scores)
    scores[0, 0, :] = mx.array(lowest)  # a row masked whole: MLX's answer is uniform
    scores[1, 1, :5] = -mx.inf
    expected = mx.softmax(scores, axis=-1, precise=True)
    assert mx.array_equal(softmax(scores), expected).item()


def test_other_inputs_go_to_mlx_lms_attention():
    q, k, v, _ = attention_inputs(2, 4, 2, 3, 3, None, seed=1)
    sinks = mx.array([0.5, -1.0, 0.0, 2.0])
    expected = mlx_lm_base.scaled_dot_product_attention(
        q, k, v, cache=None, scale=0.25, mask="causal", sinks=sinks
    )
    got = cpu_attention(q, k, v, cache=None, scale=0.25, mask="causal", sinks=sinks)
    assert mx.array_equal(got, expected).item()
    half = [a.astype(mx.float16) for a in (q, k, v)]
    expected = mx.fast.scaled_dot_product_attention(*half, scale=0.25, mask="causal")
    got = cpu_attention(*half, cache=None, scale=0.25, mask="causal")
    assert got.dtype == mx.float16 and mx.array_equal(got, expected).item()


def test_a_model_with_cpu_attention_computes_the_same_logits(tmp_path: Path, monkeypatch):
    """Prefill (causal) and a left-padded batched decode (array mask), before and after."""
    # As mlx-lm leaves it, whatever models of this process had installed before.
    monkeypatch.setattr(
        llama, "scaled_dot_product_attention", mlx_lm_base.scaled_dot_product_attention
    )
    model = load_model_dir(write_tiny_llama(tmp_path / "tiny")).model
    model.set_dtype(mx.float32)
    prompts = mx.array([[5, 17, 3, 99, 42, 7], [0, 0, 8, 9, 60, 61], [0, 0, 0, 0, 4, 12]])

    def logits() -> list[mx.array]:
        cache = [BatchKVCache([0, 2, 4]) for _ in model.layers]
        out = [model(prompts, cache=cache)]
        for token in ([[1], [2], [3]], [[7], [7], [7]]):
            out.append(model(mx.array(token), cache=cache))
        mx.eval(out)
        return out

    before = logits()
    assert install_cpu_attention(model) == ["mlx_lm.models.llama"]
    assert llama.scaled_dot_product_attention is cpu_attention
    assert install_cpu_attention(model) == []  # already installed: nothing more to change
    after = logits()
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after, strict=True))


def test_no_vector_jit_without_the_cpu_features(tmp_path: Path, monkeypatch):
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the features are read on x86-64 Linux")
    monkeypatch.setattr(vector_jit, "cpu_features", lambda: {"sse2", "avx"})
    path, tmpdir = os.environ.get("PATH"), os.environ.get("TMPDIR")
    jit = enable_vector_jit(tmp_path)
    assert not jit.enabled and "lacks avx2, fma, f16c" in jit.reason
    assert (os.environ.get("PATH"), os.environ.get("TMPDIR")) == (path, tmpdir)
    assert not (tmp_path / "mlx-jit").exists()


def test_no_vector_jit_without_a_compiler(tmp_path: Path, monkeypatch):
    if vector_jit_unavailable() is not None:
        pytest.skip(vector_jit_unavailable())
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    jit = enable_vector_jit(tmp_path)
    assert not jit.enabled and "no g++" in jit.reason
    assert os.environ["PATH"] == str(tmp_path / "empty")


# Run in a fresh process: enabling sets that process's PATH and TMPDIR, and MLX keeps the
# kernels it built for the life of the process.
_UNDER_THE_FLAGS = """
import json, os, sys
from pathlib import Path
import mlx.core as mx
import mlx.nn as nn
from hotlora.models.cpu.attention import cpu_attention
from hotlora.models.cpu.vector_jit import enable_vector_jit

jit = enable_vector_jit(Path(sys.argv[1]))
x = mx.random.normal((4, 1, 1536), key=mx.random.key(0)) * 4
q = mx.random.normal((4, 6, 1, 16), key=mx.random.key(1)) * 3
k = mx.random.normal((4, 2, 40, 16), key=mx.random.key(2)) * 3
v = mx.random.normal((4, 2, 40, 16), key=mx.random.key(3))
mask = mx.arange(40)[None, None, None, :] >= mx.array([0, 3, 9, 30])[:, None, None, None]
silu = nn.silu(x)
half = x.astype(mx.float16)
silu_half = nn.silu(half)
attention = cpu_attention(q, k, v, cache=None, scale=0.25, mask=mask)
mx.eval(silu, silu_half, attention)
mx.disable_compile()
plain_silu = x * mx.sigmoid(x)
plain_silu_half = half * mx.sigmoid(half)
expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
kernels = sorted(p.name for p in Path(os.environ["TMPDIR"]).rglob("*.so"))
print(json.dumps({
    "enabled": jit.enabled,
    "reason": jit.reason,
    "path0": os.environ["PATH"].split(os.pathsep)[0],
    "kernels": kernels,
    "silu": mx.array_equal(silu, plain_silu).item(),
    "silu_half": mx.array_equal(silu_half, plain_silu_half).item(),
    "attention": mx.array_equal(attention, expected).item(),
}))
"""


def test_the_vector_jit_builds_kernels_with_the_flags_and_the_same_results(tmp_path: Path):
    if (reason := vector_jit_unavailable()) is not None:
        pytest.skip(reason)
    home = tmp_path / "home"
    run = subprocess.run(
        [sys.executable, "-c", _UNDER_THE_FLAGS, str(home)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout.strip().splitlines()[-1])
    root = home / "mlx-jit" / "avx2-fma-f16c"
    assert found["enabled"], found["reason"]
    assert found["path0"] == str(root / "bin")
    wrapper = (root / "bin" / "g++").read_text()
    assert wrapper.endswith(f'"$@" {" ".join(JIT_FLAGS)}\n') and os.access(
        root / "bin" / "g++", os.X_OK
    )
    # SiLU's kernel and the softmax's two, each built by the wrapper into the home.
    assert any("Sigmoid" in name for name in found["kernels"]), found["kernels"]
    assert any("Exp" in name for name in found["kernels"]), found["kernels"]
    assert found["silu"] and found["silu_half"] and found["attention"]
