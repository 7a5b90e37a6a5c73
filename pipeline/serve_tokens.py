"""Requests to prompt token ids for the Serve endpoint: chat template and plain prompts.

The ingress tokenizes (not the engine replica) so it can count prompt tokens and reject an
oversize prompt with a 400 before the request takes a queue slot. Chats are rendered with the
tokenizer's own chat template (generation prompt on) and then encoded without adding special
tokens again, the same way the batch pipeline builds chat prompts, so a prompt served here and
the same prompt in a nightly job reach the engine as identical token ids.
"""

from __future__ import annotations

from typing import Any

from pipeline.spec import ModelSpec, StorageSpec


class PromptTokenizer:
    """One model's tokenizer, loaded once per ingress replica."""

    def __init__(self, model: ModelSpec, storage: StorageSpec) -> None:
        from transformers import AutoTokenizer

        from pipeline.storage import materialize_model

        source = model.tokenizer or model.path
        local = materialize_model(
            source,
            model.cache_dir,
            storage,
            required_file="tokenizer_config.json",
            field="model.tokenizer" if model.tokenizer else "model.path",
        )
        self._tokenizer = AutoTokenizer.from_pretrained(str(local))
        self.has_chat_template = bool(getattr(self._tokenizer, "chat_template", None))

    def chat_ids(self, messages: list[dict[str, Any]], system_prompt: str | None) -> list[int]:
        """Token ids of a chat, with the generation prompt; `system_prompt` is prepended when
        the chat brings no system message of its own."""
        if system_prompt and not any(m["role"] in ("system", "developer") for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.text_ids(text, add_special_tokens=False)

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)
