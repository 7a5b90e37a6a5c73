"""Requests to prompt token ids for the Serve endpoint, through the batch pipeline's helpers.

The ingress tokenizes (not the engine replica) so it can count prompt tokens and reject an
oversize prompt with a 400 before the request takes an engine slot. It uses
`pipeline.batch.prompts` (tokenizer loading, chat validation, chat template, raw completions), so a
prompt served here and the same prompt in a nightly job reach the engine as identical ids.
"""

from __future__ import annotations

from typing import Any

from pipeline.serve.protocol import ApiError
from pipeline.spec import ModelSpec, PromptSpec, StorageSpec


class PromptTokenizer:
    """One model's tokenizer, loaded once per ingress replica."""

    def __init__(self, model: ModelSpec, prompt: PromptSpec, storage: StorageSpec) -> None:
        from pipeline.batch.prompts import load_tokenizer

        self._tokenizer = load_tokenizer(model, storage)
        self._prompt = prompt
        self.has_chat_template = bool(getattr(self._tokenizer, "chat_template", None))

    def chat_ids(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """A chat through the chat template (generation prompt on; the model's system_prompt
        first when the chat brings no system message); `template_kwargs` are the request's
        chat_template_kwargs, already checked against the template's reserved names."""
        from pipeline.batch.prompts import PromptError, render_prompt

        try:
            return render_prompt(
                self._tokenizer, self._prompt, messages=messages, template_kwargs=template_kwargs
            )
        except PromptError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None

    def completion_ids(self, text: str) -> list[int]:
        """A /v1/completions prompt: a raw continuation, no chat template, no system prompt."""
        from pipeline.batch.prompts import RAW_COMPLETION, PromptError, render_prompt

        try:
            return render_prompt(self._tokenizer, RAW_COMPLETION, text=text)
        except PromptError as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_value") from None

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)
