"""The inference service: turns a validated request into generation jobs and jobs into responses.

Everything that can refuse a request (model, adapters, lengths) runs in `prepare`, and a full
wait list refuses it in `submit`, both before the first byte of a response is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from jinja2 import TemplateError

from hotlora.adapters import AdapterLease, AdapterManager, AdapterRef
from hotlora.config.errors import InvalidRequest
from hotlora.config.settings import Settings
from hotlora.server.api.completion_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    template_refusal,
)
from hotlora.server.api.generic_tools import GENERIC, GenericToolCalls
from hotlora.server.api.output_formats import OutputSpec
from hotlora.server.api.tool_calls import ToolCalls, ToolFormat, template_message
from hotlora.server.api.tool_families import (
    UnenforceableArguments,
    family_grammar,
    llama3_format,
    writes_control_tokens,
)
from hotlora.server.engine import (
    Delta,
    Finished,
    GenerationJob,
    GenerationWorker,
    SampledToken,
    SamplingParams,
    Share,
    Ticket,
)
from hotlora.server.engine.generate import PromptLogprobs, cache_scope
from hotlora.server.engine.grammar import Grammar, UnsupportedSchema
from hotlora.server.http.request_errors import ContextOverflow
from hotlora.server.http.request_ids import client_request_id, current_request_id
from hotlora.server.http.tenants import DEFAULT_TENANT, Tenant, current_tenant
from hotlora.server.render.chat_prompt import ChatTemplate
from hotlora.server.render.chat_templates import NO_CHAT_TEMPLATE
from hotlora.server.render.echo import EchoedPrompt, echoed_prompts
from hotlora.server.render.reasoning import PROMPT_TAIL_TOKENS, Reasoning, ThinkTags
from hotlora.server.render.tool_prompt import generic_messages, takes_system_messages
from hotlora.server.request_sampling import sampling_params
from hotlora.server.telemetry.prometheus import Metrics
from hotlora.server.telemetry.request_stats import RequestStats, UsageTally

log = logging.getLogger("hotlora")
T = TypeVar("T")


@dataclass
class Prepared:
    """A request that passed every check, holding its adapter lease until released."""

    lease: AdapterLease
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    tool_calls: ToolCalls | None = None  # the request's tools, when its answer may call them
    grammar: Grammar | None = None  # what `response_format` holds every choice to; None: free
    reasoning: Reasoning | None = None  # a thinking model's tags, when its answer may think
    request_id: str | None = (
        None  # the client's id for it (x-request-id, `request_id`): the answer's
    )
    echo: list[EchoedPrompt] | None = None  # each prompt as its choices echo it (`echo`)
    shows_prompt_logprobs: bool = True  # vLLM's `prompt_logprobs` asked for, not only echo's
    echo_chat: str = ""  # chat `echo`: the last (assistant) message, before the answer
    cache_salt: str | None = None  # vLLM's `cache_salt`: only its like share cached prompts

    def jobs(self, tenant: Tenant = DEFAULT_TENANT) -> list[GenerationJob]:
        """One job per choice, in choice-index order: each prompt's n choices in turn; their
        cached prompts are `tenant`'s own (shared by all where no keys name tenants)."""
        scope = cache_scope(None if tenant is DEFAULT_TENANT else tenant.name, self.cache_salt)
        adapters = self.lease.adapters
        jobs: list[GenerationJob] = []
        for prompt in self.prompts:
            for choice in range(self.n):
                params = self.params
                if params.seed is not None:
                    # Seeded choices are reproducible but not identical to each other; a
                    # prompt's are the same wherever it stands in a list of prompts.
                    params = replace(params, seed=params.seed + choice)
                jobs.append(
                    GenerationJob(prompt, params, adapters, grammar=self.grammar, cache_scope=scope)
                )
        return jobs


@dataclass
class Submitted:
    """A prepared request admitted to the worker; its events carry the choice index."""

    prepared: Prepared
    ticket: Ticket
    stats: RequestStats  # told of its events as they are read, ended by `let_go`


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str
    logprobs: list[SampledToken]
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class Outcome:
    choices: list[Choice]
    usage: UsageTally


class InferenceService:
    """Chat and text completions on the one base model held by the worker."""

    def __init__(
        self,
        worker: GenerationWorker,
        settings: Settings,
        *,
        adapters: AdapterManager,
        generation_defaults: dict[str, float] | None = None,
        metrics: Metrics | None = None,
    ):
        self.worker = worker
        self.engine = worker.engine
        self.tokenizer = worker.engine.tokenizer
        self.settings = settings
        self.adapters = adapters
        self.metrics = metrics or Metrics()
        # The operator's settings win over the model's generation_config.json.
        operator = {"temperature": settings.default_temperature, "top_p": settings.default_top_p}
        self._defaults = {
            **(generation_defaults or {}),
            **{name: value for name, value in operator.items() if value is not None},
        }
        # One thread: the tokenizer is shared with the generation thread, never used in parallel
        # by requests.
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="hotlora-tokenize")
        self.tool_format = ToolFormat.of(self.tokenizer) or llama3_format(self.tokenizer)
        # Whether the template takes a system message, where the generic format describes tools.
        self._system_role = self.tool_format is not None or takes_system_messages(self.tokenizer)
        # Control tokens in the tool-call markup are kept in the text, where the parser reads
        # them (the markup never reaches the client).
        self._keep_control = writes_control_tokens(self.tool_format, self._is_control)
        self._template = ChatTemplate(self.tokenizer)
        self.think_tags = ThinkTags.of(self.tokenizer)

    # Preparation: every refusal happens here.

    async def off_loop(self, work: Callable[[], T]) -> T:
        """Run tokenizer work (templating, encoding) on its own thread: a megabyte of prompt
        takes a second, which the event loop must spend serving everyone else."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work)

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def prepare_chat(self, request: ChatCompletionRequest) -> Prepared:
        messages = [template_message(m) for m in request.messages]
        if not getattr(self.tokenizer, "has_chat_template", True):
            raise InvalidRequest(f"{NO_CHAT_TEMPLATE}, or use /v1/completions.")
        tool_calls = self._tool_calls(request)
        tools = tool_calls.tools if tool_calls else None
        # Calls the conversation shows in the generic format, which an answer that may call
        # nothing must not copy.
        copied_calls = False
        if self.tool_format is None:  # the template cannot show tools: the generic format
            copied_calls = (
                tool_calls is None
                and self._may_hold_to_text(request)
                and any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
            )
            messages, tools = self.generic_messages(messages, tool_calls), None
        variables = self._template.variables(request)
        prompt = await self.off_loop(
            lambda: self.render_chat(
                messages,
                tools,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                add_special_tokens=request.add_special_tokens,
                variables=variables,
            )
        )
        grammar = await self._grammar(
            request.output_spec(request.response_format),
            tool_calls,
            request.tool_use,
            text_only=copied_calls,
        )
        prepared = await self._prepare(
            request,
            [prompt],
            "messages",
            request.requested_max_tokens,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs or 0,
            grammar=grammar,
        )
        prepared.tool_calls = tool_calls
        if tool_calls is not None and self._keep_control:
            prepared.params = replace(prepared.params, skip_special_tokens=False)
        if request.echo and request.messages[-1].role == "assistant":
            prepared.echo_chat = request.messages[-1].text()  # vLLM's chat echo
        shown = request.include_reasoning is not False
        prepared.reasoning = await self._reasoning(prompt, grammar, shown=shown)
        return prepared

    def _may_hold_to_text(self, request: ChatCompletionRequest) -> bool:
        """Whether an answer may be held to text that cannot begin as calls do without taking
        from the request what it asked for: room to think, an assistant message to continue (it
        may go on with a space), token masks of its own (refused beside a grammar)."""
        return not (
            self.think_tags is not None
            or request.continue_final_message
            or request.min_tokens
            or request.allowed_token_ids
        )

    async def _reasoning(
        self, prompt: list[int], grammar: Grammar | None, *, shown: bool = True
    ) -> Reasoning | None:
        """How the answer's reasoning is told apart (and whether it is `shown`); None when the
        model does not think, or a grammar holds the answer from its first token (there is no
        room to think)."""
        tags = self.think_tags
        if tags is None or grammar is not None:
            return None
        tail = await self.off_loop(lambda: self.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:]))
        return Reasoning(tags, tags.opened_by(tail), shown)

    async def _grammar(
        self,
        spec: OutputSpec | None,
        tool_calls: ToolCalls | None,
        use: str = "none",
        *,
        text_only: bool = False,
    ) -> Grammar | None:
        """The grammar the answer is held to, compiled (or found in the cache) off the event
        loop: the request's output constraint (`response_format`, `guided_*`, ...), the tool
        call `tool_choice` requires, or (`text_only`, when the answer may call no tool but the
        conversation shows calls in the generic format) text that cannot begin as calls do;
        None: free."""
        grammars = self.engine.grammars
        if use not in ("none", "auto"):
            if spec is not None and spec.param != "response_format":
                raise InvalidRequest(
                    f"{spec.param} cannot be combined with a tool_choice that requires a tool "
                    "call: the answer must be the tool call.",
                    param=spec.param,
                )
            if spec is not None:
                # OpenAI's pair: the format holds a text answer, and this answer is the calls.
                # Its schema is still checked, as it would be on its own.
                await self._output_grammar(spec)
            assert tool_calls is not None  # there are tools when one must be called
            calls = tool_calls  # narrowed for the closure

            def required() -> Grammar | None:
                lark = self._calls_lark(calls, use)
                return None if lark is None else grammars.tool_lark(lark)

            grammar = await self.off_loop(required)
            if grammar is None:
                raise InvalidRequest(
                    f"tool_choice '{use}' cannot be enforced for this model's tool-call format; "
                    "send 'auto' and the model may still call a tool.",
                    param="tool_choice",
                )
            return grammar
        if isinstance(tool_calls, GenericToolCalls) and spec is None:
            answer = tool_calls.answer_schema()  # `auto`: calls or text
            return await self.off_loop(lambda: grammars.tool_answer(answer, text=True))
        if tool_calls is not None and spec is not None and spec.param == "response_format":
            # `auto` beside OpenAI's format (an agent's tools and its structured answer): the
            # calls, or the format's JSON. The format alone would never let a tool be called.
            calls = tool_calls  # narrowed for the closure
            value, param, closed = spec.value, spec.param, spec.closed

            def calls_or_answer() -> Grammar | None:
                # The format's own refusal stands; tools the grammar cannot hold leave the
                # answer to the format, as `auto` alone leaves them unheld.
                try:
                    lark = self._calls_lark(calls, "required")
                    if lark is None:
                        return None
                    return grammars.calls_or_json(lark, value, param=param, closed=closed)
                except (UnsupportedSchema, UnenforceableArguments) as exc:
                    if exc.param == param:
                        raise
                    log.info("tools beside %s not held by the grammar: %s", param, exc.message)
                    return None

            grammar = await self.off_loop(calls_or_answer)
            if grammar is not None:
                return grammar
        if spec is None:
            return await self.off_loop(grammars.plain_text) if text_only else None
        return await self._output_grammar(spec)

    def _calls_lark(self, tool_calls: ToolCalls, use: str) -> str | None:
        """The Lark grammar of an answer that is calls in the model's format, to any tool (`use`
        'required') or the named one; None where the format has none here."""
        grammars = self.engine.grammars
        if isinstance(tool_calls, GenericToolCalls):
            return grammars.generic_calls_lark(tool_calls.answer_schema())
        form = tool_calls.format
        if form.json_body and form.end is not None:  # JSON in tags
            call = form.call_schema(tool_calls.tools, None if use == "required" else use)
            return grammars.tagged_call_lark(form.start, form.end, call)
        return family_grammar(tool_calls, use, grammars.literal, grammars.json_rule)

    async def _output_grammar(self, spec: OutputSpec) -> Grammar:
        """The grammar of the request's output constraint, compiled off the event loop."""
        grammars = self.engine.grammars
        kind, value, param, closed = spec.kind, spec.value, spec.param, spec.closed
        return await self.off_loop(lambda: grammars.output(kind, value, param, closed=closed))

    def _tool_calls(self, request: ChatCompletionRequest) -> ToolCalls | None:
        """How this request's tools are shown and its tool calls read; None: plain text."""
        use = request.tool_use
        if use == "none":
            return None
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
        if self.tool_format is None:
            return GenericToolCalls(GENERIC, tools, use=use, parallel=request.parallel_tool_calls)
        return ToolCalls(self.tool_format, tools, parallel=request.parallel_tool_calls, use=use)

    def _is_control(self, text: str) -> bool:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return len(ids) == 1 and ids[0] in self.engine.special_ids

    def generic_messages(
        self, messages: list[dict[str, Any]], tool_calls: ToolCalls | None
    ) -> list[dict[str, Any]]:
        """The conversation for a template that cannot show tools: calls, results and the
        tools written in the generic format."""
        generic = tool_calls if isinstance(tool_calls, GenericToolCalls) else None
        return generic_messages(messages, generic, system_role=self._system_role)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation as the chat template renders it, encoded (on the tokenizer thread)."""
        try:
            text = self.tokenizer.apply_chat_template(
                self._template.with_roles(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(variables or {}),
            )
        except (TemplateError, ValueError, TypeError) as exc:
            # Templates refuse conversations they cannot render (e.g. roles out of order, or a
            # role OpenAI does not define that this template does not take).
            raise template_refusal(exc, messages) from exc
        # Encoded apart from the rendering, as `tokenize=True` does, through the call that lets
        # the event loop run meanwhile (the tokenizer works without holding the GIL).
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def prepare_completion(self, request: CompletionRequest) -> Prepared:
        prompt = request.prompt
        if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        special = request.add_special_tokens
        token_lists = await self.off_loop(
            lambda: [self.tokens(p, "prompt", special=special) for p in prompts]
        )
        grammar = await self._grammar(request.output_spec(request.response_format), None)
        n_logprobs = request.logprobs
        prepared = await self._prepare(
            request,
            token_lists,
            "prompt",
            request.requested_max_tokens,
            logprobs=n_logprobs is not None,
            top_logprobs=n_logprobs or 0,
            grammar=grammar,
        )
        # Echoed, the prompt is scored with `logprobs` alternatives (prompt_logprobs' count);
        # the token that ends an answer is listed as vLLM's legacy completions list it.
        prepared.params = replace(
            prepared.params, prompt_logprobs=request.scored_prompt, logprobs_of_end=True
        )
        prepared.shows_prompt_logprobs = request.prompt_logprobs is not None
        if request.echo:
            kept, pieces = prepared.prompts, self.engine.pieces
            try:
                prepared.echo = await self.off_loop(
                    lambda: echoed_prompts(self.tokenizer, pieces, prompts, token_lists, kept)
                )
            except BaseException:
                prepared.lease.release()
                raise
        return prepared

    def tokens(self, prompt: Any, param: str, *, special: bool = True) -> list[int]:
        """A text prompt encoded (with the tokenizer's special tokens unless `special` is
        false), or a token-id prompt checked against the vocabulary."""
        if isinstance(prompt, str):
            # Special tokens as the tokenizer adds them (a BOS where the model expects one),
            # unless the text already starts with that token or the request asks for none.
            bos = getattr(self.tokenizer, "bos_token", None)
            if not special or (bos and prompt.startswith(bos)):
                return list(self.tokenizer.encode(prompt, add_special_tokens=False))
            return list(self.tokenizer.encode(prompt))
        vocab = self.engine.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"Token id {bad[0]} is outside the vocabulary (0..{vocab - 1}).", param=param
            )
        return list(prompt)

    async def _prepare(
        self,
        request: SamplingFields,
        prompts: list[list[int]],
        prompt_param: str,
        max_tokens: int | None,
        *,
        logprobs: bool,
        top_logprobs: int,
        grammar: Grammar | None,
    ) -> Prepared:
        if request.n > self.settings.max_n:
            raise InvalidRequest(
                f"n is {request.n}; this server allows at most {self.settings.max_n}.", param="n"
            )
        choices, most = len(prompts) * request.n, self.settings.max_choices
        if choices > most:  # a list of prompts is a batch (lm-evaluation-harness's batch_size)
            raise InvalidRequest(
                f"A request may ask for at most {most} choices; this one asks for {choices} "
                f"({len(prompts)} prompts x n={request.n}).",
                param=prompt_param if len(prompts) > 1 else "n",
            )
        limit = self.settings.max_tokens_limit
        if max_tokens is not None and max_tokens > limit:
            field = request.max_tokens_field
            raise InvalidRequest(
                f"{field} is {max_tokens}; this server allows at most {limit}.", param=field
            )
        context = self.engine.context_length
        if request.truncate_prompt_tokens is not None:
            keep = request.truncate_prompt_tokens
            keep = context if keep == -1 else keep
            prompts = [p[-keep:] for p in prompts]  # vLLM keeps the prompt's end
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
        params = sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            defaults=self._defaults,
            vocab_size=self.engine.vocab_size,
            eos_ids=frozenset(self.engine.tokenizer.eos_token_ids),
            grammar=grammar,
        )
        # Select last: the lease it takes must be released on any later error.
        lease = await self.lease(request.model, request.adapter)
        # As vLLM: the client's x-request-id header names the answer, else its request_id;
        # else the id the access log names the request by, so an answer's id finds its line.
        named = client_request_id() or request.request_id or current_request_id()
        return Prepared(
            lease,
            prompts,
            params,
            request.n,
            grammar=grammar,
            request_id=named,
            cache_salt=request.cache_salt,
        )

    async def lease(
        self, model: str, refs: tuple[AdapterRef, ...], *, queued: bool = True
    ) -> AdapterLease:
        """The request's adapters, leased; an adapter to mount first (on first use, or evicted)
        is read on a thread, and a request that goes away meanwhile lets its lease go. `queued`:
        the request then waits in the worker's queue (generation; embeddings do not)."""
        lease = self.adapters.try_select(model, refs)
        if lease is not None:
            return lease
        if queued:
            # A request the queue would refuse is refused before its adapter is mounted, which
            # may evict another: refused, it changes nothing.
            self.worker.check_room(current_tenant().name)
        loop = asyncio.get_running_loop()
        # In the request's context: the key's adapter scope (`adapters.scope`) holds there too.
        run = contextvars.copy_context().run
        selecting = loop.run_in_executor(None, run, self.adapters.select, model, refs)
        try:
            return await asyncio.shield(selecting)
        except asyncio.CancelledError:
            selecting.add_done_callback(_release_unclaimed)
            raise

    # Running.

    def submit(self, prepared: Prepared, tenant: Tenant = DEFAULT_TENANT) -> Submitted:
        """Admit the request now, before any response starts, in `tenant`'s fair share of the
        batch; refused, it holds nothing."""
        try:
            share = Share(tenant.name, tenant.weight)
            ticket = self.worker.submit(prepared.jobs(tenant), share)
        except BaseException:
            prepared.lease.release()
            raise
        lease = prepared.lease
        stats = RequestStats(
            self.metrics, lease.model, lease.adapters, len(ticket.jobs), prepared.n, ticket
        )
        return Submitted(prepared, ticket, stats)

    async def run(self, submitted: Submitted) -> Outcome:
        """Generate every choice and collect it."""
        choices: dict[int, Choice] = {}
        usage = UsageTally(submitted.prepared.n)
        async for index, event in self.events(submitted):
            choice = choices.setdefault(index, Choice(index, "", "length", []))
            if isinstance(event, Delta):
                choice.text += event.text
                choice.logprobs.extend(event.logprobs)
            else:
                choice.finish_reason = event.finish_reason
                choice.prompt_logprobs = event.prompt_logprobs
                usage.add(index, event)
        return Outcome([choices[i] for i in sorted(choices)], usage)

    def let_go(self, submitted: Submitted) -> None:
        """Nobody reads the rest of `submitted`: stop its rows, release its adapters and count
        what it used. A no-op once done; the routes call it however their response ends: a
        response cut before it asked for the first event never ran `events` (whose end calls it
        too), and one cut later may leave its events' generator to be closed by the garbage
        collector, after the access log has been written."""
        self.worker.abandon(submitted.ticket)  # a no-op once finished
        submitted.prepared.lease.release()
        stats = submitted.stats
        if not stats.ended:
            if submitted.ticket.not_read:
                # Its reader may never see the error: the connection is cut for not reading.
                stats.failed = True
                self.metrics.client_not_reading()
            stats.done()

    async def events(self, submitted: Submitted) -> AsyncIterator[tuple[int, Delta | Finished]]:
        """Every choice's events in order, tagged with its index; releases the lease after."""
        stats = submitted.stats
        try:
            async with contextlib.aclosing(self.worker.events(submitted.ticket)) as events:
                async for index, event in events:
                    stats.saw(index, event)
                    yield index, event
        except Exception:
            stats.failed = True
            raise
        finally:
            self.let_go(submitted)


def _release_unclaimed(selecting: asyncio.Future[AdapterLease]) -> None:
    """A lease selected for a request that went away while it was loaded: let it go."""
    if not selecting.cancelled() and selecting.exception() is None:
        selecting.result().release()
