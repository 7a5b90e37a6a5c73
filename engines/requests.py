"""Request checks every engine runs before a request reaches its scheduler.

One place decides what a request may ask for, so the same request gets the same answer from
every engine kind (the contract suite in tests/contract checks this):
- an empty prompt, a token id outside the vocabulary (prompt or logit_bias) or a prompt that
  leaves no room for one output token is a row error (finish_reason "error") naming what to change;
- max_tokens beyond the context is clipped to what fits, and the request finishes with
  "length" when it reaches that point, as OpenAI's and vLLM's servers do for a completion
  that runs into the context.

Engine-specific limits (the reference engine's KV pool, TensorRT-LLM's max_num_tokens without
chunked prefill) are checked by each engine after this.

The checkpoint facts both sides need (vocabulary size, context length, EOS ids) are read from
the model directory here too, so engines cannot disagree on them.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.api import EngineError, GenerationRequest, GenerationResult, RequestMetrics


@dataclass(frozen=True)
class Admission:
    """What a request may do: an error text (the request cannot run) or its output budget."""

    error: str | None
    max_tokens: int  # sampling.max_tokens clipped to the context; 0 when error is set

    @property
    def ok(self) -> bool:
        return self.error is None


EMBED_UNSUPPORTED = (
    "embeddings are computed by the reference engine only (engine.kind: reference); this "
    "engine kind generates text"
)


def admit(
    request: GenerationRequest,
    *,
    vocab_size: int,
    max_model_len: int,
    takes_adapters: bool = False,
    takes_images: bool = False,
) -> Admission:
    """Check `request` against the model's vocabulary and context; clip its max_tokens.
    `takes_adapters`: the engine runs LoRA adapters (it checks the name itself); an engine
    that does not must never answer an adapter's request with its base model. `takes_images`:
    the engine's model reads images (the engine checks them against the prompt itself)."""
    if request.adapter is not None and not takes_adapters:
        return Admission(
            f"LoRA adapter {request.adapter!r}: this engine does not run adapters (it was "
            "started without any: list them in model.adapters; engine.kind synthetic runs none)",
            0,
        )
    if request.images and not takes_images:
        return Admission(
            f"the prompt has {len(request.images)} image(s) but this engine's model takes text "
            "only; serve a vision-language model (e.g. Qwen2.5-VL) or send text",
            0,
        )
    if request.embed is not None:
        # The production kinds run one engine per replica for generation; their embedding
        # runners (vLLM's pooling runner) are separate engines that cannot generate.
        return Admission(EMBED_UNSUPPORTED, 0)
    prompt = request.prompt_token_ids
    if len(prompt) == 0:
        return Admission("the prompt is empty: give at least one token", 0)
    for token in prompt:
        # bool is an int subclass; a True in a token list is a caller bug, not token 1.
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            return Admission(
                f"prompt token id {token!r} is outside the vocabulary [0, {vocab_size}) "
                "(tokenized with a different tokenizer?)",
                0,
            )
    for token, _ in request.sampling.logit_bias:
        if token >= vocab_size:
            return Admission(
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", 0
            )
    if len(prompt) >= max_model_len:
        return Admission(
            f"prompt has {len(prompt)} tokens but the model's context (max_model_len) is "
            f"{max_model_len} tokens, which must hold the prompt and at least one output "
            "token; shorten the prompt",
            0,
        )
    return Admission(None, min(request.sampling.max_tokens, max_model_len - len(prompt)))


def embed_error(request: GenerationRequest, vocab_size: int, max_model_len: int) -> str | None:
    """Why an embed request cannot run, or None. Its prompt may fill the whole context: no
    output token follows it."""
    prompt = request.prompt_token_ids
    if len(prompt) == 0:
        return "the input is empty: give at least one token"
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            return (
                f"input token id {token!r} is outside the vocabulary [0, {vocab_size}) "
                "(tokenized with a different tokenizer?)"
            )
    if len(prompt) > max_model_len:
        return (
            f"input has {len(prompt)} tokens but the model's context (max_model_len) is "
            f"{max_model_len} tokens; shorten the input"
        )
    return None


def error_result(request: GenerationRequest, message: str, arrival: float) -> GenerationResult:
    """A request that ends as a row error without output (refused at admission, or failed in
    the engine), timed from `arrival` (time.monotonic()) to now."""
    return GenerationResult.without_output(
        request,
        "error",
        error=message,
        metrics=RequestMetrics(arrival_time=arrival, finish_time=time.monotonic()),
    )


# --- checkpoint facts --------------------------------------------------------------------------


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """`config.json` of a Hugging Face directory (the language model's part for multimodal
    wrappers); an error names the file when it is missing or not JSON."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise EngineError(f"{path} not found: the model must be a Hugging Face directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is not valid JSON: {exc}") from exc
    return raw.get("text_config", raw) if "hidden_size" not in raw else raw


def context_length(config: dict[str, Any]) -> int:
    """The model's context: max_position_embeddings (2048 when a config omits it)."""
    return int(config.get("max_position_embeddings") or 2048)


def eos_token_ids(config: dict[str, Any], model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from config.json, then generation_config.json, in order, without repeats.

    Chat models often list their end-of-turn token only in generation_config.json; both
    sources count, so a model stops on either (as transformers' generate does)."""
    ids: list[int] = []
    sources = [config]
    # generation_config is optional metadata; when unreadable, config.json's EOS id still holds.
    with contextlib.suppress(OSError, json.JSONDecodeError):
        sources.append(json.loads((Path(model_dir) / "generation_config.json").read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and token not in ids:
                ids.append(token)
    return tuple(ids)


# --- bad words ---------------------------------------------------------------------------------


def bad_words_token_ids(tokenizer: Any, words: tuple[str, ...]) -> list[list[int]]:
    """The token sequences each bad word is banned as, by vLLM's rule (so engines agree): the
    word as given (left-stripped) and, when that spelling is a different first token of the
    same length, with a leading space, since a word in running text usually carries the space
    of the token before it."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return [s for s in sequences if s]
