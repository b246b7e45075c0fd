"""The inference service: turns a validated request into generation jobs and jobs into responses.

Everything that can refuse a request (model, adapters, lengths) runs in `prepare`, before the
first byte of a response is sent and before anything is queued.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from hotlora.config.settings import Settings
from hotlora.server.engine import Delta, Finished, GenerationJob, SamplingParams
from hotlora.server.errors import ContextOverflow, InvalidRequest, ModelNotFound
from hotlora.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from hotlora.server.worker import GenerationWorker
from jinja2 import TemplateError


@dataclass
class Target:
    """What a request is served with: the echoed model name and its adapter state."""

    model: str
    adapters: Any = None  # the resolved, request-owned adapter set; None serves the base
    release: Callable[[], None] = lambda: None


@dataclass
class Prepared:
    target: Target
    prompts: list[list[int]]
    params: SamplingParams
    n: int

    def jobs(self) -> list[tuple[int, GenerationJob]]:
        """(choice index, job) in serving order: each prompt's n choices in turn."""
        out = []
        for p, prompt in enumerate(self.prompts):
            for i in range(self.n):
                out.append(
                    (p * self.n + i, GenerationJob(prompt, self.params, self.target.adapters))
                )
        return out


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str
    logprobs: list[Any]


@dataclass
class UsageTally:
    """Token counts over a request's jobs; each prompt counts once, however many choices."""

    n: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, index: int, finished: Finished) -> None:
        self.completion_tokens += finished.completion_tokens
        if index % self.n == 0:
            self.prompt_tokens += finished.prompt_tokens
            self.cached_tokens += finished.cached_tokens


@dataclass
class Outcome:
    choices: list[Choice]
    usage: UsageTally


ResolveTarget = Callable[[str, tuple[Any, ...]], Target]


class InferenceService:
    """Chat and text completions on the one base model held by the worker."""

    def __init__(
        self,
        worker: GenerationWorker,
        settings: Settings,
        *,
        base_id: str,
        resolve_target: ResolveTarget | None = None,
        generation_defaults: dict[str, Any] | None = None,
    ):
        self.worker = worker
        self.engine = worker.engine
        self.tokenizer = worker.engine.tokenizer
        self.settings = settings
        self.base_id = base_id
        self._resolve_target = resolve_target or self._base_only
        self._defaults = generation_defaults or {}

    # Preparation: every refusal happens here.

    def prepare_chat(self, request: ChatCompletionRequest) -> Prepared:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        if not getattr(self.tokenizer, "has_chat_template", True):
            raise InvalidRequest("This model has no chat template; use /v1/completions.")
        try:
            prompt = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except (TemplateError, ValueError, TypeError) as exc:
            # Templates refuse conversations they cannot render (e.g. roles out of order).
            raise InvalidRequest(
                f"The model's chat template cannot render these messages: {exc}", param="messages"
            ) from exc
        return self._prepare(
            request,
            [prompt],
            "messages",
            request.requested_max_tokens,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs or 0,
        )

    def prepare_completion(self, request: CompletionRequest) -> Prepared:
        prompt = request.prompt
        if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        token_lists = [self._tokens(p) for p in prompts]
        n_logprobs = request.logprobs
        return self._prepare(
            request,
            token_lists,
            "prompt",
            request.requested_max_tokens,
            logprobs=n_logprobs is not None,
            top_logprobs=n_logprobs or 0,
        )

    def _tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        vocab = self.engine.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"Token id {bad[0]} is outside the vocabulary (0..{vocab - 1}).", param="prompt"
            )
        return list(prompt)

    def _prepare(
        self,
        request: SamplingFields,
        prompts: list[list[int]],
        prompt_param: str,
        max_tokens: int | None,
        *,
        logprobs: bool,
        top_logprobs: int,
    ) -> Prepared:
        if request.n > self.settings.max_n:
            raise InvalidRequest(f"n must be at most {self.settings.max_n}.", param="n")
        limit = self.settings.max_tokens_limit
        if max_tokens is not None and max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens is {max_tokens}; this server allows at most {limit}.",
                param="max_tokens",
            )
        context = self.engine.context_length
        longest = max(len(p) for p in prompts)
        if any(not p for p in prompts):
            raise InvalidRequest("The prompt is empty.", param=prompt_param)
        if max_tokens is None:
            if longest >= context:
                raise ContextOverflow(
                    f"This model's maximum context length is {context} tokens, but the prompt "
                    f"has {longest} tokens.",
                    param=prompt_param,
                )
            max_tokens = min(self.settings.default_max_tokens, context - longest)
        elif longest + max_tokens > context:
            raise ContextOverflow(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                param=prompt_param,
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_pick(request.temperature, self._defaults.get("temperature"), 1.0),
            top_p=_pick(request.top_p, self._defaults.get("top_p"), 1.0),
            top_k=_pick(request.top_k, self._defaults.get("top_k"), 0),
            min_p=_pick(request.min_p, None, 0.0),
            seed=request.seed,
            stop=tuple(request.stop_list),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
        )
        # Resolve last: it may take a lease on adapters that must be released on any later error.
        target = self._resolve_target(request.model, request.adapter)
        return Prepared(target, prompts, params, request.n)

    def _base_only(self, model: str, adapter: tuple[Any, ...]) -> Target:
        if model != self.base_id:
            raise ModelNotFound(model, [self.base_id])
        if adapter:
            raise InvalidRequest("Adapters are not enabled on this server.", param="adapter")
        return Target(self.base_id)

    # Running.

    async def run(self, prepared: Prepared) -> Outcome:
        """Generate every choice and collect it."""
        choices: dict[int, Choice] = {}
        usage = UsageTally(prepared.n)
        async for index, event in self.events(prepared):
            choice = choices.setdefault(index, Choice(index, "", "length", []))
            if isinstance(event, Delta):
                choice.text += event.text
                choice.logprobs.extend(event.logprobs)
            else:
                choice.finish_reason = event.finish_reason
                usage.add(index, event)
        return Outcome([choices[i] for i in sorted(choices)], usage)

    async def events(self, prepared: Prepared) -> AsyncIterator[tuple[int, Delta | Finished]]:
        """Every job's events in order, tagged with the choice index; releases the target after."""
        jobs = prepared.jobs()
        try:
            for index, job in jobs:
                async with contextlib.aclosing(self.worker.stream(job)) as stream:
                    async for event in stream:
                        yield index, event
        finally:
            for _, job in jobs:
                job.cancelled.set()  # a no-op for finished jobs; stops the rest at once
            prepared.target.release()


def _pick(value: Any, default: Any, fallback: Any) -> Any:
    if value is not None:
        return value
    return default if default is not None else fallback
