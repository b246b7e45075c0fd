"""What one prefill call costs: prompt tokens weighed by the context their attention reads.

A prompt token's projections and MLP cost the same wherever it sits; its attention reads every
position before it, so a chunk deep in a long prompt costs far more than one at its start. The
scheduler sizes each step's chunk by this cost, not by a token count: a step costs about what
`chunk` tokens cost on an empty cache, however deep the prompt is, and running streams wait
about as long for their next token while a long prompt prefills as while a short one does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillCost:
    """Costs in units of one token's projections; its attention adds one unit per
    `context_unit` positions it reads. A step may spend what `chunk` tokens cost on an empty
    cache (`budget`)."""

    chunk: int  # prompt tokens a step prefills on an empty cache
    context_unit: int  # positions whose attention costs as much as a token's projections

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.context_unit < 1:
            raise ValueError("a prefill chunk and its context unit are at least 1")

    @property
    def budget(self) -> float:
        """What one step may spend."""
        return self.cost(self.chunk, 0)

    def cost(self, tokens: int, context: int) -> float:
        """`tokens` prompt tokens prefilled after `context` cached ones, in one call."""
        # Token i (1-based) reads context + i positions: the chunk reads n * context + n(n+1)/2.
        read = tokens * context + tokens * (tokens + 1) / 2
        return tokens + read / self.context_unit

    def call_cost(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One call prefilling these (tokens, context) chunks side by side: each row is padded
        to the longest chunk and the deepest context, as the batched call lays them out."""
        live = [(n, c) for n, c in chunks if n > 0]
        if not live:
            return 0.0
        if len(live) == 1:
            return self.cost(*live[0])
        longest = max(n for n, _ in live)
        deepest = max(c for _, c in live)
        return len(live) * self.cost(longest, deepest)

    def take(self, chunks: Sequence[tuple[int, int]], context: int, most: int) -> int:
        """How many of a group's `most` pending tokens after `context` cached ones join a step
        whose call already holds `chunks` (tokens, context), within the budget. The step's first
        chunk takes one token at least, so that a prompt deeper than the budget still advances."""
        if not any(n for n, _ in chunks):
            return min(most, max(1, self.tokens_within(self.budget, context, most)))
        low, high = 0, most  # call_cost grows with the chunk: the largest that fits
        while low < high:
            mid = (low + high + 1) // 2
            if self.call_cost([*chunks, (mid, context)]) <= self.budget:
                low = mid
            else:
                high = mid - 1
        return low

    def tokens_within(self, budget: float, context: int, most: int) -> int:
        """The most tokens, up to `most`, that one call after `context` cached ones prefills
        within `budget`; 0 when not even one fits."""
        # cost(n) = n^2 / 2u + n (1 + (context + 1/2) / u): the positive root of cost(n) = budget.
        u = self.context_unit
        b = 1 + (context + 0.5) / u
        n = int((-b + math.sqrt(b * b + 2 * budget / u)) * u)
        n = max(0, min(n, most))
        while n < most and self.cost(n + 1, context) <= budget:  # the root, rounded down
            n += 1
        while n > 0 and self.cost(n, context) > budget:
            n -= 1
        return n
