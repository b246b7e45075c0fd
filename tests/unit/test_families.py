"""Each model family hotlora serves, at a tiny random size: adapters, mixed batches and the
scheduler answer as mlx-lm and as each row alone would."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tuner.utils import load_adapters

from hotlora.adapters import (
    BASE_ONLY,
    AdapterManager,
    AdapterSet,
    RowAdapterCache,
    RowAdapters,
    activate,
)
from hotlora.adapters.projections import TARGET_PROJECTIONS
from hotlora.models.batch_masks import install_row_masks
from hotlora.models.cpu import extension, install_packed_kernels, install_rows_kernels
from hotlora.models.cpu.layers import NativeLinear, NativeOffsetRMSNorm, NativeRMSNorm, NativeRoPE
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import Engine, GenerationJob, SamplingParams, Scheduler, check_batching

from tests.support.adapter_builders import (
    BASE_ID,
    RANK,
    SCALE,
    TOKENS,
    Pairs,
    adapter_set,
    logits,
    random_pairs,
    write_mlx_adapter,
    write_peft_adapter,
)
from tests.support.families import FAMILIES, LONG, WINDOW, Family
from tests.support.fidelity import LOGIT_TOLERANCE, dequantized_reference, relative_difference
from tests.support.scheduling import Recorder, run
from tests.support.tiny import ENDOFTEXT_ID, EOS_TOKEN_ID, MAX_POSITION_EMBEDDINGS, write_checkpoint

TOLERANCE = 1e-4


def cases(names: Callable[[Family], bool] = lambda family: True) -> list:
    """The families a check runs on."""
    return [pytest.param(name, id=name) for name, family in FAMILIES.items() if names(family)]


@dataclass
class Mounted:
    """A family's model with adapters `a` and `b` mounted, and what built them."""

    name: str
    family: Family
    model: nn.Module
    manager: AdapterManager
    pairs: dict[str, Pairs]
    root: Path

    def sets(self) -> dict[str, AdapterSet]:
        return {spec: adapter_set(self.manager, spec) for spec in ("a", "b", "a+b")}

    def mlx_lm_logits(self, adapter: str, tokens: mx.array) -> mx.array:
        """A fresh copy with the adapter loaded by mlx-lm's own `load_adapters`."""
        model = self.family.build(self.name)
        load_adapters(model, str(self.root / adapter))
        return logits(model, tokens)

    def merged_logits(self, tokens: mx.array) -> mx.array:
        """A fresh copy with `W + scale * (A @ B).T` of both adapters in its weights."""
        model = self.family.build(self.name)
        modules = dict(model.named_modules())
        for pairs in self.pairs.values():
            for path, (a, b) in pairs.items():
                modules[path].weight = modules[path].weight + SCALE * (a @ b).T  # [out, in]
        return logits(model, tokens)


def mount_a_and_b(name: str, model: nn.Module, root: Path) -> tuple[AdapterManager, dict]:
    """A manager over `model` with two random adapters of the family mounted, `a` and `b`."""
    family = FAMILIES[name]
    manager = AdapterManager(model, base_id=BASE_ID, adapter_root=root, max_rank=8)
    pairs = {}
    for seed, adapter in enumerate(("a", "b"), start=1):
        keys = family.keys or TARGET_PROJECTIONS
        pairs[adapter] = random_pairs(family.build(name), seed=seed, keys=keys)
        write_mlx_adapter(root / adapter, pairs[adapter])
        assert manager.mount(adapter, adapter).mounted_layers == len(pairs[adapter])
    return manager, pairs


@pytest.fixture(scope="module")
def mounted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Mounted:
    """The family's model with `a` and `b` mounted, built once per family for the module."""
    name = request.param
    root = tmp_path_factory.mktemp(f"adapters-{name}")
    model = FAMILIES[name].build(name)
    manager, pairs = mount_a_and_b(name, model, root)
    return Mounted(name, FAMILIES[name], model, manager, pairs, root)


def difference(x: mx.array, y: mx.array) -> float:
    return mx.abs(x - y).max().item()


@pytest.mark.parametrize("mounted", cases(), indirect=True)
def test_base_and_adapters_alone_equal_mlx_lm(mounted: Mounted):
    untouched = logits(mounted.family.build(mounted.name))
    assert mx.array_equal(logits(mounted.model), untouched).item()
    with activate(BASE_ONLY):
        assert mx.array_equal(logits(mounted.model), untouched).item()
    sets = mounted.sets()
    expected = mounted.mlx_lm_logits("a", TOKENS)
    assert difference(expected, untouched) > 1e-2  # the adapter changes the answer
    with activate(sets["a"]):
        assert difference(logits(mounted.model), expected) < TOLERANCE
    with activate(sets["a+b"]):
        assert difference(logits(mounted.model), mounted.merged_logits(TOKENS)) < TOLERANCE


def mixed_batch_matches_rows_alone(mounted: Mounted, tokens: mx.array) -> None:
    sets = mounted.sets()
    rows = [BASE_ONLY, sets["a"], sets["b"], sets["a+b"]]
    batch = RowAdapterCache().for_rows(rows)
    assert isinstance(batch, RowAdapters)
    with activate(batch):
        batched = logits(mounted.model, mx.concatenate([tokens] * len(rows)))
    for i, adapters in enumerate(rows):
        with activate(adapters):
            alone = logits(mounted.model, tokens)
        assert difference(batched[i : i + 1], alone) < TOLERANCE, f"row {i}"
    assert difference(batched[1], batched[2]) > 1e-2


@pytest.mark.parametrize("mounted", cases(), indirect=True)
def test_each_row_of_a_mixed_batch_equals_the_row_alone(mounted: Mounted):
    mixed_batch_matches_rows_alone(mounted, TOKENS)


def sliding(family: Family) -> bool:
    return family.sliding


@pytest.mark.parametrize("mounted", cases(sliding), indirect=True)
def test_a_prompt_longer_than_the_window_alone_and_batched(mounted: Mounted):
    with activate(adapter_set(mounted.manager, "a")):
        alone = logits(mounted.model, LONG)
    assert difference(alone, mounted.mlx_lm_logits("a", LONG)) < TOLERANCE
    mixed_batch_matches_rows_alone(mounted, LONG)


def write_family_dir(directory: Path, name: str, family: Family) -> Path:
    """A checkpoint directory of the family: the tiny tokenizer, its config and weights."""
    model = family.build(name)
    config = {
        **dataclasses.asdict(family.model_args(name)),
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": ENDOFTEXT_ID,
    }
    if "query_pre_attn_scalar" in config:  # transformers' config class takes an int here
        config["query_pre_attn_scalar"] = int(config["query_pre_attn_scalar"])
    return write_checkpoint(directory, model, config)


def job(prompt: list[int], adapters: AdapterSet | None) -> GenerationJob:
    sampling = SamplingParams(max_tokens=6, temperature=0.0)
    if adapters is None:
        return GenerationJob(prompt, sampling)
    return GenerationJob(prompt, sampling, adapters)


@pytest.mark.parametrize("name", cases())
def test_the_scheduler_batches_rows_as_each_alone(name: str, tmp_path: Path):
    family = FAMILIES[name]
    loaded = load_model_dir(write_family_dir(tmp_path / "model", name, family))
    assert check_batching(loaded.model) is None  # start-up would serve it batched
    manager, _ = mount_a_and_b(name, loaded.model, tmp_path)
    engine = Engine(loaded, base_id=BASE_ID, prompt_cache_size=0)
    long = LONG[0].tolist()  # past the window of the sliding-window families
    rows = [([5, 6, 7], ""), (long, "a"), ([9, 10, 11, 12, 13], "b"), ([20, 21], "a+b")]

    def jobs(prompt: list[int], spec: str) -> list[GenerationJob]:
        return [job(prompt, adapter_set(manager, spec) if spec else None)]

    scheduler = Scheduler(engine, max_batch=len(rows))
    batched = [Recorder() for _ in rows]
    for row, sink in zip(rows, batched, strict=True):
        scheduler.add(jobs(*row), sink)
    widest = 0
    for _ in range(100):
        if scheduler.idle:
            break
        scheduler.step()
        widest = max(widest, len(scheduler.running))
    assert scheduler.idle
    assert [sink.errors for sink in batched] == [[]] * len(rows)
    assert widest == len(rows)  # every row decoded in one batch at some step
    for i, row in enumerate(rows):
        alone = run(Scheduler(engine, max_batch=1), [jobs(*row)])[0]
        assert batched[i].text() == alone.text(), f"row {i} ({row[1] or 'base'})"
        assert batched[i].finished() == alone.finished(), f"row {i} ({row[1] or 'base'})"


class CountingKernels:
    """The native extension, counting the batched calls of its projection and attention."""

    def __init__(self, native: ModuleType):
        self.native, self.calls = native, Counter[str]()

    def __getattr__(self, name: str) -> object:
        kernel = getattr(self.native, name)
        if name not in ("rows_matmul", "rows_matmul_lora", "attention_rows"):
            return kernel

        def counted(*args: object) -> object:
            self.calls[name] += 1
            return kernel(*args)

        return counted


def batched_step(
    model: nn.Module, prompts: list[list[int]], sets: list[AdapterSet] | None = None
) -> mx.array:
    """Each prompt but its last token prefilled alone (under its row's adapter set, if given),
    then one batched decode step of all the rows, their caches merged as the scheduler merges
    them: logits [rows, vocab]."""
    sets = sets or [BASE_ONLY] * len(prompts)
    caches = []
    for prompt, adapters in zip(prompts, sets, strict=True):
        cache = make_prompt_cache(model)
        with activate(adapters):
            model(mx.array([prompt[:-1]]), cache=cache)
        caches.append(cache)
    merged = [layer[0].merge(list(layer)) for layer in zip(*caches, strict=True)]
    with activate(RowAdapterCache().for_rows(sets)):
        step = model(mx.array([[p[-1]] for p in prompts]), cache=merged)[:, -1, :]
    mx.eval(step)
    return step


# What each family leaves to MLX's own operations once the kernels are installed.
MLX_PARTS = {
    "gemma2": "the attention of gemma2 (its own)",
    "qwen3_moe": "6 switch_layers.SwitchLinear",
}


@pytest.mark.parametrize("name", cases())
def test_a_float32_model_of_the_family_takes_the_native_kernels(name: str, monkeypatch):
    if extension.unavailable():
        pytest.skip(f"native kernels: {extension.unavailable()}")
    family = FAMILIES[name]
    model = family.build(name)
    model.set_dtype(mx.float32)
    install_row_masks(model)  # as the loader does
    prompts = [LONG[0, :n].tolist() for n in (3, 2 * WINDOW + 1, 5)]  # one past the window
    alone_before = logits(model, TOKENS)
    step_before = batched_step(model, prompts)

    state = install_rows_kernels(model, threads=2)
    assert state.enabled, state.reason
    assert f"MLX's own operations: {MLX_PARTS.get(name, 'none')}" in state.reason
    served = (NativeRMSNorm, NativeOffsetRMSNorm, NativeLinear, NativeRoPE)
    norms = [m for _, m in model.named_modules() if "Norm" in type(m).__name__]
    assert norms and all(isinstance(m, served) for m in norms)

    counting = CountingKernels(extension.native)
    monkeypatch.setattr(extension, "native", counting)
    # A request alone is MLX's to the bit (BLAS products; norms and RoPEs computing MLX's
    # operations); the batched step is the kernels', within rounding of MLX's.
    assert mx.array_equal(logits(model, TOKENS), alone_before).item()
    assert not counting.calls
    step = batched_step(model, prompts)
    assert counting.calls["rows_matmul"] > 0
    assert (counting.calls["attention_rows"] > 0) == (name != "gemma2")
    assert difference(step, step_before) < TOLERANCE


@pytest.mark.parametrize("mounted", cases(), indirect=True)
def test_the_peft_layout_of_an_adapter_equals_its_mlx_lm_layout(mounted: Mounted):
    # alpha / r = SCALE, PEFT's scale: the same residual as the mlx-lm layout's.
    peft = write_peft_adapter(mounted.root / "peft-a", mounted.pairs["a"], alpha=SCALE * RANK)
    assert mounted.manager.mount("peft-a", peft.name).mounted_layers == len(mounted.pairs["a"])
    try:
        with activate(adapter_set(mounted.manager, "peft-a")):
            peft_logits = logits(mounted.model)
        assert difference(peft_logits, mounted.mlx_lm_logits("a", TOKENS)) < TOLERANCE
    finally:
        mounted.manager.unmount("peft-a")


def quantized_family(name: str) -> nn.Module:
    """The family's tiny model quantized as mlx-lm's converter does (4 bits, groups of 32)."""
    model = FAMILIES[name].build(name)
    nn.quantize(model, group_size=32, bits=4)
    install_row_masks(model)  # as the loader does
    mx.eval(model.parameters())
    return model


def dense(family: Family) -> bool:
    """Not a mixture of experts: the packed kernels serve every quantized layer."""
    return not family.module.__name__.endswith("_moe")


# Families whose attention is their own: their rows agree with the row alone within rounding,
# not to the bit (MLX's products there).
OWN_ATTENTION = {"gemma2"}


def bitwise(name: str) -> bool:
    """Whether a row's decode is the same bits alone and batched. Not so for the sliding-window
    families: in a batch, a rotating cache holds a short row's keys in another order than alone
    (the kernel sums them in cache order), nor for an attention of the family's own."""
    return name not in OWN_ATTENTION and not FAMILIES[name].sliding


@pytest.mark.parametrize("name", cases(dense))
def test_a_packed_quantized_model_of_the_family_is_batch_invariant(name: str, tmp_path: Path):
    if extension.unavailable():
        pytest.skip(f"native kernels: {extension.unavailable()}")
    model = quantized_family(name)
    state = install_packed_kernels(model, threads=2)
    assert state.enabled, state.reason
    assert f"MLX's own operations: {MLX_PARTS.get(name, 'none')}" in state.reason
    manager, _ = mount_a_and_b(name, model, tmp_path)
    sets = [BASE_ONLY, *(adapter_set(manager, spec) for spec in ("a", "b", "a+b"))]
    prompts = [LONG[0, :n].tolist() for n in (3, 2 * WINDOW + 1, 5, 9)]  # one past the window
    together = batched_step(model, prompts, sets)
    reference = dequantized_reference(quantized_family(name))
    for row, (prompt, adapters) in enumerate(zip(prompts, sets, strict=True)):
        alone = batched_step(model, [prompt], [adapters])[0]
        if bitwise(name):
            assert mx.array_equal(together[row], alone).item(), row
        else:
            assert relative_difference(together[row], alone) < LOGIT_TOLERANCE, row
    # The base row against mlx-lm on the same weights dequantized in float32.
    assert relative_difference(together[0], batched_step(reference, [prompts[0]])[0]) < (
        LOGIT_TOLERANCE
    )
    # A prompt's logits are the same bits however it is chunked.
    whole = logits(model, LONG)
    cache = make_prompt_cache(model)
    parts = [model(LONG[:, at : at + 5], cache=cache) for at in range(0, LONG.shape[1], 5)]
    assert mx.array_equal(mx.concatenate(parts, axis=1), whole).item() or name in OWN_ATTENTION


def test_a_quantized_moe_is_served_by_mlx_with_the_reason():
    model = FAMILIES["qwen3_moe"].build("qwen3_moe")
    nn.quantize(model, group_size=32, bits=4)
    from hotlora.models.cpu import packed_unserved

    why = packed_unserved(model, batch_kernels=True)
    assert why is not None and "quantized" in why and "Switch" in why, why
