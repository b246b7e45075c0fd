"""Prefill chunks sized by cost: the most tokens a step's budget pays for, padded calls included."""

from __future__ import annotations

import pytest

from hotlora.server.engine.prefill_cost import PrefillCost


def test_a_token_costs_one_plus_the_positions_it_reads_per_unit():
    cost = PrefillCost(chunk=4, context_unit=10)
    # Tokens after 6 cached read 7, 8 and 9 positions: 3 + 24 / 10.
    assert cost.cost(3, 6) == pytest.approx(5.4)
    assert cost.budget == cost.cost(4, 0) == pytest.approx(5.0)


@pytest.mark.parametrize("chunk, unit", [(16, 1), (32, 16), (512, 256), (512, 1 << 30)])
def test_tokens_within_is_the_largest_count_that_fits(chunk, unit):
    cost = PrefillCost(chunk, unit)
    for context in (0, 1, 7, 100, 1000, 8000):
        for budget in (0.5, 1.0, 3.7, cost.budget, 10 * cost.budget):
            n = cost.tokens_within(budget, context, most=10_000)
            assert n == 0 or cost.cost(n, context) <= budget
            assert cost.cost(n + 1, context) > budget


def test_the_first_chunk_of_a_step_takes_a_token_however_deep_the_prompt():
    cost = PrefillCost(chunk=16, context_unit=1)
    assert cost.tokens_within(cost.budget, 10_000, most=50) == 0
    assert cost.take([], 10_000, most=50) == 1
    assert cost.take([], 0, most=50) == 16
    assert cost.take([], 0, most=5) == 5
    assert cost.take([], 0, most=0) == 0


def test_chunks_side_by_side_are_priced_as_padded_to_the_longest_and_deepest():
    cost = PrefillCost(chunk=64, context_unit=32)
    assert cost.call_cost([(10, 0), (4, 100)]) == pytest.approx(2 * cost.cost(10, 100))
    assert cost.call_cost([(10, 0), (0, 100)]) == cost.cost(10, 0)
    beside = [(20, 0)]
    n = cost.take(beside, 50, most=1000)
    assert (
        cost.call_cost([*beside, (n, 50)]) <= cost.budget < cost.call_cost([*beside, (n + 1, 50)])
    )


def test_chunk_and_unit_are_positive():
    with pytest.raises(ValueError):
        PrefillCost(0, 16)
    with pytest.raises(ValueError):
        PrefillCost(16, 0)
