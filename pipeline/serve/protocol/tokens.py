"""Requests to prompt token ids for the Serve endpoint, through the OpenAI layer's chat rendering.

The ingress tokenizes (not the engine replica) so it can count prompt tokens and reject an
oversize prompt with a 400 before the request takes an engine slot. It uses
`pipeline.openai.chat` (tokenizer loading, chat validation, chat template, raw completions), as
the batch prompt stage does, so a prompt served here and the same prompt in a nightly job reach
the engine as identical ids.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from engines.api import ImageInput
from pipeline.media.prompt import PromptImages
from pipeline.openai.chat import (
    RAW_COMPLETION,
    PromptError,
    chat_messages,
    load_tokenizer,
    render_prompt,
)
from pipeline.openai.errors import ApiError
from pipeline.openai.reasoning import ReasoningParser, make_parser
from pipeline.openai.tools import ToolParser, choose_parser
from pipeline.spec import ModelSpec, PromptSpec, StorageSpec

logger = logging.getLogger(__name__)

# Distinct token texts kept per tokenizer for logprobs (a full vocabulary is ~150k short strings).
TOKEN_TEXT_CACHE = 200_000


class PromptTokenizer:
    """One model's tokenizer, loaded once per ingress replica."""

    def __init__(
        self, model: ModelSpec, prompt: PromptSpec, storage: StorageSpec, engine_kind: str
    ) -> None:
        self._tokenizer = load_tokenizer(model, storage)
        self._prompt = prompt
        self.has_chat_template = bool(getattr(self._tokenizer, "chat_template", None))
        # How the model writes tool calls (prompt.tool_parser, else the template's markers).
        # A tokenizer may hold several named templates: the markers of any of them will do.
        template = getattr(self._tokenizer, "chat_template", None)
        template = json.dumps(template) if isinstance(template, dict) else template
        self.tool_parser: ToolParser = choose_parser(template, prompt.tool_parser)
        self.max_bytes_per_token = bytes_per_token_bound(self._tokenizer)
        self._token_texts: dict[int, str] = {}
        # prompt.reasoning's parser: chat answers are split by it (ReasoningError, naming what
        # the tokenizer lacks, when the format does not fit the model: the server does not start).

        self.reasoning: ReasoningParser | None = make_parser(prompt.reasoning, self._tokenizer)
        # Image parts: the model's processor (loaded on the first image). A request never
        # reads the server's files or buckets: data: URLs, and http(s) from the listed hosts.
        self._model, self._storage, self._engine_kind = model, storage, engine_kind
        self._images: PromptImages | None = None
        self._image_lock = threading.Lock()
        self._image_limits = prompt.images.model_copy(update={"allow_local": False})

    def chat_images(self, messages: list[dict[str, Any]]) -> tuple[ImageInput, ...]:
        """The chat's images fetched, decoded and processed, in order; a bad image (or any
        image to a text model) is a 400 naming its part. Thread-safe, and apart from the
        tokenizer: Serve runs it on its image threads (pipeline/serve/gateway.py)."""
        try:
            return self._image_reader().inputs(chat_messages(messages, self._prompt.system_prompt))
        except PromptError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None

    def chat_request(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        images: tuple[ImageInput, ...] | None = None,
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """chat_ids with the chat's images' placeholders expanded, and the images: `images`
        as chat_images read them, or read here when None."""
        if images is None:
            # Images first: a text model's template is never shown image parts.
            images = self.chat_images(messages)
        try:
            prompt_ids = self.chat_ids(messages, template_kwargs)
            if images:
                prompt_ids = self._image_reader().expand(prompt_ids, images)
        except PromptError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
        return prompt_ids, images

    def _image_reader(self) -> PromptImages:
        with self._image_lock:  # made once, whichever thread asks first
            if self._images is None:
                self._images = PromptImages.for_model(
                    self._model,
                    self._image_limits,
                    self._storage,
                    read_s3=False,
                    engine_kind=self._engine_kind,
                )
            return self._images

    def chat_ids(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """A chat through the chat template (generation prompt on; the model's system_prompt
        first when the chat brings no system message); `template_kwargs` are the request's
        chat_template_kwargs, already checked against the template's reserved names."""
        try:
            return render_prompt(
                self._tokenizer, self._prompt, messages=messages, template_kwargs=template_kwargs
            )
        except PromptError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (logprobs name tokens by their text); cached, as the
        same tokens recur in every response."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            if len(self._token_texts) < TOKEN_TEXT_CACHE:
                self._token_texts[token_id] = text
        return text

    def completion_ids(self, text: str) -> list[int]:
        """A /v1/completions prompt: a raw continuation, no chat template, no system prompt."""
        try:
            return render_prompt(self._tokenizer, RAW_COMPLETION, text=text)
        except PromptError as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_value") from None

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text (an echoed token-id prompt), special tokens left out."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)


# --- prompt length from bytes -------------------------------------------------------------------
#
# A prompt too long for the context should be refused before the tokenizer thread spends time
# on it. From its byte length alone that is certain only with an upper bound on the bytes one
# token can cover: a text of B bytes then has at least B / bound tokens. The bound is the
# longest token in the vocabulary (its raw UTF-8 form, which is never shorter than the text it
# stands for: byte-level BPE writes each byte as one 1-2 byte character, SentencePiece writes a
# space as the 3-byte "▁", byte-fallback tokens are "<0xAB>"), times how much the tokenizer's
# normalizer can shrink the text before it is split (Unicode normalization and lowercasing map
# a character of up to 4 bytes to one of at least 1: 4). Anything that can shrink text without
# bound makes the check impossible, and it is then off: normalizers that strip whitespace or
# accents, pre-tokenizers that drop whitespace or matches, added tokens that swallow the
# spaces beside them, and models that map an unknown word to one token (WordPiece, Unigram,
# BPE without byte coverage).

_SHRINK_FACTOR = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # keep text unless behavior "Removed"


def _normalizer_factor(node: dict[str, Any] | None) -> int | None:
    if node is None:
        return 1
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1
        for child in node.get("normalizers", []):
            child_factor = _normalizer_factor(child)
            if child_factor is None:
                return None
            factor *= child_factor
        return factor
    if kind == "Replace":
        pattern, content = node.get("pattern", {}), node.get("content", "")
        if "String" not in pattern or not content:
            return None  # a regex, or a deletion: no bound
        return max(1, -(-len(pattern["String"].encode()) // len(content.encode())))
    return _SHRINK_FACTOR.get(kind)


def _pre_tokenizer_keeps_text(node: dict[str, Any] | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(c) for c in node.get("pretokenizers", []))
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return node.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_byte_level(node: dict[str, Any] | None) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has_byte_level(c) for c in node.get("pretokenizers", []))
    return node.get("type") == "ByteLevel"


def bytes_per_token_bound(tokenizer: Any) -> int | None:
    """Most bytes of prompt text one token can stand for; None when no bound is certain."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow (Python) tokenizer: nothing to inspect
    try:
        config = json.loads(backend.to_str())
    except Exception:
        logger.warning("cannot inspect the tokenizer: prompt byte-length check off", exc_info=True)
        return None
    model = config.get("model") or {}
    pre_tokenizer = config.get("pre_tokenizer")
    factor = _normalizer_factor(config.get("normalizer"))
    covers_bytes = model.get("type") == "BPE" and (
        model.get("byte_fallback") or _has_byte_level(pre_tokenizer)
    )
    added = config.get("added_tokens") or []
    if (
        factor is None
        or not covers_bytes
        or not _pre_tokenizer_keeps_text(pre_tokenizer)
        or any(t.get("lstrip") or t.get("rstrip") for t in added)
    ):
        return None
    tokens = list(tokenizer.get_vocab()) + [t.get("content", "") for t in added]
    longest = max((len(t.encode()) for t in tokens), default=0)
    return longest * factor if longest else None
