"""The `hotlora` command line: help on every command, clear failures, real conversions."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from hotlora.models.cpu.fidelity import record, recorded, verdict_path
from hotlora.models.loader import load_model_dir

from tests.support.adapter_builders import (
    random_pairs,
    tiny_model,
    write_mlx_adapter,
    write_peft_adapter,
)
from tests.support.gguf_models import write_family_gguf
from tests.support.server_process import ServerProcess, hotlora_spec
from tests.support.tiny import is_quantized, write_tiny_llama

pytestmark = pytest.mark.e2e


def hotlora(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hotlora.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "command", ["serve", "import-gguf", "quantize", "fuse", "fidelity", "keys"]
)
def test_every_command_has_help(command: str):
    result = hotlora(command, "--help")
    assert result.returncode == 0
    assert f"usage: hotlora {command}" in result.stdout


def test_top_level_help_lists_the_commands():
    result = hotlora("--help")
    assert result.returncode == 0
    for command in ("serve", "import-gguf", "quantize", "fuse", "fidelity", "keys"):
        assert command in result.stdout


def test_import_of_a_file_that_is_not_gguf_fails_cleanly(tmp_path: Path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    result = hotlora("import-gguf", str(bogus), str(tmp_path / "out"))
    assert result.returncode == 1
    assert result.stderr.startswith("hotlora import-gguf: ")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_import_of_another_architecture_names_it(tmp_path: Path):
    write_family_gguf(tmp_path / "m.gguf", "qwen2", arch="mamba")
    result = hotlora("import-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"hotlora import-gguf: {tmp_path / 'm.gguf'}: architecture 'mamba' is not supported"
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_serve_imports_a_gguf_file_and_answers_under_its_name(tmp_path: Path):
    # Phi-3: fused quantized projections and a sentencepiece vocabulary, through a real server.
    write_family_gguf(tmp_path / "tiny-phi3.Q4_0.gguf", "phi3")
    spec = hotlora_spec("--model", str(tmp_path / "tiny-phi3.Q4_0.gguf"), "--home", str(tmp_path))
    with ServerProcess(spec, log_dir=tmp_path) as server:
        assert server.model_id == "tiny-phi3.Q4_0"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "the world"}],
            max_tokens=6,
            temperature=0,
        )
    assert answer.usage is not None and answer.usage.completion_tokens == 6
    assert answer.choices[0].finish_reason == "length"
    assert [p.name for p in (tmp_path / "models").glob("gguf-v*/tiny-phi3.Q4_0-*")]


def test_serve_of_a_gguf_of_another_architecture_exits_naming_it(tmp_path: Path):
    write_family_gguf(tmp_path / "m.gguf", "qwen2", arch="mamba")
    result = hotlora(
        "serve", "--model", str(tmp_path / "m.gguf"), "--port", "0", "--home", str(tmp_path)
    )
    assert result.returncode == 1
    assert f"could not start: {tmp_path / 'm.gguf'}: architecture 'mamba'" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_the_model_s_import_stops_it_writing_nothing(tmp_path: Path, sig):
    """The import gives up at its next tensor, rather than holding the exit until it ends and
    then writing an import no one serves; the exit status says the start failed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "hotlora.server.cli", "serve", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HOTLORA_HOME": str(tmp_path)},
    )
    assert process.stderr is not None
    for line in process.stderr:
        if "hotlora: importing" in line:
            break
    process.send_signal(sig)
    began = time.monotonic()
    _, err = process.communicate(timeout=60)
    assert time.monotonic() - began < 20  # the whole import takes longer on these machines
    assert process.returncode == 1
    assert err.endswith(
        "hotlora: could not start: a signal stopped the model's import; nothing of it was kept\n"
    )
    cache = tmp_path / "models" / "gguf-v3"
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_serve_with_a_missing_model_exits_with_the_reason(tmp_path: Path):
    result = hotlora(
        "serve", "--model", str(tmp_path / "nowhere"), "--port", "0", "--home", str(tmp_path)
    )
    assert result.returncode == 1
    assert "could not start" in result.stderr and "does not exist" in result.stderr


def test_serve_refuses_a_bad_keys_file_in_one_line(tmp_path: Path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "acme"\nsha256 = "' + "ab" * 32 + '"\nrole = "owner"\n')
    result = hotlora("serve", "--keys", str(keys), "--port", "0")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hotlora serve: keys file {keys}: key[0].role: Input should be")
    assert "Traceback" not in result.stderr and "ab" * 32 not in result.stderr


def test_serve_refuses_a_bad_adapter_flag():
    result = hotlora("serve", "--adapter", "no-equals-sign")
    assert result.returncode == 2
    assert "expected NAME=PATH" in result.stderr


def test_quantize_then_fuse(tmp_path: Path):
    float_dir = write_tiny_llama(tmp_path / "float")
    quantized = tmp_path / "q8"
    result = hotlora(
        "quantize", str(float_dir), str(quantized), "--bits", "8", "--group-size", "32"
    )
    assert result.returncode == 0, result.stderr
    assert is_quantized(load_model_dir(quantized).model)
    adapter = write_mlx_adapter(tmp_path / "adapter", random_pairs(tiny_model(quantize=True)))
    fused = tmp_path / "fused"
    result = hotlora("fuse", "--model", str(quantized), "--adapter", str(adapter), str(fused))
    assert result.returncode == 0, result.stderr
    assert (fused / "tokenizer.json").read_bytes() == (float_dir / "tokenizer.json").read_bytes()
    assert is_quantized(load_model_dir(fused).model)
    # An adapter refused, or not there: one line saying why.
    dora = write_peft_adapter(tmp_path / "dora", random_pairs(tiny_model(quantize=True)))
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    missing = tmp_path / "none"
    for refused, words in [(dora, "DoRA adapters (use_dora)"), (missing, "does not exist")]:
        out = tmp_path / "refused"
        result = hotlora("fuse", "--model", str(quantized), "--adapter", str(refused), str(out))
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("hotlora fuse: ") and words in line
        assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--threads", "0"], "--threads: must be between 1 and 256 (got 0)"),
        (["--positions", "1"], "--positions is at least 2"),
    ],
)
def test_fidelity_refuses_what_serve_would_in_one_line(flags: list[str], line: str):
    result = hotlora("fidelity", *flags)
    assert result.returncode == 1
    assert result.stderr == f"hotlora fidelity: {line}\n"


def test_fidelity_records_a_verdict_and_serve_keeps_to_it(tmp_path: Path):
    """`hotlora fidelity` measures a 4-bit model and records its verdict in the home; a server
    on a model whose recorded verdict says int8 activations break their rule serves exact."""
    model = write_tiny_llama(tmp_path / "tiny", quantize=True)
    home = tmp_path / "home"
    result = subprocess.run(
        [sys.executable, "-m", "hotlora.server.cli", "fidelity", "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HOTLORA_HOME": str(home)},
    )
    assert result.returncode == 0, result.stderr
    assert "verdict: the fast path keeps its rule (64 teacher-forced positions)" in result.stdout
    verdict = recorded(home, model)
    assert verdict is not None and verdict.holds
    assert f"recorded in {verdict_path(home, model)}" in result.stdout

    # What a model on which int8 is further from float32 than bfloat16 records.
    closer = dataclasses.replace(verdict.bfloat16, largest=verdict.fast.largest / 2)
    record(home, dataclasses.replace(verdict, bfloat16=closer))
    with ServerProcess(hotlora_spec("--model", str(model)), env={"HOTLORA_HOME": str(home)}) as srv:
        log = srv.log(400)
        answer = httpx.post(
            f"{srv.url}/v1/completions",
            json={"model": srv.model_id, "prompt": "hello", "max_tokens": 2},
            timeout=60,
        )
    assert answer.status_code == 200, answer.text
    assert "fidelity: serving --cpu-precision exact" in log
    assert "activations in three int8 parts, integer dot products (--cpu-precision exact)" in log
