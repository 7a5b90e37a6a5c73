"""Chat rendering and tokenization, shared by Serve and batch: a prompt (OpenAI `messages`, or
a text) → the model's prompt token ids.

- `load_tokenizer`: the model's Hugging Face tokenizer (its files only, no weights), one per
  process.
- `chat_messages`: OpenAI `messages` (a list, or its JSON text) validated into the chat the
  template reads: known roles, text content (text parts joined; a message with image_url
  parts keeps its parts, each image as {"type": "image"} for the template, `chat_images`
  lists them), `developer` as `system`, the system prompt first when the chat has none.
- `render_prompt`: one prompt's token ids. Chats go through the tokenizer's chat template with
  the generation prompt and the template's extra variables (`template_kwargs`: enable_thinking
  and reasoning_effort from `prompt`, a Serve request's chat_template_kwargs); a text does too
  with `prompt.chat_template`, else it is tokenized as is. `RAW_COMPLETION` is the prompt spec
  of an OpenAI /v1/completions prompt: a raw continuation.

Serve (pipeline.serve.protocol.tokens) renders a request with `render_prompt`; the batch prompt
stage (pipeline.batch.stages.prompts) renders rows with the same pieces (`prompt_chat`,
`apply_chat_template`) over many rows at once, so a prompt served and the same prompt in a job
reach the engine as identical ids.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.spec import ModelSpec, PromptSpec, StorageSpec
from pipeline.storage import materialize_model

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Files a tokenizer needs; the weights are not downloaded to tokenize.
TOKENIZER_FILES = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py")


# Keys of an image part of a validated chat (beside its "type": "image").
IMAGE_URL = "url"
IMAGE_WHERE = "where"


class PromptError(ValueError):
    """A prompt cannot be rendered (a batch row, a Serve request); the message says why and
    what to fix."""


# --- the tokenizer -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: ModelSpec, storage: StorageSpec) -> Any:
    """The Hugging Face tokenizer for the model (or `model.tokenizer`); one per process."""
    from transformers import AutoTokenizer

    source = model.tokenizer or model.path
    field = "model.tokenizer" if model.tokenizer else "model.path"
    local = materialize_model(
        source,
        model.cache_dir,
        storage,
        required_file="tokenizer_config.json",
        field=field,
        patterns=TOKENIZER_FILES,
    )
    try:
        return AutoTokenizer.from_pretrained(str(local))
    except Exception as exc:
        raise PromptError(f"{field}: cannot load a tokenizer from {source}: {exc}") from exc


# --- chats ------------------------------------------------------------------------------------


def _content(content: Any, index: int) -> str | list[dict[str, Any]]:
    """A message's content as the template reads it: text (text parts joined), or, when it
    has images, its parts in order, each image as {"type": "image"} (the shape vision chat
    templates place a placeholder for) carrying its URL and where it came from."""
    if isinstance(content, str):
        return content
    if not (isinstance(content, (list, tuple)) and all(isinstance(p, Mapping) for p in content)):
        raise PromptError(
            f"messages[{index}].content must be text or a list of content parts, got "
            f"{type(content).__name__}"
        )
    kinds = {p.get("type") for p in content}
    if kinds <= {"text"}:
        return "".join(str(p.get("text", "")) for p in content)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        # An image column's part names its column (pipeline.batch.stages.prompts).
        where = part.get("where") or f"messages[{index}].content[{j}]"
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            # bytes: an image column's cell (pipeline.batch.stages.prompts), never a request's
            if not isinstance(url, (str, bytes)) or not url:
                raise PromptError(f"{where}.image_url.url must be a non-empty string")
            parts.append({"type": "image", IMAGE_URL: url, IMAGE_WHERE: where})
        else:
            raise PromptError(f"{where} has type {kind!r}; content parts may be text or image_url")
    return parts


def chat_images(chat: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(URL, where) of each image of a validated chat, in the order the template places
    them (`where` names the part, e.g. messages[0].content[1])."""
    return [
        (part[IMAGE_URL], part[IMAGE_WHERE])
        for message in chat
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image"
    ]


def _has_content(content: str | list[dict[str, Any]]) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] == "image" or p["text"].strip() for p in content)


def _template_call(call: Any) -> dict[str, Any]:
    """An assistant turn's tool call as chat templates read it: OpenAI's shape with the
    arguments as an object (templates write `arguments | tojson`), as vLLM passes them."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # Checked before in Serve (pipeline.openai.tools); a batch row's stays as written.
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(arguments or "{}")
    return {"id": call.get("id"), "type": "function", "function": function}


def chat_messages(messages: str | Sequence[Any], system_prompt: str | None = None) -> list[dict]:
    """Validate a chat (a list, or its JSON text) and prepend the system prompt if it has none.

    Raises PromptError for anything that is not a non-empty list of {role, content} with a
    known role and text content.
    """
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as exc:
            raise PromptError(f"messages is not valid JSON ({exc})") from None
    if not isinstance(messages, (list, tuple)) or not messages:
        raise PromptError("messages must be a non-empty list of {role, content}")
    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise PromptError(f"messages[{index}] must be an object with role and content")
        role = message["role"]
        if role not in CHAT_ROLES:
            raise PromptError(
                f"messages[{index}].role {role!r} is not one of {', '.join(CHAT_ROLES)}"
            )
        calls = message.get("tool_calls")
        content = message["content"]
        # Chat templates know `system`; OpenAI's `developer` role means the same.
        turn: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": "" if content is None and calls else _content(content, index),
        }
        if calls:
            turn["tool_calls"] = [_template_call(call) for call in calls]
        if message.get("tool_call_id") is not None:
            turn["tool_call_id"] = message["tool_call_id"]
        chat.append(turn)
    if not any(_has_content(m["content"]) or m.get("tool_calls") for m in chat):
        raise PromptError("messages are all empty")
    if system_prompt and chat[0]["role"] != "system":
        chat.insert(0, {"role": "system", "content": system_prompt})
    return chat


def prompt_chat(
    tokenizer: Any,
    prompt_spec: PromptSpec,
    text: str | None,
    messages: str | Sequence[Any] | None,
) -> list[dict] | None:
    """The chat to render for one prompt, or None when `text` is tokenized as is.

    Raises PromptError for what render_prompt refuses before the chat template runs."""
    if (text is None) == (messages is None):
        raise PromptError("give exactly one of a prompt text or messages")
    if messages is not None:
        if not prompt_spec.chat_template:
            raise PromptError("messages need prompt.chat_template: true")
        chat = chat_messages(messages, prompt_spec.system_prompt)
    else:
        if not isinstance(text, str) or not text.strip():
            raise PromptError("empty prompt")
        if not prompt_spec.chat_template:
            return None
        chat = chat_messages([{"role": "user", "content": text}], prompt_spec.system_prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "the tokenizer has no chat template; set prompt.chat_template: false to tokenize "
            "the text as is"
        )
    return chat


def apply_chat_template(
    tokenizer: Any, chat: list[dict] | list[list[dict]], template_kwargs: Mapping[str, Any] | None
) -> Any:
    """The chat template over one chat (its text) or a list of chats (their texts, one call);
    raises PromptError when it fails (on any of the chats)."""
    try:
        return tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
    except Exception as exc:  # templates raise anything, often on purpose (raise_exception)
        raise PromptError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def render_prompt(
    tokenizer: Any,
    prompt_spec: PromptSpec,
    *,
    text: str | None = None,
    messages: str | Sequence[Any] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids for one prompt: a chat (`messages`) or a user text (`text`).

    With `prompt.chat_template` the text becomes a one-turn chat (after the system prompt) and
    the tokenizer's chat template is applied with the generation prompt; without, the text is
    tokenized as is (with the tokenizer's special tokens, e.g. BOS). `template_kwargs` are
    extra variables for the chat template (the endpoint's `chat_template_kwargs`, e.g.
    enable_thinking); the caller keeps them off the tokenizer's apply_chat_template parameters
    (a Serve request's are checked in models.py).
    """
    chat = prompt_chat(tokenizer, prompt_spec, text, messages)
    if chat is None:
        return list(tokenizer.encode(text, add_special_tokens=True))
    rendered = apply_chat_template(tokenizer, chat, template_kwargs)
    # The template already wrote any BOS it wants; adding special tokens again would double it.
    return list(tokenizer.encode(rendered, add_special_tokens=False))


# An OpenAI /v1/completions request is a raw text continuation: no chat template, no system.
RAW_COMPLETION = PromptSpec(chat_template=False)
