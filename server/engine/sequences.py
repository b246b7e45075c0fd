"""The state of one generated sequence (a row of the batch) and of a prompt being prefilled."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from hotlora.adapters import AdapterSet
from hotlora.server.engine.generate import (
    Delta,
    Event,
    Finished,
    GenerationJob,
    PromptLogprobs,
    RankedLogprob,
    SampledToken,
)
from hotlora.server.engine.grammar import Constraint
from hotlora.server.engine.kv_caches import LayerCaches
from hotlora.server.engine.sampling import RowSampler
from hotlora.server.engine.stops import StopMatcher
from hotlora.server.engine.tokens import TokenPiece


class Sink(Protocol):
    """Where a row's events go (the worker's ticket)."""

    def started(self) -> None: ...

    def event(self, position: int, event: Event) -> None: ...

    def failed(self, position: int, error: BaseException) -> None: ...


@dataclass(eq=False)
class Row:
    """One sequence being generated: its job, where its events go, and its decoding state.

    `tokens` is the prompt plus every token generated so far; its last token is the next
    decode step's input (the cache holds all the others).
    """

    job: GenerationJob
    sink: Sink
    position: int  # the job's place in its request: the choice index
    detokenizer: Any  # a fresh copy of the tokenizer's streaming detokenizer
    eos: frozenset[int]
    pieces: Callable[[int], TokenPiece] = field(kw_only=True)  # each token's exact bytes
    silent: frozenset[int] = frozenset()  # control tokens: generated, they add no text
    tenant: str = "default"  # whose request it is, for the fair share of the batch
    sampler: RowSampler = field(init=False)
    stops: StopMatcher = field(init=False)
    constraint: Constraint | None = field(init=False)  # its grammar (`response_format`), if any
    enders: frozenset[int] = field(init=False)  # tokens that end the answer
    tokens: list[int] = field(init=False)
    generated: int = 0
    cached: int = 0  # prompt tokens that came from the prompt cache
    head: int = 0  # its opening shared with recent prompts, to keep once done (not cached)
    prompt_logprobs: PromptLogprobs | None = None  # set once prefilled, when asked for
    # Sampled tokens whose text has not all gone out, with where it starts and ends in the
    # answer's text, in UTF-8 bytes: a token's log-probability goes out with its text. Counted
    # on the tokens' own bytes, which join into the text (a character split over byte tokens
    # included), not on what the detokenizer has written so far (it may hold a token's text
    # back: mlx-lm's byte-level BPE holds a lone space).
    held: list[tuple[SampledToken, int, int]] = field(default_factory=list)
    spelled: int = 0  # the sampled tokens' bytes so far
    # The same bytes as characters: how many each token completes, and the bytes of one split
    # over tokens not yet all sampled (an answer cut there ends before that character).
    characters: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def __post_init__(self) -> None:
        params = self.job.params
        eos = frozenset() if params.ignore_eos else self.eos
        self.enders = eos | frozenset(params.stop_token_ids)
        self.sampler = RowSampler(params, self.enders)
        self.stops = StopMatcher(list(params.stop), include=params.include_stop)
        if not params.skip_special_tokens:
            self.silent = frozenset()
        self.constraint = self.job.grammar.start() if self.job.grammar else None
        self.tokens = list(self.job.prompt)

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled.is_set()

    @property
    def paused(self) -> bool:
        return self.job.paused.is_set()

    @property
    def adapters(self) -> AdapterSet:
        return self.job.adapters

    def ends_quietly(self, token: int) -> bool:
        """Whether `token` ends the answer adding nothing to it: EOS, or a stop token id that
        `include_stop_str_in_output` does not keep."""
        params = self.job.params
        kept = params.include_stop and token in params.stop_token_ids
        return token in self.enders and not kept

    def advance(self, token: int, sampled: SampledToken | None) -> bool:
        """Take the row's next token and emit the text it completes; False once it is done."""
        params = self.job.params
        if self.ends_quietly(token):
            if sampled is not None:  # asked for (`logprobs_of_end`): listed, adding no text
                self.held.append((replace(sampled, width=0), self.spelled, self.spelled))
            self.finish("stop")
            return False
        if self.constraint is not None:
            self.constraint.consume(token)
        self.tokens.append(token)
        self.generated += 1
        if token not in self.silent:
            self.detokenizer.add_token(token)
        # Stop strings are looked for from `min_tokens` on, as vLLM does.
        armed = self.generated >= params.min_tokens
        text = self.stops.feed(self.detokenizer.last_segment, armed=armed)
        data = b"" if token in self.silent else self.pieces(token).bytes
        chars = len(self.characters.decode(data))
        if sampled is not None:
            start = self.spelled
            self.spelled += len(data)
            self.held.append((replace(sampled, width=chars), start, self.spelled))
        shown = self._shown_tokens()
        if text or shown:
            self.sink.event(self.position, Delta(text, shown, self.generated))
        ended = token in self.enders or self.stops.stopped
        if ended or (self.constraint is not None and self.constraint.done):
            self.finish("stop")
            return False
        if self.generated >= params.max_tokens:
            self.finish("length")
            return False
        return True

    def finish(self, reason: str) -> None:
        """Emit the text held back for stop matching, then `Finished`. An answer cut inside a
        character split over tokens (by max_tokens, a stop token, an end) ends before it: the
        detokenizer would write its bytes so far as U+FFFD."""
        self.detokenizer.finalize()
        last = self.detokenizer.last_segment
        cut_inside, _ = self.characters.getstate()
        if cut_inside and last.endswith("\ufffd"):
            last = last[:-1]
        tail = self.stops.feed(last) + self.stops.flush()
        shown = self._shown_tokens(end=True)
        if (tail or shown) and reason != "cancelled":
            self.sink.event(self.position, Delta(tail, shown, self.generated))
        finished = Finished(
            reason, len(self.job.prompt), self.generated, self.cached, self.prompt_logprobs
        )
        self.sink.event(self.position, finished)

    def _shown_tokens(self, end: bool = False) -> tuple[SampledToken, ...]:
        """The held tokens whose text has all gone out; once a stop sequence is reached, those
        whose text starts before its cut (one holding the cut included), and the rest never:
        the log-probabilities cover the answer's text and nothing past it. At the `end` of an
        answer no stop cut, every one."""
        emitted = self.stops.emitted
        if self.stops.stopped or end:
            stopped = self.stops.stopped
            shown = tuple(token for token, start, _ in self.held if start < emitted or not stopped)
            self.held.clear()
            return shown
        done = 0
        while done < len(self.held) and self.held[done][2] <= emitted:
            done += 1
        shown = tuple(token for token, _, _ in self.held[:done])
        del self.held[:done]
        return shown


@dataclass(eq=False)
class Group:
    """Rows sharing one prompt and adapter set (a request's `n` choices): prefilled once."""

    rows: list[Row]
    cache: LayerCaches | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    started: bool = False
    prompt_logprobs: list[tuple[RankedLogprob, ...]] = field(default_factory=list)  # so far
    # Before it starts: (tokens to prefill, context) as the prompt cache held its prompt when
    # the scheduler first looked, for the order of prefills (`Scheduler._prefill_order`).
    estimate: tuple[int, int] | None = None

    @property
    def job(self) -> GenerationJob:
        """Its first row's job: the prompt, adapters, cache scope and scoring its rows share."""
        return self.rows[0].job

    @property
    def prompt(self) -> list[int]:
        return self.job.prompt

    @property
    def context(self) -> int:
        """Prompt tokens in the group's cache (once started): the cached prefix and the chunks
        prefilled so far. The last prompt token is never prefilled: it is the first decode
        step's input."""
        return len(self.prompt) - 1 - len(self.pending)

    @property
    def adapters(self) -> AdapterSet:
        return self.rows[0].adapters
