"""llama.cpp's LoRA files mount like mlx-lm's and PEFT's: same residuals, same checks.

Each GGUF adapter is written as `convert_lora_to_gguf.py` writes it (tests/support/gguf_adapters)
and compared with the same pairs written as a PEFT directory, holding the values the GGUF file
holds. Both are mounted in float32 and give the same arrays, so their logits must agree bit for
bit: llama.cpp's q/k row permutation is a reordering, undone exactly, and `alpha / r` is the
same number as PEFT's `lora_alpha / r`.
"""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from hotlora.adapters import AdapterManager, InvalidAdapter, activate
from hotlora.adapters.adapter_files import read_adapter
from hotlora.adapters.fuse import fuse_adapter
from hotlora.adapters.projections import find_targets, linear_dims, with_base_layout
from hotlora.models.gguf import import_gguf
from hotlora.models.loader import load_model_dir

from tests.support.adapter_builders import (
    adapter_set,
    parameter_ids,
    random_pairs,
    slots,
    write_mlx_adapter,
    write_peft_adapter,
)
from tests.support.gguf_adapters import stored_pairs, write_gguf_adapter
from tests.support.gguf_files import (
    HEADS,
    KV_HEADS,
    MALFORMED_HEADERS,
    write_raw_gguf,
    write_tiny_gguf,
)
from tests.support.gguf_models import FAMILIES, write_family_gguf

RANK = 4
ALPHA = 8.0  # scale 2
TOKENS = mx.array([[5, 17, 3, 99, 42, 7, 120, 64]])
LLAMA_HEADS = (HEADS, KV_HEADS)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama GGUF (mixed quantized types, q/k permuted) imported as the base."""
    work = tmp_path_factory.mktemp("gguf-base")
    write_tiny_gguf(work / "tiny.gguf")
    return import_gguf(work / "tiny.gguf", work / "model")


def base_model(model_dir: Path) -> nn.Module:
    model = load_model_dir(model_dir).model
    mx.eval(model.parameters())
    return model


def manager(model: nn.Module, root: Path, max_rank: int = 16) -> AdapterManager:
    root.mkdir(parents=True, exist_ok=True)
    return AdapterManager(model, base_id="base", adapter_root=root, max_rank=max_rank)


def logits(model: nn.Module, manager: AdapterManager | None = None, spec: str = "") -> mx.array:
    if manager is None or not spec:
        out = model(TOKENS)
    else:
        with activate(adapter_set(manager, spec)):
            out = model(TOKENS)
    mx.eval(out)
    return out


TYPES = [(Q.F32, Q.F32), (Q.F16, Q.F16), (Q.BF16, Q.BF16), (Q.Q8_0, Q.F16)]


@pytest.mark.parametrize("types", TYPES, ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_a_llama_cpp_file_mounts_as_its_peft_twin(tmp_path, llama_dir, types):
    model = base_model(llama_dir)
    pairs = stored_pairs(random_pairs(model, seed=1, rank=RANK), types)  # what the file holds
    adapters = manager(model, tmp_path / "root")
    gguf_file = tmp_path / "root" / "sft.gguf"
    write_gguf_adapter(gguf_file, pairs, alpha=ALPHA, heads=LLAMA_HEADS, types=types)
    write_peft_adapter(tmp_path / "root" / "peft", pairs, rank=RANK, alpha=ALPHA)

    info = adapters.mount("gguf", "sft.gguf")
    assert (info.rank, info.scale, info.rslora) == (RANK, ALPHA / RANK, False)
    assert info.mounted_layers == 14 and info.path == str(gguf_file)
    assert info.size_bytes == gguf_file.stat().st_size
    adapters.mount("peft", "peft")
    mounted = {item.id: item for item in adapters.list()}
    assert mounted["gguf"].ram_bytes == mounted["peft"].ram_bytes

    base = logits(model)
    with_gguf = logits(model, adapters, "gguf")
    assert mx.array_equal(with_gguf, logits(model, adapters, "peft"))
    assert mx.abs(with_gguf - base).max().item() > 1e-2


def test_the_mounted_arrays_are_the_peft_ones(tmp_path, llama_dir):
    """llama's q/k lora_b rows are put back exactly; every other pair is as written."""
    model = base_model(llama_dir)
    pairs = random_pairs(model, seed=2, rank=RANK)
    root = tmp_path / "root"
    write_gguf_adapter(root / "g.gguf", pairs, alpha=ALPHA, heads=LLAMA_HEADS)
    write_peft_adapter(root / "p", pairs, rank=RANK, alpha=ALPHA)
    adapters = manager(model, root)
    adapters.mount("g", "g.gguf")
    adapters.mount("p", "p")
    gguf_weights = adapter_set(adapters, "g").entries[0].mounted.adapter.weights
    peft_weights = adapter_set(adapters, "p").entries[0].mounted.adapter.weights
    assert gguf_weights.keys() == peft_weights.keys() == pairs.keys()
    for path, (a, b) in peft_weights.items():
        assert mx.array_equal(gguf_weights[path][0], a) and mx.array_equal(gguf_weights[path][1], b)


def test_q_and_k_rows_left_in_llama_cpp_order_would_change_the_answer(tmp_path, llama_dir):
    """The permutation matters: a file whose q/k lora_b rows were not permuted is another
    adapter (this is what un-permuting guards against)."""
    model = base_model(llama_dir)
    pairs = random_pairs(model, seed=3, rank=RANK, keys=["q_proj", "k_proj"])
    root = tmp_path / "root"
    write_gguf_adapter(root / "right.gguf", pairs, alpha=ALPHA, heads=LLAMA_HEADS)
    write_gguf_adapter(root / "unpermuted.gguf", pairs, alpha=ALPHA, heads=None)
    write_peft_adapter(root / "p", pairs, rank=RANK, alpha=ALPHA)
    adapters = manager(model, root)
    for adapter_id, path in (("right", "right.gguf"), ("wrong", "unpermuted.gguf"), ("p", "p")):
        adapters.mount(adapter_id, path)
    peft = logits(model, adapters, "p")
    assert mx.array_equal(logits(model, adapters, "right"), peft)
    assert mx.abs(logits(model, adapters, "wrong") - peft).max().item() > 1e-3


def test_scaled_and_stacked_specs_take_a_gguf_adapter(tmp_path, llama_dir):
    model = base_model(llama_dir)
    root = tmp_path / "root"
    first, second = random_pairs(model, seed=4), random_pairs(model, seed=5)
    write_gguf_adapter(root / "g.gguf", first, alpha=ALPHA, heads=LLAMA_HEADS)
    write_peft_adapter(root / "p", first, rank=RANK, alpha=ALPHA)
    write_mlx_adapter(root / "other", second, scale=1.5)
    adapters = manager(model, root)
    for adapter_id in ("g", "p", "other"):
        adapters.mount(adapter_id, f"{adapter_id}.gguf" if adapter_id == "g" else adapter_id)
    stacked = logits(model, adapters, "g@0.5+other")
    assert mx.array_equal(stacked, logits(model, adapters, "p@0.5+other"))
    assert not mx.array_equal(stacked, logits(model, adapters, "g+other"))
    assert mx.array_equal(logits(model, adapters, "g@-1"), logits(model, adapters, "p@-1"))


@pytest.mark.parametrize(("alpha", "scale"), [(16.0, 4.0), (None, 1.0), (0.0, 1.0), (-2.0, -0.5)])
def test_the_scale_is_llama_cpps(tmp_path, llama_dir, alpha, scale):
    """`alpha / r`, and 1 where the file gives no alpha or 0 (llama-adapter.h's get_scale)."""
    model = base_model(llama_dir)
    root = tmp_path / "root"
    pairs = random_pairs(model, seed=6, keys=["v_proj"])
    write_gguf_adapter(root / "g.gguf", pairs, alpha=alpha, heads=LLAMA_HEADS)
    write_mlx_adapter(root / "m", pairs, scale=scale)
    adapters = manager(model, root)
    assert adapters.mount("g", "g.gguf").scale == scale
    adapters.mount("m", "m")
    assert mx.array_equal(logits(model, adapters, "g"), logits(model, adapters, "m"))


def test_a_directory_holding_one_gguf_file_mounts_it(tmp_path, llama_dir):
    model = base_model(llama_dir)
    root = tmp_path / "root"
    pairs = random_pairs(model, seed=7)
    write_gguf_adapter(root / "sft" / "sft-lora-f32.gguf", pairs, alpha=ALPHA, heads=LLAMA_HEADS)
    adapters = manager(model, root)
    info = adapters.mount("sft", "sft")
    assert info.path == str(root / "sft") and info.rank == RANK
    assert adapters.mount("again", "sft/sft-lora-f32.gguf").revision == info.revision


def test_a_peft_directory_with_its_conversion_beside_reads_the_safetensors(tmp_path, llama_dir):
    """convert_lora_to_gguf.py writes its file into the PEFT directory by default."""
    model = base_model(llama_dir)
    root = tmp_path / "root"
    pairs = random_pairs(model, seed=8)
    write_peft_adapter(root / "sft", pairs, rank=RANK, alpha=ALPHA)
    write_gguf_adapter(root / "sft" / "Sft-F32-LoRA.gguf", pairs, alpha=ALPHA, heads=LLAMA_HEADS)
    adapters = manager(model, root)
    adapters.mount("dir", "sft")
    adapters.mount("file", "sft/Sft-F32-LoRA.gguf")
    cards = {info.id: info for info in adapters.list()}
    assert cards["dir"].size_bytes == (root / "sft" / "adapter_model.safetensors").stat().st_size
    assert mx.array_equal(logits(model, adapters, "dir"), logits(model, adapters, "file"))


# A Hugging Face checkpoint's mlx-lm names -> the families whose importer maps them differently:
# qwen2 keeps q/k rows as they are, phi3's projections are fused, gemma3's type is gemma3_text.
@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma3", "mistral"])
def test_other_families_mount_as_their_peft_twins(tmp_path, family):
    write_family_gguf(tmp_path / "base.gguf", family)
    model = base_model(import_gguf(tmp_path / "base.gguf", tmp_path / "model"))
    args = FAMILIES[family].model_args(8)
    heads = (args.num_attention_heads, args.num_key_value_heads)
    root = tmp_path / "root"
    pairs = random_pairs(model, seed=9)
    arch = FAMILIES[family].arch
    permuted = heads if arch == "llama" else None
    write_gguf_adapter(root / "g.gguf", pairs, alpha=ALPHA, arch=arch, heads=permuted)
    write_peft_adapter(root / "p", pairs, rank=RANK, alpha=ALPHA)
    adapters = manager(model, root)
    assert adapters.mount("g", "g.gguf").mounted_layers == len(pairs)
    adapters.mount("p", "p")
    with_gguf = logits(model, adapters, "g")
    assert mx.array_equal(with_gguf, logits(model, adapters, "p"))
    assert mx.abs(with_gguf - logits(model)).max().item() > 1e-3


def test_fuse_takes_a_gguf_adapter(tmp_path, llama_dir):
    model = base_model(llama_dir)
    pairs = random_pairs(model, seed=10, keys=["q_proj", "k_proj", "down_proj"])
    write_gguf_adapter(tmp_path / "g.gguf", pairs, alpha=ALPHA, heads=LLAMA_HEADS)
    write_peft_adapter(tmp_path / "p", pairs, rank=RANK, alpha=ALPHA)
    from_gguf = base_model(fuse_adapter(llama_dir, tmp_path / "g.gguf", tmp_path / "fused-g"))
    from_peft = base_model(fuse_adapter(llama_dir, tmp_path / "p", tmp_path / "fused-p"))
    assert mx.array_equal(logits(from_gguf), logits(from_peft))


# --- refusals: the OpenAI error's message names the problem, and nothing is mounted ----------

Q_PROJ = "model.layers.0.self_attn.q_proj"


def good_pairs(model: nn.Module) -> dict[str, tuple[mx.array, mx.array]]:
    return random_pairs(model, seed=11, keys=["q_proj", "v_proj"])


def gguf_with(root: Path, model: nn.Module, **options: object) -> str:
    write_gguf_adapter(
        root / "bad.gguf",
        good_pairs(model),
        **{"alpha": ALPHA, "heads": LLAMA_HEADS, **options},  # type: ignore[arg-type]
    )
    return "bad.gguf"


def pairs_with(model: nn.Module, path: str, a_shape: tuple, b_shape: tuple) -> dict:
    return {**good_pairs(model), path: (mx.zeros(a_shape), mx.zeros(b_shape))}


def base_gguf(root: Path, model: nn.Module) -> str:
    write_tiny_gguf(root / "model.gguf")
    return "model.gguf"


def not_gguf(root: Path, model: nn.Module) -> str:
    (root / "notes.gguf").write_text("not a GGUF file at all")
    return "notes.gguf"


def plain_file(root: Path, model: nn.Module) -> str:
    (root / "weights.bin").write_bytes(b"\x00\x01 neither a GGUF nor a directory")
    return "weights.bin"


def two_files(root: Path, model: nn.Module) -> str:
    for name in ("a.gguf", "b.gguf"):
        write_gguf_adapter(root / "two" / name, good_pairs(model), alpha=ALPHA, heads=LLAMA_HEADS)
    return "two"


def truncated(root: Path, model: nn.Module) -> str:
    name = gguf_with(root, model)
    data = (root / name).read_bytes()
    (root / name).write_bytes(data[:-100])
    return name


def unknown_type(root: Path, model: nn.Module) -> str:
    """A LoRA half whose type id no ggml release this reader knows has (a newer file)."""
    name = gguf_with(root, model)
    data = bytearray((root / name).read_bytes())
    tensor = b"blk.0.attn_q.weight.lora_a"
    at = data.find(tensor) + len(tensor)
    dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * dims, 250)  # after the name: dims, shape, type
    (root / name).write_bytes(bytes(data))
    return name


def mixed_ranks(root: Path, model: nn.Module) -> str:
    pairs = {**random_pairs(model, seed=12, keys=["q_proj"], rank=4)}
    pairs |= random_pairs(model, seed=13, keys=["v_proj"], rank=8)
    write_gguf_adapter(root / "bad.gguf", pairs, alpha=ALPHA, heads=LLAMA_HEADS)
    return "bad.gguf"


def renamed(name: str):
    return lambda root, model: gguf_with(root, model, names={Q_PROJ: name})


def poisoned(root: Path, model: nn.Module) -> str:
    pairs = good_pairs(model)
    a, b = pairs[Q_PROJ]
    b = mx.array(b)
    b[0, 0] = float("nan")
    pairs[Q_PROJ] = (a, b)
    write_gguf_adapter(root / "bad.gguf", pairs, alpha=ALPHA, heads=LLAMA_HEADS)
    return "bad.gguf"


# (case id, path maker, words in the message)
REFUSED = [
    ("base-model-gguf", base_gguf, "model.gguf is not a LoRA adapter: its general.type is none"),
    ("model-type", lambda r, m: gguf_with(r, m, general_type="model"),
     "its general.type is 'model', not 'adapter' (a model GGUF is served with --model"),
    ("control-vector", lambda r, m: gguf_with(r, m, adapter_type="cvec"),
     "adapter.type 'cvec' is not supported"),
    ("type-of-numbers", lambda r, m: gguf_with(
        r, m, general_type=None, metadata={"general.type": [1, 2]}),
     "bad.gguf is not a LoRA adapter: its general.type is array([1, 2]"),
    ("alora", lambda r, m: gguf_with(r, m, metadata={"adapter.alora.invocation_tokens": [1, 2]}),
     "activated LoRA"),
    ("not-gguf", not_gguf, "notes.gguf cannot be read as a GGUF adapter"),
    ("plain-file", plain_file, "weights.bin is not an adapter"),
    ("two-gguf-files", two_files, "holds 2 .gguf files (a.gguf, b.gguf); mount one by its path"),
    ("truncated", truncated,
     "bad.gguf is truncated: blk.1.attn_q.weight.lora_b ends past the end of the file"),
    ("unknown-type", unknown_type, "blk.0.attn_q.weight.lora_a is stored as type id 250"),
    ("other-arch", lambda r, m: gguf_with(r, m, arch="qwen2", heads=None),
     "bad.gguf is a LoRA adapter for qwen2 models; the base model is llama"),
    ("unknown-arch", lambda r, m: gguf_with(r, m, arch="mamba"), "architecture 'mamba'"),
    ("unknown-tensor", renamed("blk.0.attn_foo"),
     "blk.0.attn_foo.weight.lora_a (not a tensor name of llama.cpp's llama models)"),
    ("norm-lora", renamed("blk.0.attn_norm"),
     "blk.0.attn_norm.weight.lora_a (input_layernorm is not a projection that takes LoRA)"),
    ("layer-the-base-lacks", renamed("blk.7.attn_q"),
     "the base model has no model.layers.7.self_attn.q_proj"),
    ("fused-the-base-lacks", renamed("blk.0.attn_qkv"), "(not a tensor name of llama.cpp's llama"),
    ("expert", renamed("blk.0.ffn_gate_exps"), "MoE expert weights take no LoRA here"),
    ("token-embd", lambda r, m: gguf_with(
        r, m, extra_tensors={"token_embd.weight.lora_a": np.zeros((4, 64), np.float32),
                             "token_embd.weight.lora_b": np.zeros((4, 271), np.float32)}),
     "token_embd.weight.lora_a (embeddings take no LoRA here)"),
    ("output", lambda r, m: gguf_with(
        r, m, extra_tensors={"output.weight.lora_a": np.zeros((4, 64), np.float32),
                             "output.weight.lora_b": np.zeros((271, 4), np.float32)}),
     "output.weight.lora_a (the output head takes no LoRA here)"),
    ("norm-vector", lambda r, m: gguf_with(
        r, m, extra_tensors={"blk.0.attn_norm.weight": np.ones(64, np.float32)}),
     "blk.0.attn_norm.weight (a norm vector: llama.cpp skips these"),
    ("not-a-half", lambda r, m: gguf_with(
        r, m, extra_tensors={"blk.0.attn_q.weight.lora_c": np.ones((4, 64), np.float32)}),
     "blk.0.attn_q.weight.lora_c (not a LoRA half"),
    ("missing-half", lambda r, m: gguf_with(
        r, m, extra_tensors={
            "blk.0.attn_k.weight.lora_a": np.zeros((4, 64), np.float32)}),
     "blk.0.attn_k.weight: lora_a is present but its lora_b is missing"),
    ("wrong-shapes", lambda r, m: write_gguf_adapter(
        r / "bad.gguf", pairs_with(m, Q_PROJ, (64, 4), (4, 32)), alpha=ALPHA).name,
     "blk.0.attn_q.weight: lora_a (4, 64) and lora_b (32, 4) (rows first) do not fit the base "
     "projection: it takes 64 inputs to 64 outputs"),
    ("not-transposed", lambda r, m: write_gguf_adapter(
        r / "bad.gguf", pairs_with(m, "model.layers.0.mlp.up_proj", (128, 4), (4, 64)),
        alpha=ALPHA).name,
     "blk.0.ffn_up.weight: lora_a (4, 128) and lora_b (64, 4)"),
    ("mixed-ranks", mixed_ranks, "the adapter's pairs differ in rank"),
    ("rank-over-limit", lambda r, m: write_gguf_adapter(
        r / "bad.gguf", random_pairs(m, seed=14, rank=16), alpha=ALPHA).name,
     "adapter rank 16 is above this server's limit of 8"),
    ("q4-tensor", lambda r, m: gguf_with(r, m, types=(Q.Q4_0, Q.F32)),
     "blk.0.attn_v.weight.lora_a is stored as Q4_0; LoRA tensors mount from F32, F16, BF16, Q8_0"),
    ("q8-rows-too-short", lambda r, m: gguf_with(r, m, extra_tensors={
        "blk.0.attn_output.weight.lora_a": np.zeros((4, 64), np.float32),
        "blk.0.attn_output.weight.lora_b": (np.zeros((64, 4), np.float32), Q.Q8_0, (64, 4))}),
     "blk.0.attn_output.weight.lora_b: Q8_0 rows of 32 values cannot hold shape (64, 4)"),
    ("alpha-past-bound", lambda r, m: gguf_with(r, m, alpha=1e6),
     "the adapter scale 250000 (adapter.lora.alpha / r) is outside the bound |scale| <= 10000"),
    ("alpha-nan", lambda r, m: gguf_with(r, m, alpha=float("nan")),
     "adapter.lora.alpha must be a finite number, got nan"),
    ("nan-values", poisoned,
     "NaN or infinite values in the tensor model.layers.0.self_attn.q_proj.lora_B.weight"),
    *[(f"header-{case}", lambda r, m, values=values: write_raw_gguf(r / "bad.gguf", values).name,
       words) for case, (values, words) in MALFORMED_HEADERS.items()],
]  # fmt: skip


@pytest.fixture(scope="module")
def refusing(tmp_path_factory, llama_dir):
    """One manager over the base with a GGUF adapter mounted, for every refusal to leave as is."""
    root = tmp_path_factory.mktemp("refusals")
    model, shapes = base_model(llama_dir), base_model(llama_dir)  # `shapes` takes no slots
    adapters = manager(model, root, max_rank=8)
    write_gguf_adapter(root / "ok.gguf", good_pairs(shapes), alpha=ALPHA, heads=LLAMA_HEADS)
    adapters.mount("ok", "ok.gguf")
    return root, model, adapters, shapes


def snapshot(model: nn.Module, adapters: AdapterManager) -> tuple:
    return (
        [(i.id, i.revision, i.ram_bytes, i.mounted_at) for i in adapters.list()],
        {path: (id(slot), id(slot.base)) for path, slot in slots(model).items()},
        parameter_ids(model),
    )


@pytest.mark.parametrize(
    ("make_path", "words"), [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED]
)
def test_a_refused_gguf_file_mounts_nothing(refusing, make_path, words):
    root, model, adapters, shapes = refusing
    for leftover in root.glob("bad*"):
        leftover.unlink()
    before = snapshot(model, adapters)
    base, adapted = logits(model), logits(model, adapters, "ok")
    path = make_path(root, shapes)
    with pytest.raises(InvalidAdapter) as caught:
        adapters.mount("sft", path)
    assert words in str(caught.value)
    assert (caught.value.param, caught.value.code) == ("path", "invalid_adapter")
    with pytest.raises(InvalidAdapter):
        adapters.mount("ok", path, replace=True)
    assert snapshot(model, adapters) == before
    assert mx.array_equal(logits(model), base)
    assert mx.array_equal(logits(model, adapters, "ok"), adapted)


def test_a_base_without_its_type_or_head_counts_is_refused(tmp_path, llama_dir):
    """The file is checked against the base's type, and llama's q/k rows put back by the base's
    own head counts: targets that do not say them refuse a llama.cpp file."""
    model = base_model(llama_dir)
    linears = find_targets(model)
    bare = {path: linear_dims(linear) for path, linear in linears.items()}
    laid_out = with_base_layout(model, bare)
    assert laid_out[Q_PROJ].heads == HEADS and laid_out[Q_PROJ].model_type == "llama"
    assert laid_out["model.layers.0.self_attn.k_proj"].heads == KV_HEADS
    assert laid_out["model.layers.0.self_attn.v_proj"].heads is None
    path = write_gguf_adapter(tmp_path / "g.gguf", random_pairs(model, seed=15), alpha=ALPHA)
    with pytest.raises(InvalidAdapter, match="the base model's type is not known here"):
        read_adapter(path, bare, max_rank=8)
    headless = {p: replace(dims, heads=None) for p, dims in laid_out.items()}
    with pytest.raises(InvalidAdapter, match="does not say how many heads its 32 rows hold"):
        read_adapter(path, headless, max_rank=8)
    assert read_adapter(path, laid_out, max_rank=8).config.rank == RANK


def test_the_embedded_models_q_and_k_rows_come_back_in_order(tmp_path, embedded_model_dir):
    """SmolLM2 (9 query and 3 key-value heads of 64): a llama.cpp file for it gives the arrays
    and logits of its PEFT original."""
    model = base_model(embedded_model_dir)
    pairs = random_pairs(model, seed=16, rank=8, keys=["q_proj", "k_proj"])
    root = tmp_path / "root"
    write_gguf_adapter(root / "g.gguf", pairs, alpha=16.0, heads=(9, 3), types=(Q.F16, Q.F16))
    write_peft_adapter(root / "p", stored_pairs(pairs, (Q.F16, Q.F16)), rank=8, alpha=16.0)
    adapters = manager(model, root)
    assert adapters.mount("g", "g.gguf").mounted_layers == 60
    adapters.mount("p", "p")
    with_gguf = logits(model, adapters, "g")
    assert mx.array_equal(with_gguf, logits(model, adapters, "p"))
    assert mx.abs(with_gguf - logits(model)).max().item() > 1e-3
