"""From a parsed OpenAI request to an engine request, and from an engine result to `usage`.

Pure functions between the wire format (pipeline.serve.protocol) and the engine contract
(engines.api): tokenization through the model's tokenizer, the token caps that turn into 400s,
OpenAI's defaults (temperature 1, max_tokens 16 on /v1/completions), and the cost of a result.
The ingress deployment calls these; keeping them out of it keeps them testable without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engines.api import EngineInfo, GenerationRequest, GenerationResult, SamplingParams
from pipeline.cost import cost_usd, list_price_usd
from pipeline.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    ResponseIds,
    Usage,
    parse_chat_request,
    parse_completion_request,
)
from pipeline.serve.spec import ServedModelSpec
from pipeline.serve.tokens import PromptTokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to dispatch: endpoint, model, engine request, stream mode."""

    endpoint: Endpoint
    served: ServedModelSpec
    engine_request: GenerationRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    ids: ResponseIds = field(init=False)

    def __post_init__(self) -> None:
        ids = ResponseIds.new(self.endpoint, self.engine_request.request_id, self.served.name)
        object.__setattr__(self, "ids", ids)


def parse_request(
    data: dict[str, Any], endpoint: Endpoint
) -> ChatCompletionRequest | CompletionRequest:
    return parse_chat_request(data) if endpoint == "chat" else parse_completion_request(data)


def to_engine_request(
    request: ChatCompletionRequest | CompletionRequest,
    endpoint: Endpoint,
    served: ServedModelSpec,
    tokenizer: PromptTokenizer,
    info: EngineInfo,
) -> Prepared:
    """Tokenize, apply the caps and OpenAI's defaults; ApiError (400) names what to change."""
    if isinstance(request, ChatCompletionRequest):
        if not served.prompt.chat_template or not tokenizer.has_chat_template:
            raise ApiError(
                400,
                f"model '{served.name}' has no chat template; use /v1/completions",
                param="messages",
                code="unsupported_endpoint",
            )
        messages = [{"role": m.role, "content": m.text} for m in request.messages]
        prompt_ids = tokenizer.chat_ids(messages)
        prompt_param = "messages"
        default_max = served.limits.default_max_tokens
    else:
        prompt_ids = completion_prompt_ids(request, tokenizer)
        prompt_param = "prompt"
        default_max = COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = capped_max_tokens(
        served, info, len(prompt_ids), request.requested_max_tokens, default_max, prompt_param
    )
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=request.stop_list,
            ignore_eos=request.ignore_eos,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None
    return Prepared(
        endpoint,
        served,
        GenerationRequest(prompt_token_ids=prompt_ids, sampling=sampling),
        stream=request.stream,
        include_usage=request.include_usage,
    )


def usage_of(served: ServedModelSpec, result: GenerationResult, gpu_seconds: float) -> Usage:
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_prompt_tokens,
        gpu_seconds=gpu_seconds,
        cost_usd=cost_usd(gpu_seconds, served.cost),
        list_price_usd=_list_price(served, result),
    )


def engine_unavailable(name: str, exc: Exception) -> ApiError:
    return ApiError(
        503,
        f"model '{name}' is unavailable right now ({type(exc).__name__}); retry shortly",
        type="server_error",
        code="engine_unavailable",
    )


def _list_price(served: ServedModelSpec, result: GenerationResult) -> float | None:
    """List price of the request's tokens; None without prices. An interactive request is
    priced as an online one: cost.batch_discount does not apply here."""
    if served.cost.price_per_million is None:
        return None
    online = served.cost.model_copy(update={"batch_discount": 0.0})
    return list_price_usd(
        result.prompt_tokens, result.cached_prompt_tokens, result.completion_tokens, online
    )


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def completion_prompt_ids(request: CompletionRequest, tokenizer: PromptTokenizer) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt", code="invalid_value")
        return tokenizer.completion_ids(prompt)
    ids = list(prompt)
    vocab = tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(
            400,
            f"'prompt' holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
            param="prompt",
            code="invalid_value",
        )
    return ids


def capped_max_tokens(
    served: ServedModelSpec,
    info: EngineInfo,
    num_prompt: int,
    requested: int | None,
    default: int,
    prompt_param: str,
) -> int:
    """The request's max_tokens after the caps; a 400 names what to shorten."""
    context = info.max_model_len
    prompt_cap = min(served.limits.max_prompt_tokens or context - 1, context - 1)
    if num_prompt > prompt_cap:
        raise ApiError(
            400,
            f"The prompt is {num_prompt} tokens; model '{served.name}' accepts at most "
            f"{prompt_cap} prompt tokens. Shorten the {prompt_param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = context - num_prompt
    if requested is None:
        return max(1, min(default, served.limits.max_tokens, room))
    if requested > served.limits.max_tokens:
        raise ApiError(
            400,
            f"max_tokens is {requested}; this server allows at most {served.limits.max_tokens}",
            param="max_tokens",
            code="invalid_value",
        )
    if requested > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{num_prompt + requested} tokens ({num_prompt} in the {prompt_param}, {requested} in "
            "the completion). Reduce the length of the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested
