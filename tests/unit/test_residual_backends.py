"""The residual backend each kind of weights selects, and what each adds: a set alone and a set
per row, against MLX's own terms on the same served model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from hotlora.adapters import AdapterManager, RowAdapterCache, RowAdapters, activate
from hotlora.adapters import slots as slot_module
from hotlora.adapters.backends import selector
from hotlora.models.cpu import extension, install_packed_kernels, install_rows_kernels

from tests.support.adapter_builders import (
    BASE_ID,
    TOKENS,
    adapter_set,
    logits,
    random_pairs,
    slots,
    tiny_model,
    write_mlx_adapter,
)

KINDS = {"packed": "gathered", "float32": "side-by-side", "mlx": "mlx"}
SPECS = ["a", "b", "a+b", ""]


def served(kind: str, root: Path) -> tuple[nn.Module, AdapterManager]:
    """The tiny llama served as `kind` (packed 4-bit or float32 on the native kernels, or MLX's
    own layers), its slots installed after, with adapters `a` and `b` mounted."""
    model = tiny_model(quantize=kind == "packed")
    if kind == "packed":
        assert install_packed_kernels(model, threads=2).enabled
    elif kind == "float32":
        model.set_dtype(mx.float32)
        assert install_rows_kernels(model, threads=2).enabled
    manager = AdapterManager(model, base_id=BASE_ID, adapter_root=root, max_rank=64)
    for seed, adapter_id in enumerate(("a", "b"), start=1):
        if not (root / adapter_id).exists():
            write_mlx_adapter(root / adapter_id, random_pairs(tiny_model(), seed=seed))
        manager.mount(adapter_id, adapter_id)
    return model, manager


def outputs(model: nn.Module, manager: AdapterManager) -> dict[str, mx.array]:
    """Logits of a prompt and of a one-token step for each set alone, and for the sets on rows
    of their own in one call (`mixed:` and `step:`)."""
    sets = [adapter_set(manager, spec) for spec in SPECS]
    prompts = mx.concatenate([TOKENS] * len(sets))  # [rows, L]
    steps = mx.array([[7]] * len(sets))  # [rows, 1]: a batched decode step's shape
    got = {}
    for spec, adapters in zip(SPECS, sets, strict=True):
        with activate(adapters):
            got[spec] = logits(model, TOKENS)[0]
    for name, tokens in (("mixed", prompts), ("step", steps)):
        batch = RowAdapterCache().for_rows(sets)
        assert isinstance(batch, RowAdapters)
        with activate(batch):
            out = logits(model, tokens)
        for row, spec in enumerate(SPECS):
            got[f"{name}:{spec}"] = out[row]
    return got


@pytest.fixture(scope="module", autouse=True)
def kernels():
    loaded = extension.load(2)
    if isinstance(loaded, str):
        pytest.skip(f"native kernels: {loaded}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_weights_selects_its_backend_and_adds_what_mlx_terms_add(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Packed 4-bit weights take the gathered backend, float32 weights on the native kernels
    the side-by-side one, MLX's layers MLX's own; each gives a set alone and sets on rows of
    their own what MLX's terms give on the same layers, and a row beside others what it gets
    alone (the same bits on packed weights)."""
    model, manager = served(kind, tmp_path)
    assert {slot.backend.name for slot in slots(model).values()} == {KINDS[kind]}
    got = outputs(model, manager)

    # The same model served the same way, every slot on MLX's own terms: the reference.
    monkeypatch.setattr(slot_module, "select_backend", lambda base, gpu=None: selector.MLX)
    reference_model, reference_manager = served(kind, tmp_path)
    assert {slot.backend.name for slot in slots(reference_model).values()} == {"mlx"}
    expected = outputs(reference_model, reference_manager)

    for name, value in got.items():
        difference = mx.abs(value - expected[name]).max().item()
        assert difference < 1e-3, (kind, name, difference)
    for spec in SPECS:
        row, alone = got[f"mixed:{spec}"], got[spec]
        if kind == "packed":
            assert mx.array_equal(row, alone).item(), spec
        else:
            assert mx.abs(row - alone).max().item() < 1e-4, spec
    assert mx.abs(got["a"] - got[""]).max().item() > 1e-2  # the adapters really apply
    assert mx.abs(got["step:a"] - got["step:b"]).max().item() > 1e-2


def test_a_gpu_selects_mlx_terms_whatever_the_layers():
    model = tiny_model(quantize=True)
    assert install_packed_kernels(model, threads=2).enabled
    projection = model.layers[0].self_attn.q_proj
    assert selector.select_backend(projection, gpu=False) is selector.GATHERED
    assert selector.select_backend(projection, gpu=True) is selector.MLX
