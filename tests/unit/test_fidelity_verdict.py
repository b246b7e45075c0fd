"""The fast path's fidelity verdict on a model: measured against mlx-lm's float32 and bfloat16
runs of a real (tiny, 4-bit) model, recorded in the home, and kept to at start-up."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from hotlora.models.cpu import extension
from hotlora.models.cpu.fidelity import (
    Verdict,
    fingerprint,
    measure,
    record,
    recorded,
    serving_precision,
    verdict_path,
)

from tests.support.tiny import write_tiny_llama

if (_why := extension.unavailable()) is not None:
    pytest.skip(f"packed kernels: {_why}", allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), quantize=True)


@pytest.fixture(scope="module")
def verdict(model_dir: Path) -> Verdict:
    return measure(model_dir, threads=2, positions=16, progress=lambda _: None)


def broken(verdict: Verdict) -> Verdict:
    """The measured verdict with bfloat16's largest difference half the int8 path's: what a
    model on which int8 activations are further from float32 than bfloat16 records."""
    closer = dataclasses.replace(verdict.bfloat16, largest=verdict.fast.largest / 2)
    return dataclasses.replace(verdict, bfloat16=closer)


def test_a_measure_sets_the_int8_path_and_bfloat16_against_float32(verdict: Verdict, model_dir):
    print(f"\n{verdict.describe()}")
    assert verdict.model == str(model_dir)
    assert verdict.fingerprint == fingerprint(model_dir)
    assert verdict.positions == 32  # two conversations, 16 positions each
    assert verdict.fast.largest > 1e-4  # int8 activations move the logits
    assert verdict.bfloat16.largest > 1e-4  # and so does bfloat16
    assert 0 < verdict.fast.top1 <= 1 and 0 < verdict.bfloat16.top1 <= 1
    # The tiny llama keeps the rule (tests/unit/test_cpu_precision.py measures it too).
    assert verdict.holds
    assert not broken(verdict).holds


def test_a_verdict_is_recorded_and_read_back(tmp_path: Path, verdict: Verdict, model_dir: Path):
    assert recorded(tmp_path, model_dir) is None
    path = record(tmp_path, verdict)
    assert path == verdict_path(tmp_path, model_dir)
    assert recorded(tmp_path, model_dir) == verdict


def test_weights_written_again_have_no_verdict(tmp_path: Path, verdict: Verdict):
    again = write_tiny_llama(tmp_path / "tiny")
    first = fingerprint(again)
    record(tmp_path, dataclasses.replace(verdict, model=str(again), fingerprint=first))
    assert recorded(tmp_path, again) is not None
    write_tiny_llama(again, seed=1)  # other weights under the same name
    assert fingerprint(again) != first
    assert recorded(tmp_path, again) is None


def test_serve_keeps_the_fast_path_where_it_holds_and_says_how_to_measure_it_else(
    tmp_path: Path, verdict: Verdict, model_dir: Path, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="hotlora"):
        assert serving_precision("fast", tmp_path, model_dir) == "fast"
    assert f"`hotlora fidelity --model {model_dir}` measures it" in caplog.text
    caplog.clear()
    record(tmp_path, verdict)
    with caplog.at_level(logging.INFO, logger="hotlora"):
        assert serving_precision("fast", tmp_path, model_dir) == "fast"
    assert "the int8 path keeps its rule on this model" in caplog.text


def test_a_model_whose_int8_path_breaks_its_rule_is_served_exact(
    tmp_path: Path, verdict: Verdict, model_dir: Path, caplog: pytest.LogCaptureFixture
):
    record(tmp_path, broken(verdict))
    with caplog.at_level(logging.INFO, logger="hotlora"):
        assert serving_precision("fast", tmp_path, model_dir) == "exact"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = warning.getMessage()
    assert text.startswith("fidelity: serving --cpu-precision exact")
    assert f"max {verdict.fast.largest:.4f}" in text  # the figures that decided it
    assert str(verdict_path(tmp_path, model_dir)) in text
    assert serving_precision("exact", tmp_path, model_dir) == "exact"


@pytest.mark.parametrize("damage", ["truncated", "null figure", "NaN figure"])
def test_an_unreadable_verdict_is_said_and_left_aside(
    tmp_path: Path,
    verdict: Verdict,
    model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    damage: str,
):
    path = record(tmp_path, broken(verdict))
    text = path.read_text()
    if damage == "truncated":
        text = text[: len(text) // 2]
    else:
        data = json.loads(text)
        data["bfloat16"]["kl_max"] = None if damage == "null figure" else float("nan")
        text = json.dumps(data)
    path.write_text(text)
    with caplog.at_level(logging.INFO, logger="hotlora"):
        assert serving_precision("fast", tmp_path, model_dir) == "fast"
    assert f"the verdict {path} cannot be read" in caplog.text
