"""The variables a chat request passes to the model's chat template, checked against the ones the
template reads: `chat_template_kwargs` (say, `enable_thinking`) and `documents`."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotlora.config.errors import InvalidRequest
from hotlora.server.api.completion_requests import ChatCompletionRequest

# What `apply_chat_template` itself takes, or the request sets through its own fields.
_RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

# Template variables that switch a model's thinking on or off.
_THINKING_SWITCHES = frozenset({"enable_thinking", "thinking"})


class ChatTemplate:
    """The model's chat template as far as a request's own variables go."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    @cached_property
    def reads(self) -> frozenset[str] | None:
        """The variables the template reads from outside; None when that cannot be told (no
        single template text, or one this parser does not read)."""
        text = getattr(self._tokenizer, "chat_template", None)
        if not isinstance(text, str):
            return None
        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        try:
            return frozenset(meta.find_undeclared_variables(env.parse(text)))
        except TemplateError:
            return None

    @cached_property
    def takes_developer(self) -> bool:
        """Whether the template names OpenAI's `developer` role itself (gpt-oss's does)."""
        text = getattr(self._tokenizer, "chat_template", None)
        return "developer" in (text if isinstance(text, str) else str(text or ""))

    def with_roles(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the template takes them: OpenAI's `developer` messages, its newer
        name for system ones, become `system` messages for a template that does not name the
        role (most: ChatML's would show a `developer` turn beside its default system prompt)."""
        if self.takes_developer:
            return messages
        return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]

    def variables(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """The keyword arguments the template gets besides the messages and tools; a variable
        the template does not read is refused, since it would change nothing."""
        variables = dict(request.chat_template_kwargs or {})
        for name, value in list(variables.items()):
            param = f"chat_template_kwargs.{name}"
            if name in _RESERVED:
                raise InvalidRequest(
                    f"'{name}' cannot be set through chat_template_kwargs; send the request field "
                    "of that name if there is one.",
                    param=param,
                )
            if name in _THINKING_SWITCHES and value is False and not self._reads(name):
                # Clients send `enable_thinking: false` to every model: one that never thinks
                # already does what it asks.
                del variables[name]
                continue
            self._check_read(name, param)
        if request.reasoning_effort is not None:
            self._check_read("reasoning_effort", "reasoning_effort")
            variables["reasoning_effort"] = request.reasoning_effort
        if request.documents is not None:
            self._check_read("documents", "documents")
            variables["documents"] = request.documents
        return variables

    def _reads(self, name: str) -> bool:
        """Whether the template reads `name` (or cannot be told not to)."""
        return self.reads is None or name in self.reads

    def _check_read(self, name: str, param: str) -> None:
        if not self._reads(name):
            raise InvalidRequest(
                f"This model's chat template does not read '{name}' ({param}): it would change "
                "nothing.",
                param=param,
            )
