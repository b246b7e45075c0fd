"""Import a GGUF file (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3) as an mlx-lm model
directory, keeping its quantization.

The header is read here and the tensors one at a time (`gguf_tensors`): quantized ones become
MLX affine triplets (group size 32) with the bits their type takes, so a mixed file such as
Q4_K_M gives a per-layer `quantization` in config.json. `mx.load` is not used: it dequantizes
K-quants to float16 (the whole model at once), drops some newer types and narrows BF16.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, Keys
from mlx_lm.utils import save_config

from hotlora.config.errors import HotloraError
from hotlora.models.gguf_checks import check_metadata, check_not_split, check_shapes, check_whole
from hotlora.models.gguf_families import (
    TOP_LEVEL_NAMES,
    Family,
    Metadata,
    UnsupportedGGUF,
    family_of,
    longrope_scaling,
)
from hotlora.models.gguf_header import GGUFHeader, read_header
from hotlora.models.gguf_tensors import GROUP_SIZE, SUPPORTED_TYPES, read_tensor, tensor_bytes
from hotlora.models.gguf_tokenizer import UnsupportedTokenizer, write_tokenizer_files
from hotlora.models.loader import DEFAULT_CONTEXT_LENGTH
from hotlora.models.model_files import atomic_model_dir, save_weights
from hotlora.models.progress import bar, evaluate

Q = GGMLQuantizationType
log = logging.getLogger("hotlora")
__all__ = ["ImportStopped", "UnsupportedGGUF", "check_whole", "import_gguf", "read_header"]


class ImportStopped(HotloraError):
    """An import given up before it finished (the process is stopping); nothing was written."""


def _check_stopped(src: Path, stopped: Callable[[], bool] | None) -> None:
    """Raise `ImportStopped` for the import of `src` once `stopped()` is true."""
    if stopped is not None and stopped():
        raise ImportStopped(f"the import of {src} was stopped before it finished")


def _type_name(kind: int) -> str:
    try:
        return Q(kind).name
    except ValueError:
        return f"type id {kind}"


def _check_supported(header: GGUFHeader) -> Family:
    arch = header.metadata.get("general.architecture")
    family = family_of(arch)
    if "token_embd.weight" not in header.tensors:
        raise UnsupportedGGUF("GGUF has no token_embd.weight tensor")
    _check_vocabulary(header)
    if header.metadata.get(f"{arch}.expert_count", 0):
        raise UnsupportedGGUF(f"mixture-of-experts {arch} models are not supported")
    bad: dict[str, list[str]] = {}
    for name, info in header.tensors.items():
        if info.type not in SUPPORTED_TYPES:
            bad.setdefault(_type_name(info.type), []).append(name)
    if bad:
        found = "; ".join(
            f"{kind} ({names[0]}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
            for kind, names in bad.items()
        )
        allowed = ", ".join(t.name for t in SUPPORTED_TYPES)
        why = (
            " (IQ types pick each value from a codebook, which MLX's affine quantization cannot"
            " hold: use a K-quant or Q8_0 file of the model)"
            if any(kind.startswith("IQ") for kind in bad)
            else ""
        )
        raise UnsupportedGGUF(f"unsupported tensor type: {found}{why}. Supported types: {allowed}")
    return family


def _check_vocabulary(header: GGUFHeader) -> None:
    """Refuse a token list that is not one token a row of the embedding and of an untied output
    head, as llama.cpp does at load: an id past either list has no text or no logit."""
    tokens = header.metadata.get(Keys.Tokenizer.LIST)
    if not isinstance(tokens, list) or not tokens:
        raise UnsupportedGGUF(f"GGUF has no vocabulary ({Keys.Tokenizer.LIST})")
    for name in ("token_embd.weight", "output.weight"):
        if (info := header.tensors.get(name)) is not None and info.shape[:1] != (len(tokens),):
            rows = info.shape[0] if info.shape else 0
            raise UnsupportedGGUF(
                f"{name} has {rows:,} rows for a vocabulary of {len(tokens):,} tokens "
                f"({Keys.Tokenizer.LIST}); llama.cpp refuses such a file too"
            )


# Meta's Llama 3.1 rope scaling constants; the releases since differ only in the factor.
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama3_rope_scaling(rope_factors: np.ndarray, base: float, head_dim: int) -> dict:
    """Recover the Llama 3 rope scaling that llama.cpp baked into its `rope_freqs` tensor.

    llama.cpp keeps only the per-frequency divisors; mlx-lm wants the parameters. The factor is
    the largest divisor; the other three are Meta's constants, checked against the tensor.
    """
    factor = float(rope_factors.max())
    low, high = LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"]
    old = LLAMA3_ROPE["original_max_position_embeddings"]
    wavelens = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)  # [head_dim // 2]
    smooth = (old / wavelens - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    expected = np.where(wavelens < old / high, 1.0, np.where(wavelens > old / low, factor, medium))
    if rope_factors.shape != expected.shape or not np.allclose(rope_factors, expected, rtol=1e-3):
        raise UnsupportedGGUF("rope_freqs tensor does not match Llama 3 rope scaling")
    return {"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE}


def model_config(
    header: GGUFHeader, family: Family, settings: dict[str, np.ndarray], src: Path | None = None
) -> dict[str, Any]:
    """The mlx-lm `config.json` (without quantization) described by the GGUF metadata.

    `settings` holds the family's setting tensors found in the file (llama's `rope_freqs`,
    Phi-3's long-context rope factors), as float32. A context length of 0 becomes the
    server's default, with a warning naming the file `src`.
    """
    meta = Metadata(header.metadata, header.metadata["general.architecture"])
    if meta.get("context_length") == 0:
        log.warning(
            "%s: %s.context_length is 0, which states no context length: the import takes "
            "%d tokens, the server's default",
            src or "GGUF",
            meta.arch,
            DEFAULT_CONTEXT_LENGTH,
        )
    config = {
        "model_type": family.model_type,
        "architectures": [family.architecture],
        **family.config(meta, header.tensors),
    }
    if family.always_tied and not config["tie_word_embeddings"]:
        raise UnsupportedGGUF(
            f"{meta.arch} always reads logits through its embedding; "
            "this GGUF has a separate output.weight"
        )
    if (rope_factors := settings.get("rope_freqs.weight")) is not None:
        head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
        config["rope_scaling"] = _llama3_rope_scaling(rope_factors, config["rope_theta"], head_dim)
    long, short = (
        settings.get("rope_factors_long.weight"),
        settings.get("rope_factors_short.weight"),
    )
    if long is not None and short is not None:
        config["rope_scaling"] = longrope_scaling(meta, config, long, short)
    elif long is not None or short is not None:
        raise UnsupportedGGUF("GGUF has only one of rope_factors_long and rope_factors_short")
    return config


def _mlx_path(gguf_base: str, family: Family) -> str | None:
    """`blk.3.attn_q` -> `model.layers.3.self_attn.q_proj`; None for a name the family lacks."""
    if gguf_base in TOP_LEVEL_NAMES:
        return TOP_LEVEL_NAMES[gguf_base]
    parts = gguf_base.split(".")
    names = family.layer_names
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def _unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's rotary row order: per head it stores rows [d/2, 2] for mlx-lm's [2, d/2].

    Whole rows move, so a quantized weight, its scales and its biases all take the same call.
    """
    rest = x.shape[1:]
    return x.reshape(n_head, -1, 2, *rest).swapaxes(1, 2).reshape(x.shape)


def read_tensors(
    src: Path,
    header: GGUFHeader,
    names: Iterable[str] | None = None,
    stopped: Callable[[], bool] | None = None,
) -> dict[str, mx.array]:
    """The tensors `names` (default: every one) by GGUF name, a quantized `x.weight` as
    `x.weight`, `x.scales` and `x.biases`; converted one at a time from a read-only map of the
    file. Raises `ImportStopped` once `stopped()` is true, between two tensors."""
    data = np.memmap(src, dtype=np.uint8, mode="r")
    tensors: dict[str, mx.array] = {}
    chosen = list(header.tensors if names is None else names)
    for name in bar(chosen, f"reading {src.name}", len(chosen)):
        _check_stopped(src, stopped)
        info = header.tensors[name]
        start = header.data_start + info.offset
        raw = data[start : start + tensor_bytes(info.type, info.shape)]
        arrays = read_tensor(raw, info.type, info.shape)
        base = name.rpartition(".")[0]
        names = [name] if len(arrays) == 1 else [name, f"{base}.scales", f"{base}.biases"]
        tensors.update(zip(names, arrays, strict=True))
    return tensors


def convert_tensors(
    loaded: dict[str, mx.array], family: Family, config: dict[str, Any]
) -> dict[str, mx.array]:
    """Rename the GGUF's tensors to mlx-lm's names and undo what llama.cpp's converter
    did to them: q/k rows permuted (llama), 1 added to norm weights (gemma). Every tensor is
    one the family has, all it needs are there (`check_shapes`)."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for name, array in loaded.items():
        base, _, part = name.rpartition(".")  # part: weight | bias | scales | biases
        path = _mlx_path(base, family)
        assert path is not None, name
        kind = base.rpartition(".")[2]
        if family.permuted_qk and kind in heads:
            array = _unpermute_rows(array, heads[kind])
        if family.norm_offset and kind.endswith("norm"):
            if part != "weight" or f"{base}.scales" in loaded:
                raise UnsupportedGGUF(f"{name}: a quantized gemma norm cannot be shifted back")
            array = array.astype(mx.float32) - family.norm_offset
        weights[f"{path}.{part}"] = array
    return weights


def quantization_config(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` block: the commonest bit width, and per layer where it differs.

    Float layers are marked `False` so mlx-lm leaves them as plain `nn.Linear`/`nn.Embedding`.
    """
    bits = {}
    for key, scales in weights.items():
        if key.endswith(".scales"):
            path = key.removesuffix(".scales")
            # uint32 words per row * 32 bits / values per row.
            bits[path] = weights[f"{path}.weight"].shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
    if not bits:
        return None

    def params(b: int) -> dict[str, Any]:
        return {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}

    default = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = params(default)
    config.update({path: params(b) for path, b in sorted(bits.items()) if b != default})
    for key, array in sorted(weights.items()):
        path = key.removesuffix(".weight")
        if key.endswith(".weight") and array.ndim == 2 and path not in bits:
            config[path] = False
    return config


@contextmanager
def _naming(src: Path) -> Iterator[None]:
    """A refusal raised without the file's name gets it in front: every refusal names it."""
    try:
        yield
    except UnsupportedTokenizer as e:
        raise UnsupportedGGUF(f"{src}: {e}") from e
    except UnsupportedGGUF as e:
        if str(e).startswith((str(src), src.name)):
            raise
        raise UnsupportedGGUF(f"{src}: {e}") from e


def import_gguf(src: Path, dest: Path, stopped: Callable[[], bool] | None = None) -> Path:
    """Convert the GGUF at `src` into an mlx-lm model directory at `dest`; return `dest`.

    The architecture must be one of `FAMILIES` (llama.cpp writes Mistral as llama). Quantized
    tensors stay quantized (MLX affine, group size 32); what llama.cpp's converter changed is put
    back (llama's q/k row order, gemma's norm weights); config, tokenizer and generation
    defaults come from the GGUF metadata. The file is checked whole first (`gguf_checks`): its
    layout, its metadata against its tensors, every tensor's shape against the config. Raises
    `UnsupportedGGUF`, naming the file, for what cannot be kept faithfully, `FileExistsError`
    for a non-empty `dest`, and `ImportStopped` once `stopped()` is true (checked between
    tensors). Nothing appears at `dest` unless all succeeds.
    """
    src, dest = Path(src), Path(dest)
    header = read_header(src)
    with _naming(src):
        check_not_split(src, header)
        family = _check_supported(header)
        check_whole(src, header)
        arch = header.metadata["general.architecture"]
        check_metadata(header, arch)
        present = [name for name in family.setting_tensors if name in header.tensors]
        settings = {
            name: np.array(array.astype(mx.float32))
            for name, array in read_tensors(src, header, present).items()
        }
        config = model_config(header, family, settings, src)
        check_shapes(header, family, config)
        with atomic_model_dir(dest) as tmp:
            write_tokenizer_files(header.metadata, tmp)
            weights = [name for name in header.tensors if name not in settings]
            loaded = read_tensors(src, header, weights, stopped)
            converted = convert_tensors(loaded, family, config)
            evaluate(converted, f"converting {src.name}")
            if (quantization := quantization_config(converted)) is not None:
                config["quantization"] = quantization
            _check_stopped(src, stopped)
            save_weights(converted, tmp)
            save_config(config, tmp / "config.json")
    return dest
