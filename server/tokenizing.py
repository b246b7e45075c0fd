"""vLLM's /tokenize and /detokenize: the served tokenizer and chat template, without generating."""

from __future__ import annotations

from hotlora.config.errors import InvalidRequest
from hotlora.server.api.generic_tools import GENERIC, GenericToolCalls
from hotlora.server.api.token_requests import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from hotlora.server.api.tool_calls import template_message
from hotlora.server.render.chat_templates import NO_CHAT_TEMPLATE
from hotlora.server.serving import InferenceService


class TokenizingService:
    """Text to token ids and back, as the chat and completion routes tokenize."""

    def __init__(self, inference: InferenceService):
        self.inference = inference
        self.tokenizer = inference.tokenizer

    def check_model(self, model: str | None) -> None:
        """`model`, when given, must be one a request could be served with. An adapter that
        would be mounted on first use (or was evicted) is not loaded for it: the tokenizer is the
        base's whatever the adapters."""
        if model is not None:
            lease = self.inference.adapters.try_select(model)
            if lease is not None:
                lease.release()

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """The prompt's token ids, or the conversation's as the chat template renders it."""
        self.check_model(request.model)
        inference = self.inference
        if request.messages is not None:
            if not getattr(self.tokenizer, "has_chat_template", True):
                raise InvalidRequest(f"{NO_CHAT_TEMPLATE}, or send a 'prompt'.")
            messages = [template_message(m) for m in request.messages]
            # Tools are shown as on chat with `tool_choice` auto: by the template, or in the
            # generic format when it cannot show them.
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()] or None
            if inference.tool_format is None:
                generic = GenericToolCalls(GENERIC, tools) if tools else None
                messages, tools = inference.generic_messages(messages, generic), None
            generation_prompt = request.add_generation_prompt
            special = bool(request.add_special_tokens)
            tokens = await inference.off_loop(
                lambda: inference.render_chat(
                    messages,
                    tools,
                    add_generation_prompt=generation_prompt,
                    add_special_tokens=special,
                )
            )
        else:
            prompt = request.prompt or ""
            special = request.add_special_tokens is not False
            tokens = await inference.off_loop(
                lambda: inference.tokens(prompt, "prompt", special=special)
            )
        strs = None
        if request.return_token_strs:
            pieces = await inference.off_loop(lambda: self.tokenizer.convert_ids_to_tokens(tokens))
            strs = [str(piece) for piece in pieces]
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=inference.engine.context_length,
            tokens=tokens,
            token_strs=strs,
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids, special tokens written out."""
        self.check_model(request.model)
        tokens = self.inference.tokens(request.tokens, "tokens")
        text = await self.inference.off_loop(lambda: self.tokenizer.decode(tokens))
        return DetokenizeResponse(prompt=text)
