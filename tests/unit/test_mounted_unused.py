"""Mounted adapters that no request names cost a request and its decode steps nothing.

What a request and its steps do is counted, not timed: every look into the manager's table of
mounted adapters, and every side-by-side layout built for a mixed batch, from selection to the
last decode step and the lease's release. The same requests with 200 more adapters mounted do
the same, and nothing walks the table.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hotlora.adapters import AdapterManager, parse_adapter_spec
from hotlora.adapters.backends import side_by_side
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import Engine, GenerationJob, SamplingParams, Scheduler

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.scheduling import run

SPECS = ["a", "b", "", "a+b"]  # one batch: rows with different sets, the base among them
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]
UNUSED = 200


class CountedTable(dict[str, Any]):
    """The manager's table of mounted adapters, counting each way it is read."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.reads: Counter[str] = Counter()

    def __getitem__(self, key: Any) -> Any:
        self.reads["lookup"] += 1
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.reads["lookup"] += 1
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.reads["lookup"] += 1
        return super().__contains__(key)

    def __iter__(self) -> Any:
        self.reads["walk"] += 1
        return super().__iter__()

    def __len__(self) -> int:
        self.reads["walk"] += 1
        return super().__len__()

    def keys(self) -> Any:
        self.reads["walk"] += 1
        return super().keys()

    def values(self) -> Any:
        self.reads["walk"] += 1
        return super().values()

    def items(self) -> Any:
        self.reads["walk"] += 1
        return super().items()


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> tuple[Engine, AdapterManager]:
    loaded = load_model_dir(tiny_model_dir)
    reference = tiny_model()
    for seed, name in enumerate(("a", "b", "unused")):
        write_mlx_adapter(tmp_path / name, random_pairs(reference, seed=20 + seed))
    manager = AdapterManager(loaded.model, base_id="tiny", adapter_root=tmp_path, max_rank=64)
    manager.mount("a", "a")
    manager.mount("b", "b")
    return Engine(loaded, base_id="tiny", prompt_cache_size=0), manager


def serve_once(
    engine: Engine, manager: AdapterManager, monkeypatch: pytest.MonkeyPatch
) -> tuple[Counter[str], list[str], list[str]]:
    """Select, decode in one batch and release the four requests; what the table was asked,
    and the adapters of each side-by-side layout built (its ids), in order."""
    table = CountedTable(manager._mounted)
    monkeypatch.setattr(manager, "_mounted", table)
    built: list[str] = []
    build = side_by_side.SideBySide._build

    def counted_build(self: side_by_side.SideBySide, path: str, *layout: bool) -> Any:
        built.append("+".join(sorted(mounted.id for mounted in self.adapters)))
        return build(self, path, *layout)

    monkeypatch.setattr(side_by_side.SideBySide, "_build", counted_build)
    leases = [manager.select("tiny", parse_adapter_spec(spec)) for spec in SPECS]
    sampling = SamplingParams(max_tokens=6, temperature=0.0)
    jobs = [
        [GenerationJob(prompt, sampling, lease.adapters)]
        for prompt, lease in zip(PROMPTS, leases, strict=True)
    ]
    sinks = run(Scheduler(engine, max_batch=len(SPECS)), jobs)
    for lease in leases:
        lease.release()
    texts = [sink.text() for sink in sinks]
    monkeypatch.undo()
    return table.reads, built, texts


def test_a_step_costs_the_same_with_200_unused_adapters_mounted(served, monkeypatch):
    engine, manager = served
    reads, built, texts = serve_once(engine, manager, monkeypatch)
    for index in range(UNUSED):
        manager.mount(f"unused-{index:03d}", "unused")
    assert len(manager.list()) == UNUSED + 2
    reads_many, built_many, texts_many = serve_once(engine, manager, monkeypatch)

    assert texts_many == texts
    assert reads_many == reads  # a lookup per adapter a request names, whatever is mounted
    assert reads["walk"] == 0  # nothing lists what is mounted on a request's way
    assert built_many == built  # one layout per slot, of the batch's adapters alone
    assert built and set(built) == {"a+b"}
