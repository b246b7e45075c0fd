"""A decode step launched: one batched model call and its rows' next tokens, evaluating while
the worker's thread goes on.

The scheduler launches step t+1 from step t's tokens before it reads them (`Scheduler._decode`,
as mlx-lm's `generate_step` does for one row): building and dispatching a step (~0.9 ms at one
row on the CPU for the embedded model) and the rows' bookkeeping (detokenizing, stop strings,
events) then overlap the evaluation of the step before. Every path is batch invariant, so a
row's results depend on its own inputs alone: a step launched for rows of which some then finish,
stop or are cancelled is still right, to the bit, for the others, which keep their entries
(`DecodeStep.rows_at`). A sampling row's key is split lazily at each launch, so its tokens are
the same with or without the step launched ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from hotlora.adapters import RowAdapterCache, activate
from hotlora.server.engine.kv_caches import decode_step_size, stepped
from hotlora.server.engine.next_tokens import (
    choose,
    constrained,
    held_off,
    log_probabilities,
    processed,
    scanned,
)
from hotlora.server.engine.sequences import Row


@dataclass
class DecodeStep:
    """One decode step's rows (in the batch's order) and their results, lazy until read."""

    rows: list[Row]
    chosen: mx.array | None = None  # [B] each row's next token
    finite: mx.array | None = None  # [B] whether each row's logits were all finite
    logprobs: dict[int, mx.array] = field(default_factory=dict)  # row index -> [1, vocab]
    failed: dict[int, Exception] = field(default_factory=dict)  # row index -> its error
    error: BaseException | None = None  # the model call failed: every row shares it
    state: list[Any] = field(default_factory=list)  # the rows' keys and the cache it updates

    @property
    def pending(self) -> list[Any]:
        """What reading the step waits for: its results, its rows' keys and the cache."""
        return [self.chosen, self.finite, self.state]

    def rows_at(self, keep: Sequence[int]) -> DecodeStep:
        """The step of these rows only (indices into `rows`, in order)."""
        if self.chosen is None or self.finite is None:
            return DecodeStep([self.rows[i] for i in keep], error=self.error)
        index = mx.array(list(keep), dtype=mx.int32)
        return DecodeStep(
            [self.rows[i] for i in keep],
            self.chosen[index],
            self.finite[index],
            {new: self.logprobs[old] for new, old in enumerate(keep) if old in self.logprobs},
            {new: self.failed[old] for new, old in enumerate(keep) if old in self.failed},
            state=self.state,
        )


def launch(
    model: nn.Module,
    rows: list[Row],
    inputs: mx.array,
    cache: Any,
    row_adapters: RowAdapterCache,
    ahead: int = 0,
) -> DecodeStep:
    """Build the decode step of `rows` from `inputs` [B, 1] and start evaluating it.

    `ahead`: the tokens each row will have taken, beyond those it holds now, before this step's
    token (1 for a step launched from the previous step's tokens before they are read): the
    rows' token masks (`min_tokens`) count them."""
    # A row writes one position a step until its last token, which it never writes: the
    # caches grow by no more than the rows can still write.
    most = max(row.job.params.max_tokens - row.generated - ahead for row in rows)
    stepped(cache, decode_step_size(most))
    try:
        with activate(row_adapters.for_rows([row.adapters for row in rows])):
            logits = model(inputs, cache=cache)[:, -1, :]  # [B, vocab]
    except Exception as exc:  # noqa: BLE001 - the whole batch shared the failed call
        return DecodeStep(rows, error=exc)
    logits, failed = processed(rows, logits)
    greedy, finite = scanned(logits)  # [B] each, before masks set tokens to -inf
    masked = constrained(rows, held_off(rows, logits, ahead), failed)
    logprobs = log_probabilities(rows, masked)  # row index -> [1, vocab]
    chosen = choose(rows, masked, logprobs, failed, greedy if masked is logits else None)  # [B]
    state = [[row.sampler.key for row in rows], [c.state for c in cache]]
    step = DecodeStep(rows, chosen, finite, logprobs, failed, state=state)
    mx.async_eval(step.pending)
    return step


def launches_ahead(rows: Sequence[Row]) -> bool:
    """Whether the next step of `rows` may be launched from this step's tokens before they are
    read: no row's penalties (not `logit_bias`, which reads no tokens) or grammar need its latest
    token in Python, and some row may go on past this step (else the step ahead would be thrown
    away)."""
    return all(not row.sampler.penalties and row.constraint is None for row in rows) and any(
        row.generated + 1 < row.job.params.max_tokens for row in rows
    )
