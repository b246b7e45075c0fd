"""Generation outcomes and events in the OpenAI wire shapes, whole or as SSE chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from hotlora.server.api import completion_answers as answers
from hotlora.server.api.tool_calls import ToolCallStream
from hotlora.server.engine import Delta, Finished, SampledToken
from hotlora.server.engine.generate import PromptLogprobs
from hotlora.server.http.error_responses import error_response
from hotlora.server.render import echo
from hotlora.server.render.reasoning import ReasoningStream
from hotlora.server.serving import (
    Choice,
    InferenceService,
    Outcome,
    Prepared,
    Submitted,
    UsageTally,
)

DONE = "[DONE]"


def _dump_chunk(
    chunk: answers.ChatCompletionChunk | answers.CompletionResponse, include_usage: bool
) -> str:
    """A stream chunk without null noise, but with `finish_reason` always present as OpenAI's,
    and, on a chat stream that ends with a usage chunk, `usage` null on every chunk before it
    (OpenAI's chat chunk has it nullable; its text completion has no null `usage`)."""
    body = chunk.model_dump(exclude_none=True)
    if include_usage and body["object"] == "chat.completion.chunk":
        body.setdefault("usage", None)
    for choice in body["choices"]:
        choice.setdefault("finish_reason", None)
        # What OpenAI's schema requires, null as OpenAI sends it: a text chunk's `logprobs`,
        # and the `refusal` beside a chat chunk's logprobs.
        if body["object"] == "text_completion":
            choice.setdefault("logprobs", None)
        elif "logprobs" in choice:
            choice["logprobs"].setdefault("refusal", None)
    # JSON has no NaN or Infinity: a non-finite number fails the stream rather than go out.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _finish(reason: str) -> answers.FinishReason:
    # A cancelled job has no client left to read its reason.
    return "length" if reason == "length" else "stop"


def _usage(tally: UsageTally) -> answers.Usage:
    return answers.Usage(
        prompt_tokens=tally.prompt_tokens,
        completion_tokens=tally.completion_tokens,
        total_tokens=tally.prompt_tokens + tally.completion_tokens,
        prompt_tokens_details=answers.PromptTokensDetails(cached_tokens=tally.cached_tokens),
    )


def _chat_logprobs(entries: Iterable[SampledToken]) -> answers.ChoiceLogprobs:
    return answers.ChoiceLogprobs(
        content=[
            answers.TokenLogprob(
                token=e.token.label,
                logprob=e.logprob,
                bytes=list(e.token.bytes),
                top_logprobs=[
                    answers.TopLogprob(token=t.label, logprob=v, bytes=list(t.bytes))
                    for t, v in e.top
                ],
            )
            for e in entries
        ]
    )


def _text_logprobs(entries: list[SampledToken], start: int = 0) -> answers.CompletionLogprobs:
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += e.width
    return answers.CompletionLogprobs(
        tokens=[e.token.legacy_label for e in entries],
        token_logprobs=[e.logprob for e in entries],
        # As OpenAI's legacy completions and vLLM: the sampled token, then the `logprobs` most
        # likely (so up to logprobs + 1 entries), as an echoed prompt's tokens are.
        top_logprobs=[
            echo.legacy_top(
                e.token.legacy_label, e.logprob, ((t.legacy_label, v) for t, v in e.top)
            )
            for e in entries
        ],
        text_offset=offsets,
    )


def _prompt_logprobs(reported: PromptLogprobs | None) -> answers.PromptLogprobs | None:
    if reported is None:
        return None
    return [
        None
        if entry is None
        else {
            e.token_id: answers.PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=e.text)
            for e in entry
        }
        for entry in reported
    ]


class _RunningUsage:
    """vLLM's `continuous_usage_stats`: the usage so far, on every chunk of a stream."""

    def __init__(self, prepared: Prepared, on: bool):
        self.on = on
        self.prompt_tokens = sum(len(prompt) for prompt in prepared.prompts)
        self._generated: dict[int, int] = {}

    def saw(self, index: int, event: Delta | Finished) -> None:
        if isinstance(event, Delta):
            self._generated[index] = max(self._generated.get(index, 0), event.generated)
        else:
            self._generated[index] = event.completion_tokens

    def now(self) -> answers.Usage | None:
        if not self.on:
            return None
        completion = sum(self._generated.values())
        return answers.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
        )


def _message(
    prepared: Prepared, choice: Choice
) -> tuple[answers.AssistantMessage, answers.FinishReason]:
    """The answer as an assistant message: a thinking model's reasoning apart, its tool calls
    read out of the rest, if it may call."""
    finish = _finish(choice.finish_reason)
    text, reasoning = choice.text, None
    if prepared.reasoning is not None:
        reasoning, text = prepared.reasoning.split(text)
        reasoning = (reasoning or None) if prepared.reasoning.shown else None
    if prepared.tool_calls is None:
        return answers.AssistantMessage(content=text, reasoning_content=reasoning), finish
    text, calls = prepared.tool_calls.split(text)
    if not calls:
        return answers.AssistantMessage(content=text, reasoning_content=reasoning), finish
    message = answers.AssistantMessage(
        content=text if text.strip() else None, reasoning_content=reasoning, tool_calls=calls
    )
    return message, "tool_calls" if finish == "stop" else finish


def chat_response(prepared: Prepared, outcome: Outcome) -> answers.ChatCompletionResponse:
    choices = []
    for c in outcome.choices:
        message, finish = _message(prepared, c)
        if prepared.echo_chat:
            message.content = prepared.echo_chat + (message.content or "")
        logprobs = _chat_logprobs(c.logprobs) if prepared.params.logprobs else None
        choices.append(
            answers.ChatChoice(
                index=c.index, message=message, logprobs=logprobs, finish_reason=finish
            )
        )
    return answers.ChatCompletionResponse(
        id=answers.completion_id("chatcmpl", prepared.request_id),
        created=answers.now(),
        model=prepared.lease.model,
        choices=choices,
        usage=_usage(outcome.usage),
        prompt_logprobs=_prompt_logprobs(outcome.choices[0].prompt_logprobs),
    )


def completion_response(prepared: Prepared, outcome: Outcome) -> answers.CompletionResponse:
    choices = []
    for c in outcome.choices:
        text = c.text
        logprobs = _text_logprobs(c.logprobs) if prepared.params.logprobs else None
        if prepared.echo is not None:
            echoed = prepared.echo[c.index // prepared.n]
            text = echoed.text + text
            if prepared.params.logprobs:
                before = echo.prompt_part(echoed, c.prompt_logprobs)
                logprobs = echo.joined(before, _text_logprobs(c.logprobs, echoed.length))
        shown = c.prompt_logprobs if prepared.shows_prompt_logprobs else None
        choices.append(
            answers.CompletionChoice(
                index=c.index,
                text=text,
                logprobs=logprobs,
                finish_reason=_finish(c.finish_reason),
                prompt_logprobs=_prompt_logprobs(shown),
            )
        )
    return answers.CompletionResponse(
        id=answers.completion_id("cmpl", prepared.request_id),
        created=answers.now(),
        model=prepared.lease.model,
        choices=choices,
        usage=_usage(outcome.usage),
    )


def _stream_meta(prefix: str, prepared: Prepared) -> dict[str, Any]:
    """What every chunk of a stream repeats: its id, creation time and model."""
    return {
        "id": answers.completion_id(prefix, prepared.request_id),
        "created": answers.now(),
        "model": prepared.lease.model,
    }


async def chat_stream(
    service: InferenceService,
    submitted: Submitted,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """`chat.completion.chunk` JSON strings, then the usage chunk if asked, then [DONE]."""
    prepared = submitted.prepared
    meta = _stream_meta("chatcmpl", prepared)
    running = _RunningUsage(prepared, continuous_usage)

    def chunk(choice: answers.ChatChunkChoice) -> str:
        return _dump_chunk(
            answers.ChatCompletionChunk(**meta, choices=[choice], usage=running.now()),
            include_usage,
        )

    def call_chunks(index: int, calls: list[answers.OutputToolCall], first: int) -> Iterable[str]:
        for k, call in enumerate(calls, start=first):
            delta = answers.ChatDelta(
                tool_calls=[answers.DeltaToolCall(index=k, **call.model_dump())]
            )
            yield chunk(answers.ChatChunkChoice(index=index, delta=delta))

    def reasoning_chunk(index: int, reasoning: str, logprobs: answers.ChoiceLogprobs | None) -> str:
        delta = answers.ChatDelta(reasoning_content=reasoning)
        return chunk(answers.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs))

    started: set[int] = set()
    said: set[int] = set()  # the choices that have sent text
    tools: dict[int, ToolCallStream] = {}
    thinking: dict[int, ReasoningStream] = {}
    thoughts_shown = prepared.reasoning is None or prepared.reasoning.shown
    tally = UsageTally(prepared.n)
    async for index, event in service.events(submitted):
        if index not in started:
            started.add(index)
            if prepared.tool_calls is not None:
                tools[index] = prepared.tool_calls.stream()
            if prepared.reasoning is not None:
                thinking[index] = prepared.reasoning.stream()
            # The role chunk (and an echoed message) come before the choice's first token:
            # their usage counts none. It holds no content where the answer may be tool calls
            # alone, whose message has a null content, as OpenAI's: a client gathering the
            # deltas keeps it null unless text comes.
            role = answers.ChatDelta(
                role="assistant", content=None if prepared.tool_calls is not None else ""
            )
            yield chunk(answers.ChatChunkChoice(index=index, delta=role))
            if prepared.echo_chat:
                said.add(index)
                delta = answers.ChatDelta(content=prepared.echo_chat)
                yield chunk(answers.ChatChunkChoice(index=index, delta=delta))
        running.saw(index, event)
        stream, thoughts = tools.get(index), thinking.get(index)
        if isinstance(event, Delta):
            text, reasoning, calls, made = event.text, "", [], stream.count if stream else 0
            logprobs = _chat_logprobs(event.logprobs) if prepared.params.logprobs else None
            if thoughts is not None:
                reasoning, text = thoughts.feed(text)
                reasoning = reasoning if thoughts_shown else ""
            if stream is not None:
                text, calls = stream.feed(text)
            if reasoning:
                # The tokens' logprobs go with the answer's text when there is some.
                yield reasoning_chunk(index, reasoning, None if text else logprobs)
            if text or (event.logprobs and not reasoning):
                # Tokens with no text to show yet (a tool call's markup, a held stop) bring
                # their logprobs alone, no empty content.
                if text:
                    said.add(index)
                delta = answers.ChatDelta(content=text or None)
                yield chunk(answers.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs))
            for line in call_chunks(index, calls, made):
                yield line
        else:
            tally.add(index, event)
            finish: answers.FinishReason = _finish(event.finish_reason)
            text = ""
            if thoughts is not None:
                reasoning, text = thoughts.flush()
                if reasoning and thoughts_shown:
                    yield reasoning_chunk(index, reasoning, None)
            if stream is not None:
                made = stream.count
                shown, calls = stream.feed(text)
                tail, more = stream.flush()
                text, calls = shown + tail, calls + more
                if not (text or stream.count or index in said):
                    # No call and no text: the message's content is "", not null.
                    yield chunk(
                        answers.ChatChunkChoice(index=index, delta=answers.ChatDelta(content=""))
                    )
                if text:
                    yield chunk(
                        answers.ChatChunkChoice(index=index, delta=answers.ChatDelta(content=text))
                    )
                for line in call_chunks(index, calls, made):
                    yield line
                if stream.count and finish == "stop":
                    finish = "tool_calls"
            elif text:
                yield chunk(
                    answers.ChatChunkChoice(index=index, delta=answers.ChatDelta(content=text))
                )
            yield chunk(
                answers.ChatChunkChoice(
                    index=index, delta=answers.ChatDelta(), finish_reason=finish
                )
            )
    if include_usage:
        usage = _usage(tally)
        yield answers.ChatCompletionChunk(**meta, choices=[], usage=usage).model_dump_json()
    yield DONE


async def completion_stream(
    service: InferenceService,
    submitted: Submitted,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """`text_completion` JSON strings, then the usage chunk if asked, then [DONE]."""
    prepared = submitted.prepared
    meta = _stream_meta("cmpl", prepared)
    offsets: dict[int, int] = {}
    tally = UsageTally(prepared.n)
    running = _RunningUsage(prepared, continuous_usage)
    echoed: set[int] = set()
    async for index, event in service.events(submitted):
        running.saw(index, event)
        if prepared.echo is not None and index not in echoed:
            # The prompt first, once, with its scores (they come before the first token).
            scored = isinstance(event, Delta) and event.prompt_logprobs is not None
            if scored or not prepared.params.logprobs or isinstance(event, Finished):
                echoed.add(index)
                prompt = prepared.echo[index // prepared.n]
                reported = event.prompt_logprobs if isinstance(event, Delta) else None
                logprobs = echo.prompt_part(prompt, reported) if prepared.params.logprobs else None
                offsets[index] = prompt.length
                choice = answers.CompletionChoice(
                    index=index, text=prompt.text, logprobs=logprobs, finish_reason=None
                )
                yield _dump_chunk(
                    answers.CompletionResponse(**meta, choices=[choice]), include_usage
                )
        if isinstance(event, Delta):
            if not (event.text or event.logprobs):
                continue
            logprobs = None
            if prepared.params.logprobs:
                # Offsets count the tokens' texts, as the whole answer's do: a chunk's first
                # token may have begun in text an earlier chunk sent (held for a stop string).
                at = offsets.get(index, 0)
                logprobs = _text_logprobs(list(event.logprobs), at)
                offsets[index] = at + sum(e.width for e in event.logprobs)
            choice = answers.CompletionChoice(
                index=index, text=event.text, logprobs=logprobs, finish_reason=None
            )
        else:
            tally.add(index, event)
            finish = _finish(event.finish_reason)
            choice = answers.CompletionChoice(index=index, text="", finish_reason=finish)
        chunk = answers.CompletionResponse(**meta, choices=[choice], usage=running.now())
        yield _dump_chunk(chunk, include_usage)
    if include_usage:
        usage = _usage(tally)
        yield answers.CompletionResponse(**meta, choices=[], usage=usage).model_dump_json()
    yield DONE


async def with_error_event(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's 200 is sent before generation runs: a later failure becomes an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        yield bytes(error_response(exc).body).decode()
        yield DONE
