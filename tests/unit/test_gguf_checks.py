"""A GGUF checked whole before anything is read or written: a part of a split file, tensor data
llama.cpp's reader refuses, metadata numbers that do not fit the tensors (a layer count of
2^40) and tensors that do not fit the metadata are refused in one line naming the file and the
key or tensor, and nothing is imported, nor cached under the home."""

from __future__ import annotations

import json
import logging
import re
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from hotlora.config.settings import Settings
from hotlora.models.embedded import imported_gguf_path
from hotlora.models.gguf import UnsupportedGGUF, import_gguf, read_header
from hotlora.models.loader import DEFAULT_CONTEXT_LENGTH, MAX_CONTEXT_LENGTH, load_model_dir
from hotlora.server.runtime import model_dir

from tests.support.gguf_files import (
    CONTEXT,
    FFN,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    add_tensor,
    tiny_float_weights,
    tiny_vocab,
    write_tiny_gguf,
)

AGAIN = "the file is damaged or was not written by llama.cpp's converter: get it again"


def write_gguf(
    path: Path,
    *,
    meta: dict[str, object] | None = None,
    tensors: dict[str, np.ndarray | None] | None = None,
    types: dict[str, Q] | None = None,
    merges: bool = True,
) -> Path:
    """The tiny llama as float tensors (q/k rows as they come: nothing here reads values), its
    metadata updated by `meta` (a None value leaves the key out), tensors replaced, added or
    (None) left out by `tensors`, by full GGUF name; without `merges`, no merge list."""
    tokens, token_types, merge_list = tiny_vocab()
    values = {
        "llama.block_count": LAYERS,
        "llama.context_length": CONTEXT,
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        **(meta or {}),
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            (writer.add_uint64 if value >= 2**32 else writer.add_uint32)(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if merges:
        writer.add_token_merges(merge_list)
    writer.add_eos_token_id(2)
    weights = {f"{name}.weight": w for name, w in tiny_float_weights(len(tokens)).items()}
    for name, w in {**weights, **(tensors or {})}.items():
        if w is not None:
            add_tensor(writer, name, w, (types or {}).get(name, Q.F32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patch_tensor(path: Path, name: str, *, dims=None, offset=None) -> None:
    """Rewrite one entry of the tensor directory: its dimensions (GGUF order, columns first)
    or its offset in the data."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if dims is not None:
        struct.pack_into(f"<{n_dims}Q", data, at + 4, *dims)
    if offset is not None:
        struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, offset)
    path.write_bytes(bytes(data))


def refused(src: Path, words: str, tmp_path: Path) -> str:
    """Importing `src` fails naming the file and saying `words`, on one line, and writes
    nothing; the message."""
    with pytest.raises(UnsupportedGGUF) as caught:
        import_gguf(src, tmp_path / "model")
    message = str(caught.value)
    assert str(src) in message or src.name in message
    assert words in message
    assert "\n" not in message
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    return message


def test_the_tiny_file_written_here_imports(tmp_path):
    import_gguf(write_gguf(tmp_path / "m.gguf"), tmp_path / "model")
    assert (tmp_path / "model" / "config.json").is_file()


# Metadata a model cannot be built from, and words of the refusal (after the file's name).
BAD_METADATA = {
    "layers-2^40": (
        {"llama.block_count": 2**40},
        "llama.block_count is 1,099,511,627,776, but the file holds no tensors of layer 2 "
        "(it has 2 layers)",
    ),
    "layers-2-million": (
        {"llama.block_count": 2_000_000},
        "llama.block_count is 2,000,000, but the file holds no tensors of layer 2",
    ),
    "layers-fewer": (
        {"llama.block_count": 1},
        "llama.block_count is 1, but the file holds tensors of layer 1 (blk.1.",
    ),
    "layers-0": ({"llama.block_count": 0}, "llama.block_count is 0, not a whole number above 0"),
    "layers-text": (
        {"llama.block_count": "2"},
        "llama.block_count is '2', not a whole number above 0",
    ),
    "hidden-2^40": (
        {"llama.embedding_length": 2**40},
        "llama.embedding_length is 1,099,511,627,776, but token_embd.weight has shape (271, 64)",
    ),
    "heads-0": (
        {"llama.attention.head_count": 0},
        "llama.attention.head_count is 0, not a whole number above 0",
    ),
    "heads-float": (
        {"llama.attention.head_count": 4.0},
        "llama.attention.head_count is 4.0, not a whole number above 0",
    ),
    "kv-heads-0": (
        {"llama.attention.head_count_kv": 0},
        "llama.attention.head_count_kv is 0, not a whole number above 0",
    ),
    "kv-heads-not-dividing": (
        {"llama.attention.head_count_kv": 3},
        "llama.attention.head_count_kv (3) does not divide llama.attention.head_count (4)",
    ),
    "kv-heads-2^40": (
        {"llama.attention.head_count_kv": 2**40},
        "llama.attention.head_count_kv (1,099,511,627,776) does not divide",
    ),
    "hidden-not-split-in-heads": (
        {"llama.attention.head_count": 6},
        "llama.embedding_length (64) is not a multiple of llama.attention.head_count (6)",
    ),
    "head-size-odd": (
        {"llama.attention.key_length": 15, "llama.attention.value_length": 15},
        "a head size of 15 is odd",
    ),
    "ffn-2^40": (
        {"llama.feed_forward_length": 2**40},
        "tensor blk.0.ffn_gate.weight has shape (128, 64), where the metadata makes it "
        "(1099511627776, 64)",
    ),
    "epsilon-negative": (
        {"llama.attention.layer_norm_rms_epsilon": -1.0},
        "llama.attention.layer_norm_rms_epsilon is -1.0, not a number above 0",
    ),
    "context-text": (
        {"llama.context_length": "long"},
        "llama.context_length is 'long', not a whole number",
    ),
}


@pytest.mark.parametrize(("meta", "words"), BAD_METADATA.values(), ids=list(BAD_METADATA))
def test_metadata_that_does_not_fit_the_tensors_is_refused(tmp_path, meta, words):
    src = write_gguf(tmp_path / "m.gguf", meta=meta)
    began = time.perf_counter()
    message = refused(src, words, tmp_path)
    # Refused from the header alone: a count of 2^40 sizes nothing.
    assert time.perf_counter() - began < 5
    assert message.startswith(f"{src}: ")


def test_a_refusal_says_the_file_is_damaged(tmp_path):
    refused(write_gguf(tmp_path / "m.gguf", meta={"llama.block_count": 2**40}), AGAIN, tmp_path)


rng = np.random.default_rng(0)
# Tensors that do not fit the metadata (hidden 64, 4 heads of 16, 2 kv heads, ffn 128).
BAD_TENSORS = {
    "q-rows": (
        {"blk.1.attn_q.weight": rng.standard_normal((32, 64), np.float32)},
        "tensor blk.1.attn_q.weight has shape (32, 64), where the metadata makes it (64, 64)",
    ),
    "ffn-rows": (
        {"blk.0.ffn_up.weight": rng.standard_normal((96, 64), np.float32)},
        "tensor blk.0.ffn_up.weight has shape (96, 64), where the metadata makes it (128, 64)",
    ),
    "norm-size": (
        {"blk.0.attn_norm.weight": np.ones(32, np.float32)},
        "tensor blk.0.attn_norm.weight has shape (32,), where the metadata makes it (64,)",
    ),
    "q-one-dimension": (
        {"blk.0.attn_q.weight": np.ones(4096, np.float32)},
        "tensor blk.0.attn_q.weight has shape (4096,), where the metadata makes it (64, 64)",
    ),
    "norm-two-dimensions": (
        {"blk.0.attn_norm.weight": np.ones((2, 64), np.float32)},
        "tensor blk.0.attn_norm.weight has shape (2, 64), where the metadata makes it (64,)",
    ),
    "q-empty": (
        {"blk.0.attn_q.weight": np.ones((0, 64), np.float32)},
        "tensor blk.0.attn_q.weight has shape (0, 64), where the metadata makes it (64, 64)",
    ),
    "q-bias-size": (
        {"blk.0.attn_q.bias": np.ones(32, np.float32)},
        "tensor blk.0.attn_q.bias has shape (32,), where the metadata makes it (64,)",
    ),
    "layer-past-the-count": (
        {"blk.5.ffn_up.weight": np.ones((128, 64), np.float32)},
        "llama.block_count is 2, but the file holds tensors of layer 5 (blk.5.ffn_up.weight)",
    ),
    "tensor-missing": (
        {"blk.1.ffn_down.weight": None},
        "the file lacks tensor blk.1.ffn_down.weight, which a llama model needs",
    ),
    "tensor-unknown": (
        {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)},
        "tensor blk.0.attn_q_norm.weight is not one a llama model has",
    ),
}


@pytest.mark.parametrize(("tensors", "words"), BAD_TENSORS.values(), ids=list(BAD_TENSORS))
def test_tensors_that_do_not_fit_the_metadata_are_refused(tmp_path, tensors, words):
    refused(write_gguf(tmp_path / "m.gguf", tensors=tensors), words, tmp_path)


def test_two_tensors_over_the_same_bytes_are_refused(tmp_path):
    """A second tensor pointed at the first's data would be served as that data."""
    src = write_gguf(tmp_path / "m.gguf")
    offset = read_header(src).tensors["blk.0.ffn_down.weight"].offset
    patch_tensor(src, "blk.1.ffn_up.weight", offset=offset)
    refused(
        src,
        "tensors blk.0.ffn_down.weight and blk.1.ffn_up.weight share bytes of the file",
        tmp_path,
    )


def test_an_offset_off_the_alignment_is_refused(tmp_path):
    src = write_gguf(tmp_path / "m.gguf")
    offset = read_header(src).tensors["blk.0.ffn_down.weight"].offset
    patch_tensor(src, "blk.0.ffn_down.weight", offset=offset + 3)
    refused(
        src,
        f"tensor blk.0.ffn_down.weight starts at data offset {offset + 3:,}, not a multiple "
        "of general.alignment (32)",
        tmp_path,
    )


@pytest.mark.parametrize(
    ("kind", "written", "claimed", "words"),
    [
        (Q.Q4_K, (32, 256), (64, 128), "has rows of 64 values, not a whole number of Q4_K blocks"),
        (Q.Q4_0, (128, 64), (48, 128), "has rows of 48 values, not a whole number of Q4_0 blocks"),
    ],
    ids=["q4_k-64", "q4_0-48"],
)
def test_rows_of_part_of_a_block_are_refused(tmp_path, kind, written, claimed, words):
    """The bytes a whole number of blocks, the row length (GGUF's first dimension) not."""
    w = rng.standard_normal(written).astype(np.float32)
    src = write_gguf(
        tmp_path / "m.gguf", tensors={"blk.0.ffn_up.weight": w}, types={"blk.0.ffn_up.weight": kind}
    )
    patch_tensor(src, "blk.0.ffn_up.weight", dims=claimed)
    refused(src, f"tensor blk.0.ffn_up.weight {words}", tmp_path)


def test_a_tensor_listed_twice_is_refused(tmp_path):
    src = write_gguf(tmp_path / "m.gguf")
    data = src.read_bytes()
    src.write_bytes(data.replace(b"blk.1.ffn_up.weight", b"blk.0.ffn_up.weight"))
    refused(src, "tensor 'blk.0.ffn_up.weight' is listed twice", tmp_path)


@pytest.mark.parametrize("part", [0, 1])
def test_a_part_of_a_split_gguf_is_refused_saying_how_to_merge(tmp_path, part):
    src = tmp_path / f"model-0000{part + 1}-of-00003.gguf"
    meta = {"split.no": part, "split.count": 3, "split.tensors.count": 20}
    write_gguf(src, meta=meta)
    message = refused(src, f"is part {part + 1} of a split GGUF (split.count = 3)", tmp_path)
    assert message == (
        f"{src} is part {part + 1} of a split GGUF (split.count = 3): merge the parts with "
        "llama.cpp's `llama-gguf-split --merge` first"
    )


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"arch": "mamba"}, "architecture 'mamba' is not supported"),
        ({"types": {"blk.1.ffn_down": Q.IQ4_NL}}, "unsupported tensor type: IQ4_NL"),
        ({"rows": {"token_embd": 279}}, "token_embd.weight has 279 rows for a vocabulary of 271"),
        ({"pre": "mystery"}, "pre-tokenizer 'mystery' is not supported"),
    ],
    ids=["architecture", "tensor-type", "vocabulary", "tokenizer"],
)
def test_every_refusal_names_the_file(tmp_path, options, words):
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, **options)
    assert refused(src, words, tmp_path).startswith(f"{src}: ")


def test_a_byte_level_bpe_vocabulary_without_merges_is_refused(tmp_path):
    """Without its merges every word would be split into single bytes, silently: llama.cpp
    refuses the file, and so does the import."""
    src = write_gguf(tmp_path / "m.gguf", merges=False)
    message = refused(src, "its byte-level BPE vocabulary has no merges", tmp_path)
    assert message == (
        f"{src}: its byte-level BPE vocabulary has no merges (tokenizer.ggml.merges), without "
        "which no text is tokenized as the model was trained; llama.cpp refuses such a file "
        "too: get one converted with its merges"
    )


def test_a_refused_file_is_not_cached_and_is_refused_again(tmp_path):
    """`serve --model` imports into the home: a file whose tensors do not fit is refused naming
    the .gguf, not the cache, and leaves no model there that a later start would trust."""
    src = write_gguf(
        tmp_path / "m.gguf", tensors={"blk.1.attn_q.weight": np.ones((32, 64), np.float32)}
    )
    settings = Settings(model=src, home=tmp_path / "home")
    dest = imported_gguf_path(settings.home, src)
    for _ in range(2):
        with pytest.raises(UnsupportedGGUF, match=re.escape(f"{src}: tensor blk.1.attn_q")):
            model_dir(settings)
        assert not dest.exists()
        assert [p.name for p in dest.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_a_context_length_of_0_is_imported_as_the_default_with_a_warning(tmp_path, caplog):
    src = write_gguf(tmp_path / "m.gguf", meta={"llama.context_length": 0})
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        import_gguf(src, tmp_path / "model")
    assert [r.getMessage() for r in caplog.records] == [
        f"{src}: llama.context_length is 0, which states no context length: the import takes "
        "4096 tokens, the server's default"
    ]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["max_position_embeddings"] == DEFAULT_CONTEXT_LENGTH
    tokenizer = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    assert "model_max_length" not in tokenizer


def test_a_context_length_past_any_model_s_is_served_cut_with_a_warning(tmp_path, caplog):
    src = write_gguf(tmp_path / "m.gguf", meta={"llama.context_length": 2**40})
    loaded = load_model_dir(import_gguf(src, tmp_path / "model"))
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        assert loaded.context_length == MAX_CONTEXT_LENGTH == 2**24
    assert (
        "max_position_embeddings is 1099511627776, past any model's context: served with "
        "16777216 tokens"
    ) in caplog.text
