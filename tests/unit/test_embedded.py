"""What `--model` names and the import cache under the home: a GGUF file known by its suffix in
any case or by its first bytes, a missing one told from a missing directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hotlora.config.settings import Settings
from hotlora.models.embedded import imported_gguf_path
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
