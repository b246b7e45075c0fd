"""Each row's next token from the batch's logits: its logits processors, the tokens it holds off,
its grammar's mask, then one argmax for the greedy rows and each other row's own sampler.

Only rows that sample or report logprobs get log-probabilities: on the CPU the softmax's `exp`
over the vocabulary costs more per row than anything else after the model call (about 1.2 ms
per row for a 49k vocabulary), and a greedy row's argmax needs none.

A row whose processors, grammar or sampler fail is named in `failed` (row index -> error): it
stops, and the rest of the batch goes on.
"""

from __future__ import annotations

import mlx.core as mx

from hotlora.models.cpu import extension
from hotlora.server.engine.grammar import constrain
from hotlora.server.engine.sequences import Row


def processed(rows: list[Row], logits: mx.array) -> tuple[mx.array, dict[int, Exception]]:
    """The logits after each row's `logit_bias`, then its penalties: mlx-lm's order; the rows
    the penalties failed."""
    logits = biased(rows, logits)
    failed: dict[int, Exception] = {}
    if not any(row.sampler.penalties for row in rows):
        return logits, failed
    parts = []
    for i, row in enumerate(rows):
        part = logits[i : i + 1]
        if row.sampler.penalties:
            try:
                part = row.sampler.process(row.tokens, len(row.job.prompt), part)
            except Exception as exc:  # noqa: BLE001
                failed[i] = exc
        parts.append(part)
    return mx.concatenate(parts), failed


def biased(rows: list[Row], logits: mx.array) -> mx.array:
    """Each row's `logit_bias` added, in one scatter for the batch: the bits of mlx-lm's
    processor run row by row (a row's tokens are distinct, so each logit gets at most one add).
    It reads none of a row's tokens, so a biased row's next step may be launched ahead."""
    at = [(i, token, value) for i, row in enumerate(rows) for token, value in row.sampler.bias]
    if not at:
        return logits
    row_ids, tokens, values = zip(*at, strict=True)
    return logits.at[mx.array(row_ids), mx.array(tokens)].add(mx.array(values, dtype=mx.float32))


def scanned(logits: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's greedy token ([B] uint32, mx.argmax's) and whether all its logits are finite
    ([B] bool): one pass of the CPU's native kernels where they take the logits
    (`extension.greedy_rows`), else MLX's argmax and `finite_rows` (which also flags a row whose
    float32 sum overflows, as no working model's does)."""
    return extension.greedy_rows(logits) or (mx.argmax(logits, axis=-1), finite_rows(logits))


def finite_rows(logits: mx.array) -> mx.array:
    """[B] bool: whether each row's logits are all finite.

    One float32 sum per row: a NaN or an infinity anywhere makes it non-finite. So do finite
    logits summing past float32's range (~3e38), which no working model produces.
    """
    return mx.isfinite(logits.astype(mx.float32).sum(axis=-1))


def log_probabilities(rows: list[Row], logits: mx.array) -> dict[int, mx.array]:
    """Log-probabilities [1, vocab] by row index, for the rows that sample or report logprobs."""
    return {
        i: _log_softmax(logits[i : i + 1])
        for i, row in enumerate(rows)
        if not row.sampler.greedy or row.job.params.logprobs
    }


def _log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def held_off(rows: list[Row], logits: mx.array, ahead: int = 0) -> mx.array:
    """Rows with tokens held off (`allowed_token_ids`, EOS before `min_tokens`) get -inf for
    them: after the finite check, which an -inf would trip, and before any grammar's mask.
    `ahead`: tokens each row takes before these logits' token beyond those it holds now."""
    if not any(row.sampler.masks_tokens for row in rows):
        return logits
    vocab = logits.shape[-1]
    masks = [row.sampler.mask(row.generated + ahead, vocab) for row in rows]
    if all(mask is None for mask in masks):
        return logits
    zeros = mx.zeros((vocab,), dtype=mx.float32)
    stacked = mx.stack([zeros if mask is None else mask for mask in masks])  # [B, vocab]
    return logits + stacked.astype(logits.dtype)


def constrained(rows: list[Row], logits: mx.array, failed: dict[int, Exception]) -> mx.array:
    """Rows under a grammar (`response_format`) get -inf for every token it does not allow
    next, before sampling and logprobs: they report the distribution sampled from."""
    constraints = [row.constraint for row in rows]
    if not any(constraints):
        return logits
    mx.async_eval(logits)  # the model call runs while the grammars compute their masks
    return constrain(logits, constraints, failed)


def choose(
    rows: list[Row],
    logits: mx.array,
    logprobs: dict[int, mx.array],
    failed: dict[int, Exception],
    greedy: mx.array | None = None,
) -> mx.array:
    """Every row's next token: one argmax over the logits for the greedy rows, each other row's
    own sampler on its log-probabilities. `greedy`: that argmax where `scanned` took it already,
    of these very logits (after every mask), else None."""
    if greedy is None:
        greedy = scanned(logits)[0]  # [B]
    if all(row.sampler.greedy for row in rows):
        return greedy
    picks: list[mx.array] = []
    for i, row in enumerate(rows):
        if row.sampler.greedy or i in failed:
            picks.append(greedy[i : i + 1])
            continue
        try:
            picks.append(row.sampler.sample(logprobs[i]))
        except Exception as exc:  # noqa: BLE001 - this row's sampling settings failed
            failed[i] = exc
            picks.append(greedy[i : i + 1])
    return mx.concatenate(picks)
