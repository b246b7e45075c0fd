"""A random-weight llama for section `cpu`: an mlx-lm directory and a GGUF of the same weights.

The model is built with mlx-lm's own `llama.Model` in float16 and quantized to 4 bits in groups
of 32 as mlx-lm's converter does. MLX's affine 4-bit group (value = scale * q + bias, scale and
bias float16) is exactly GGUF's Q4_1 block (value = d * q + m, d and m float16), so the GGUF
repacks the very same 4-bit codes and float16 factors: both servers read identical weights, not
two quantizations of one float model. q/k rows are permuted for llama.cpp's rotary layout as
its converter does. The tokenizer is the embedded model's (vocabulary 49,152), copied into both;
a larger vocabulary (`Shape.vocab`) pads it with tokens `<unused{i}>` that no text encodes to
(in the BPE vocabulary without merges, and in the GGUF's token list as normal tokens), so that
both servers take and decode every id of the model's embedding and head.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from hotlora.models.gguf import read_header

from tests.support.gguf_files import MLX_NAMES, llama_cpp_permute

GROUP_SIZE = 32
BITS = 4
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of 32 4-bit codes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# Copied from the embedded GGUF with the writer call that keeps each key's GGUF type.
GGUF_TOKENIZER_KEYS: dict[str, Callable[[gguf.GGUFWriter, Any], None]] = {
    "tokenizer.ggml.model": lambda w, v: w.add_tokenizer_model(str(v)),
    "tokenizer.ggml.pre": lambda w, v: w.add_tokenizer_pre(str(v)),
    "tokenizer.ggml.tokens": lambda w, v: w.add_token_list(list(v)),
    "tokenizer.ggml.token_type": lambda w, v: w.add_token_types(list(v)),
    "tokenizer.ggml.merges": lambda w, v: w.add_token_merges(list(v)),
    "tokenizer.ggml.bos_token_id": lambda w, v: w.add_bos_token_id(int(v)),
    "tokenizer.ggml.eos_token_id": lambda w, v: w.add_eos_token_id(int(v)),
    "tokenizer.ggml.unknown_token_id": lambda w, v: w.add_unk_token_id(int(v)),
    "tokenizer.ggml.padding_token_id": lambda w, v: w.add_pad_token_id(int(v)),
    "tokenizer.ggml.add_bos_token": lambda w, v: w.add_add_bos_token(bool(v)),
    "tokenizer.ggml.add_eos_token": lambda w, v: w.add_add_eos_token(bool(v)),
    "tokenizer.ggml.add_space_prefix": lambda w, v: w.add_add_space_prefix(bool(v)),
    "tokenizer.chat_template": lambda w, v: w.add_chat_template(str(v)),
}


@dataclass(frozen=True)
class Shape:
    """The architecture's sizes; the defaults make the ~0.8B model section `cpu` serves."""

    hidden: int = 2048
    layers: int = 16
    ffn: int = 5632
    heads: int = 32
    kv_heads: int = 4
    vocab: int = 49152
    context: int = 8192
    rope_theta: float = 10000.0

    @property
    def name(self) -> str:
        return (
            f"llama-h{self.hidden}-l{self.layers}-f{self.ffn}-a{self.heads}"
            f"x{self.kv_heads}-v{self.vocab}-q{BITS}g{GROUP_SIZE}"
        )

    def args(self) -> llama.ModelArgs:
        return llama.ModelArgs(
            model_type="llama",
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            intermediate_size=self.ffn,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            rms_norm_eps=1e-5,
            vocab_size=self.vocab,
            max_position_embeddings=self.context,
            rope_theta=self.rope_theta,
            tie_word_embeddings=True,
        )

    def config(self) -> dict:
        """mlx-lm's config.json for the quantized model."""
        quantization = {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.ffn,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": 1e-5,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.context,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": True,
            "quantization": quantization,
            "quantization_config": quantization,
        }


def random_weights(shape: Shape, seed: int = 0) -> dict[str, mx.array]:
    """mlx-lm's random llama at `shape`, float16, quantized to 4 bits (group 32), by name.

    Built and quantized a layer at a time, so the float copy of one layer is all that exists
    at once beside the quantized weights.
    """
    mx.random.seed(seed)
    model = llama.Model(shape.args())
    model.set_dtype(mx.float16)
    nn.quantize(
        model,
        group_size=GROUP_SIZE,
        bits=BITS,
        class_predicate=lambda _, module: isinstance(module, nn.Embedding),
    )
    mx.eval(model.model.embed_tokens.parameters())
    for layer in model.model.layers:
        nn.quantize(layer, group_size=GROUP_SIZE, bits=BITS)
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return dict(tree_flatten(model.parameters()))


def padding(first: int, vocab: int) -> list[str]:
    """The tokens that pad a vocabulary of `first` tokens to `vocab`."""
    return [f"<unused{i}>" for i in range(vocab - first)]


def write_model_dir(
    weights: dict[str, mx.array], shape: Shape, dest: Path, tokenizer_dir: Path
) -> Path:
    """The mlx-lm directory: model.safetensors, config.json and the tokenizer's files, its
    vocabulary padded to the model's."""
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(shape.config(), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, dest / name)
    tokenizer = json.loads((dest / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first = max([*vocab.values(), *(t["id"] for t in tokenizer["added_tokens"])]) + 1
    if first < shape.vocab:
        vocab.update({token: first + i for i, token in enumerate(padding(first, shape.vocab))})
        (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    return dest


def q4_1_blocks(weight: mx.array, scales: mx.array, biases: mx.array) -> np.ndarray:
    """An MLX 4-bit affine triplet (group 32) as GGUF Q4_1 bytes: [rows, groups * 20] uint8."""
    # [rows, in / 8] uint32 words, little-endian: byte k holds codes 2k (low) and 2k+1 (high).
    packed = np.array(weight).view(np.uint8)
    rows = packed.shape[0]
    codes = np.empty((rows, packed.shape[1] * 2), dtype=np.uint8)  # [rows, in]
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    codes = codes.reshape(rows, -1, GROUP_SIZE)  # [rows, groups, 32]
    # Q4_1 keeps a block's codes i and i + 16 in byte i (low, high nibble).
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [rows, groups, 16]
    d = np.array(scales.astype(mx.float16)).view(np.uint8).reshape(rows, -1, 2)
    m = np.array(biases.astype(mx.float16)).view(np.uint8).reshape(rows, -1, 2)
    return np.concatenate([d, m, qs], axis=-1).reshape(rows, -1)  # [rows, groups * 20]


_GGUF_NAMES = {path: name for name, path in MLX_NAMES.items()}


def gguf_name(mlx_path: str) -> str:
    """`model.layers.0.self_attn.q_proj` -> `blk.0.attn_q`; `model.norm` -> `output_norm`."""
    parts = mlx_path.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:])]}"
    return _GGUF_NAMES[mlx_path]


def write_gguf(
    weights: dict[str, mx.array], shape: Shape, dest: Path, tokenizer_gguf: Path
) -> Path:
    """The GGUF llama.cpp serves: the same 4-bit weights as Q4_1, norms as F32, the tokenizer
    metadata of `tokenizer_gguf`."""
    heads = {"attn_q": shape.heads, "attn_k": shape.kv_heads}
    metadata = read_header(tokenizer_gguf).metadata
    writer = gguf.GGUFWriter(str(dest), "llama")
    writer.add_name(shape.name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    extra = padding(len(tokens), shape.vocab)
    for key, add in GGUF_TOKENIZER_KEYS.items():
        if key == "tokenizer.ggml.tokens":
            writer.add_token_list([*tokens, *extra])
        elif key == "tokenizer.ggml.token_type":
            normal = [int(gguf.TokenType.NORMAL)] * len(extra)
            writer.add_token_types([*metadata[key].tolist(), *normal])
        elif key in metadata:
            add(writer, metadata[key])
    paths = sorted({key.rpartition(".")[0] for key in weights})
    for path in paths:
        name = gguf_name(path)
        if f"{path}.scales" in weights:
            data = q4_1_blocks(
                weights[f"{path}.weight"], weights[f"{path}.scales"], weights[f"{path}.biases"]
            )
            if (kind := name.rpartition(".")[2]) in heads:
                data = llama_cpp_permute(data, heads[kind])  # whole rows: blocks stay intact
            writer.add_tensor(f"{name}.weight", data, raw_shape=data.shape, raw_dtype=Q.Q4_1)
        else:
            writer.add_tensor(
                f"{name}.weight", np.array(weights[f"{path}.weight"].astype(mx.float32))
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@dataclass(frozen=True)
class Built:
    """The random llama's two forms."""

    model_dir: Path
    gguf: Path


def ensure_random_llama(
    cache: Path,
    shape: Shape,
    tokenizer_dir: Path,
    tokenizer_gguf: Path,
    progress: Callable[[str], None] = print,
) -> Built:
    """The random llama under `cache/<shape name>`, built on first use (a file lock makes
    concurrent callers build it once; a finished build leaves `done.json`)."""
    root = cache / shape.name
    built = Built(root / "mlx", root / f"{shape.name}.Q4_1.gguf")
    done = root / "done.json"
    if done.is_file():
        return built
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return built
        progress(f"building the random llama {shape.name} in {root} (once)")
        weights = random_weights(shape)
        progress(f"  writing the mlx-lm directory {built.model_dir}")
        write_model_dir(weights, shape, built.model_dir, tokenizer_dir)
        progress(f"  writing the GGUF {built.gguf} (Q4_1, the same 4-bit codes)")
        write_gguf(weights, shape, built.gguf, tokenizer_gguf)
        done.write_text(json.dumps(asdict(shape)) + "\n")
        progress("  built")
    return built
