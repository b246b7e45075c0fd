"""A GGUF model checked before any tensor is read or anything written: one whole file (not a
part of a split one), its tensor data laid out as llama.cpp's reader requires, its metadata
numbers consistent with each other and with its tensors, and every tensor of the shape the
config made from that metadata gives it.

So a damaged or hand-edited file is refused in a line naming the key or the tensor, before a
number in it (a layer count of 2^40) can size anything, and no import of it is ever cached.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hotlora.models.gguf_families import Family, Metadata, UnsupportedGGUF
from hotlora.models.gguf_header import GGUFHeader
from hotlora.models.gguf_tensors import tensor_bytes

Q = GGMLQuantizationType
# What a refusal of inconsistent metadata or tensors tells the user to do.
GET_IT_AGAIN = "the file is damaged or was not written by llama.cpp's converter: get it again"


def check_not_split(src: Path, header: GGUFHeader) -> None:
    """Refuse one part of a split GGUF (`split.count` > 1): its tensors are spread over the
    other parts, which llama.cpp's own tool merges into one file."""
    count = header.metadata.get("split.count", 1)
    if isinstance(count, int) and count > 1:
        part = header.metadata.get("split.no", 0)
        number = f" {part + 1}" if isinstance(part, int) else ""
        raise UnsupportedGGUF(
            f"{src} is part{number} of a split GGUF (split.count = {count}): merge the parts "
            "with llama.cpp's `llama-gguf-split --merge` first"
        )


def check_whole(src: Path, header: GGUFHeader) -> None:
    """Refuse tensor data llama.cpp's reader refuses: a row that is not a whole number of its
    type's blocks, an offset off `general.alignment`, two tensors over the same bytes, and a
    file cut short (a download that stopped). A model is checked before anything is written,
    an adapter before it mounts; every tensor's type is known by then."""
    size = src.stat().st_size
    spans = []
    for name, info in header.tensors.items():
        kind = Q(info.type)
        block = GGML_QUANT_SIZES[kind][0]
        row = info.shape[-1] if info.shape else 1
        if row % block:
            raise UnsupportedGGUF(
                f"{src}: tensor {name} has rows of {row:,} values, not a whole number of "
                f"{kind.name} blocks of {block} (llama.cpp refuses it too); {GET_IT_AGAIN}"
            )
        if info.offset % header.alignment:
            raise UnsupportedGGUF(
                f"{src}: tensor {name} starts at data offset {info.offset:,}, not a multiple of "
                f"general.alignment ({header.alignment}); {GET_IT_AGAIN}"
            )
        length = tensor_bytes(info.type, info.shape)
        if header.data_start + info.offset + length > size:
            raise UnsupportedGGUF(
                f"{src.name} is truncated: {name} ends past the end of the file "
                f"({size:,} bytes); download it again"
            )
        spans.append((info.offset, length, name))
    spans.sort()
    for (start, length, name), (later, _, other) in itertools.pairwise(spans):
        if later < start + length:
            raise UnsupportedGGUF(
                f"{src}: tensors {name} and {other} share bytes of the file (offsets "
                f"{start:,} and {later:,}); {GET_IT_AGAIN}"
            )


def _count(meta: Metadata, key: str, default: int | None = None) -> int:
    """`{arch}.{key}` (else `default`), which must be a whole number above 0."""
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedGGUF(
            f"{meta.arch}.{key} is {value!r:.40}, not a whole number above 0; {GET_IT_AGAIN}"
        )
    return value


def layer_numbers(header: GGUFHeader) -> set[int]:
    """The layers the file holds tensors of (`blk.N.*`)."""
    parts = (name.split(".") for name in header.tensors)
    return {int(p[1]) for p in parts if len(p) > 2 and p[0] == "blk" and p[1].isdigit()}


def check_metadata(header: GGUFHeader, arch: str) -> None:
    """Refuse metadata numbers a model cannot be built from, before any is used: the layer
    count against the `blk.N` tensors present, the hidden size against the embedding's rows,
    heads and key/value heads above 0 and the second dividing the first, a head size (the
    hidden size over the heads unless `attention.key_length` gives one) that is whole and even
    (rotary embedding turns pairs of values), a whole context length, a positive norm
    epsilon."""
    meta = Metadata(header.metadata, arch)
    layers, blocks = layer_numbers(header), _count(meta, "block_count")
    if beyond := sorted(i for i in layers if i >= blocks):
        example = next(n for n in header.tensors if n.startswith(f"blk.{beyond[0]}."))
        raise UnsupportedGGUF(
            f"{arch}.block_count is {blocks:,}, but the file holds tensors of layer "
            f"{beyond[0]} ({example}); {GET_IT_AGAIN}"
        )
    if len(layers) < blocks:
        missing = next(i for i in range(blocks) if i not in layers)
        raise UnsupportedGGUF(
            f"{arch}.block_count is {blocks:,}, but the file holds no tensors of layer "
            f"{missing} (it has {len(layers)} layers); {GET_IT_AGAIN}"
        )
    hidden = _count(meta, "embedding_length")
    embedding = header.tensors["token_embd.weight"].shape
    if embedding[1:] != (hidden,):
        raise UnsupportedGGUF(
            f"{arch}.embedding_length is {hidden:,}, but token_embd.weight has shape "
            f"{embedding}; {GET_IT_AGAIN}"
        )
    heads = _count(meta, "attention.head_count")
    kv_heads = _count(meta, "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise UnsupportedGGUF(
            f"{arch}.attention.head_count_kv ({kv_heads:,}) does not divide "
            f"{arch}.attention.head_count ({heads:,}); {GET_IT_AGAIN}"
        )
    if meta.has("attention.key_length"):
        head_dim = _count(meta, "attention.key_length")
    elif hidden % heads:
        raise UnsupportedGGUF(
            f"{arch}.embedding_length ({hidden:,}) is not a multiple of "
            f"{arch}.attention.head_count ({heads:,}) and no {arch}.attention.key_length "
            f"gives the head size; {GET_IT_AGAIN}"
        )
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise UnsupportedGGUF(
            f"{arch}: a head size of {head_dim} is odd, where rotary embedding turns pairs "
            f"of values; {GET_IT_AGAIN}"
        )
    _count(meta, "feed_forward_length")
    context = meta.get("context_length")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise UnsupportedGGUF(
            f"{arch}.context_length is {context!r:.40}, not a whole number; {GET_IT_AGAIN}"
        )
    epsilon = meta.get("attention.layer_norm_rms_epsilon")
    if not isinstance(epsilon, float) or not math.isfinite(epsilon) or epsilon <= 0:
        raise UnsupportedGGUF(
            f"{arch}.attention.layer_norm_rms_epsilon is {epsilon!r:.40}, not a number above "
            f"0; {GET_IT_AGAIN}"
        )


def tensor_shapes(
    family: Family, config: dict[str, Any]
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The shape (numpy order) `config` gives each weight: the model's by llama.cpp's name
    (`output_norm`), a layer's by its name within the layer (`attn_q` of `blk.N.attn_q`)."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    # Phi-3 keeps gate and up in one tensor, gate rows first.
    up = 2 * ffn if family.layer_names.get("ffn_up") == "mlp.gate_up_proj" else ffn
    projections = {
        "attn_q": (q, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_qkv": (q + 2 * kv, hidden),
        "attn_output": (hidden, q),
        "attn_q_norm": (head_dim,),
        "attn_k_norm": (head_dim,),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (up, hidden),
        "ffn_down": (hidden, ffn),
    }
    vocab = config["vocab_size"]
    model = {"token_embd": (vocab, hidden), "output": (vocab, hidden), "output_norm": (hidden,)}
    # Every other layer weight is a norm over the hidden size.
    layer = {kind: projections.get(kind, (hidden,)) for kind in family.layer_names}
    return model, layer


def check_shapes(header: GGUFHeader, family: Family, config: dict[str, Any]) -> None:
    """Refuse a tensor the family does not have, a tensor it needs and the file lacks, and a
    tensor whose shape is not the one `config` gives it (a bias: one value a row of its
    weight), naming the tensor and both shapes."""
    model, layer = tensor_shapes(family, config)
    for name, info in header.tensors.items():
        if name in family.setting_tensors:
            continue  # read into the config, which checks them
        base, _, part = name.rpartition(".")
        parts = base.split(".")
        in_layer = len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit()
        shape = layer.get(parts[2]) if in_layer else model.get(base)
        if shape is None or part not in ("weight", "bias"):
            raise UnsupportedGGUF(
                f"tensor {name} is not one a {family.model_type} model has, so the importer "
                "has nowhere to put it"
            )
        if part == "bias":
            shape = shape[:1]
        if info.shape != shape:
            raise UnsupportedGGUF(
                f"tensor {name} has shape {info.shape}, where the metadata makes it {shape}; "
                f"{GET_IT_AGAIN}"
            )
    needed = ["output_norm.weight"]
    for i in range(config["num_hidden_layers"]):
        needed += [f"blk.{i}.{kind}.weight" for kind in family.layer_names]
        needed += [f"blk.{i}.{kind}.bias" for kind in family.required_biases]
    if missing := [name for name in needed if name not in header.tensors]:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UnsupportedGGUF(
            f"the file lacks tensor {missing[0]}{more}, which a {family.model_type} model "
            f"needs; {GET_IT_AGAIN}"
        )
