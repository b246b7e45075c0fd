"""Scored openings (server/engine/scoring.py): what is kept, what a prompt finds, who waits."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from hotlora.server.engine.generate import RankedLogprob
from hotlora.server.engine.scoring import ScoredOpenings

KEY = (("base", "a@1"), 1)
OTHER = (("base", "b@1"), 1)
LAYERS = 2


def caches(positions: int) -> list[KVCache]:
    """A prefilled prompt's caches: `positions` KV positions a layer, values = position."""
    out = []
    for _ in range(LAYERS):
        cache = KVCache()
        data = mx.broadcast_to(
            mx.arange(positions, dtype=mx.float32)[None, None, :, None], (1, 2, positions, 4)
        )
        cache.update_and_fetch(data, data)
        out.append(cache)
    return out


def scores(tokens: list[int]) -> list[tuple[RankedLogprob, ...]]:
    return [
        (RankedLogprob(t, -float(i), 1, str(t), str(t)),) for i, t in enumerate(tokens[1:], start=1)
    ]


def test_a_kept_opening_gives_its_kv_but_the_last_token_and_its_scores():
    store = ScoredOpenings()
    prompt = list(range(100, 130))
    opening = prompt[:20]
    store.keep(KEY, opening, caches(len(prompt) - 1), scores(prompt))
    found = store.fetch(KEY, [*opening, 7, 8, 9])
    assert found is not None
    kv, entries, n = found
    assert n == 20 and len(entries) == 19 and entries == scores(prompt)[:19]
    assert [c.offset for c in kv] == [19] * LAYERS
    assert kv[0].keys[0, 0, :, 0].tolist() == list(range(19))
    # Another adapter set, another opening, a prompt shorter than it: nothing.
    assert store.fetch(OTHER, [*opening, 7]) is None
    assert store.fetch(KEY, [*prompt[:19], 1, 2]) is None
    assert store.fetch(KEY, opening[:-1]) is None
    # Writing past the fetched opening leaves the kept arrays as they were.
    more = mx.ones((1, 2, 3, 4))
    kv[0].update_and_fetch(more, more)
    again = store.fetch(KEY, [*opening, 1])
    assert again is not None and again[0][0].keys.shape[2] == 19


def test_openings_are_bounded_least_recently_used_out():
    store = ScoredOpenings(max_size=2)
    prompts = [[i] * 12 + [50, 51] for i in range(3)]
    for prompt in prompts:
        store.keep(KEY, prompt[:12], caches(13), scores(prompt))
    assert len(store) == 2
    assert store.fetch(KEY, prompts[0]) is None
    assert store.fetch(KEY, prompts[2]) is not None
    off = ScoredOpenings(max_size=0)
    off.keep(KEY, prompts[0][:12], caches(13), scores(prompts[0]))
    assert len(off) == 0 and not off.waits(KEY, prompts[0], [prompts[0]])


def test_the_shared_opening_and_who_waits():
    store = ScoredOpenings()
    context = list(range(40))
    store.note(KEY, [*context, 1, 2], owner=1)
    store.note(OTHER, [*context, 3], owner=2)
    assert store.shared(KEY, [*context, 5], owner=3) == 40
    assert store.shared(KEY, [*context, 1, 2], owner=1) == 0  # not with itself
    assert store.shared(KEY, [*range(5), 99], owner=3) == 0  # under 8 tokens: none
    # A question's next choice waits for the one being prefilled; a question sharing only a
    # preamble (under half of it) does not.
    assert store.waits(KEY, [*context, 7], [[*context, 1, 2]])
    assert not store.waits(KEY, [*context[:10], *range(500, 560)], [[*context, 1, 2]])
    store.keep(KEY, context, caches(41), scores([*context, 1]))
    assert not store.waits(KEY, [*context, 7], [[*context, 1, 2]])  # already kept
