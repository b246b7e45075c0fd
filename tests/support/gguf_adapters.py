"""llama.cpp LoRA files written by the tests as `convert_lora_to_gguf.py` writes them.

The converter reads PEFT's `lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]`, renames
each module to llama.cpp's tensor name, and runs the base converter's own tensor changes on the
pair: for llama that permutes the rows of q/k's `lora_B` for its rotary layout, as it permutes
the base's q/k weights. The pair is written as `<tensor>.weight.lora_a` / `.lora_b`, with
`general.type = adapter`, `adapter.type = lora` and `adapter.lora.alpha` (float32).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.support.gguf_files import llama_cpp_permute
from tests.support.gguf_models import GEMMA_LAYER, LAYER

Pairs = dict[str, tuple[mx.array, mx.array]]  # module path -> (A [in, r], B [r, out])


def gguf_module(path: str, gemma: bool = False) -> str:
    """`model.layers.0.self_attn.q_proj` -> `blk.0.attn_q`, as the converter's tensor map does."""
    _, _, index, module = path.split(".", 3)
    return f"blk.{index}.{(GEMMA_LAYER if gemma else LAYER)[module]}"


def encode(w: np.ndarray, kind: Q) -> tuple[np.ndarray, Q | None]:
    """`w` as the converter stores it for `kind` (its raw dtype for a quantized one)."""
    if kind == Q.F32:
        return w.astype(np.float32), None
    if kind == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), kind), kind


def stored(w: np.ndarray, kind: Q) -> np.ndarray:
    """The float32 values a tensor of `kind` holds for `w`, as llama.cpp reads them back."""
    data, raw = encode(w, kind)
    if raw is None:
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, raw).astype(np.float32)


def write_gguf_adapter(
    path: Path,
    pairs: Pairs,
    *,
    alpha: float | None,
    arch: str = "llama",
    heads: tuple[int, int] | None = None,
    types: tuple[Q, Q] = (Q.F32, Q.F32),
    general_type: str | None = "adapter",
    adapter_type: str = "lora",
    extra_tensors: dict[str, np.ndarray | tuple[np.ndarray, Q, tuple[int, ...]]] | None = None,
    metadata: dict[str, object] | None = None,
    names: dict[str, str] | None = None,
) -> Path:
    """Write `pairs` (mlx-lm layout) as llama.cpp's LoRA file at `path`.

    `heads` (query, key-value) permutes llama's q/k `lora_b` rows as the converter does; None
    leaves them (families the converter does not permute). `types` are the GGUF types of A and
    B. `alpha` None leaves `adapter.lora.alpha` out. `names` maps module paths to other tensor
    names (a file made for another model). `extra_tensors` are written as they are, or as the
    (data, type, shape) a tuple gives.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    if general_type is not None:
        writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, value in (metadata or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_float32(key, float(value))  # type: ignore[arg-type]
    for module_path, (a, b) in pairs.items():
        lora_a = np.array(a.T.astype(mx.float32))  # [r, in], PEFT's lora_A.weight
        lora_b = np.array(b.T.astype(mx.float32))  # [out, r], PEFT's lora_B.weight
        name = (names or {}).get(module_path) or gguf_module(module_path, arch.startswith("gemma"))
        kind = name.rpartition(".")[2]
        if heads is not None and kind in ("attn_q", "attn_k"):
            lora_b = llama_cpp_permute(lora_b, heads[0] if kind == "attn_q" else heads[1])
        for half, w, stored_as in (("lora_a", lora_a, types[0]), ("lora_b", lora_b, types[1])):
            data, raw = encode(w, stored_as)
            if raw is None:
                writer.add_tensor(f"{name}.weight.{half}", data)
            else:
                writer.add_tensor(
                    f"{name}.weight.{half}", data, raw_shape=data.shape, raw_dtype=raw
                )
    for name, extra in (extra_tensors or {}).items():
        if isinstance(extra, tuple):  # (data, GGUF type, shape rows first), written as given
            data, kind, shape = extra
            writer.add_tensor(name, data, raw_shape=shape, raw_dtype=kind)
        else:
            writer.add_tensor(name, extra)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stored_pairs(pairs: Pairs, types: tuple[Q, Q]) -> Pairs:
    """`pairs` holding the values a GGUF adapter of `types` holds (mlx-lm layout, float32)."""
    return {
        path: (
            mx.array(stored(np.array(a.T), types[0]).T),
            mx.array(stored(np.array(b.T), types[1]).T),
        )
        for path, (a, b) in pairs.items()
    }
