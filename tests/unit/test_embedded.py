"""What `--model` names and the import cache under the home: a GGUF file known by its suffix in
any case or by its first bytes, a missing one told from a missing directory; an import leaves
no lock file, removes what a killed one left, and gives up writing nothing when told to stop."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from hotlora.config.settings import Settings
from hotlora.models import embedded
from hotlora.models.embedded import ensure_gguf_model, imported_gguf_path, stop_imports
from hotlora.models.gguf import ImportStopped
from hotlora.models.loader import ModelLoadError, load_model_dir
from hotlora.server.runtime import model_dir

from tests.support.gguf_files import write_tiny_gguf


def served(model: Path, home: Path) -> Path:
    return model_dir(Settings(model=model, home=home))


@pytest.mark.parametrize("name", ["MODEL.GGUF", "model.Gguf", "model.bin", "model"])
def test_a_gguf_file_is_imported_whatever_its_name(tmp_path, name):
    src = tmp_path / name
    write_tiny_gguf(src)
    path = served(src, tmp_path / "home")
    assert path == imported_gguf_path(tmp_path / "home", src)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.parametrize("name", ["nowhere.gguf", "NOWHERE.GGUF"])
def test_a_missing_gguf_file_is_refused_as_a_file(tmp_path, name):
    with pytest.raises(ModelLoadError) as refused:
        served(tmp_path / name, tmp_path / "home")
    assert str(refused.value) == (
        f"GGUF file {tmp_path / name} does not exist: check the path given as the model"
    )
    assert not (tmp_path / "home").exists()


def test_a_missing_directory_is_refused_as_a_directory(tmp_path):
    path = served(tmp_path / "nowhere", tmp_path / "home")
    with pytest.raises(ModelLoadError, match=f"model directory {path} does not exist"):
        load_model_dir(path)


def test_a_file_neither_gguf_nor_a_directory_says_what_to_give(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 not a model")
    path = served(tmp_path / "model.bin", tmp_path / "home")
    with pytest.raises(ModelLoadError) as refused:
        load_model_dir(path)
    assert str(refused.value) == (
        f"model path {path} is neither a model directory nor a GGUF file (one starts with the "
        "bytes GGUF): give the model's directory or its .gguf file"
    )


def test_a_directory_named_gguf_is_read_as_a_directory(tmp_path):
    (tmp_path / "dir.gguf").mkdir()
    path = served(tmp_path / "dir.gguf", tmp_path / "home")
    assert path == tmp_path / "dir.gguf"
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model_dir(path)


@pytest.fixture
def stopping(monkeypatch) -> threading.Event:
    """A stop flag of this test's own: `stop_imports` sets it for the whole process."""
    event = threading.Event()
    monkeypatch.setattr(embedded, "_stopping", event)
    return event


def test_an_import_leaves_no_lock_file(tmp_path):
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src)
    dest = ensure_gguf_model(src, tmp_path / "home")
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]


def test_what_a_killed_import_left_is_removed_by_the_next(tmp_path, caplog):
    """Every writer of the folder holds its lock, so a partial folder found under it is one no
    process still writes; another folder's partial one, and one newer than the import, stay."""
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src)
    home = tmp_path / "home"
    dest = imported_gguf_path(home, src)
    dest.parent.mkdir(parents=True)
    left = dest.parent / f".{dest.name}.k1ll3d_x.partial"
    (left / "sub").mkdir(parents=True)
    (left / "sub" / "model.safetensors").write_bytes(b"half")
    hour_ago = time.time() - 3600
    os.utime(left, (hour_ago, hour_ago))
    other = dest.parent / f".{dest.name}-other.k1ll3d_y.partial"
    other.mkdir()
    os.utime(other, (hour_ago, hour_ago))
    newer = dest.parent / f".{dest.name}.n3wer_zz.partial"
    newer.mkdir()
    later = time.time() + 3600
    os.utime(newer, (later, later))
    with caplog.at_level(logging.INFO, logger="hotlora"):
        assert ensure_gguf_model(src, home) == dest
    assert sorted(p.name for p in dest.parent.iterdir()) == sorted(
        [dest.name, other.name, newer.name]
    )
    assert f"removed {left}, left by an import that did not finish" in caplog.text


def test_an_import_told_to_stop_gives_up_writing_nothing(tmp_path, stopping):
    """As the server does on SIGTERM or Ctrl-C: the import ends at its next tensor, and the
    home holds no model, whole or partial (the lock file stays: see `_import_once`)."""
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src)
    home = tmp_path / "home"
    under_way = []

    def progress(message: str) -> None:
        if message.startswith("importing"):
            under_way.append(stop_imports())

    with pytest.raises(ImportStopped) as caught:
        ensure_gguf_model(src, home, progress=progress)
    assert str(caught.value) == f"the import of {src} was stopped before it finished"
    assert under_way == [True]
    assert not stop_imports()  # none under way now
    dest = imported_gguf_path(home, src)
    assert [p.name for p in dest.parent.iterdir()] == [f".{dest.name}.lock"]
