"""Continuous batching: every step admits waiting rows, prefills in chunks, then decodes once.

One loop in the spirit of vLLM's scheduler, on MLX-native batch state (mlx-lm's
`BatchKVCache`, left-padded):

1. Admit waiting rows while the batch has room (`max_batch`) and the KV cache budget covers
   every admitted row's prompt plus its `max_tokens`: each tenant's rows first come first
   served, the tenants' queues by weighted fair share (`FairQueue`).
2. Prefill: spend at most what `prefill_chunk` prompt tokens cost on an empty cache
   (`PrefillCost`: deeper in a long prompt, attention makes each token dearer and a step takes
   fewer), first on the groups whose whole rest fits in half of it, then oldest group first,
   and every other step oldest first while both kinds wait. A group is one prompt with its
   adapter set: the `n` choices of a request share it. A long prompt takes several steps, so
   running streams never wait for more than one chunk's cost, and a short prompt behind long
   ones never for theirs.
3. Decode: one batched model call for every running row, each row with its own adapter set,
   sampler, PRNG key, stops and `max_tokens`. Finished, stopped and cancelled rows leave at
   once; prefilled groups join before the next call. The next step is launched from this
   step's tokens before they are read (`decode_step`), so that building it and the rows'
   bookkeeping overlap this step's evaluation; rows joining, pausing or resuming take the
   step launched ahead first.

Nothing here knows about HTTP or asyncio: rows report through their `sink`.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from hotlora.adapters import RowAdapterCache, activate
from hotlora.config.log_text import printable
from hotlora.server.engine.decode_step import DecodeStep, launch, launches_ahead
from hotlora.server.engine.fair_share import DEFAULT_SHARE, FairQueue, Share
from hotlora.server.engine.generate import (
    Delta,
    Engine,
    GenerationJob,
    NonFiniteLogits,
    SampledToken,
    cached_length,
    prompt_cache_key,
)
from hotlora.server.engine.grammar import GrammarFailed
from hotlora.server.engine.kv_caches import (
    KV_STEP,
    LayerCaches,
    kept_caches,
    new_caches,
    prefill_step,
    row_caches,
    stepped,
)
from hotlora.server.engine.prefill_cost import PrefillCost
from hotlora.server.engine.scoring import (
    MAX_OPENINGS,
    ScoredOpenings,
    job_scoring_key,
    scoring_key,
)
from hotlora.server.engine.sequences import Group, Row, Sink

log = logging.getLogger("hotlora")

# A prefill step's budget, in `prefill_chunk`s, while no row decodes: only a request that comes
# meanwhile waits on it, for its first step.
ALONE_CHUNKS = 4


@dataclass(frozen=True)
class Load:
    """The batch as the last step left it, published whole for other threads (the metrics)."""

    running: int = 0  # requests with a row prefilling or decoding
    kv_reserved: int = 0  # bytes, as `kv_reserved()` counts them
    running_adapters: frozenset[str] = frozenset()  # adapter ids of those rows
    waiting_adapters: frozenset[str] = frozenset()  # adapter ids of rows not admitted yet
    paused: int = 0  # requests with a row paused (their client reads nothing)


class Scheduler:
    """The batch state and the step that advances it; driven by the worker's thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 8,
        prefill_chunk: int = 192,
        prefill_context_unit: int = 1024,
        kv_cache_bytes: int = 2 << 30,
        look_ahead: bool = True,
    ):
        self.engine = engine
        self.model = engine.model
        self.max_batch = max_batch
        self.prefill = PrefillCost(prefill_chunk, prefill_context_unit)
        # While no row decodes, no stream waits on a step: one may prefill this much more.
        self.prefill_alone = PrefillCost(prefill_chunk * ALONE_CHUNKS, prefill_context_unit)
        self.kv_cache_bytes = kv_cache_bytes
        self.kv_bytes_per_token = engine.kv_bytes_per_token
        self.eos = frozenset(engine.tokenizer.eos_token_ids)
        self.waiting = FairQueue()
        self.prefilling: deque[Group] = deque()
        self._quick_first = False  # the last step served short prompts before older ones
        self.running: list[Row] = []
        # Rows out of the batch while their client takes none of their tokens, each with its
        # own KV cache: they keep their slot and compute nothing.
        self.paused: list[tuple[Row, LayerCaches]] = []
        self._cache: LayerCaches | None = None  # the running rows' batch KV cache, row-aligned
        # The running rows' next step, launched before their latest tokens were read.
        self.look_ahead = look_ahead
        self._ahead: DecodeStep | None = None
        self._row_adapters = RowAdapterCache()
        # Openings shared by scoring prompts, kept with their scores (off with the prompt cache).
        self.scored = ScoredOpenings(MAX_OPENINGS if engine.prompt_cache.max_size else 0)
        self.load = Load()
        self.on_decode: Callable[[int], None] | None = None  # told each decode step's batch size

    # Admission.

    def add(self, jobs: Sequence[GenerationJob], sink: Sink, share: Share = DEFAULT_SHARE) -> None:
        """Queue one request's jobs, in order, behind its tenant's rows already waiting."""
        # A fresh, reset detokenizer a row. All rows or none.
        rows = [
            Row(
                job,
                sink,
                position,
                self.engine.detokenizers(),
                self.eos,
                self.engine.special_ids,
                pieces=self.engine.pieces,
                tenant=share.tenant,
            )
            for position, job in enumerate(jobs)
        ]
        self.waiting.extend(rows, share)
        self._note_scoring(jobs)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.running or self.paused)

    @property
    def admitted(self) -> int:
        return len(self._admitted_rows())

    def _admitted_rows(self) -> list[Row]:
        """Every row past admission: prefilling, running, then paused."""
        prefilling = (row for group in self.prefilling for row in group.rows)
        return [*prefilling, *self.running, *(row for row, _ in self.paused)]

    def kv_reserved(self, extra: Sequence[Row] = ()) -> int:
        """Bytes the batch cache may reach with `extra` admitted: every row padded to the
        longest prompt + max_tokens, plus one allocation step of slack each."""
        rows = [*self._admitted_rows(), *extra]
        if not rows:
            return 0
        longest = max(len(r.job.prompt) + r.job.params.max_tokens for r in rows)
        return len(rows) * (longest + KV_STEP) * self.kv_bytes_per_token

    def _admit(self) -> None:
        held = Counter(row.tenant for row in self._admitted_rows())
        while (queue := self.waiting.pick(held)) is not None:
            head = queue.head
            room = self.max_batch - self.admitted
            if room <= 0:
                return
            group = [head]
            for _, row in list(queue.rows)[1:room]:
                if (
                    row.sink is head.sink
                    and row.job.prompt is head.job.prompt
                    and row.adapters is head.adapters
                ):
                    group.append(row)
                else:
                    break
            # The KV budget: the oldest request always fits when the batch is empty.
            while len(group) > 1 and self.kv_reserved(group) > self.kv_cache_bytes:
                group.pop()
            if self.admitted and self.kv_reserved(group) > self.kv_cache_bytes:
                return
            self.waiting.admit(queue, len(group))
            held[queue.share.tenant] += len(group)
            for row in group:
                row.sink.started()
            self.prefilling.append(Group(group))

    # The step.

    def step(self) -> bool:
        """Admit, prefill one chunk's worth, decode once for every running row. False when
        there was nothing to run: every admitted row is paused and none can be admitted."""
        try:
            self._drop_cancelled()
            self._pause_and_resume()
            self._admit()
            if not (self.prefilling or self.running):
                return False
            self._prefill()
            if self.running:
                self._decode()
            return True
        finally:
            self._publish()

    def _publish(self) -> None:
        admitted = self._admitted_rows()
        self.load = Load(
            running=len({id(row.sink) for row in admitted}),
            kv_reserved=self.kv_reserved(),
            running_adapters=frozenset(i for row in admitted for i in row.adapters.ids),
            waiting_adapters=frozenset(i for row in self.waiting for i in row.adapters.ids),
            paused=len({id(row.sink) for row, _ in self.paused}),
        )

    def _drop_cancelled(self) -> None:
        """Finish every cancelled row, wherever it is; a cancelled request never starts."""
        self.waiting.keep(_without_cancelled)
        for group in list(self.prefilling):
            group.rows = _without_cancelled(group.rows)
            if not group.rows:
                self.prefilling.remove(group)
        live = {id(row) for row in _without_cancelled(self.running)}
        if len(live) < len(self.running):
            self._keep([i for i, row in enumerate(self.running) if id(row) in live])
        if any(row.cancelled for row, _ in self.paused):
            live = {id(row) for row in _without_cancelled([row for row, _ in self.paused])}
            self.paused = [(row, cache) for row, cache in self.paused if id(row) in live]

    def _pause_and_resume(self) -> None:
        """Rows whose client has taken none of their latest tokens (its socket's buffers are
        full) leave the batch with a copy of their own KV cache; rows whose client has read
        since come back. A paused row holds its KV cache and its slot, and computes nothing."""
        if self._ahead is not None and (
            any(not row.paused for row, _ in self.paused) or any(r.paused for r in self.running)
        ):
            self._settle()  # a row's cache leaves or joins with no step launched past its tokens
        back = [(row, cache) for row, cache in self.paused if not row.paused]
        if back:
            self.paused = [(row, cache) for row, cache in self.paused if row.paused]
            for row, cache in back:
                joined = stepped([c.merge([c]) for c in cache])
                if self._cache is None:
                    self._cache = joined
                else:
                    for mine, theirs in zip(self._cache, joined, strict=True):
                        mine.extend(theirs)
                self.running.append(row)
        held = {i for i, row in enumerate(self.running) if row.paused}
        if held and self._cache is not None:
            for i in sorted(held):
                own = kept_caches(row_caches(self._cache, i))
                self.paused.append((self.running[i], own))
            self._keep([i for i in range(len(self.running)) if i not in held])

    # Prefill.

    def _prefill(self) -> None:
        """Spend up to one step's prefill budget in one model call (`_prefill_order`)."""
        work: list[tuple[Group, list[int], int]] = []  # (group, chunk, its first position)
        sizes: list[tuple[int, int]] = []  # (tokens, context) of each chunk in the call
        cost = self.prefill if self.running else self.prefill_alone
        for group in self._prefill_order(cost):
            if sizes and cost.call_cost(sizes) + 1 > cost.budget:
                break  # not one token more fits: the next groups wait for the next step
            if not group.started and self._waits_for_opening(group):
                continue  # another scoring prompt that opens alike keeps their opening first
            if not group.started:
                self._start(group)
            context = group.context
            take = cost.take(sizes, context, len(group.pending))
            if group.pending and not take:
                break  # the budget is spent; an empty prompt remainder still joins below
            chunk, group.pending = group.pending[:take], group.pending[take:]
            sizes.append((len(chunk), context))
            work.append((group, chunk, context))
        running = [(g, c, at) for g, c, at in work if c]
        try:
            if len(running) == 1:
                group, chunk, at = running[0]
                with activate(group.adapters):
                    logits = self.model(mx.array([chunk]), cache=group.cache)  # [1, L, vocab]
                mx.eval([c.state for c in cast(list[Any], group.cache)])
                self._prompt_logprobs(group, at, logits[0])
            elif running:
                self._prefill_together(running)
        except Exception as exc:  # noqa: BLE001 - these groups' requests get the error
            for group, _, _ in running:
                self.prefilling.remove(group)
                self._fail(group.rows, exc)
        for group, _, _ in work:
            if not group.pending and group in self.prefilling:
                self.prefilling.remove(group)
                self._join(group)

    def _prefill_order(self, cost: PrefillCost) -> list[Group]:
        """The prefilling groups in the order a step serves them: first, oldest first, those
        whose whole rest fits in half the step's budget together (a short prompt behind long
        ones, a new turn of a cached conversation: prefilled in one step, its first token not
        waiting for theirs); then the others, oldest first. While both kinds wait, every other
        step serves the oldest first (a step's first chunk always advances), so a long prompt
        is never held for longer than one step at a time."""
        quick: list[Group] = []
        sizes: list[tuple[int, int]] = []
        for group in self.prefilling:
            size = (len(group.pending), group.context) if group.started else self._unstarted(group)
            if cost.call_cost([*sizes, size]) <= cost.budget / 2:
                quick.append(group)
                sizes.append(size)
        rest = [group for group in self.prefilling if group not in quick]
        if quick and rest and self._quick_first:
            self._quick_first = False
            return list(self.prefilling)
        self._quick_first = bool(quick and rest)
        return [*quick, *rest]

    def _unstarted(self, group: Group) -> tuple[int, int]:
        """(tokens to prefill, context) of a group not started yet, as the prompt cache held
        its prompt when first asked (one search of it a group, not one a step); a scoring
        prompt, which takes nothing from the prompt cache, whole."""
        if group.estimate is None:
            cached = 0
            if scoring_key(self.engine.base_id, group) is None:
                key = prompt_cache_key(self.engine.base_id, group.job)
                cached = cached_length(self.engine.prompt_cache, key, group.prompt)
            cached = min(cached, len(group.prompt) - 1)
            group.estimate = (max(0, len(group.prompt) - 1 - cached), cached)
        return group.estimate

    def _prefill_together(self, work: list[tuple[Group, list[int], int]]) -> None:
        """One batched call for several groups' chunks: right-padded, each with its adapters."""
        groups = [g for g, _, _ in work]
        lengths = [len(c) for _, c, _ in work]
        longest = max(lengths)
        layers = len(cast(list[Any], groups[0].cache))
        # Each layer's cache type merges its own kind (KVCache into BatchKVCache, ...).
        per_layer = [[cast(list[Any], g.cache)[i] for g in groups] for i in range(layers)]
        cache = stepped([caches[0].merge(caches) for caches in per_layer])
        for c in cache:
            c.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
        tokens = mx.array([c + [0] * (longest - len(c)) for _, c, _ in work])  # [G, longest]
        with activate(self._row_adapters.for_rows([g.adapters for g in groups])):
            logits = self.model(tokens, cache=cache)  # [G, longest, vocab]
        for c in cache:
            c.finalize()
        mx.eval([c.state for c in cache])
        for i, group in enumerate(groups):
            group.cache = stepped([c.extract(i) for c in cache], prefill_step(len(group.pending)))
            self._prompt_logprobs(group, work[i][2], logits[i, : lengths[i]])

    def _prompt_logprobs(self, group: Group, at: int, logits: mx.array) -> None:
        """Keep the log-probabilities of the prompt tokens that follow a prefilled chunk, from
        its logits [chunk, vocab], when the group's request asks for them (`at`: the chunk's
        first position in the prompt)."""
        k = group.job.params.prompt_logprobs
        if k is None:
            return
        targets = group.prompt[at + 1 : at + 1 + logits.shape[0]]
        group.prompt_logprobs.extend(self.engine.prompt_logprobs(targets, logits, k))

    def _start(self, group: Group) -> None:
        """The group's cache: the nearest cached prefix under its adapter set, else empty.

        The cache is made to hold `prompt[:-1]`; the last prompt token is the first decode
        step's input, whose logits give the first generated token. A kept head of the prompt
        (its opening shared with recent prompts) serves when it is longer than what the prompt
        cache has; when neither has that opening, the rows keep it once done.
        """
        group.started = True
        prompt = group.prompt
        key = prompt_cache_key(self.engine.base_id, group.job)
        cache, rest = self.engine.prompt_cache.fetch_nearest_cache(key, prompt)
        heads = self.engine.prompt_heads
        opening = heads.opening(prompt, group.job.cache_scope)
        head = heads.fetch(key, prompt) if len(heads) else None
        if head is not None and head[1] > len(prompt) - len(rest):
            cache, rest = head[0], prompt[head[1] :]
        scoring = scoring_key(self.engine.base_id, group)
        if scoring is not None:
            # Every prompt position's logits are wanted: a kept scored opening, or nothing.
            self.scored.note(scoring, prompt, id(group.job))
            cache, rest = None, prompt
            kept = self.scored.fetch(scoring, prompt)
            if kept is not None:
                cache, group.prompt_logprobs, n = kept
                rest = prompt[n - 1 :]
        if cache is not None and not rest:
            # The whole prompt is cached; step back one token to feed it again.
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
            else:
                cache, rest = None, prompt
        if cache is None:
            cache, rest = new_caches(self.engine.model), prompt
        # The rest of the prompt in one growth; a fetched cache grows as a new one does.
        group.cache = stepped(cache, prefill_step(len(rest) - 1))
        group.pending = list(rest[:-1])
        for row in group.rows:
            row.cached = len(prompt) - len(rest)
            row.head = opening if opening > row.cached else 0

    def _join(self, group: Group) -> None:
        """Move a prefilled group's rows into the decode batch."""
        caches = cast(list[Any], group.cache)
        rows = _without_cancelled(group.rows)
        if not rows:
            return
        self._settle()  # the running rows' step launched ahead did not include these
        if rows[0].job.params.prompt_logprobs is not None:
            reported = (None, *group.prompt_logprobs)
            self._keep_opening(group)
            for row in rows:
                row.prompt_logprobs = reported
                row.sink.event(row.position, Delta("", prompt_logprobs=reported))
        if rows[0].job.params.max_tokens == 0:
            for row in rows:  # scored only (echo with max_tokens 0): nothing to decode
                row.finish("length")
            return
        joined = stepped([c.merge([c] * len(rows)) for c in caches])
        if self._cache is None:
            self._cache = joined
        else:
            for mine, theirs in zip(self._cache, joined, strict=True):
                mine.extend(theirs)
        self.running.extend(rows)

    def _note_scoring(self, jobs: Sequence[GenerationJob]) -> None:
        """Remember each scoring prompt as it arrives (once for its `n` choices), so that the
        first of its question's choices to be prefilled keeps the opening they share."""
        seen: set[int] = set()
        for job in jobs:
            key = job_scoring_key(self.engine.base_id, job)
            if key is not None and id(job.prompt) not in seen:
                seen.add(id(job.prompt))
                self.scored.note(key, job.prompt, id(job))

    def _waits_for_opening(self, group: Group) -> bool:
        """Whether a scoring group waits for another of its key being prefilled, which shares
        a longer opening with it than is kept: that one keeps the opening as it joins."""
        key = scoring_key(self.engine.base_id, group)
        if key is None:
            return False
        leaders = [
            g.prompt
            for g in self.prefilling
            if g.started and scoring_key(self.engine.base_id, g) == key
        ]
        if not self.scored.waits(key, group.prompt, leaders):
            return False
        self.scored.note(key, group.prompt, id(group.job))
        return True

    def _keep_opening(self, group: Group) -> None:
        """Keep the opening a prefilled scoring group shares with other scoring prompts."""
        key = scoring_key(self.engine.base_id, group)
        if key is None or group.cache is None:
            return
        shared = min(self.scored.shared(key, group.prompt, id(group.job)), len(group.prompt))
        if shared:
            opening = group.prompt[:shared]
            self.scored.keep(key, opening, group.cache, group.prompt_logprobs)

    # Decode.

    def _decode(self) -> None:
        rows = self.running
        step, self._ahead = self._ahead, None
        if step is None:
            inputs = mx.array([[row.tokens[-1]] for row in rows])  # [B, 1]
            step = launch(self.model, rows, inputs, self._cache, self._row_adapters)
        if step.chosen is not None and self.look_ahead and launches_ahead(rows):
            inputs = step.chosen[:, None]  # [B, 1], not read yet
            ahead = launch(self.model, rows, inputs, self._cache, self._row_adapters, ahead=1)
            if ahead.error is not None:  # the next call failed: the batch cache is not whole
                self._finish(step, store=False)
                self._fail_running(ahead.error)
                return
            self._ahead = ahead
        self._finish(step)

    def _settle(self) -> None:
        """Take the step launched ahead now, as a decode step of its own."""
        step, self._ahead = self._ahead, None
        if step is not None:
            self._finish(step)

    def _finish(self, step: DecodeStep, store: bool = True) -> None:
        """Read a launched step's tokens and advance its rows (the running rows, in order);
        `store`: keep finished rows' caches for later prompts."""
        if self.on_decode is not None:
            self.on_decode(len(step.rows))
        if step.error is not None or step.chosen is None or step.finite is None:
            self._fail_running(step.error or RuntimeError("decode step not launched"))
            return
        failed = step.failed
        try:
            mx.eval(step.pending)
        except Exception as exc:  # noqa: BLE001
            self._fail_running(exc)
            return
        for i, ok in enumerate(cast(list[bool], step.finite.tolist())):
            if not ok:
                failed.setdefault(i, NonFiniteLogits())
        tokens = cast(list[int], step.chosen.tolist())
        keep = []
        for i, (row, token) in enumerate(zip(step.rows, tokens, strict=True)):
            if i in failed:
                self._fail([row], failed[i])
            elif row.advance(token, self._sampled(row, token, step.logprobs, i)):
                keep.append(i)
            elif store:
                self._store(row, i)
        if len(keep) < len(step.rows):
            self._keep(keep)

    def _sampled(
        self, row: Row, token: int, logprobs: dict[int, mx.array], i: int
    ) -> SampledToken | None:
        params = row.job.params
        if not params.logprobs or (row.ends_quietly(token) and not params.logprobs_of_end):
            return None
        return self.engine.logprob(token, logprobs[i][0], params.top_logprobs)

    def _store(self, row: Row, index: int) -> None:
        """Keep a finished row's cache (prompt + output) for the next turn of its conversation,
        and the head it did not find cached for the next requests of its adapter set."""
        keep_all = self.engine.prompt_cache.max_size > 0
        if self._cache is None or not (keep_all or row.head):
            return
        try:
            # Kept beyond this step: one buffer, evaluated now.
            cache = kept_caches(row_caches(self._cache, index))
            offset = cache[0].offset if cache else 0
            if offset > len(row.tokens) and can_trim_prompt_cache(cache):
                # A step launched ahead took the token that ended it, which it does not keep
                trim_prompt_cache(cache, offset - len(row.tokens))
                offset = len(row.tokens)
            key = prompt_cache_key(self.engine.base_id, row.job)
            if row.head:
                self.engine.prompt_heads.keep(key, row.tokens[: row.head], cache)
            if keep_all and 0 < offset <= len(row.tokens):
                self.engine.prompt_cache.insert_cache(key, row.tokens[:offset], cache)
        except Exception:  # noqa: BLE001 - the row is done; only the cache for later is lost
            log.warning("could not keep a finished request's prompt cache", exc_info=True)

    def _keep(self, keep: list[int]) -> None:
        """Keep only these running rows (by index), and their rows of the batch cache."""
        if not keep:
            self._drop_batch()
            return
        self.running = [self.running[i] for i in keep]
        if self._ahead is not None:
            self._ahead = self._ahead.rows_at(keep)
        if self._cache is not None:
            for c in self._cache:
                c.filter(keep)

    def _drop_batch(self) -> list[Row]:
        """Empty the decode batch; returns the rows it held."""
        rows, self.running, self._cache = self.running, [], None
        self._ahead = None
        if not self.prefilling:
            self._row_adapters.clear()  # drop side-by-side copies of adapters
        return rows

    # Failure.

    def _fail(self, rows: list[Row], error: BaseException) -> None:
        if isinstance(error, GrammarFailed):  # the request's constraint, not the server
            log.warning("generation stopped: %s", printable(error))
        else:
            log.error("generation failed: %s", printable(error), exc_info=error)
        for row in rows:
            row.sink.failed(row.position, error)

    def _fail_running(self, error: BaseException) -> None:
        self._fail(self._drop_batch(), error)

    def _take_admitted(self) -> list[Row]:
        """Every admitted row, leaving nothing prefilling, running or paused."""
        prefilling = [row for group in self.prefilling for row in group.rows]
        self.prefilling.clear()
        paused, self.paused = [row for row, _ in self.paused], []
        return [*prefilling, *self._drop_batch(), *paused]

    def fail_admitted(self, error: BaseException) -> None:
        """Fail every admitted row (a step failed outside a model call); waiting rows stay."""
        self._fail(self._take_admitted(), error)
        self._publish()

    def cancel_all(self, error: BaseException) -> None:
        """Fail everything admitted or waiting (the worker is stopping)."""
        rows = [*self.waiting.clear(), *self._take_admitted()]
        for row in rows:
            row.sink.failed(row.position, error)
        self._publish()


def _without_cancelled(rows: Iterable[Row]) -> list[Row]:
    """The rows still wanted, in order; each cancelled one is finished (read once per row)."""
    live = []
    for row in rows:
        if row.cancelled:
            row.finish("cancelled")
        else:
            live.append(row)
    return live
