"""Files of a model directory: weight shards, auxiliary files copied verbatim, atomic writes."""

from __future__ import annotations

import json
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import make_shards

# Files a converted model keeps byte for byte: the tokenizer and its templates, generation
# defaults, the model card. Any other `*.model` file (SentencePiece) is kept as well.
AUX_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "README.md",
    "kv_config.json",
)


def copy_aux_files(src_dir: Path, dest_dir: Path) -> list[str]:
    """Copy the auxiliary files present in `src_dir` into `dest_dir`; return their names, sorted."""
    src_dir, dest_dir = Path(src_dir), Path(dest_dir)
    names = {name for name in AUX_FILES if (src_dir / name).is_file()}
    names.update(p.name for p in src_dir.glob("*.model") if p.is_file())
    for name in sorted(names):
        shutil.copyfile(src_dir / name, dest_dir / name)
    return sorted(names)


@contextmanager
def atomic_model_dir(dest: Path) -> Iterator[Path]:
    """Yield an empty directory that becomes `dest` only if the block finishes.

    The directory is a sibling of `dest` (same filesystem, so the final rename is atomic); on an
    exception it is removed, so a reader never finds a half-written model at `dest`. An existing
    non-empty `dest` is refused rather than overwritten; an empty one is replaced.
    """
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} already exists and is not empty; choose another path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is not
    try:
        yield tmp
        if dest.exists():
            dest.rmdir()
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_partial_dirs(dest: Path, older_than: float) -> list[Path]:
    """Remove the directories `atomic_model_dir` left beside `dest` from writes that never
    finished (a process killed in the middle), those last changed before `older_than` (a
    `time.time()`); return them. Only for a caller that knows their writers are gone, such as
    one holding the lock every writer of `dest` holds."""
    own = re.compile(rf"\.{re.escape(dest.name)}\.[^.]+\.partial")  # mkdtemp's names
    removed = []
    for path in sorted(dest.parent.iterdir()) if dest.parent.is_dir() else []:
        if own.fullmatch(path.name) and path.is_dir() and path.stat().st_mtime < older_than:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def safetensors_names(file: Path) -> list[str]:
    """The tensor names of a safetensors file, read from its header alone; raises ValueError
    saying what is wrong where the file is not a whole one (empty, cut short, its header not
    JSON, a tensor's data past its end), as a download that stopped leaves it."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        if size < 8:
            raise ValueError(f"is {size} bytes long, too short for a safetensors header")
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > size:
            raise ValueError("is cut short: its header runs past the end of the file")
        try:
            header = json.loads(f.read(length))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ValueError("is not a safetensors file: its header is not one") from None
    if 8 + length + max(ends, default=0) > size:
        raise ValueError("is cut short: its tensors run past the end of the file")
    return [name for name in header if name != "__metadata__"]


def layers_in(names: list[str]) -> int | None:
    """How many layers tensors named `...layers.N....` make (the highest N + 1); None where
    none is named so."""
    numbers = [int(m.group(1)) for n in names if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n))]
    return max(numbers) + 1 if numbers else None


def save_weights(weights: dict[str, mx.array], dest: Path) -> None:
    """Write safetensors shards and their index the way `mlx_lm.utils.save_model` names them."""
    shards = make_shards(weights)
    index: dict[str, Any] = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {},
    }
    for i, shard in enumerate(shards):
        name = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        mx.save_safetensors(str(dest / name), shard, metadata={"format": "mlx"})
        index["weight_map"].update(dict.fromkeys(shard, name))
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
