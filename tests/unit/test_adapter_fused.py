"""LoRA on fused projections (phi3's `qkv_proj`, `gate_up_proj`) matches mlx-lm's own LoRA."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.tuner.utils import load_adapters

from hotlora.adapters import (
    BASE_ONLY,
    AdapterManager,
    InvalidAdapter,
    RowAdapterCache,
    RowAdapters,
    activate,
)

from tests.support.adapter_builders import (
    BASE_ID,
    RANK,
    SCALE,
    TOKENS,
    Pairs,
    adapter_set,
    logits,
    random_pairs,
    slots,
    tiny_model,
    tiny_phi3,
    write_mlx_adapter,
    write_peft_adapter,
)

FUSED = ("qkv_proj", "gate_up_proj")
TOLERANCE = 1e-4


def mlx_lm_logits(directory: Path) -> mx.array:
    """The logits of a fresh tiny phi3 with the adapter loaded by mlx-lm's `load_adapters`."""
    model = tiny_phi3()
    load_adapters(model, str(directory))
    return logits(model)


def merged_phi3(terms: list[tuple[Pairs, float]]) -> mx.array:
    """The logits of a tiny phi3 with `W + scale * (A @ B).T` written into its weights."""
    model = tiny_phi3()
    linears = dict(model.named_modules())
    for pairs, scale in terms:
        for path, (a, b) in pairs.items():
            linears[path].weight = linears[path].weight + scale * (a @ b).T  # [out, in]
    return logits(model)


def difference(x: mx.array, y: mx.array) -> float:
    return mx.abs(x - y).max().item()


@pytest.fixture
def mounted(tmp_path: Path):
    """A phi3 with `fused` (only the fused projections) and `all` (every projection) mounted."""
    model = tiny_phi3()
    manager = AdapterManager(model, base_id=BASE_ID, adapter_root=tmp_path, max_rank=8)
    pairs = {
        "fused": random_pairs(tiny_phi3(), keys=FUSED, seed=1),
        "all": random_pairs(tiny_phi3(), seed=2),
    }
    for name, adapter_pairs in pairs.items():
        write_mlx_adapter(tmp_path / name, adapter_pairs)
        manager.mount(name, name)
    return model, manager, pairs, tmp_path


def test_phi3s_fused_projections_are_slots():
    model = tiny_phi3()
    AdapterManager(model, base_id=BASE_ID, adapter_root=Path("/nonexistent"), max_rank=8)
    leaves = sorted({path.rsplit(".", 1)[-1] for path in slots(model)})
    assert leaves == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert len(slots(model)) == 8


@pytest.mark.parametrize("name", ["fused", "all"])
def test_one_adapter_matches_mlx_lms_load_adapters(mounted, name):
    model, manager, pairs, root = mounted
    assert manager.get(name).mounted_layers == len(pairs[name])
    expected = mlx_lm_logits(root / name)
    assert difference(expected, logits(tiny_phi3())) > 1e-2  # the adapter changes the answer
    with activate(adapter_set(manager, name)):
        assert difference(logits(model), expected) < TOLERANCE


def test_a_stack_sums_both_residuals(mounted):
    model, manager, pairs, _ = mounted
    expected = merged_phi3([(pairs["fused"], SCALE), (pairs["all"], 0.5 * SCALE)])
    with activate(adapter_set(manager, "fused+all@0.5")):
        assert difference(logits(model), expected) < TOLERANCE


def test_each_row_of_a_mixed_batch_gets_its_own_sets_residual(mounted):
    model, manager, _, _ = mounted
    specs = ["fused", "all", "fused+all@0.5"]
    rows = [BASE_ONLY, *(adapter_set(manager, spec) for spec in specs)]
    batch = RowAdapterCache().for_rows(rows)
    assert isinstance(batch, RowAdapters)
    with activate(batch):
        batched = logits(model, mx.concatenate([TOKENS] * len(rows)))
    for i, adapters in enumerate(rows):
        with activate(adapters):
            alone = logits(model)
        assert difference(batched[i : i + 1], alone) < TOLERANCE, f"row {i}"
    assert difference(batched[0], batched[1]) > 1e-2


def test_a_peft_phi3_adapter_matches_mlx_lm(tmp_path: Path):
    pairs = random_pairs(tiny_phi3(), keys=FUSED, seed=3)
    write_mlx_adapter(tmp_path / "mlx", pairs)
    write_peft_adapter(tmp_path / "peft", pairs, alpha=SCALE * RANK)
    model = tiny_phi3()
    manager = AdapterManager(model, base_id=BASE_ID, adapter_root=tmp_path, max_rank=8)
    assert manager.mount("peft", "peft").mounted_layers == 4
    with activate(adapter_set(manager, "peft")):
        assert difference(logits(model), mlx_lm_logits(tmp_path / "mlx")) < TOLERANCE


def test_a_split_projection_adapter_is_refused_on_phi3(tmp_path: Path):
    """A llama adapter names q_proj, which phi3 fuses: refused, not mounted with a part left out."""
    write_mlx_adapter(tmp_path / "llama", random_pairs(tiny_model()))
    manager = AdapterManager(tiny_phi3(), base_id=BASE_ID, adapter_root=tmp_path, max_rank=8)
    with pytest.raises(InvalidAdapter, match="modules the base model does not have"):
        manager.mount("llama", "llama")
    assert manager.list() == []
