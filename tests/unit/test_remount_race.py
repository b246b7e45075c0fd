"""Mounts, unmounts, replaces and re-mounts while mixed batches run: every answer is the answer
its request gets alone, with the adapter files its set was resolved to.

A request holds the mounts it was resolved to, so a batch can hold two mounts of one id at one
revision (a request from before an unmount and re-mount of the same files, or before a replace
away and back) beside other rows. Random operations, seeded, between scheduler steps.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from hotlora.adapters import AdapterManager, AdapterRef, AdapterSet, parse_adapter_spec
from hotlora.adapters.adapter_set import AppliedAdapter
from hotlora.models.loader import load_model_dir
from hotlora.server.engine import Engine, GenerationJob, SamplingParams, Scheduler

from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.scheduling import Recorder, run

FILES = ("one", "two", "three")  # adapter directories under the root
IDS = ("a", "b")
SPECS = ("", "a", "b", "a+b", "b@0.5+a")
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]
ROUNDS = 60
Files = tuple[tuple[str, float], ...]  # a set's mounts by the files each came from, with weights


def engine_and_manager(model_dir: Path, root: Path, mounts: dict[str, str]):
    loaded = load_model_dir(model_dir)
    manager = AdapterManager(loaded.model, base_id="tiny", adapter_root=root, max_rank=64)
    for adapter_id, directory in mounts.items():
        manager.mount(adapter_id, directory)
    return Engine(loaded, base_id="tiny", prompt_cache_size=0), manager


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    reference = tiny_model()
    for seed, name in enumerate(FILES):
        rank = 4 + seed
        write_mlx_adapter(
            root / name, random_pairs(reference, seed=20 + seed, rank=rank), rank=rank
        )
    return root


class Reference:
    """Answers alone, on a model of its own where each file is mounted under its own name."""

    def __init__(self, model_dir: Path, root: Path):
        self.engine, self.manager = engine_and_manager(
            model_dir, root, {name: name for name in FILES}
        )
        self.answers: dict[tuple[Files, tuple[int, ...], int], tuple[str, int]] = {}

    def answer(self, files: Files, prompt: list[int], max_tokens: int) -> tuple[str, int]:
        """Text and token count of the set over `files` alone."""
        key = (files, tuple(prompt), max_tokens)
        if key not in self.answers:
            entries = tuple(
                AppliedAdapter(self.manager.resolve((AdapterRef(name),)).entries[0].mounted, w)
                for name, w in files
            )
            adapters = AdapterSet(entries) if entries else None
            solo = run(Scheduler(self.engine, max_batch=1), [[job(prompt, max_tokens, adapters)]])
            finished = solo[0].finished()
            assert finished is not None and not solo[0].errors
            self.answers[key] = (solo[0].text(), finished.completion_tokens)
        return self.answers[key]


def job(prompt: list[int], max_tokens: int, adapters: AdapterSet | None) -> GenerationJob:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if adapters is None:
        return GenerationJob(prompt, params)
    return GenerationJob(prompt, params, adapters)


def over_files(adapters: AdapterSet | None, files_of: dict[int, str]) -> Files:
    """The set with each mount named by the files it was mounted from."""
    if adapters is None:
        return ()
    return tuple((files_of[id(entry.mounted)], entry.weight) for entry in adapters.entries)


def twin_mounts(rows: list[AdapterSet]) -> bool:
    """Whether two rows hold different mounts of one id at one revision."""
    mounts = {
        entry.mounted for adapters in rows for entry in adapters.entries if entry.weight != 0.0
    }
    revisions = Counter((m.id, m.adapter.revision) for m in mounts)
    return any(count > 1 for count in revisions.values())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_answers_beside_remounts_equal_the_same_requests_alone(tiny_model_dir, root, seed):
    engine, manager = engine_and_manager(tiny_model_dir, root, {"a": "one", "b": "two"})
    reference = Reference(tiny_model_dir, root)
    rng = random.Random(seed)
    scheduler = Scheduler(engine, max_batch=6)
    mounted = {"a": "one", "b": "two"}  # id -> the files mounted under it now
    files_of: dict[int, str] = {}  # id(MountedAdapter) -> its files; sets keep mounts alive
    sent: list[tuple[Recorder, Files, list[int], int]] = []
    twins = 0
    for _ in range(ROUNDS):
        action = rng.random()
        if action < 0.45:
            spec = rng.choice(SPECS)
            if all(part.split("@")[0] in mounted for part in spec.split("+") if part):
                adapters = manager.resolve(parse_adapter_spec(spec)) if spec else None
                for entry in adapters.entries if adapters else ():
                    files_of[id(entry.mounted)] = mounted[entry.mounted.id]
                prompt, max_tokens = rng.choice(PROMPTS), rng.randint(3, 12)
                sink = Recorder()
                scheduler.add([job(prompt, max_tokens, adapters)], sink)
                sent.append((sink, over_files(adapters, files_of), prompt, max_tokens))
        elif action < 0.75:  # the same files again, under a fresh mount
            adapter_id = rng.choice(IDS)
            if adapter_id in mounted:
                manager.unmount(adapter_id)
                manager.mount(adapter_id, mounted[adapter_id])
            else:
                mounted[adapter_id] = rng.choice(FILES)
                manager.mount(adapter_id, mounted[adapter_id])
        elif action < 0.9:  # replaced by other files (then, later, maybe back)
            adapter_id = rng.choice(IDS)
            files = rng.choice([f for f in FILES if f != mounted.get(adapter_id)])
            manager.mount(adapter_id, files, replace=adapter_id in mounted)
            mounted[adapter_id] = files
        elif len(mounted) > 1:
            adapter_id = rng.choice(sorted(mounted))
            manager.unmount(adapter_id)
            del mounted[adapter_id]
        for _ in range(rng.randint(1, 3)):
            if not scheduler.idle:
                scheduler.step()
                twins += twin_mounts([row.adapters for row in scheduler.running])
    for _ in range(500):
        if scheduler.idle:
            break
        scheduler.step()
        twins += twin_mounts([row.adapters for row in scheduler.running])
    assert scheduler.idle
    assert twins > 0, "no batch held two mounts of one revision: the race was not exercised"
    assert len(sent) > 10
    for sink, files, prompt, max_tokens in sent:
        finished = sink.finished()
        assert finished is not None and not sink.errors
        text, tokens = reference.answer(files, prompt, max_tokens)
        assert (sink.text(), finished.completion_tokens) == (text, tokens), f"{files} on {prompt}"
