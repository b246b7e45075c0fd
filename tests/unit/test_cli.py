"""The `hotlora` command's failures: one line naming what is wrong, never a traceback, never an
empty message; SIGTERM stops an offline command as Ctrl-C does."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import hotlora.models.gguf as gguf_module
from hotlora.config.log_text import one_line
from hotlora.server.cli import main

from tests.support.gguf_files import write_tiny_gguf


def test_a_gguf_with_no_heads_is_refused_in_one_line(tmp_path, capsys):
    """It was a ZeroDivisionError's traceback."""
    src = tmp_path / "heads0.gguf"
    write_tiny_gguf(src)
    data = src.read_bytes()
    key = b"llama.attention.head_count\x04\x00\x00\x00"  # a uint32 value follows
    at = data.index(key) + len(key)
    src.write_bytes(data[:at] + (0).to_bytes(4, "little") + data[at + 4 :])
    assert main(["import-gguf", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"hotlora import-gguf: {src}: llama.attention.head_count is 0, not a whole number above "
        "0; the file is damaged or was not written by llama.cpp's converter: get it again\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("raised", "told"),
    [
        (MemoryError(), "MemoryError"),
        (
            ZeroDivisionError("integer division by zero"),
            "ZeroDivisionError: integer division by zero",
        ),
        (ValueError("first\n  second\n"), "first second"),
        (RuntimeError(""), "RuntimeError"),
    ],
    ids=["empty", "unexpected", "lines", "empty-runtime"],
)
def test_any_failure_is_told_in_one_line_never_empty(tmp_path, capsys, monkeypatch, raised, told):
    def fail(src: Path, dest: Path) -> Path:
        raise raised

    monkeypatch.setattr(gguf_module, "import_gguf", fail)
    assert main(["import-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"hotlora import-gguf: {told}\n"
    assert one_line(raised) == told


def test_sigterm_stops_an_import_as_ctrl_c_does(tmp_path, capsys, monkeypatch):
    """The import's directory is removed on the way out (`atomic_model_dir`); the exit status
    says it was interrupted, and the process's own SIGTERM handler is back afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    reached = []

    def killed(src: Path, dest: Path) -> Path:
        reached.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(gguf_module, "import_gguf", killed)
    assert main(["import-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 130
    assert reached == [True]
    assert capsys.readouterr().err == "hotlora import-gguf: interrupted\n"
    assert signal.getsignal(signal.SIGTERM) == before
